"""benchmarks.waits: each py-spy sample sorted by where its thread waits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import waits

# Innermost frames of samples py-spy took of real processes (a server and the engine
# harness, MLX on CUDA and on the CPU), outermost first as in its raw output.
PY = ["thread_run (libpython3.12.so.1.0)", "Runner.step (mlx_serve/runner/batch.py:119)"]
SAMPLES = {
    waits.LOCK: [
        PY + ["one_array_step (mlx_serve/runner/decode_step.py:75)",
              "pthread_cond_timedwait (libc.so.6)", "0x7f0bef8a3f16 (libc.so.6)"],
        PY + ["Event.is_set (threading.py:575)", "pthread_cond_wait (libc.so.6)",
              "0x7fb0f34a3f16 (libc.so.6)"],  # after a forced switch, for the taker
        ["Loop__run (loop.c:100)", "loop___uvasync_callback (loop.c:91202)",
         "loop___ensure_handle_data (loop.c:89695)", "pthread_cond_timedwait (libc.so.6)",
         "0x7f0bef8a3f16 (libc.so.6)"],
    ],
    waits.MLX_EVENT: [
        PY + ["mlx::core::eval (libmlx.so)", "cudaStreamSynchronize (libcudart.so.13)",
              "0x7f0c11aa0000 (libcuda.so.1)", "pthread_cond_wait (libc.so.6)"],
        PY + ["mlx::core::eval (libmlx.so)", "mlx::core::array::wait (libmlx.so)",
              "mlx::core::Event::wait (libmlx.so)", "pthread_cond_wait (libc.so.6)",
              "0x7f0bef8a3f16 (libc.so.6)"],
    ],
    waits.MLX_EVAL: [
        PY + ["mlx::core::async_eval (libmlx.so)", "mlx::core::eval_impl (libmlx.so)",
              "mlx::core::scheduler::Scheduler::enqueue (libmlx.so)",
              "pthread_mutex_lock (libc.so.6)", "0x7f5efeaa412b (libc.so.6)"],
        PY + ["0x7f0bddb238b1 (core.cpython-312-x86_64-linux-gnu.so)",
              "mlx::core::async_eval (libmlx.so)", "mlx::core::eval_impl (libmlx.so)",
              "pthread_cond_wait (libc.so.6)", "0x7f0bef8a3f16 (libc.so.6)"],
        PY + ["mlx::core::async_eval (libmlx.so)", "mlx::core::eval_impl (libmlx.so)",
              "pthread_cond_wait (libc.so.6)", "0x7f0bef8a3f16 (libc.so.6)"],
    ],
    waits.POLL: [
        ["Loop__run (loop.c:19903)", "uv_run (core.c:464)", "uv__io_poll (linux.c:1452)",
         "epoll_pwait (libc.so.6)"],
    ],
    waits.WRITE: [
        ["UVStream__exec_write (loop.c:107733)", "UVStream__try_write (loop.c:106818)",
         "write (libc.so.6)"],
    ],
    waits.OTHER_WAIT: [
        ["Condition.wait (threading.py:327)", "lock_PyThread_acquire_lock (libpython)",
         "PyThread_acquire_lock_timed (libpython)", "0x7f0bef8aed90 (libc.so.6)",
         "0x7f0bef8a3f16 (libc.so.6)"],
        ["readline (reader.py:3)", "_Py_read (libpython)", "read (libc.so.6)"],
    ],
    waits.ON_CPU: [
        PY + ["mlx::core::async_eval (libmlx.so)", "mlx::core::eval_impl (libmlx.so)",
              "mlx::core::gpu::eval (libmlx.so)"],
        PY + ["TabledBPEStreamingDetokenizer.add_token (mlx_serve/runner/text.py:114)"],
        PY + ["mlx::core::scheduler::Scheduler::enqueue (libmlx.so)",
              "pthread_cond_signal (libc.so.6)"],
        PY + ["mlx::core::allocator::CommonAllocator::malloc (libmlx.so)",
              "pthread_mutex_lock (libc.so.6)"],  # the uncontended fast path
    ],
}


@pytest.mark.parametrize("state,frames", [(s, f) for s, fs in SAMPLES.items() for f in fs])
def test_each_real_stack_lands_in_its_state(state: str, frames: list[str]) -> None:
    assert waits.classify(frames) == state


def test_raw_lines_add_up_per_thread_with_their_commonest_stacks() -> None:
    lock = ";".join(SAMPLES[waits.LOCK][0])
    cpu = ";".join(SAMPLES[waits.ON_CPU][0])
    poll = ";".join(SAMPLES[waits.POLL][0])
    raw = [f"thread (7): mlx;{lock} 3", f"thread (7): mlx;{cpu} 9",
           f"thread (1): MainThread;{poll} 12", ""]
    threads = waits.parse_raw(raw)
    mlx = threads["thread (7): mlx"]
    assert (mlx.samples, mlx.share(waits.LOCK), mlx.share(waits.ON_CPU)) == (12, 0.25, 0.75)
    assert threads["thread (1): MainThread"].share(waits.POLL) == 1.0
    text = waits.format_waits(threads, top=2)
    assert text.splitlines()[0].endswith("thread (7): mlx")  # ties: most on CPU first
    assert "25.0%  interpreter lock" in text and "one_array_step" in text


def test_a_thread_whose_shares_the_kernel_contradicts_is_flagged() -> None:
    cpu = ";".join(SAMPLES[waits.ON_CPU][0])
    wait = ";".join(SAMPLES[waits.MLX_EVAL][0])
    threads = waits.parse_raw([f"thread (7): mlx;{cpu} 40", f"thread (7): mlx;{wait} 60",
                               f"thread (9): other;{cpu} 80", f"thread (9): other;{wait} 20"])
    text = waits.format_waits(threads, kernel={7: 0.85, 9: 0.82})
    other, mlx = text.split("samples  thread (7)")  # the most on CPU first
    assert "thread (9)" in other and "thread (9)" not in mlx
    assert "disagrees with the kernel's count" in mlx  # 40 % against 85 %
    assert "disagrees" not in other  # 80 % against 82 %


def test_a_summary_shows_the_kernel_count_kept_beside_the_samples(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    samples = tmp_path / "s.raw"
    samples.write_text(f"thread (7): mlx;{';'.join(SAMPLES[waits.ON_CPU][0])} 10\n")
    waits.main(["--summarize", str(samples)])
    assert "kernel's count" not in capsys.readouterr().out
    waits.kernel_file(samples).write_text('{"7": 0.5}')
    waits.main(["--summarize", str(samples)])
    out = capsys.readouterr().out
    assert "50.0%  on a CPU by the kernel's count" in out and "disagrees" in out


CHILD = """
import sys, threading
done = threading.Event()
def spin():
    n = 0
    while not done.is_set():
        n += 1
