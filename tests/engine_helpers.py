"""Small helpers for driving an Engine directly in tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import anyio

from mlx_serve.engine import Engine, RequestHandle
from mlx_serve.errors import MLXServeError
from mlx_serve.generation import Failure, GenerationRequest, SamplingParams, StepOutcome

_ids = itertools.count()


@dataclass
class Result:
    text: str
    tokens: int
    finish: str | None
    error: MLXServeError | None = None
    cached_tokens: int = 0


def make_request(prompt: list[int], *, user: str | None = None, **params: object
                 ) -> GenerationRequest:
    params.setdefault("max_tokens", 16)
    params.setdefault("temperature", 0.0)
    return GenerationRequest(f"req-{next(_ids)}", tuple(prompt),
                             SamplingParams(**params), user)  # type: ignore[arg-type]


async def drain(handle: RequestHandle) -> Result:
    text, tokens = [], 0
    async with handle:
        async for event in handle:
            if isinstance(event, Failure):
                return Result("".join(text), tokens, None, event.error)
            text.append(event.text)
            tokens += event.token_count
            if event.finish_reason is not None:
                return Result("".join(text), tokens, event.finish_reason.value,
                              cached_tokens=event.cached_tokens)
    raise AssertionError("reply stream ended without a terminal event")


async def generate(engine: Engine, prompt: list[int], **params: object) -> Result:
    return await drain(engine.submit(make_request(prompt, **params)))


async def generate_all(engine: Engine, requests: list[GenerationRequest]) -> list[Result]:
    results: list[Result | None] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await drain(engine.submit(requests[i]))

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


def prompts(engine: Engine, count: int) -> list[list[int]]:
    tok = engine.runner.tokenizer
    return [tok.encode(f"Request {i}: tell me about topic {i * 7} " * (1 + i % 3))
            for i in range(count)]


async def step_hanging(engine: Engine, timeout: float = 10.0) -> None:
    """Wait (bounded) until a step hangs at the ``engine.step`` fail point."""
    hanging = await anyio.to_thread.run_sync(
        engine.failpoints.wait_hanging, "engine.step", 1, timeout)  # type: ignore[attr-defined]
    assert hanging, f"no step hung at engine.step within {timeout} s"


def record_runner_steps(engine: Engine) -> list[tuple[list[str], StepOutcome]]:
    """From now on, each runner step's admitted request ids and outcome, in order."""
    step = engine.runner.step
    steps: list[tuple[list[str], StepOutcome]] = []

    def recorded(admissions: list[GenerationRequest], cancellations: list[str]) -> StepOutcome:
        outcome = step(admissions, cancellations)
        steps.append(([r.request_id for r in admissions], outcome))
        return outcome

    engine.runner.step = recorded
    return steps
