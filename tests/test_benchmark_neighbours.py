"""The neighbours benchmark and the quiet before runs: real processes, a real harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.host import process_cpu_seconds, quiet
from benchmarks.neighbours import main, neighbours, parse_variant


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(c) for c in fh.read().split()]


def test_variants_parse_and_bad_ones_are_refused():
    assert parse_variant("0") == ("alone", "")
    assert parse_variant("spin:2") == ("spin", "2")
    assert parse_variant("thread:150/1") == ("thread", "150/1")
    assert parse_variant("offmain") == ("offmain", "")
    for bad in ("spin", "spin:0", "pingpong:x", "thread:150", "thread:0/1", "burn:2"):
        with pytest.raises(Exception, match="expected 0"):
            parse_variant(bad)


def test_neighbour_processes_run_until_the_block_ends_then_none_is_left():
    with neighbours(("pingpong", "1")) as pids:
        (pid,) = pids
        (child,) = _children(pid)  # the pair's other end
        before = process_cpu_seconds(pid)
        deadline = time.monotonic() + 30
        while process_cpu_seconds(pid) == before:  # it is passing bytes, not waiting
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while _running(pid) or _running(child):
        assert time.monotonic() < deadline, "a neighbour outlived its block"
        time.sleep(0.05)


def test_quiet_records_what_a_busy_and_an_idle_process_did(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = quiet(0.5, {"busy": busy.pid, "idle": idle.pid})
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait(10)
    assert record["seconds"] >= 0.5
    assert record["process_cpu_s"]["busy"] > 0.1
    assert record["process_cpu_s"]["idle"] < 0.05
    assert record["busy_vcpus"] > 0.2
    gone = quiet(0.0, {"gone": busy.pid})
    assert gone["process_cpu_s"] == {"gone": None}


def test_the_harness_runs_alone_and_beside_every_kind_of_neighbour(tiny_model_dir: Path,
                                                                    tmp_path: Path, capsys):
    out = tmp_path / "neighbours.json"
    assert main(["--model", str(tiny_model_dir), "--concurrency", "2",
                 "--requests-per-stream", "1", "--rounds", "1", "--settle", "0",
                 "--prompt-tokens", "16", "--output-tokens", "4", "--blas", "reference",
                 "--variant", "spin:1", "--variant", "pingpong:1",
                 "--variant", "thread:50/1", "--variant", "offmain", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {run["variant"]: run["summary"] for run in report["runs"]}
    # The harness alone is always measured, first in round 0, as the others' reference.
    assert [run["variant"] for run in report["runs"]][0] == "alone"
    assert set(runs) == {"alone", "spin:1", "pingpong:1", "thread:50/1", "offmain"}
    for summary in runs.values():
        assert (summary["completed"], summary["failed"]) == (2, 0)
        assert summary["stepping_detail"]["steps"] > 0
        assert summary["busy_vcpus"] is not None
    assert runs["thread:50/1"]["beside_thread"]["bursts"] > 0
    assert "beside_thread" not in runs["alone"]
    # Off the main thread the stepping thread is another one, still measured.
    assert runs["offmain"]["cpu_ms_per_token_by_thread"]["stepping"] > 0
    table = capsys.readouterr().out
    assert "offmain |" in table and "over alone" in table
    # Every neighbour was stopped after its run.
    assert not [p for p in os.listdir("/proc")
                if p.isdigit() and 'print("ready", flush=True)' in _cmdline(int(p))]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
