"""A real ``mlx-serve`` process on 127.0.0.1 for black-box and fault tests."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path | str | None, log_path: Path, *, env: dict[str, str] | None
                 = None, args: list[str] | None = None,
                 open_files: tuple[int, int] | None = None) -> None:
        """``open_files``: the (soft, hard) limit on open files the server starts with."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "mlx_serve", "--host", "127.0.0.1", "--port",
               str(self.port), "--log-level", "info"]
        if model is not None:
            cmd += ["--model", str(model)]
        cmd += args or []
        full_env = {**os.environ, **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            preexec_fn=None if open_files is None else lambda: resource.setrlimit(
                resource.RLIMIT_NOFILE, open_files))

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll /health until 200, the process exits, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                       f"{self.log_text()}")
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.terminate()
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
