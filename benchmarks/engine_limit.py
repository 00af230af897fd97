"""The engine limit: the HTTP workload run in-process through mlx-lm's BatchGenerator.

Same prompts, output length, batch settings and arrival pattern as the load generator
(closed loop keeping ``concurrency`` sequences in flight, or Poisson arrivals), greedy
sampling and the model's end-of-sequence tokens as stop tokens, like the servers. Times
are taken when ``BatchGenerator.next()`` hands a token back (on mlx_serve's schedule,
``--early-decode-join``, a first token when the call that moved its sequence into
decoding returns, as mlx_serve sends it); with detokenization on
(default) only tokens that release text count as chunks, exactly as the HTTP client
counts SSE chunks with non-empty text. No HTTP, no threads, no event loop: the ceiling
a server can approach.

    python -m benchmarks.engine_limit --model MODEL_DIR --concurrency 16 \\
        --num-requests 64 --prompt-tokens 128 --output-tokens 128 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from benchmarks.beside_thread import BesideThread
from benchmarks.host import HostWatch
from benchmarks.metrics import (
    RequestRecord,
    cpu_per_token,
    report_run,
    run_span,
    step_figures,
    summarize,
)
from benchmarks.servers import add_shape_args
from benchmarks.thread_detail import per_step, read_thread
from benchmarks.threads import cpu_by_role, cpu_per_token_by_thread, thread_times
from benchmarks.workload import Workload, add_length_mix_args, build_prompts, length_mix


@dataclass(frozen=True)
class BatchSettings:
    decode_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # mlx_serve's decode step (log-probabilities evaluated as one array) in place of
    # mlx-lm's: the engine that mlx_serve drives, rather than the stock one.
    one_array_logprobs: bool = False
    # mlx_serve's prefill schedule: a prompt joins the decode batch in the step that
    # finished its prefill, a step sooner than in mlx-lm's, and its first token is
    # taken from that step, as mlx_serve sends it (runner/early_split.py).
    early_decode_join: bool = False


@dataclass
class _InFlight:
    arrival: float
    detokenizer: Any
    max_tokens: int
    record: RequestRecord = field(default_factory=RequestRecord)
    last: float | None = None


class EngineHarness:
    """Drives one BatchGenerator the way a server would, minus the server."""

    def __init__(self, model: Any, tokenizer: Any, batch: BatchSettings,
                 detokenize: bool = True) -> None:
        from mlx_lm.generate import StopSequences

        self.model, self.tokenizer, self.batch = model, tokenizer, batch
        self.detokenize = detokenize
        self._eos = StopSequences([(t,) for t in sorted(tokenizer.eos_token_ids)])
        self._eos_ids = frozenset(tokenizer.eos_token_ids)

    def _generator(self) -> Any:
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(self.model,
                             completion_batch_size=self.batch.decode_batch_size,
                             prefill_batch_size=self.batch.prefill_batch_size,
                             prefill_step_size=self.batch.prefill_step_size)
        if self.batch.one_array_logprobs:
            from mlx_serve.runner.decode_step import use_one_array_step

            if not use_one_array_step(gen):
                raise RuntimeError("this mlx-lm has no one-array decode step")
        if self.batch.early_decode_join:
            from mlx_serve.runner.early_split import use_early_split

            if not use_early_split(gen):
                raise RuntimeError("this mlx-lm has no early decode join")
        return gen

    def run(self, prompts: list[list[int]], workload: Workload) -> dict[str, Any]:
        """Run ``prompts`` (token ids) under the workload's arrival pattern; summarize."""
        from mlx_lm.sample_utils import greedy_sampler

        gen = self._generator()
        arrivals = _arrival_times(workload)
        lengths = workload.output_lengths()
        waiting = deque(range(min(len(prompts), workload.num_requests)))
        inflight: dict[int, _InFlight] = {}
        records: list[RequestRecord] = []
        steps = prefill_steps = 0
        start = last_done = time.perf_counter()
        wall_start = time.time()
        try:
            while waiting or inflight:
                now = time.perf_counter() - start
                if now > workload.time_limit:
                    break
                admit = self._due(waiting, inflight, arrivals, workload.concurrency, now)
                if admit:
                    uids = gen.insert([prompts[i] for i in admit],
                                      max_tokens=[lengths[i] for i in admit],
                                      samplers=[greedy_sampler] * len(admit),
                                      logits_processors=[[] for _ in admit],
                                      stop_sequences=[self._eos] * len(admit))
                    t = time.perf_counter()
                    for uid, i in zip(uids, admit, strict=True):
                        inflight[uid] = _InFlight(t, self._new_detokenizer(), lengths[i])
                if not inflight:
                    time.sleep(min(0.01, max(0.0, arrivals[waiting[0]] - now)))
                    continue
                prompt_responses, responses = gen.next()
                if self.batch.early_decode_join:
                    responses = self._first_tokens_ahead(
                        gen, responses, lambda uid: inflight[uid].max_tokens)
                steps += 1
                prefill_steps += bool(prompt_responses)
                if self._emit(responses, inflight, records):
                    last_done = time.perf_counter()
        finally:
            gen.close()
        records.extend(RequestRecord(error="not finished at the time limit") for _ in inflight)
        summary = summarize(records, last_done - start)
        run_span(summary, wall_start, last_done - start)
        step_figures(summary, steps, prefill_steps)
        return summary

    @staticmethod
    def _due(waiting: deque[int], inflight: dict[int, _InFlight], arrivals: list[float],
             limit: int, now: float) -> list[int]:
        admit: list[int] = []
        while waiting and len(inflight) + len(admit) < limit and arrivals[waiting[0]] <= now:
            admit.append(waiting.popleft())
        return admit

    def _first_tokens_ahead(self, gen: Any, responses: list[Any],
                            max_tokens: Callable[[int], int]) -> list[Any]:
        """mlx_serve's first tokens: those of the sequences this step moved into decoding,
        unless one would end its request; the same tokens handed back by the next step
        are dropped, as in mlx_serve's runner."""
        from mlx_serve.runner.early_split import (
            FirstToken,
            drop_handed_back,
            mark_sent_ahead,
            take_first_tokens,
        )

        kept = drop_handed_back(gen, responses)
        ahead = {uid: token for uid, token in take_first_tokens(gen).items()
                 if token not in self._eos_ids and max_tokens(uid) > 1}
        mark_sent_ahead(gen, ahead)
        return kept + [FirstToken(uid, token) for uid, token in ahead.items()]

    def _new_detokenizer(self) -> Any:
        return self.tokenizer.detokenizer if self.detokenize else None

    def _emit(self, responses: list[Any], inflight: dict[int, _InFlight],
              records: list[RequestRecord]) -> bool:
        """Account one step's tokens; return True when a request finished."""
        now = time.perf_counter()
        finished = False
        for r in responses:
            state = inflight[r.uid]
            rec = state.record
            rec.output_tokens += 1
            if _releases_text(state.detokenizer, r):
                t = now - state.arrival
                if rec.ttft is None:
                    rec.ttft = t
                else:
                    rec.itl.append(t - state.last)  # type: ignore[operator]
                state.last = t
            if r.finish_reason is not None:
                rec.e2e, rec.ok = now - state.arrival, True
                records.append(rec)
                del inflight[r.uid]
                finished = True
        return finished


