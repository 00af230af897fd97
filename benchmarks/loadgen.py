"""Load generator for any OpenAI-compatible server (vLLM's serving metrics).

Closed loop: ``concurrency`` requests in flight until ``num_requests`` are done. Open loop
(``--rate R``): Poisson arrivals at R requests/s, at most ``concurrency`` in flight.
Every run is bounded by its request count and a wall-clock limit; requests still in
flight at the limit are cancelled and counted as failed.

    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --concurrency 16 --num-requests 64 --prompt-tokens 128 --output-tokens 128 \\
        --stream --json out.json [--rate 4] [--api chat] [--health-probe 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import aiohttp

try:  # a faster event loop, where installed (uvicorn[standard] brings it)
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

from benchmarks.health_probe import HealthProbe
from benchmarks.metrics import RequestRecord, percentiles, report_run, run_span, summarize
from benchmarks.workload import (
    Workload,
    add_length_mix_args,
    build_prompts,
    length_mix,
    load_tokenizer,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    api: str = "completions"  # or "chat"
    stream: bool = True
    model: str | None = None  # the request's "model" field; None leaves it out
    request_timeout: float = 300.0
    health_probe: float | None = None  # seconds between GET /health probes


def request_body(target: Target, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0,
                            "stream": target.stream}
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if target.model is not None:
        body["model"] = target.model
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord,
                       start: float) -> None:
    last: float | None = None
    chunks = 0
    async for line in response.content:  # one SSE line at a time
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        now = time.perf_counter() - start
        if payload == b"[DONE]":
            break
        data = json.loads(payload)
        if "error" in data:
            raise RuntimeError(f"error event: {str(data['error'])[:100]}")
        if _chunk_text(data):
            chunks += 1
            if record.ttft is None:
                record.ttft = now
            else:
                record.itl.append(now - last)  # type: ignore[operator]
            last = now
        if usage := data.get("usage"):
            record.output_tokens = usage.get("completion_tokens", 0)
            record.prompt_tokens = usage.get("prompt_tokens", 0)
    if not record.output_tokens:  # a server without usage: one token per content chunk
        record.output_tokens = chunks


async def send_one(client: aiohttp.ClientSession, target: Target, prompt: str,
                   max_tokens: int) -> RequestRecord:
    """One request, measured; never raises (failures are recorded)."""
    record = RequestRecord()
    path = "/v1/chat/completions" if target.api == "chat" else "/v1/completions"
    start = time.perf_counter()
    try:
        body = request_body(target, prompt, max_tokens)
        async with client.post(target.base_url + path, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")[:100]
                raise RuntimeError(f"HTTP {response.status}: {text}")
            if target.stream:
                await _read_stream(response, record, start)
            else:
                data = json.loads(await response.read())
                usage = data.get("usage") or {}
                record.output_tokens = usage.get("completion_tokens", 0)
                record.prompt_tokens = usage.get("prompt_tokens", 0)
        record.e2e = time.perf_counter() - start
        record.ok = True
    except asyncio.CancelledError:
        record.error = "cancelled at the time limit"
        raise
    except Exception as exc:
        record.error = describe_error(exc)
    return record


def describe_error(exc: BaseException) -> str:
    """The error and its first non-empty cause (some client errors have no message)."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    while cause is not None and not str(exc):
        exc, cause = cause, cause.__cause__ or cause.__context__
        text += f" <- {type(exc).__name__}: {exc}"
    return text[:200]


def make_client(concurrency: int, timeout: float) -> aiohttp.ClientSession:
    """HTTP/1.1, one connection per in-flight request, a pool that never queues.

    aiohttp (as vLLM's benchmark uses): its C parser keeps the generator's own CPU time
    per streamed chunk well below what a hundred streams need.
    """
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=False)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=30.0))


class _Run:
    """One measured run: the request tasks, their records and the clock."""

    def __init__(self, client: aiohttp.ClientSession, target: Target, workload: Workload,
                 prompts: list[str]) -> None:
        self.client, self.target, self.workload, self.prompts = client, target, workload, prompts
        self.lengths = workload.output_lengths()
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()
        self.wall_start = time.time()
        self.last_done = self.start
        self._next = 0

    def take(self) -> int | None:
        if self._next >= self.workload.num_requests:
            return None
        if time.perf_counter() - self.start >= self.workload.time_limit:
            return None
        self._next += 1
        return self._next - 1

    async def one(self, index: int) -> None:
        prompt = self.prompts[index % len(self.prompts)]
        try:
            record = await send_one(self.client, self.target, prompt, self.lengths[index])
        except asyncio.CancelledError:
            self.records.append(RequestRecord(error="cancelled at the time limit"))
            raise
        self.records.append(record)
        self.last_done = time.perf_counter()

    async def closed_loop(self) -> None:
        async def worker() -> None:
            while (index := self.take()) is not None:
                await self.one(index)

        await asyncio.gather(*(worker() for _ in range(self.workload.concurrency)))

    async def open_loop(self) -> None:
        rng = random.Random(self.workload.seed)
        slots = asyncio.Semaphore(self.workload.concurrency)
        tasks: list[asyncio.Task[None]] = []

        async def limited(index: int) -> None:
            async with slots:
                await self.one(index)

        try:
            while (index := self.take()) is not None:
                tasks.append(asyncio.create_task(limited(index)))
                await asyncio.sleep(rng.expovariate(self.workload.rate or 1.0))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            # Let cancelled requests record themselves before the summary is taken.
            await asyncio.gather(*tasks, return_exceptions=True)


