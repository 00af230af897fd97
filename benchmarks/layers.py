"""Where mlx_serve's step time goes, layer by layer, in one process on one set of weights.

The same closed-loop workload (seeded prompts, fixed output length, greedy) runs through
eight layers, interleaved round by round in a rotating order:

- ``engine``: the engine harness (mlx-lm's ``BatchGenerator``, its stock decode step),
  the ceiling that ``ab`` compares against;
- ``engine-busy``: the engine harness while another process keeps one vCPU busy with
  Python, as a load generator's client does beside a server (on a host whose vCPUs
  share cores, a busy neighbour can slow the stepping thread);
- ``engine-1arr``: the same harness with mlx_serve's one-array decode step;
- ``runner``: mlx_serve's ``Runner.step`` in a plain loop on the MLX thread (admission,
  text, deltas, prefix cache), no actor and no event loop;
- ``runner-nocache``: the same runner with its prefix cache off (what storing every
  finished request's KV costs);
- ``actor``: the ``Engine`` actor on a uvloop event loop, its clients in-process tasks
  reading their reply streams: everything but HTTP;
- ``actor-busy``: the same, each client running ``--client-work-us`` of pure Python per
  token it reads (about what HTTP costs the event loop per token): the event loop
  holding the interpreter lock as long as with HTTP, without sockets;
- ``http``: the same actor behind mlx_serve's routes on uvicorn, on the same event loop,
  streamed to ``benchmarks.loadgen`` in a process of its own (``benchmarks.layer_http``):
  the whole server, in this process and on these weights.

Every run gets prompts of its own, so that no layer finds another's in its prefix cache
(mlx_serve's runner keeps one, 1 GiB by default; the harness has none). Each run reports
ms per batch step, tokens per step, tokens/s and the median time to first text (from
the request's hand-over to the layer until its first text leaves it: the harness's
insert, the runner's admitting step call, the actor's submit, the client's send); each
layer's figures over the engine's in the same round are the result, median [min-max]
over rounds. Where ``ab`` compares two processes (each on its own vCPUs, which on a
shared host run at different speeds), this compares layers of one process, and tells
which layer a gap comes from.

    python -m benchmarks.layers --model tiny --concurrency 1 --rounds 6
    python -m benchmarks.layers --model DIR --concurrency 1 --rounds 8 \\
        --decode-batch-size 128 --prefill-step-size 2048 --mlx-cache-limit-bytes 4000000000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import itemgetter
from pathlib import Path
from typing import Any

from benchmarks.contenders import MODEL_HELP, rotated
from benchmarks.engine_limit import BatchSettings, EngineHarness, load_harness
from benchmarks.metrics import percentiles
from benchmarks.report import cell, pair_spread, rounds_by_concurrency
from benchmarks.servers import add_shape_args
from benchmarks.thread_detail import describe as describe_detail
from benchmarks.thread_detail import per_step, read_thread
from benchmarks.threads import cpu_by_role, thread_times
from benchmarks.workload import Workload, build_prompts, load_tokenizer

LAYERS = ("engine", "engine-busy", "engine-1arr", "runner", "runner-nocache", "actor",
          "actor-busy", "http")


@dataclass(frozen=True)
class Counted:
    """What a layer's run counts: batch steps, output tokens, the median ms from a
    request's hand-over to its first text, and the seconds it served where the layer
    times itself."""

    steps: int
    tokens: int
    ttft_p50_ms: float | None
    wall_s: float | None = None


class Layers:
    """The layers over one loaded model; ``run(layer, count)`` measures one run."""

    def __init__(self, model_path: str, args: argparse.Namespace, texts: list[str]) -> None:
        from mlx_serve.mlx_thread import MLXThread
        from mlx_serve.runner.streams import release_thread_streams

        self.args = args
        batch = BatchSettings(args.decode_batch_size, args.prefill_batch_size,
                              args.prefill_step_size)
        self.harness = load_harness(model_path, batch, True, args.mlx_cache_limit_bytes)
        # The servers' tokenization of /v1/completions text (see benchmarks.workload).
        self._prompts = iter([list(self.harness.tokenizer.encode(t)) for t in texts])
        self.harness_1arr = EngineHarness(self.harness.model, self.harness.tokenizer,
                                          replace(batch, one_array_logprobs=True))
        self.mlx = MLXThread(on_exit=release_thread_streams)
        self.runner = self.mlx.submit(self._new_runner, args.prefix_cache_bytes).result()
        self.runner_nocache = self.mlx.submit(self._new_runner, 0).result()
        self._ids = itertools.count()
        self._http_runs = itertools.count()
        self.model_path = model_path

    def _new_runner(self, prefix_cache_bytes: int) -> Any:
        from mlx_serve.failpoints import FailPoints
        from mlx_serve.runner import BatchLimits
        from mlx_serve.runner.batch import DEFAULT_CONTEXT_LENGTH, Runner

        a, tokenizer = self.args, self.harness.tokenizer
        return Runner(self.harness.model, tokenizer, context_length=DEFAULT_CONTEXT_LENGTH,
                      vocab_size=tokenizer.vocab_size, failpoints=FailPoints(),
                      limits=BatchLimits(a.decode_batch_size, a.prefill_batch_size,
                                         a.prefill_step_size),
                      prefix_cache_bytes=prefix_cache_bytes)

    def close(self) -> None:
        self.mlx.stop(timeout=10)

    def fresh_prompts(self, count: int) -> list[list[int]]:
        """The next ``count`` prompts, none of them given out before."""
        prompts = list(itertools.islice(self._prompts, count))
        if len(prompts) < count:
            raise RuntimeError("out of prompts")
        return prompts

    def run(self, layer: str, count: int) -> dict[str, Any]:
        """One run of ``layer`` over ``count`` fresh prompts."""
        prompts = self.fresh_prompts(count)
        runs: dict[str, Callable[[list[list[int]]], Counted]] = {
            "engine": lambda p: self._harness(self.harness, p),
            "engine-busy": lambda p: self._beside_busy_process(
                lambda: self._harness(self.harness, p)),
            "engine-1arr": lambda p: self._harness(self.harness_1arr, p),
            "runner": lambda p: self.mlx.submit(self._runner_loop, self.runner, p).result(),
            "runner-nocache": lambda p: self.mlx.submit(self._runner_loop, self.runner_nocache,
                                                        p).result(),
            "actor": self._actor,
            "actor-busy": lambda p: self._actor(p, self.args.client_work_us / 1e6),
            "http": self._http,
        }
        self._neighbour_cpu_s: float | None = None
        # The harness steps on this thread; the other layers on the MLX thread, with the
        # event loop (actor, http) on this one.
        stepping = (threading.get_native_id() if layer.startswith("engine")
                    else self.mlx.native_id)
        threads_before, detail_before = thread_times(), read_thread(stepping)
        started = time.perf_counter()
        counted = runs[layer](prompts)
        steps, tokens = counted.steps, counted.tokens
        detail = per_step(detail_before, read_thread(stepping), steps)
        # The http layer times its load itself: its clients' start-up is not serving.
        wall = counted.wall_s or time.perf_counter() - started
        roles = cpu_by_role(os.getpid(), threads_before, thread_times(), stepping)
        return {"layer": layer, "wall_s": round(wall, 4), "steps": steps, "tokens": tokens,
                "ms_per_step": round(wall / steps * 1e3, 4) if steps else None,
                "tokens_per_step": round(tokens / steps, 3) if steps else None,
                "tok_s": round(tokens / wall, 2) if wall > 0 else None,
                "ttft_p50_ms": counted.ttft_p50_ms,
                # CPU ms per step by thread role: a slow vCPU shows as a stepping thread
                # that needs more CPU for the same step.
                "cpu_ms_per_step": {role: round(sec / steps * 1e3, 4)
                                    for role, sec in roles.items()} if roles and steps else None,
                "stepping_detail": detail, "neighbour_cpu_s": self._neighbour_cpu_s}

    def _beside_busy_process(self, run: Callable[[], Counted]) -> Counted:
        """``run()`` while a process of pure-Python work keeps one vCPU busy; its CPU
        seconds meanwhile go in the run's ``neighbour_cpu_s``."""
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            return run()
        finally:
            times = thread_times(spinner.pid)
            spinner.kill()
            spinner.wait(10)
            self._neighbour_cpu_s = (round(sum(cpu for _, cpu in times.values()), 4)
                                     if times else None)

    def _request(self, prompt: list[int]) -> Any:
        from mlx_serve.generation import GenerationRequest, SamplingParams

        params = SamplingParams(max_tokens=self.args.output_tokens, temperature=0.0)
        return GenerationRequest(f"layers-{next(self._ids)}", tuple(prompt), params)

    def _harness(self, harness: EngineHarness, prompts: list[list[int]]) -> Counted:
        a = self.args
        workload = Workload(a.prompt_tokens, a.output_tokens, len(prompts), a.concurrency,
                            time_limit=a.run_time_limit)
        summary = harness.run(prompts, workload)
        if summary["failed"]:
            raise RuntimeError(f"engine: {summary['failed']} requests not finished")
        return Counted(summary["steps"], summary["output_tokens"], summary["ttft_ms"]["p50"])

    def _runner_loop(self, runner: Any, prompts: list[list[int]]) -> Counted:
        """On the MLX thread: keep ``concurrency`` requests in ``runner``, step it."""
        waiting = [self._request(p) for p in prompts]
        waiting.reverse()
        deadline = time.monotonic() + self.args.run_time_limit
        open_requests = steps = tokens = 0
        handed: dict[str, float] = {}  # request -> when the step call admitting it began
        first_text: list[float] = []
        while waiting or open_requests:
            if time.monotonic() > deadline:
                runner.forget(runner.live_ids())
                raise RuntimeError("runner: not finished within the run time limit")
            admit = [waiting.pop() for _ in range(min(len(waiting),
                                                      self.args.concurrency - open_requests))]
            open_requests += len(admit)
            handed.update((r.request_id, time.perf_counter()) for r in admit)
            outcome = runner.step(admit, ())
            if outcome.error is not None or outcome.failed:
                raise RuntimeError(f"runner: {outcome.error or outcome.failed}")
            steps += outcome.ran_batch
            now = time.perf_counter()
            for rid, delta in outcome.deltas:
                tokens += delta.token_count
                open_requests -= delta.finish_reason is not None
                if delta.text and rid in handed:
                    first_text.append(now - handed.pop(rid))
        return Counted(steps, tokens, percentiles(first_text)["p50"])

    def _http(self, prompts: list[list[int]]) -> Counted:
        import uvloop

        from benchmarks.layer_http import serve_and_load

        # The load generator builds prompts of its own from a seed no other run uses.
        seed = self.args.seed + 1 + next(self._http_runs)
        return uvloop.run(serve_and_load(self.runner, self.mlx, self.args, self.model_path,
                                         len(prompts), seed))

    def _actor(self, prompts: list[list[int]], work_s: float = 0.0) -> Counted:
        import uvloop

        return uvloop.run(self._actor_run(prompts, work_s))

    async def _actor_run(self, prompts: list[list[int]], work_s: float) -> Counted:
        from mlx_serve.engine import Engine, EngineConfig
        from mlx_serve.generation import Failure

        a = self.args
        engine = Engine(lambda: self.runner, EngineConfig(max_running=a.decode_batch_size),
                        self.mlx)
        actor = asyncio.ensure_future(engine.run())
        queue = iter(prompts)
        tokens = 0
        first_text: list[float] = []

        async def client() -> None:
            nonlocal tokens
            for prompt in queue:
                handed: float | None = time.perf_counter()
                async with engine.submit(self._request(prompt)) as handle:
                    async for event in handle:
                        if isinstance(event, Failure):
                            raise RuntimeError(f"actor: {event.error}")
                        tokens += event.token_count
                        if handed is not None and event.text:
                            first_text.append(time.perf_counter() - handed)
                            handed = None
                        if work_s:
                            python_work(work_s)
                        if event.finish_reason is not None:
                            break

        try:
            await asyncio.wait_for(engine.ready.wait(), a.run_time_limit)
            first = engine.statistics().steps
            clients = [asyncio.ensure_future(client()) for _ in range(a.concurrency)]
            await asyncio.wait_for(asyncio.gather(*clients), a.run_time_limit)
            return Counted(engine.statistics().steps - first, tokens,
                           percentiles(first_text)["p50"])
        finally:
            engine.abort()
            await asyncio.wait_for(engine.finished.wait(), 30)
            await actor