def _releases_text(detokenizer: Any, response: Any) -> bool:
    """Feed the streaming detokenizer as a server does; True if text came out."""
    if detokenizer is None:
        return response.finish_reason != "stop"
    if response.finish_reason == "stop":  # end-of-sequence: never shown
        detokenizer.finalize()
    else:
        detokenizer.add_token(response.token)
        if response.finish_reason is not None:
            detokenizer.finalize()
    return bool(detokenizer.last_segment)


def _arrival_times(workload: Workload) -> list[float]:
    """Seconds after start at which each request may enter (0 for the closed loop)."""
    if not workload.rate:
        return [0.0] * workload.num_requests
    rng = random.Random(workload.seed)
    times, t = [], 0.0
    for _ in range(workload.num_requests):
        times.append(t)
        t += rng.expovariate(workload.rate)
    return times


def load_harness(model_path: str, batch: BatchSettings, detokenize: bool = True,
                 cache_limit_bytes: int | None = None) -> EngineHarness:
    """Load the model (once) into a harness that can run any number of workloads."""
    import mlx.core as mx
    from mlx_lm import load

    if cache_limit_bytes is not None:  # as mlx_serve's --mlx-cache-limit-bytes
        mx.set_cache_limit(cache_limit_bytes)
    model, tokenizer = load(model_path)[:2]
    return EngineHarness(model, tokenizer, batch, detokenize)


def measure(harness: EngineHarness, model_path: str, workload: Workload,
            prompts: Sequence[str | list[int]], warmup_prompts: Sequence[str | list[int]],
            beside: dict[str, float] | None = None) -> dict[str, Any]:
    """Warm up, run the workload; return the loadgen-shaped result. A prompt is a text
    (encoded as the completions endpoint does) or token ids (a chat prompt). ``beside``
    (``{"work_us": W, "period_ms": P}``) runs a ``BesideThread`` through the run."""
    tokenizer = harness.tokenizer

    def ids(prompt: str | list[int]) -> list[int]:  # a text, or token ids already
        return list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    encode = [ids(p) for p in prompts]
    if warmup_prompts:
        warm = Workload(workload.prompt_tokens, workload.output_tokens, len(warmup_prompts), 1)
        harness.run([ids(p) for p in warmup_prompts], warm)
    stepping = threading.get_native_id()  # the harness steps in this thread
    cpu_start, threads_start = time.process_time(), thread_times()
    detail_start = read_thread(stepping)
    with HostWatch() as host, contextlib.ExitStack() as stack:
        thread = stack.enter_context(BesideThread(**beside)) if beside else None
        summary = harness.run(encode, workload)
    if thread is not None:
        summary["beside_thread"] = thread.record()
    summary["stepping_detail"] = per_step(detail_start, read_thread(stepping),
                                          summary.get("steps"))
    cpu_per_token(summary, time.process_time() - cpu_start)
    pid = os.getpid()
    cpu_per_token_by_thread(summary, cpu_by_role(pid, threads_start, thread_times(), stepping))
    summary["prompt_tokens"] = sum(len(p) for p in encode[:summary["completed"]])
    target = {"engine": "mlx_lm BatchGenerator", "model": model_path,
              "detokenize": harness.detokenize, "pid": pid, **harness.batch.__dict__}
    summary["host"] = host.record()
    return {"target": target, "workload": workload.as_dict(), "summary": summary}