def read_stdin():
    sys.stdin.readline()
    done.set()
for name in ("spin1", "spin2"):
    threading.Thread(target=spin, name=name).start()
threading.Thread(target=done.wait, name="idler").start()
threading.Thread(target=read_stdin, name="reader", daemon=True).start()
print("ready", flush=True)
done.wait()
"""


@pytest.mark.timeout(90)
def test_a_real_process_shows_its_lock_waits_and_its_idle_thread(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        raw = tmp_path / "s.raw"  # the command line: the kernel's count, then samples
        waits.main(["--pid", str(child.pid), "--seconds", "2", "--rate", "50",
                    "--raw", str(raw)])
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=30)
    parsed = waits.parse_raw(raw.read_text().splitlines())
    kernel = waits.load_kernel(raw)
    assert kernel is not None
    threads = {waits.thread_name(t.name): t for t in parsed.values()}
    spinners = [threads["spin1"], threads["spin2"]]
    assert all(t.samples >= 40 for t in spinners)
    # Two threads spinning in Python take turns with one lock: each waits for it often.
    waiting = sum(t.states[waits.LOCK] for t in spinners) / sum(t.samples for t in spinners)
    assert 0.2 <= waiting <= 0.8
    assert all(t.share(waits.LOCK) + t.share(waits.ON_CPU) >= 0.9 for t in spinners)
    assert threads["idler"].share(waits.OTHER_WAIT) >= 0.9
    # The kernel's count: one lock lets at most about one spinner run at a time.
    on_cpu = {name: kernel[waits.thread_id(t.name) or -1] for name, t in threads.items()}
    assert 0.4 <= on_cpu["spin1"] + on_cpu["spin2"] <= 1.3
    assert on_cpu["idler"] < 0.05
    assert "on a CPU by the kernel's count" in waits.format_waits(parsed, kernel=kernel)


def test_thread_ids_come_from_py_spy_names() -> None:
    assert waits.thread_id("thread (741): mlx") == 741
    assert waits.thread_id("thread (0x7f0b): MainThread") is None
