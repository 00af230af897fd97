"""Start, probe and stop the servers under test; read a process's resident memory.

Every server runs in its own session (so a terminal's Ctrl-C reaches only the runner,
which then stops it in order): SIGINT, then SIGTERM, then SIGKILL, each bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class BatchConfig:
    """Batch settings given identically to the engine harness and both servers."""

    decode_batch_size: int = 64
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # MLX's buffer cache cap for the engine harness and mlx_serve (mlx_lm.server has
    # none): MLX sizes its cache to the whole device, which co-located processes share.
    mlx_cache_limit_bytes: int | None = None


def add_shape_args(p: argparse.ArgumentParser,
                   decode_batch_size: int = BatchConfig.decode_batch_size) -> None:
    """The flags every tool shares for a run's shape: prompt and output lengths, and the
    batch settings (BatchConfig's defaults), so that the tools cannot drift apart."""
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--decode-batch-size", type=int, default=decode_batch_size)
    p.add_argument("--prefill-batch-size", type=int, default=BatchConfig.prefill_batch_size)
    p.add_argument("--prefill-step-size", type=int, default=BatchConfig.prefill_step_size)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NativeLibs:
    """The BLAS and memory allocator every contender gets, preloaded (None: MLX's
    bundled BLAS, the C library's malloc)."""

    openblas: str | None = None
    jemalloc: str | None = None

    def env(self) -> dict[str, str]:
        """The environment for a child process, with exactly these libraries preloaded."""
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        preload = [p for p in (self.openblas, self.jemalloc) if p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return env

    def mlx_serve_flags(self) -> list[str]:
        """mlx_serve preloads both by default; these flags make it take exactly ours."""
        return ["--openblas" if self.openblas else "--no-openblas",
                "--jemalloc" if self.jemalloc else "--no-jemalloc"]


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """Make Ctrl-C and SIGTERM end the tool through its ``finally`` blocks, so that the
    servers and helper processes it started (each in its own session, out of reach of a
    signal to the tool's process group) are stopped too. A shell may start a background
    job with SIGINT ignored: it is taken back."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)


def mlx_serve_command(model: str, port: int, batch: BatchConfig) -> list[str]:
    return [sys.executable, "-m", "mlx_serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--decode-batch-size", str(batch.decode_batch_size),
            "--prefill-batch-size", str(batch.prefill_batch_size),
            "--prefill-step-size", str(batch.prefill_step_size),
            "--max-queue", "4096", "--log-level", "warning",
            *cache_limit_flag(batch)]


def cache_limit_flag(batch: BatchConfig) -> list[str]:
    limit = batch.mlx_cache_limit_bytes
    return [] if limit is None else ["--mlx-cache-limit-bytes", str(limit)]


def mlx_lm_command(model: str, port: int, batch: BatchConfig) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(batch.decode_batch_size),
            "--prompt-concurrency", str(batch.prefill_batch_size),
            "--prefill-step-size", str(batch.prefill_step_size), "--log-level", "WARNING"]


class ServerProcess:
    """One server subprocess with its log file; ``stop()`` is idempotent."""

    def __init__(self, name: str, command: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.port, self.log_path = name, command, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Poll GET /health until 200; raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; see {self.log_path}")

    def health(self) -> dict[str, Any] | None:
        """The server's /health body (mlx_serve's carries MLX memory figures), or None."""
        try:
            body = httpx.get(self.base_url + "/health", timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def stop(self, timeout: float = 10.0) -> None:
        end_process(self.proc, (signal.SIGINT, signal.SIGTERM, signal.SIGKILL), timeout)
        self._log.close()


def end_process(proc: subprocess.Popen[bytes], signals: tuple[int, ...],
                timeout: float) -> None:
    """Send each signal in turn until ``proc`` has ended, waiting up to ``timeout`` after each."""
    for sig in signals:
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (psutil when installed, else /proc/PID/status)."""
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {pid}") from None
    return int(psutil.Process(pid).memory_info().rss)


def spawn(name: str, command: Callable[[int], list[str]], log_dir: Path,
          env: dict[str, str], stack: contextlib.ExitStack) -> ServerProcess:
    """Start a server on a free port (``command(port)``), its stop registered on ``stack``."""
    port = free_port()
    server = ServerProcess(name, command(port), port, log_dir / f"{name}-{port}.log", env)
    stack.callback(server.stop)
    return server


def steps_in(health: dict[str, Any] | None, key: str = "steps") -> int | None:
    """A step count a /health body reports (mlx_serve's): ``steps`` (batch steps) or
    ``prefill_steps`` (those that also prefilled prompts); None without one."""
    steps = health.get(key) if health else None
    return steps if isinstance(steps, int) else None


def busy_in(health: dict[str, Any] | None) -> float | None:
    """Seconds mlx_serve's MLX thread has spent in finished jobs, from /health, or None."""
    busy = health.get("mlx_busy_s") if health else None
    return float(busy) if isinstance(busy, (int, float)) else None