def python_work(seconds: float) -> None:
    """Hold the interpreter lock in plain Python for ``seconds``, as a client's
    per-token work would (the lock can still be taken away at a switch interval)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(layers: Layers, args: argparse.Namespace,
            after_round: Callable[[list[dict[str, Any]]], None] = lambda runs: None,
            ) -> list[dict[str, Any]]:
    """Warm every layer with one batch as wide as the runs' (a new batch width meets
    kernels not yet built on a GPU: the first run at 64 streams took three times the
    later ones' step), then ``rounds`` rounds of every layer, rotating the order."""
    for layer in args.layers:
        layers.run(layer, args.concurrency)
    runs = []
    started = time.monotonic()
    for rnd in range(args.rounds):
        if time.monotonic() - started > args.time_limit:
            print(f"time limit reached after {rnd} rounds", file=sys.stderr)
            break
        for layer in rotated(tuple(args.layers), rnd):
            run = {"round": rnd, "concurrency": args.concurrency,
                   **layers.run(layer, args.requests)}
            runs.append(run)
            cpu = run["cpu_ms_per_step"] or {}
            print(f"round {rnd} {layer:14s} {run['ms_per_step']:8.3f} ms/step  "
                  f"{run['tokens_per_step']:7.2f} tokens/step  {run['tok_s']:9.1f} tok/s  "
                  f"TTFT p50 {run['ttft_p50_ms'] or 0:7.2f} ms  "
                  "cpu ms/step " + " ".join(f"{r} {v:.3f}" for r, v in cpu.items())
                  + f"  {describe_detail(run['stepping_detail'])}", flush=True)
        after_round(runs)
    return runs


