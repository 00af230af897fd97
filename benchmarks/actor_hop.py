"""What the per-step hop to the event loop costs it, with no model in the way.

At one stream on a GPU a batch step is bound by the CPU thread that builds it, and the
event loop's work for that step runs on the same interpreter lock, where it can lengthen
the step. This tool measures that work alone, on the event loop thread's own CPU clock
(with its voluntary context switches: its blocking waits):

- ``bare``: a thread reports each "step" to a uvloop event loop with
  ``call_soon_threadsafe``, whose callback resolves the future a task waits on. The
  floor of any cross-thread hop.
- ``actor``: mlx_serve's ``Engine`` (the actor, its pipelined steps on an ``MLXThread``,
  its reply channels) driving a runner that makes one token per live request per step
  and no MLX call, with ``--concurrency`` clients reading their reply streams as the
  routes do. Its CPU per step beyond ``bare`` is the actor's own.

A step sleeps (``--mode sleep``: the lock is free meanwhile, as in a device wait) or
spins in Python (``--mode busy``: the lock is held, as while a graph is built).

    python -m benchmarks.actor_hop                       # 1 ms steps, one stream
    python -m benchmarks.actor_hop --mode busy --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import uvloop

from benchmarks.environment import describe
from benchmarks.layers import python_work
from benchmarks.thread_detail import per_step, read_thread


def _pause(seconds: float, mode: str) -> None:
    (python_work if mode == "busy" else time.sleep)(seconds)


class TokenRunner:
    """A runner without a model: each step is a pause, then one token for every live
    request, the last one finished after ``tokens``."""

    def __init__(self, tokens: int, step_s: float, mode: str) -> None:
        self._tokens, self._step_s, self._mode = tokens, step_s, mode
        self._made: dict[str, int] = {}

    def step(self, admissions: Sequence[Any], cancellations: Collection[str]) -> Any:
        from mlx_serve.generation import Delta, FinishReason, StepOutcome

        for request in admissions:
            self._made[request.request_id] = 0
        self.forget(cancellations)
        if not self._made:  # as the real runner: nothing live, no batch step to count
            return StepOutcome()
        _pause(self._step_s, self._mode)
        deltas = []
        for rid in list(self._made):
            made = self._made[rid] = self._made[rid] + 1
            finish = FinishReason.LENGTH if made >= self._tokens else None
            deltas.append((rid, Delta("x", 1, finish)))
            if finish is not None:
                del self._made[rid]
        return StepOutcome(deltas=tuple(deltas), ran_batch=True)

    def live_ids(self) -> list[str]:
        return list(self._made)

    def forget(self, request_ids: Collection[str]) -> None:
        for rid in request_ids:
            self._made.pop(rid, None)

    def rebuild(self, active: Collection[str] | None = None) -> None:
        pass


class ThreadClock:
    """The calling thread's CPU time (``time.thread_time``, exact where ``/proc``'s ticks
    are 10 ms) and blocking waits (``thread_detail``'s voluntary switches) between two
    readings."""

    def __init__(self) -> None:
        self._tid = threading.get_native_id()
        self._cpu, self._counters = time.thread_time(), read_thread(self._tid)

    def per_step(self, steps: int) -> dict[str, float]:
        cpu = time.thread_time() - self._cpu
        counters = per_step(self._counters, read_thread(self._tid), steps) or {}
        return {"steps": steps, "cpu_us": round(cpu / max(steps, 1) * 1e6, 2),
                "voluntary_switches": counters.get("voluntary", float("nan"))}


async def bare_hop(steps: int, step_s: float, mode: str, time_limit: float
                   ) -> dict[str, float]:
    """``steps`` reports from a thread, each resolving the future a task waits on."""
    loop = asyncio.get_running_loop()
    seen = 0
    waiter: asyncio.Future[None] | None = None

    def report() -> None:
        nonlocal seen
        seen += 1
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def producer() -> None:
        for _ in range(steps):
            _pause(step_s, mode)
            loop.call_soon_threadsafe(report)

    async def every_report() -> None:
        nonlocal waiter
        while seen < steps:
            waiter = loop.create_future()
            await waiter

    clock = ThreadClock()
    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    await asyncio.wait_for(every_report(), time_limit)
    figures = clock.per_step(steps)
    thread.join()
    return figures


async def actor_hop(args: argparse.Namespace) -> dict[str, float]:
    """The actor and its clients over ``args.requests`` requests at ``args.concurrency``."""
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.generation import Failure, GenerationRequest, SamplingParams
    from mlx_serve.mlx_thread import MLXThread

    mlx = MLXThread()
    engine = Engine(lambda: TokenRunner(args.tokens, args.step_ms / 1e3, args.mode),
                    EngineConfig(max_running=max(args.concurrency, 1)), mlx)
    actor = asyncio.ensure_future(engine.run())
    ids = iter(range(args.requests + args.concurrency))

    async def client(count: int) -> None:
        for _ in range(count):
            request = GenerationRequest(f"hop-{next(ids)}", (1, 2, 3),
                                        SamplingParams(max_tokens=args.tokens))
            async with engine.submit(request) as handle:
                async for event in handle:
                    if isinstance(event, Failure):
                        raise RuntimeError(f"actor_hop: {event.error}")
                    if event.finish_reason is not None:
                        break

    try:
        await asyncio.wait_for(engine.ready.wait(), args.time_limit)
        await asyncio.wait_for(client(1), args.time_limit)  # warm: the first steps
        first = engine.statistics().steps
        clock = ThreadClock()
        shares = [args.requests // args.concurrency + (i < args.requests % args.concurrency)
                  for i in range(args.concurrency)]
        await asyncio.wait_for(asyncio.gather(*(client(n) for n in shares)), args.time_limit)
        return clock.per_step(engine.statistics().steps - first)
    finally:
        engine.abort()
        await asyncio.wait_for(engine.finished.wait(), 30)
        await actor
        mlx.stop(timeout=10)


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    # About as many reports as the actor's steps, and enough to read the CPU clock by.
    steps = max(args.requests * args.tokens // max(args.concurrency, 1), 1000)
    bare = uvloop.run(bare_hop(steps, args.step_ms / 1e3, args.mode, args.time_limit))
    actor = uvloop.run(actor_hop(args))
    # The date, machine and commit, as every other benchmark's results carry them.
    return {"meta": describe(argv, "", "benchmarks.actor_hop"), "mode": args.mode,
            "step_ms": args.step_ms, "concurrency": args.concurrency,
            "bare": bare, "actor": actor}


def format_result(result: dict[str, Any]) -> str:
    rows = ["| hop | steps | event loop's CPU a step, us | voluntary switches a step |",
            "|---|---|---|---|"]
    for name in ("bare", "actor"):
        r = result[name]
        rows.append(f"| {name} | {r['steps']} | {r['cpu_us']:.1f} "
                    f"| {r['voluntary_switches']:.2f} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.actor_hop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=1.0, help="each step's pause")
    p.add_argument("--mode", choices=("sleep", "busy"), default="sleep",
                   help="a step sleeps (lock free) or spins in Python (lock held)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="tokens a request")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per part")
    p.add_argument("--json", help="write the result here too")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    result = measure(args, argv)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
