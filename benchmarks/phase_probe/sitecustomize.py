"""Where the stepping thread's time goes, phase by phase, in any process that steps mlx-lm.

Put this folder first on ``PYTHONPATH`` and set ``MLX_PHASE_PROBE_OUT=PATH``: the process
(a server, or the engine harness) then wraps mlx-lm's batch phases and mlx_serve's
runner phases, and every ``MLX_PHASE_PROBE_EVERY`` (default 200) batch steps appends one
JSON line to ``PATH.<pid>``: per batch step, each phase's calls, thread CPU ms, wall ms
and minor page faults (``getrusage(RUSAGE_THREAD)``), inclusive of the phases inside it,
and what the wrapper itself costs a call on that host (``probe_us``).
The whole step is also split into the steps that prefilled prompts and the decode-only
ones. ``python -m benchmarks.phase_report PATH.*`` prints them. Each wrapped call costs a
few microseconds (``probe_us``): fine beside steps of milliseconds, visible on a tiny
model's and in a phase made of many short calls.
"""

import os

_OUT = os.environ.get("MLX_PHASE_PROBE_OUT")


class _Probe:
    """Per-phase totals of the wrapped calls, written out every ``every`` batch steps."""

    def __init__(self, out: str, every: int) -> None:
        import time

        self.out, self.every = out, every
        self.totals: dict[str, list[int]] = {}  # label -> calls, cpu ns, wall ns, faults
        self.seen: dict[str, list[int]] = {}  # the totals at the last write
        self.clock = time.time()
        self.prefilled = False  # whether the step under way processed prompt tokens
        self.overhead: dict[str, float] | None = None  # calibrated at the first write

    def wrap(self, owner: object, name: str, label: str) -> None:
        import resource
        import time

        inner = getattr(owner, name)
        totals = self.totals

        def timed(*args, **kwargs):
            cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                return inner(*args, **kwargs)
            finally:
                t = totals.setdefault(label, [0, 0, 0, 0])
                t[0] += 1
                t[1] += time.thread_time_ns() - cpu
                t[2] += time.perf_counter_ns() - wall
                t[3] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults

        setattr(owner, name, timed)

    def wrap_mlx_lm(self, gen) -> None:
        import importlib

        for cls, names in ((gen.GenerationBatch, ("_step", "next", "extend", "filter")),
                           (gen.PromptProcessingBatch, ("prompt", "generate")),
                           (gen.BatchGenerator, ("_next", "insert", "remove"))):
            for name in names:
                self.wrap(cls, name, f"{cls.__name__}.{name}")
        # Finer phases where the CPU reads or frees device memory: a finished sequence's
        # KV extraction reads every layer's padding, and mlx-lm empties MLX's buffer
        # cache after every prefill chunk.
        cache = importlib.import_module("mlx_lm.models.cache")
        for name in ("extract", "filter", "extend"):
            self.wrap(cache.BatchKVCache, name, f"BatchKVCache.{name}")
        self.wrap(importlib.import_module("mlx.core"), "clear_cache", "mx.clear_cache")

    def wrap_runner(self) -> None:
        """mlx_serve's runner phases, where it is importable."""
        import importlib

        try:
            runner = importlib.import_module("mlx_serve.runner.batch")
            step = importlib.import_module("mlx_serve.runner.decode_step")
        except ImportError:
            return
        self.wrap(step, "one_array_step", "GenerationBatch._step (one array)")  # bound per batch
        for name in ("step", "step_tokens", "step_texts", "_account", "_admit", "_remove",
                     "_release_waiting", "_sample_memory"):
            self.wrap(runner.Runner, name, f"Runner.{name}")
        # Each token's text and delta, on whichever thread makes the step's text.
        token_text = importlib.import_module("mlx_serve.runner.token_text")
        self.wrap(token_text, "_delta", "token_text._delta")
        # The early move into decoding runs after mlx-lm's _next, and the first tokens
        # are read after it: both outside BatchGenerator._next. Each caller holds its own
        # reference to take_first_tokens, so both are wrapped.
        split = importlib.import_module("mlx_serve.runner.early_split")
        self.wrap(split, "move_prefilled", "early move (move_prefilled)")
        self.wrap(split, "take_first_tokens", "take_first_tokens")
        self.wrap(runner, "take_first_tokens", "take_first_tokens")
        text = importlib.import_module("mlx_serve.runner.text")
        self.wrap(text.TextPipeline, "advance", "TextPipeline.advance")
        prefix = importlib.import_module("mlx_serve.runner.prefix_cache")
        for name in ("store", "lookup"):
            self.wrap(prefix.PrefixCache, name, f"PrefixCache.{name}")

    def flag_prefills(self, gen) -> None:
        """Steps that prefilled prompts apart from decode-only ones: mlx-lm calls
        ``prompt`` in every step, with no tokens when no prompt waits."""
        prompting = gen.PromptProcessingBatch.prompt
        probe = self

        def flagged_prompt(batch, tokens, *args, **kwargs):
            probe.prefilled = probe.prefilled or bool(tokens)
            return prompting(batch, tokens, *args, **kwargs)

        gen.PromptProcessingBatch.prompt = flagged_prompt

    def count_steps(self, gen) -> None:
        """Split each (wrapped) ``_next`` by kind, and write every ``every`` steps."""
        stepping = gen.BatchGenerator._next
        probe, totals = self, self.totals

        def counted_next(batch, *args, **kwargs):
            probe.prefilled = False
            before = list(totals.get("BatchGenerator._next", (0, 0, 0, 0)))
            result = stepping(batch, *args, **kwargs)
            kind = "prefilled" if probe.prefilled else "decode only"
            split = totals.setdefault(f"BatchGenerator._next ({kind})", [0, 0, 0, 0])
            for i, (after, was) in enumerate(zip(totals["BatchGenerator._next"], before,
                                                 strict=True)):
                split[i] += after - was
            steps = totals["BatchGenerator._next"][0] - probe.seen.get(
                "BatchGenerator._next", [0])[0]
            if steps >= probe.every:
                probe.write(steps)
            return result

        gen.BatchGenerator._next = counted_next

    def calibrate(self, calls: int = 1000) -> dict[str, float]:
        """What the wrapper costs a call on this thread, in microseconds.

        ``own``: what a wrapped call's own figures include beyond the call (part of the
        clock reads); ``enclosing``: what each wrapped call inside a phase adds to that
        phase's figures (all four clock reads and the bookkeeping). Reading a thread's
        CPU clock and page faults is a system call, whose cost varies between hosts.
        """
        import time
        import types

        scratch = _Probe(self.out, 0)
        holder = types.SimpleNamespace(noop=lambda: None)
        scratch.wrap(holder, "noop", "noop")
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(calls):
            holder.noop()
        cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
        own = scratch.totals["noop"]
        return {"own_cpu_us": round(own[1] / calls / 1e3, 3),
                "own_wall_us": round(own[2] / calls / 1e3, 3),
                "enclosing_cpu_us": round(cpu / calls / 1e3, 3),
                "enclosing_wall_us": round(wall / calls / 1e3, 3)}

    def write(self, steps: int) -> None:
        """One line: each phase's calls, CPU, wall and faults per step since the last,
        and what the probe's wrapper costs a call (measured once, on the stepping
        thread, before the first line)."""
        import json
        import time

        if self.overhead is None:
            self.overhead = self.calibrate()
        now = time.time()
        phases = {}
        for label, t in self.totals.items():
            d = [a - b for a, b in zip(t, self.seen.get(label, [0, 0, 0, 0]), strict=True)]
            if d[0]:
                phases[label] = {"calls": round(d[0] / steps, 3),
                                 "cpu_ms": round(d[1] / steps / 1e6, 3),
                                 "wall_ms": round(d[2] / steps / 1e6, 3),
                                 "faults": round(d[3] / steps, 1)}
        with open(f"{self.out}.{os.getpid()}", "a") as fh:
            fh.write(json.dumps({"time": round(now, 3), "steps": steps,
                                 "wall_ms_per_step": round((now - self.clock) / steps * 1e3, 3),
                                 "phases": phases, "probe_us": self.overhead}) + "\n")
        self.seen.update({k: list(v) for k, v in self.totals.items()})
        self.clock = now


def _install(out: str) -> None:
    import importlib

    gen = importlib.import_module("mlx_lm.generate")
    probe = _Probe(out, int(os.environ.get("MLX_PHASE_PROBE_EVERY", "200")))
    probe.wrap_mlx_lm(gen)
    probe.wrap_runner()
    probe.flag_prefills(gen)
    probe.count_steps(gen)


if _OUT:
    try:
        _install(_OUT)
    except Exception as exc:  # a probe must never stop the process it measures
        import sys

        print(f"phase probe not installed: {exc!r}", file=sys.stderr)