def ratios(runs: list[dict[str, Any]], base: str = "engine") -> dict[str, Any]:
    """Per layer: ms/step, tok/s and TTFT p50 over ``base``'s in the same round,
    median [min-max]."""
    rounds = next(iter(rounds_by_concurrency(runs, "layer", lambda run: run).values()), [])
    return {layer: {metric: pair_spread(rounds, layer, base, itemgetter(metric))
                    for metric in ("ms_per_step", "tok_s", "ttft_p50_ms")}
            for layer in dict.fromkeys(run["layer"] for run in runs)}


def format_ratios(table: dict[str, Any], base: str = "engine") -> str:
    lines = [f"| layer | ms/step over {base} | tok/s over {base} | TTFT p50 over {base} |",
             "|---|---|---|---|"]
    lines += [f"| {layer} | {cell(r['ms_per_step'])} | {cell(r['tok_s'])} "
              f"| {cell(r['ttft_p50_ms'])} |" for layer, r in table.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help=MODEL_HELP)
    p.add_argument("--layers", type=lambda s: s.split(","), default=list(LAYERS),
                   help=f"comma-separated, the first being the base (default {','.join(LAYERS)})")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: 4 per stream, at least 8)")
    p.add_argument("--rounds", type=int, default=4)
    add_shape_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-work-us", type=float, default=40.0,
                   help="actor-busy: microseconds of Python per token in each client")
    p.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                   help="the runner's and actor's prefix cache (mlx_serve's default: 1 GiB)")
    p.add_argument("--mlx-cache-limit-bytes", type=int, default=None)
    p.add_argument("--run-time-limit", type=float, default=120.0, help="seconds per run")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="no new round starts after this many seconds")
    p.add_argument("--native", choices=("auto", "off"), default="auto",
                   help="auto: preload OpenBLAS and jemalloc where installed")
    p.add_argument("--out", default=None, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if unknown := set(args.layers) - set(LAYERS):
        raise SystemExit(f"unknown layers: {', '.join(sorted(unknown))}")
    if args.native == "auto":  # as mlx_serve and ab's contenders run
        from mlx_serve.preload import reexec_with_preloads

        reexec_with_preloads(argv, None, None, module="benchmarks.layers")
    from benchmarks.contenders import resolve_model_path
    from benchmarks.environment import describe

    args.requests = args.requests or max(8, 4 * args.concurrency)
    with tempfile.TemporaryDirectory(prefix="layers-") as workdir:
        model_path = resolve_model_path(args.model, Path(workdir))
        meta = describe(argv, model_path, "benchmarks.layers")

        def save(runs: list[dict[str, Any]]) -> None:
            # After every round, so that a run cut short by an outer bound keeps its data.
            if args.out:
                Path(args.out).write_text(json.dumps(
                    {"meta": meta, "config": vars(args), "runs": runs,
                     "ratios": ratios(runs, args.layers[0])}, indent=1))

        # One warm-up batch per layer, then a set of prompts of its own for every run.
        count = len(args.layers) * (args.concurrency + args.rounds * args.requests)
        texts = build_prompts(load_tokenizer(model_path), count, args.prompt_tokens, args.seed)
        layers = Layers(model_path, args, texts)
        try:
            runs = measure(layers, args, save)
        finally:
            layers.close()
    print(format_ratios(ratios(runs, args.layers[0]), args.layers[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
