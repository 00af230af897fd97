"""The engine harness as a process of its own, fresh for one run or kept for many.

``ab`` runs the engine harness (``engine_limit``) beside the servers, in another process
so that it has its own MLX state. A fresh process per run pays Python's start, MLX's
import and device set-up, the model's load and its first kernels every time, while the
servers stay loaded from run to run. On the H200 (1B, fresh engine processes) 28 runs
filled 480 s, 126 s of them measured load, so few rounds fit into one bounded call.
``EngineWorker``
keeps one harness process with the model loaded (``engine_limit --jobs``) and hands it
one run at a time: a line of JSON in, a line back. Each run still has its own prompts,
warm-up request and ``BatchGenerator``.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.environment import ROOT
from benchmarks.servers import BatchConfig, cache_limit_flag, end_process
from benchmarks.workload import Workload


def harness_command(model_path: str, batch: BatchConfig, one_array_logprobs: bool,
                    early_decode_join: bool = False) -> list[str]:
    """``engine_limit`` with the settings every run of one A/B shares."""
    return [sys.executable, "-m", "benchmarks.engine_limit", "--model", model_path,
            "--decode-batch-size", str(batch.decode_batch_size),
            "--prefill-batch-size", str(batch.prefill_batch_size),
            "--prefill-step-size", str(batch.prefill_step_size),
            *cache_limit_flag(batch),
            *(["--one-array-logprobs"] if one_array_logprobs else []),
            *(["--early-decode-join"] if early_decode_join else [])]


def workload_flags(workload: Workload) -> list[str]:
    return ["--concurrency", str(workload.concurrency),
            "--num-requests", str(workload.num_requests),
            "--prompt-tokens", str(workload.prompt_tokens),
            "--output-tokens", str(workload.output_tokens),
            "--time-limit", str(workload.time_limit), "--seed", str(workload.seed),
            *(["--rate", str(workload.rate)] if workload.rate else []),
            *(["--long-output-tokens", str(workload.long_output_tokens),
               "--long-fraction", str(workload.long_fraction)]
              if workload.long_output_tokens is not None else [])]


def job_files(workdir: Path, prompts: Sequence[str | list[int]],
              warmup: Sequence[str | list[int]]) -> tuple[Path, Path]:
    """A run's prompts file, written, and its result file, cleared (never report an
    earlier run's result as this one's)."""
    prompts_file, out = workdir / "prompts.json", workdir / "engine.json"
    prompts_file.write_text(json.dumps({"prompts": prompts, "warmup": warmup}))
    out.unlink(missing_ok=True)
    return prompts_file, out


def job_result(out: Path, log_path: Path) -> dict[str, Any]:
    """The result a run wrote to ``out``; raises if it wrote none."""
    if not out.exists():
        raise RuntimeError(f"the engine harness wrote no result; see {log_path}")
    return dict(json.loads(out.read_text()))


def run_fresh(command: list[str], workload: Workload, prompts_file: Path, out: Path,
              env: dict[str, str], log_path: Path) -> None:
    """One run in a process started for it alone, bounded in time."""
    with open(log_path, "ab") as log:
        subprocess.run([*command, *workload_flags(workload), "--prompts-file",
                        str(prompts_file), "--json", str(out)],
                       stdout=log, stderr=subprocess.STDOUT, check=False,
                       timeout=workload.time_limit + 120, cwd=ROOT, env=env)


class EngineWorker:
    """One harness process, loaded once; ``run`` hands it a job and waits (bounded)."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path,
                 startup_timeout: float) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*command, "--jobs"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT,
                                     env=env, start_new_session=True, bufsize=0)
        self._buffer = b""
        try:
            self.pid = self._reply(startup_timeout)["ready"]
        except BaseException:  # never leave a half-started worker behind
            self.stop()
            raise

    def run(self, workload: Workload, prompts_file: Path, out: Path,
            **extra: Any) -> None:
        """One run; its result is written to ``out``. Raises if the worker fails.
        ``extra`` goes into the job (``beside_thread``: see ``engine_limit.measure``)."""
        assert self.proc.stdin is not None
        job = {"workload": workload.as_dict(), "prompts_file": str(prompts_file),
               "json": str(out), **extra}
        try:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        except BrokenPipeError:
            raise RuntimeError(self._gone()) from None
        reply = self._reply(workload.time_limit + 120)
        if "error" in reply:
            raise RuntimeError(f"the engine harness failed: {reply['error']}; "
                               f"see {self.log_path}")

    def _reply(self, timeout: float) -> dict[str, Any]:
        """The next line on the worker's standard output, as JSON, within ``timeout``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(self.proc.args, timeout)
                if not selector.select(left):
                    continue
                chunk = self.proc.stdout.read(65536)
                if not chunk:
                    raise RuntimeError(self._gone())
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    def _gone(self) -> str:
        return f"the engine harness exited ({self.proc.poll()}); see {self.log_path}"

    def stop(self, timeout: float = 10.0) -> None:
        """End of input first (the worker ends by itself), then signals; idempotent."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        end_process(self.proc, (signal.SIGTERM, signal.SIGKILL), timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
