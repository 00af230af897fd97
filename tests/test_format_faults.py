"""A response format that fails mid-reply ends its own request with a 400, never the step.

A JSON schema whose ``$ref`` cycle has no way out compiles; its matcher finds nothing to
allow only once the reply reaches the cycle. Before the guard, that fault failed the
whole batch step: every request in it was replayed, bisected, and three such requests
in a row with no good step between them put the engine into ``failed`` for good.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from mlx_serve.engine import EngineState
from mlx_serve.errors import RequestError
from mlx_serve.generation import OutputOptions
from tests.conftest import running_engine
from tests.engine_helpers import generate_all, make_request, prompts

pytestmark = pytest.mark.anyio

# `{"a": ` is forced, then "a" must hold itself: no value can ever complete it.
DEEP_CYCLE = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}},
              "required": ["a"]}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def with_format(request, fmt):
    return dataclasses.replace(request, output=OutputOptions(response_format=fmt))


async def test_a_format_fault_fails_its_request_alone(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        fmt = engine.runner.compile_response_format(schema_format(DEEP_CYCLE))
        texts = prompts(engine, 6)
        plain = [make_request(p, max_tokens=12) for p in texts]
        expected = [r.text for r in await generate_all(engine, plain)]
        poisoned = [with_format(make_request(p, max_tokens=12), fmt) for p in texts[:3]]
        fresh = [make_request(p, max_tokens=12) for p in texts]
        results = await generate_all(engine, poisoned + fresh)
        stats = engine.statistics()
    for bad in results[:3]:
        assert isinstance(bad.error, RequestError) and bad.error.status_code == 400
        assert bad.error.param == "response_format"
        assert "cannot go on under 'response_format'" in str(bad.error)
    assert [r.error for r in results[3:]] == [None] * 6
    assert [r.text for r in results[3:]] == expected
    assert stats.recoveries == 0 and stats.isolated == 0
    assert stats.state is EngineState.READY


async def test_format_faults_one_after_another_leave_the_engine_ready(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        fmt = engine.runner.compile_response_format(schema_format(DEEP_CYCLE))
        prompt = prompts(engine, 1)[0]
        for _ in range(4):  # three in a row used to fail the engine for good
            (bad,) = await generate_all(engine, [with_format(make_request(prompt), fmt)])
            assert isinstance(bad.error, RequestError)
        with anyio.fail_after(30):
            (good,) = await generate_all(engine, [make_request(prompt, max_tokens=4)])
        assert good.error is None and good.tokens == 4
        assert engine.statistics().state is EngineState.READY
