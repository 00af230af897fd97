"""The MLX thread: one OS thread for every job, named so tools can tell it apart."""

import sys
import threading
from pathlib import Path

import anyio
import pytest

from mlx_serve.mlx_thread import MLXThread


@pytest.mark.anyio
async def test_every_job_runs_on_one_thread_and_errors_reach_the_caller():
    mlx = MLXThread()
    try:
        with anyio.fail_after(10):
            first = await mlx.call(threading.get_native_id)
            second = await mlx.call(threading.get_native_id)
            with pytest.raises(ZeroDivisionError):
                await mlx.call(lambda: 1 / 0)
        assert first == second != threading.get_native_id()
    finally:
        mlx.stop(timeout=10)


@pytest.mark.anyio
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names via /proc")
async def test_the_os_sees_the_thread_by_its_name():
    mlx = MLXThread(name="mlx-test")
    try:
        with anyio.fail_after(10):
            tid = await mlx.call(threading.get_native_id)
        comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        assert comm == "mlx-test"
    finally:
        mlx.stop(timeout=10)
