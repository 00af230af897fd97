"""Each step's text made on a text thread (``text_thread``): the same replies as on the
MLX thread, replies the text ends taken out of the batch, faults kept to their request."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import anyio
import httpx
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.generation import Delta, Failure, GenerationRequest, OutputOptions
from tests.conftest import running_engine
from tests.engine_helpers import generate, make_request, prompts
from tests.server_process import ServerProcess

pytestmark = pytest.mark.anyio

TEXT_THREAD = EngineConfig(max_running=32, text_thread=True)


async def events_of(engine: Engine, requests: list[GenerationRequest]) -> list[list[Any]]:
    """Every event of every reply, in order, the requests submitted together."""
    events: list[list[Any]] = [[] for _ in requests]

    async def one(i: int) -> None:
        async with engine.submit(requests[i]) as handle:
            async for event in handle:
                events[i].append(event)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
    return events


def mixed_requests(engine: Engine, stops: list[str]) -> list[GenerationRequest]:
    """Replies ended by length, by stop strings (the text ends them while mlx-lm goes
    on), by a stop string kept in the output, and ones with log-probabilities."""
    ps = prompts(engine, 8)
    requests = [make_request(p, max_tokens=6 + 3 * i) for i, p in enumerate(ps[:4])]
    requests += [make_request(p, max_tokens=40, stop=(stop,))
                 for p, stop in zip(ps[4:6], stops[:2], strict=True)]
    requests.append(make_request(ps[6], max_tokens=40, stop=(stops[2],),
                                 include_stop_str_in_output=True))
    with_logprobs = make_request(ps[7], max_tokens=8)
    requests.append(GenerationRequest(with_logprobs.request_id, with_logprobs.prompt_tokens,
                                      with_logprobs.params,
                                      output=OutputOptions(logprobs=2)))
    return requests


async def stops_for(engine: Engine) -> list[str]:
    """Stop strings that the tiny model's greedy replies to prompts 4-6 do contain."""
    ps = prompts(engine, 8)
    stops = []
    for p in ps[4:7]:
        full = await generate(engine, p, max_tokens=40)
        assert len(full.text) > 12, "the tiny model's reply is too short to cut"
        stops.append(full.text[6:9])
    return stops


def renamed(requests: list[GenerationRequest], suffix: str) -> list[GenerationRequest]:
    return [GenerationRequest(r.request_id + suffix, r.prompt_tokens, r.params, r.user,
                              r.index, r.output) for r in requests]


