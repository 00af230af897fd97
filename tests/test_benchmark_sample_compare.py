"""benchmarks.sample_compare: two threads' on-CPU samples against their own MLX call."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import sample_compare

STEP = "thread_run (libpython3.12.so.1.0);Runner.step (mlx_serve/runner/batch.py:119)"
IN_EVAL = f"{STEP};one_array_step (x/decode_step.py:76);mlx::core::async_eval (libmlx.so)"
LINEAR = f"{STEP};Linear.__call__ (mlx/nn/layers/linear.py:74)"
NORM = f"{STEP};RMSNorm.__call__ (mlx/nn/layers/normalization.py:166)"
LOCK = f"{LINEAR};pthread_cond_timedwait (libc.so.6);0x7f0bef8a3f16 (libc.so.6)"


def raw(thread: str, counts: dict[str, int]) -> list[str]:
    return [f"thread (7): {thread};{stack} {n}" for stack, n in counts.items()]


def test_functions_are_counted_on_cpu_only_and_per_thread() -> None:
    lines = raw("mlx", {IN_EVAL: 100, LINEAR: 30, LOCK: 50}) + raw("uvloop_0", {NORM: 9})
    counts = sample_compare.on_cpu_functions(lines, "mlx", "async_eval")
    assert counts == {"(in async_eval)": 100, "Linear.__call__ (linear.py)": 30}


def test_differences_come_in_units_of_each_own_reference_with_their_noise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = raw("mlx", {IN_EVAL: 100, LINEAR: 30, NORM: 10})
    engine = raw("MainThread", {IN_EVAL: 200, LINEAR: 40, NORM: 20})
    a = sample_compare.on_cpu_functions(server, "mlx", "async_eval")
    b = sample_compare.on_cpu_functions(engine, "MainThread", "async_eval")
    rows = sample_compare.compare(a, b, "async_eval")
    assert [r.function for r in rows] == ["Linear.__call__ (linear.py)",
                                          "RMSNorm.__call__ (normalization.py)"]
    linear = rows[0]
    assert (linear.a_share, linear.b_share) == (0.30, 0.20)
    assert linear.sigmas == pytest.approx(0.10 / math.sqrt(30 / 100**2 + 40 / 200**2))
    assert rows[1].sigmas == 0.0  # the same share in both
    # Through the command line: the step estimate is (1 + 0.40) / (1 + 0.30).
    (tmp_path / "a.raw").write_text("\n".join(server))
    (tmp_path / "b.raw").write_text("\n".join(engine))
    sample_compare.main([str(tmp_path / "a.raw"), "mlx", str(tmp_path / "b.raw"), "MainThread"])
    out = capsys.readouterr().out
    assert "0.400 / 0.300" in out and f"{1.4 / 1.3:.3f}" in out
    assert out.count("no kernel count beside it") == 2


def test_each_thread_is_checked_against_the_kernel_count_kept_beside_its_samples(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.raw", tmp_path / "b.raw"
    a.write_text("\n".join(raw("mlx", {IN_EVAL: 80, LOCK: 20})))  # 80 % on CPU
    b.write_text("\n".join(raw("MainThread", {IN_EVAL: 80, LOCK: 20})))
    (tmp_path / "a.raw.kernel.json").write_text('{"7": 0.82, "8": 0.1}')
    (tmp_path / "b.raw.kernel.json").write_text('{"7": 0.95}')
    sample_compare.main([str(a), "mlx", str(b), "MainThread"])
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert "py-spy 80.0% on CPU, the kernel 82.0%: agree" in first
    assert "the kernel 95.0%: DISAGREE" in second
    with pytest.raises(ValueError, match="no thread named 'uvloop_0'"):
        sample_compare.main([str(a), "uvloop_0", str(b), "MainThread"])


def test_a_thread_without_the_reference_call_is_refused() -> None:
    a = sample_compare.on_cpu_functions(raw("mlx", {LINEAR: 3}), "mlx", "async_eval")
    with pytest.raises(ValueError, match="async_eval"):
        sample_compare.compare(a, a, "async_eval")
