"""The MLX thread: one OS thread for every job, named so tools can tell it apart."""

import sys
import threading
import time
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
        assert first == second == mlx.native_id != threading.get_native_id()
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


@pytest.mark.anyio
async def test_busy_time_counts_the_jobs_and_not_the_wait_between_them():
    mlx = MLXThread()
    try:
        with anyio.fail_after(10):
            await mlx.call(lambda: None)  # the thread is up and has been idle since
            before = mlx.busy_seconds
            started = time.perf_counter()
            await mlx.call(time.sleep, 0.05)  # a job that holds the thread for 50 ms
            done = mlx.busy_seconds  # counted before the result was handed back
            elapsed = time.perf_counter() - started
            await anyio.sleep(0.05)  # idle: no job, so nothing more is counted
            mlx.post(lambda: None)
            await mlx.call(lambda: None)
        assert 0.05 <= done - before <= elapsed
        assert mlx.busy_seconds - done < 0.04  # two empty jobs, not the idle 50 ms
    finally:
        mlx.stop(timeout=10)


@pytest.mark.anyio
async def test_a_posted_job_that_raises_is_logged_and_the_thread_goes_on(caplog):
    mlx = MLXThread()
    try:
        with anyio.fail_after(10):
            mlx.post(lambda: 1 / 0)
            assert await mlx.call(lambda: "still serving") == "still serving"  # after it
        (record,) = [r for r in caplog.records if "job on the MLX thread failed" in r.message]
        assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
    finally:
        mlx.stop(timeout=10)


@pytest.mark.anyio
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")
async def test_the_mlx_thread_takes_its_niceness_and_the_caller_keeps_its_own():
    import os

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    mlx = MLXThread(nice=mine + 3)  # raising niceness needs no privilege
    default = MLXThread()
    try:
        with anyio.fail_after(10):
            assert await mlx.call(os.getpriority, os.PRIO_PROCESS, 0) == mine + 3
            assert await default.call(os.getpriority, os.PRIO_PROCESS, 0) == mine
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    finally:
        mlx.stop(timeout=10)
        default.stop(timeout=10)


@pytest.mark.anyio
async def test_the_exit_job_runs_on_the_thread_after_its_last_job_and_stop_waits_for_it():
    ran: list[tuple[str, int]] = []
    mlx = MLXThread(on_exit=lambda: ran.append(("exit", threading.get_native_id())))
    with anyio.fail_after(10):
        await mlx.call(lambda: ran.append(("job", threading.get_native_id())))
    mlx.stop(timeout=10)
    assert [what for what, _ in ran] == ["job", "exit"]
    assert ran[0][1] == ran[1][1] == mlx.native_id


def test_an_exit_job_that_raises_is_logged_and_the_thread_still_ends(caplog):
    mlx = MLXThread(on_exit=lambda: 1 / 0)
    mlx.stop(timeout=10)
    assert not mlx._thread.is_alive()
    assert "exit job failed" in caplog.text and "ZeroDivisionError" in caplog.text


def test_the_servers_mlx_thread_releases_its_mlx_streams_on_itself(monkeypatch):
    import mlx.core as mx

    from mlx_serve.config import Settings
    from mlx_serve.engine_setup import mlx_thread

    released: list[int] = []
    monkeypatch.setattr(mx, "clear_streams", lambda: released.append(threading.get_native_id()))
    mlx = mlx_thread(Settings())
    assert mlx.submit(lambda: mx.eval(mx.arange(4) * 2)).result(timeout=10) is None
    mlx.stop(timeout=10)
    assert released == [mlx.native_id]