def health_summary(samples: list[tuple[float, bool]]) -> dict[str, Any]:
    """Counts and percentiles, and every probe's latency in the order sent (which part
    of a run was slow: a short run's p99 is its slowest probe)."""
    return {"probes": len(samples), "failed": sum(1 for _, ok in samples if not ok),
            "latency_ms": percentiles([s for s, _ in samples]),
            "in_order_ms": [round(1e3 * s, 1) for s, _ in samples]}


async def run_load(target: Target, workload: Workload, prompts: list[str],
                   warmup_prompts: tuple[str, ...] = (),
                   on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run the workload against ``target``; return config and vLLM-style summary.

    ``warmup_prompts`` are sent first, one at a time, unmeasured. They must differ from
    ``prompts``: a server with a prompt cache (mlx_lm.server) would otherwise reuse them.
    ``on_start`` is called after them, right before the measured load (to read the
    server's counters).
    The run stops sending at ``workload.time_limit`` and is cut (in-flight requests
    cancelled, counted as failed) at ``time_limit + target.request_timeout``.
    """
    async with make_client(workload.concurrency, target.request_timeout) as client:
        for prompt in warmup_prompts:
            await send_one(client, target, prompt, workload.output_tokens)
        if on_start is not None:
            on_start()
        probe = None
        if target.health_probe:
            probe = HealthProbe(target.base_url, target.health_probe)
            probe.start()
        run = _Run(client, target, workload, prompts)
        cpu_start = time.process_time()
        loop = run.open_loop() if workload.rate else run.closed_loop()
        try:
            await asyncio.wait_for(loop, timeout=workload.time_limit + target.request_timeout)
        except TimeoutError:
            pass  # cancelled requests were recorded as failed
        finally:
            health = probe.stop() if probe is not None else []
    duration = run.last_done - run.start
    summary = summarize(run.records, duration)
    run_span(summary, run.wall_start, duration)
    # The generator's own CPU use, in cores: near 1.0 it, not the server, set the pace.
    summary["client_cpu"] = (time.process_time() - cpu_start) / max(duration, 1e-9)
    if probe is not None:
        summary["health"] = {**health_summary(health), "probe_priority": probe.priority}
    return {"target": asdict(target), "workload": workload.as_dict(), "summary": summary}


def warm_up(target: Target, tokenizer: Any, prompt_tokens: int, concurrency: int,
            seed: int) -> dict[str, Any]:
    """One unmeasured burst: ``concurrency`` requests at once, 8 output tokens each,
    prompts of its own (seeded apart from any measured run's)."""
    workload = Workload(prompt_tokens, 8, concurrency, concurrency, seed, None, 60.0)
    prompts = build_prompts(tokenizer, concurrency, prompt_tokens, seed)
    return run_async(run_load(target, workload, prompts))["summary"]


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a load on uvloop where installed: the client's per-chunk cost drops."""
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--tokenizer", required=True,
                   help="model folder whose tokenizer builds exact-length prompts")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="the request's model field (default: none)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="requests in flight (closed loop), or the cap with --rate")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    add_length_mix_args(p)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the run")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--health-probe", type=float, default=None, metavar="SECONDS",
                   help="poll GET /health at this interval during the run")
    p.add_argument("--json", default=None, help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = Workload(args.prompt_tokens, args.output_tokens, args.num_requests,
                        args.concurrency, args.seed, args.rate, args.time_limit,
                        **length_mix(args))
    target = Target(args.base_url.rstrip("/"), args.api, args.stream, args.model,
                    args.request_timeout, args.health_probe)
    prompts = build_prompts(load_tokenizer(args.tokenizer), args.num_requests + args.warmup,
                            args.prompt_tokens, args.seed)
    warmup, measured = prompts[:args.warmup], prompts[args.warmup:]
    result = run_async(run_load(target, workload, measured, tuple(warmup)))
    return report_run(result, f"{target.base_url} {workload.as_dict()}", args.json)


if __name__ == "__main__":
    sys.exit(main())