def run_engine_limit(model_path: str, workload: Workload, batch: BatchSettings,
                     prompts: list[str], warmup_prompts: list[str],
                     detokenize: bool = True, cache_limit_bytes: int | None = None
                     ) -> dict[str, Any]:
    """Load the model, warm up, run the workload; return the loadgen-shaped result."""
    harness = load_harness(model_path, batch, detokenize, cache_limit_bytes)
    return measure(harness, model_path, workload, prompts, warmup_prompts)


def serve_jobs(harness: EngineHarness, model_path: str, jobs: TextIO, replies: TextIO) -> None:
    """Run one workload per line of ``jobs`` until it ends, the model loaded once.

    A job is ``{"workload": {...}, "prompts_file": PATH, "json": PATH}``; the result goes
    to its ``json`` file, then one reply line: ``{"failed": N}`` or ``{"error": "..."}``.
    Optional: ``"beside_thread": {"work_us": W, "period_ms": P}`` (see ``measure``) and
    ``"off_main": true`` (the run steps in a kept thread other than the main one).
    """
    off_main = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepping")
    for line in jobs:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            with open(job["prompts_file"]) as fh:
                data = json.load(fh)
            workload = Workload(**job["workload"])
            args = (harness, model_path, workload, data["prompts"], data.get("warmup", []),
                    job.get("beside_thread"))
            # Off the main thread, as mlx_serve steps: one kept thread, like its MLX thread.
            result = (off_main.submit(measure, *args).result() if job.get("off_main")
                      else measure(*args))
            report_run(result, f"engine {model_path} {workload.as_dict()}", job["json"])
            reply: dict[str, Any] = {"failed": result["summary"]["failed"]}
        except Exception as exc:  # the runner decides; this process stays ready
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), file=replies, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_limit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=64)
    add_shape_args(p, decode_batch_size=32)
    add_length_mix_args(p)
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=300.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--one-array-logprobs", action="store_true",
                   help="step with mlx_serve's decode step instead of mlx-lm's own")
    p.add_argument("--early-decode-join", action="store_true",
                   help="move prefilled prompts into decoding a step sooner, as mlx_serve does")
    p.add_argument("--prompts-file", default=None,
                   help='JSON {"prompts": [...], "warmup": [...]} (overrides --seed)')
    p.add_argument("--mlx-cache-limit-bytes", type=int, default=None,
                   help="cap MLX's buffer cache (as mlx_serve's flag of that name)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--jobs", action="store_true",
                   help="load the model once, then run one job per line of standard input "
                        "(benchmarks/engine_worker.py); the workload options are ignored")
    return p


def _prompts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if args.prompts_file:
        with open(args.prompts_file) as fh:
            data = json.load(fh)
        return data["prompts"], data.get("warmup", [])
    from benchmarks.workload import load_tokenizer

    texts = build_prompts(load_tokenizer(args.model), args.num_requests + args.warmup,
                          args.prompt_tokens, args.seed)
    return texts[args.warmup:], texts[:args.warmup]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = Workload(args.prompt_tokens, args.output_tokens, args.num_requests,
                        args.concurrency, args.seed, args.rate, args.time_limit,
                        **length_mix(args))
    batch = BatchSettings(args.decode_batch_size, args.prefill_batch_size,
                          args.prefill_step_size, args.one_array_logprobs,
                          args.early_decode_join)
    if args.jobs:
        return _serve_jobs(args, batch)
    prompts, warmup = _prompts(args)
    result = run_engine_limit(args.model, workload, batch, prompts, warmup, args.detokenize,
                              args.mlx_cache_limit_bytes)
    return report_run(result, f"engine {args.model} {workload.as_dict()}", args.json)


def _serve_jobs(args: argparse.Namespace, batch: BatchSettings) -> int:
    # Replies own standard output; anything else printed (tables, libraries' notes)
    # goes to standard error, the log.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    harness = load_harness(args.model, batch, args.detokenize, args.mlx_cache_limit_bytes)
    print(json.dumps({"ready": os.getpid()}), file=replies, flush=True)
    serve_jobs(harness, args.model, sys.stdin, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
