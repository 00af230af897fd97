"""Native libraries preloaded by the CLI on Linux: which ones, and that the restart works."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_serve import preload
from tests.server_process import ServerProcess


@pytest.fixture
def fake_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Both libraries 'installed' in tmp_path and neither mapped into this process."""
    paths = {}
    for name in ("openblas", "jemalloc"):
        path = tmp_path / f"lib{name}.so"
        path.write_bytes(b"")
        paths[name] = str(path)
    monkeypatch.setattr(preload, "OPENBLAS", (str(tmp_path / "absent.so"), paths["openblas"]))
    monkeypatch.setattr(preload, "JEMALLOC", (paths["jemalloc"],))
    monkeypatch.setattr(preload, "_mapped", lambda name: False)
    monkeypatch.setattr(preload, "openblas_active", lambda: False)
    return paths


def test_automatic_takes_each_installed_library_and_off_leaves_it_out(fake_libraries):
    assert preload.wanted_preloads(None, None) == [fake_libraries["openblas"],
                                                   fake_libraries["jemalloc"]]
    assert preload.wanted_preloads(False, None) == [fake_libraries["jemalloc"]]
    assert preload.wanted_preloads(True, False) == [fake_libraries["openblas"]]


def test_a_library_already_mapped_is_not_added_again(fake_libraries, monkeypatch):
    monkeypatch.setattr(preload, "_mapped", lambda name: name == "libjemalloc")
    assert preload.wanted_preloads(None, True) == [fake_libraries["openblas"]]


def test_a_library_asked_for_but_missing_is_logged_and_automatic_is_silent(
        fake_libraries, monkeypatch, caplog):
    monkeypatch.setattr(preload, "JEMALLOC", ("/nonexistent/libjemalloc.so",))
    with caplog.at_level(logging.WARNING, logger="mlx_serve.preload"):
        assert preload.wanted_preloads(None, None) == [fake_libraries["openblas"]]
        assert not caplog.records
        preload.wanted_preloads(None, True)
    assert "libjemalloc2 requested but not found" in caplog.text


def test_the_restart_puts_ours_first_keeps_the_callers_and_happens_once(
        fake_libraries, monkeypatch):
    calls = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(preload.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setenv("LD_PRELOAD", "/opt/theirs.so")
    monkeypatch.delenv("MLX_SERVE_PRELOAD_REEXEC", raising=False)
    preload.reexec_with_preloads(["--port", "9"], None, None)
    (executable, argv, env), = calls
    assert argv[1:] == ["-m", "mlx_serve", "--port", "9"]
    assert env["LD_PRELOAD"] == ":".join(
        [fake_libraries["openblas"], fake_libraries["jemalloc"], "/opt/theirs.so"])
    # Another module (a benchmark tool) restarts as itself.
    preload.reexec_with_preloads(["--rounds", "2"], None, None, module="benchmarks.layers")
    assert calls[1][1][1:] == ["-m", "benchmarks.layers", "--rounds", "2"]
    monkeypatch.setenv("MLX_SERVE_PRELOAD_REEXEC", "1")  # the restarted process
    preload.reexec_with_preloads(["--port", "9"], None, None)
    assert len(calls) == 2


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not any(
    Path(p).exists() for p in preload.JEMALLOC), reason="Debian's jemalloc not installed")
@pytest.mark.parametrize("flag, mapped", [([], True), (["--no-jemalloc"], False)])
def test_the_server_runs_with_jemalloc_unless_told_not_to(tiny_model_dir, tmp_path, flag,
                                                           mapped):
    with ServerProcess(tiny_model_dir, tmp_path / "server.log", args=flag,
                       env={"LD_PRELOAD": ""}) as server:
        server.wait_ready()
        assert ("libjemalloc" in _mapped_libraries(server.proc.pid)) is mapped
        assert ("jemalloc is active" in server.log_text()) is mapped


def _openblas_active_in_a_process(preloaded: str) -> str:
    code = ("import numpy, mlx.core; from mlx_serve.preload import openblas_active; "
            "print(openblas_active())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LD_PRELOAD": preloaded})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's loader")
def test_numpys_own_openblas_does_not_count_as_mlxs():
    # numpy maps its bundled OpenBLAS (other symbol names, never called by MLX); the
    # check looked for "openblas" among the mapped files, so --no-openblas still logged
    # OpenBLAS as active and served the default model as float32 on the slow BLAS.
    assert _openblas_active_in_a_process("") == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux") or preload.find_openblas() is None,
                    reason="Debian's OpenBLAS not installed")
def test_preloaded_openblas_counts_as_mlxs():
    assert _openblas_active_in_a_process(str(preload.find_openblas())) == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux") or preload.find_openblas() is None,
                    reason="Debian's OpenBLAS not installed")
@pytest.mark.parametrize("flag, active", [([], True), (["--no-openblas"], False)])
def test_the_server_says_whether_it_has_openblas(tiny_model_dir, tmp_path, flag, active):
    with ServerProcess(tiny_model_dir, tmp_path / "server.log", args=flag,
                       env={"LD_PRELOAD": ""}) as server:
        server.wait_ready()
        assert ("OpenBLAS is active" in server.log_text()) is active