async def test_replies_are_the_same_event_for_event_with_and_without_a_text_thread(
        tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        stops = await stops_for(engine)
        requests = mixed_requests(engine, stops)
        on_mlx_thread = await events_of(engine, requests)
    async with running_engine(tiny_model_dir, config=TEXT_THREAD) as engine:
        on_text_thread = await events_of(engine, renamed(requests, "-t"))
        assert engine.statistics().running == 0
    assert on_text_thread == on_mlx_thread
    finishes = [reply[-1].finish_reason for reply in on_mlx_thread]
    assert finishes[4:7] == ["stop"] * 3, "the stop strings must end their replies"
    assert all(isinstance(e, Delta) for reply in on_mlx_thread for e in reply)
    assert on_mlx_thread[7][0].logprobs, "log-probabilities were asked for"


async def test_a_reply_the_text_ends_leaves_the_batch_with_the_engine_idle(tiny_model_dir):
    async with running_engine(tiny_model_dir, config=TEXT_THREAD) as engine:
        stop = (await stops_for(engine))[0]
        p = prompts(engine, 8)[4]
        cut = await generate(engine, p, max_tokens=40, stop=(stop,))
        assert cut.finish == "stop"
        with anyio.fail_after(10):  # the text thread's take-out job reaches the MLX thread
            while await engine._mlx.call(engine.runner.live_ids):
                await anyio.sleep(0.01)
        assert engine.idle


async def test_the_text_is_made_off_the_mlx_thread(tiny_model_dir, monkeypatch):
    from mlx_serve.runner import token_text

    threads: set[str] = set()
    make_delta = token_text._delta

    def recording(record, ended):
        threads.add(threading.current_thread().name)
        return make_delta(record, ended)

    monkeypatch.setattr(token_text, "_delta", recording)
    async with running_engine(tiny_model_dir, config=TEXT_THREAD) as engine:
        await generate(engine, prompts(engine, 1)[0], max_tokens=4)
    assert threads == {"text"}


async def test_a_text_fault_fails_its_request_alone(tiny_model_dir, monkeypatch):
    from mlx_serve.runner.batch import Runner

    new_live = Runner._new_live

    class Broken:
        def advance(self, token: int, finish: str | None) -> Any:
            raise RuntimeError("text fault")

    def breaking(self, request):
        live = new_live(self, request)
        if request.user == "broken":
            live.text = Broken()
        return live

    monkeypatch.setattr(Runner, "_new_live", breaking)
    async with running_engine(tiny_model_dir, config=TEXT_THREAD) as engine:
        ps = prompts(engine, 3)
        alone = [await generate(engine, p, max_tokens=10) for p in ps[:2]]
        requests = [make_request(ps[0], max_tokens=10), make_request(ps[1], max_tokens=10),
                    make_request(ps[2], max_tokens=10, user="broken")]
        events = await events_of(engine, requests)
        assert isinstance(events[2][-1], Failure) and len(events[2]) == 1
        assert ["".join(e.text for e in reply) for reply in events[:2]] == [
            r.text for r in alone]
        with anyio.fail_after(10):
            while await engine._mlx.call(engine.runner.live_ids):
                await anyio.sleep(0.01)


def test_a_server_started_with_the_setting_streams_through_its_text_thread(
        tiny_model_dir, tmp_path):
    """MLX_SERVE_TEXT_THREAD=true reaches the engine: the server has a thread named
    "text", and a streamed reply cut by a stop string equals the unstreamed one."""
    body = {"prompt": "count", "max_tokens": 24, "temperature": 0}
    with ServerProcess(tiny_model_dir, tmp_path / "server.log",
                       env={"MLX_SERVE_TEXT_THREAD": "true"}) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = full[6:9]
        cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
        with client.stream("POST", "/v1/completions",
                           json={**body, "stop": [stop], "stream": True}) as reply:
            frames = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        names = {open(f"/proc/{server.proc.pid}/task/{t}/comm").read().strip()
                 for t in os.listdir(f"/proc/{server.proc.pid}/task")}
    assert "text" in names
    chunks = [json.loads(f) for f in frames[:-1]]
    assert frames[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["choices"][0]["text"]
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_step_that_raises_before_its_text_is_recovered_from(tiny_model_dir,
                                                                    monkeypatch):
    """A fault escaping the step's first phase reaches the actor through the text
    thread, behind the steps before it; the batch is rebuilt and the reply completes."""
    from mlx_serve.runner.batch import Runner

    step_tokens = Runner.step_tokens
    calls = {"n": 0}

    def failing_once(self, admissions, cancellations):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("first phase fault")
        return step_tokens(self, admissions, cancellations)

    async with running_engine(tiny_model_dir, config=TEXT_THREAD) as engine:
        p = prompts(engine, 1)[0]
        reference = await generate(engine, p, max_tokens=12)
        calls["n"] = 0
        monkeypatch.setattr(Runner, "step_tokens", failing_once)
        with anyio.fail_after(30):
            again = await generate(engine, p, max_tokens=12)
        assert calls["n"] > 4, "the fault was never raised"
        assert (again.text, again.tokens, again.error) == (reference.text, 12, None)
        assert engine.statistics().recoveries == 1


@pytest.mark.parametrize("config", [None, TEXT_THREAD], ids=["mlx-thread", "text-thread"])
async def test_a_batch_that_will_not_let_an_ended_reply_go_is_rebuilt_with_nothing_lost(
        tiny_model_dir, monkeypatch, config):
    """Taking a reply the text ended out of the batch fails: the step's deltas still go
    out, the batch is rebuilt, and the other replies run on whole."""
    from mlx_serve.runner.batch import Runner

    remove = Runner._remove
    faults = {"n": 0}

    def failing_take_out(self, request_ids, keep_cache=False):
        if keep_cache and faults["n"] == 0:  # only a reply the text ended is kept
            faults["n"] += 1
            raise RuntimeError("remove fault")
        return remove(self, request_ids, keep_cache)

    async with running_engine(tiny_model_dir, config=config) as engine:
        stop = (await stops_for(engine))[0]
        ps = prompts(engine, 8)
        alone = await generate(engine, ps[0], max_tokens=30)
        cut_alone = await generate(engine, ps[4], max_tokens=40, stop=(stop,))
        monkeypatch.setattr(Runner, "_remove", failing_take_out)
        events = await events_of(engine, [make_request(ps[0], max_tokens=30),
                                          make_request(ps[4], max_tokens=40, stop=(stop,))])
        assert faults["n"] == 1, "the fault was never raised"
        texts = ["".join(e.text for e in reply) for reply in events]
        assert texts == [alone.text, cut_alone.text]
        assert [reply[-1].finish_reason for reply in events] == ["length", "stop"]
        assert sum(e.token_count for e in events[0]) == 30
        assert engine.statistics().recoveries == 1
