"""The probes put into or beside a measured process: host and per-thread CPU, loop and
lock stalls, the phase and admission probes, device touch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from benchmarks.phase_report import by_run, format_runs, format_windows, read_windows
from mlx_serve.http_stack import interpreter_lock_on

pytestmark = pytest.mark.anyio


def test_steal_share_is_read_from_the_cpu_line_of_proc_stat(tmp_path):
    from benchmarks.host import cpu_times, steal_share

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    before = cpu_times(stat)
    stat.write_text("cpu  160 0 70 900 10 0 5 55 0 0\ncpu0 1 2 3\n")
    after = cpu_times(stat)
    assert before == (100, 0, 50, 800, 10, 0, 5, 35)
    assert steal_share(before, after) == 0.1  # 20 stolen of 200 ticks
    assert steal_share(None, after) is None
    stat.write_text("intr 1 2 3\n")
    assert cpu_times(stat) is None
    assert cpu_times(tmp_path / "missing") is None


def test_the_host_watch_samples_the_cpu_probe_through_a_run_and_stops_its_sampler():
    import time

    from benchmarks.host import HostWatch, describe

    watch = HostWatch(period=0.05)
    with watch:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # a run that keeps a core busy meanwhile
            sum(range(10_000))
    record = watch.record()
    probe = record["cpu_probe_ms"]
    assert probe["samples"] >= 2 and 0 < probe["p50"] <= probe["p90"]
    assert watch._sampler.poll() is not None  # the sampler process has ended
    assert describe(record).startswith("probe ")
    assert describe(None) == ""


def test_the_per_cpu_sweep_times_the_probe_on_every_allowed_vcpu(capsys):
    import os

    from benchmarks.host import main

    allowed = os.sched_getaffinity(0)
    assert main(["--per-cpu", "--count", "2", "--period", "0", "--loops", "2000"]) == 0
    lines = capsys.readouterr().out.split("\n")[:-1]
    assert len(lines) == 2
    assert all(len(line.split()) == len(allowed) for line in lines)
    assert all(0 < float(s) < 1 for line in lines for s in line.split())
    assert os.sched_getaffinity(0) == allowed  # the sweep leaves the process unpinned


def test_cpu_by_role_takes_per_thread_differences_and_finds_the_mlx_thread():
    import os
    import threading

    from benchmarks.threads import (
        cpu_by_role,
        cpu_per_token_by_thread,
        mlx_thread_id,
        thread_times,
    )

    # Ids above any pid_max: no /proc entries, so only the listing order tells threads
    # of one name apart (as for threads started in the same clock tick).
    pid = 5_000_100
    before = {pid: ("python", 1.0), pid + 1: ("mlx", 2.0), pid + 5: ("mlx", 5.0),
              pid + 7: ("python", 0.5), pid + 9: ("python", 9.0)}
    # +9 ended during the run; +10 started in it; +5 is a worker the MLX thread (+1, the
    # first listed of that name) started, so it inherited the name.
    after = {pid: ("python", 1.25), pid + 1: ("mlx", 2.5), pid + 5: ("mlx", 6.0),
             pid + 7: ("python", 0.75), pid + 10: ("python", 0.125)}
    roles = cpu_by_role(pid, before, after)
    assert roles == {"main": 0.25, "stepping": 0.5, "text": 0.0,
                     "other": 1.0 + 0.25 + 0.125}
    # mlx_serve's text thread (--text-thread) is a role of its own.
    with_text = cpu_by_role(pid, before, {**after, pid + 11: ("text", 0.375)})
    assert with_text is not None
    assert with_text["text"] == 0.375 and with_text["other"] == 1.0 + 0.25 + 0.125
    # Listed first, it is the MLX thread whatever its id (ids wrap around at pid_max).
    wrapped = {pid + 5: ("mlx", 2.5), pid + 1: ("mlx", 6.0), pid: ("python", 1.25)}
    assert mlx_thread_id(wrapped) == pid + 5
    # A thread that started earlier comes first, wherever it is listed.
    main_tid = threading.get_native_id()
    assert mlx_thread_id({pid + 1: ("mlx", 0.0), main_tid: ("mlx", 0.0)}) == main_tid
    # A harness that steps in its main thread names it; it then has no "main".
    assert cpu_by_role(pid, before, after, stepping_tid=pid)["main"] == 0
    assert cpu_by_role(pid, None, after) is None
    summary = {"output_tokens": 250}
    cpu_per_token_by_thread(summary, roles)
    assert summary["cpu_ms_per_token_by_thread"] == {"main": 1.0, "stepping": 2.0,
                                                     "text": 0.0, "other": 5.5}
    here = thread_times()
    assert here is not None and here[os.getpid()][1] > 0


def test_a_threads_kernel_counters_count_its_blocking_waits():
    import threading

    from benchmarks.thread_detail import describe, per_step, read_thread

    started, go, slept, done = (threading.Event() for _ in range(4))

    def sleeper() -> None:
        started.set()
        go.wait(10)  # until the first reading is taken
        for _ in range(20):
            time.sleep(0.001)  # each sleep blocks: a voluntary context switch
        slept.set()
        done.wait(10)  # stays alive to be read again

    thread = threading.Thread(target=sleeper)
    thread.start()
    assert started.wait(10)
    before = read_thread(thread.native_id)
    go.set()
    assert slept.wait(10)
    after = read_thread(thread.native_id)
    done.set()
    thread.join(10)
    assert before is not None and after is not None
    assert after["voluntary"] - before["voluntary"] >= 20
    detail = per_step(before, after, 20)
    assert detail is not None and detail["steps"] == 20 and detail["voluntary"] >= 1.0
    assert describe(detail).startswith("stepping/step user ")
    # Nothing to read: no thread, a thread that has gone, no steps.
    assert read_thread(None) is None
    assert read_thread(thread.native_id) is None
    assert per_step(before, after, 0) is None and describe(None) == ""


async def test_the_loop_watch_reports_a_loop_held_by_blocking_work(capsys):
    from benchmarks.stalls import watch_loop

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_loop)
            await anyio.lowlevel.checkpoint()  # the watch has started its timer
            time.sleep(0.05)  # holds the loop: the watch's timer fires 50 ms late
            await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    lines = [line.split() for line in capsys.readouterr().err.splitlines()]
    late = [float(f[3]) for f in lines if f[:1] == ["mlx-serve-stall"] and f[2] == "loop"]
    assert late and max(late) >= 40, lines


def test_stalls_are_read_from_a_time_window_of_the_log(tmp_path):
    from benchmarks.stalls import read_stalls

    log = tmp_path / "server.log"
    log.write_text("mlx-serve-stall 99.0 watching 0.0 \n"
                   "INFO something else\n"
                   "mlx-serve-stall 100.5 loop 12.0 \n"
                   "mlx-serve-stall 101.0 loop 30.5 \n"
                   "mlx-serve-stall 101.5 gc 14.2 gen2\n"
                   "mlx-serve-stall 102.5 lock 80.0 \n")
    stalls = read_stalls(log, 100.0, 102.0)
    assert stalls == {"watched": True, "loop_max_ms": 30.5, "loop_count": 2,
                      "lock_max_ms": 0.0, "lock_count": 0, "gc": ["gen2 14.2"]}


def _blocks_the_loop_for_50_ms() -> None:
    time.sleep(0.05)


async def test_a_loop_stall_is_traced_to_the_code_that_held_the_loop(capsys):
    import threading

    from benchmarks.stalls import trace_loop, watch_loop

    stop = threading.Event()
    tracer = threading.Thread(target=trace_loop, args=(threading.get_ident(), 0.01, stop))
    tracer.start()
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_loop)
                await anyio.lowlevel.checkpoint()  # the watch has started its timer
                _blocks_the_loop_for_50_ms()
                await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    finally:
        stop.set()
        tracer.join(10)
    err = capsys.readouterr().err
    assert " loop-trace " in err and "_blocks_the_loop_for_50_ms" in err, err


@pytest.mark.skipif(not interpreter_lock_on(), reason="a free-threaded interpreter has no lock")
def test_a_lock_held_in_c_makes_every_threads_stack_dumped(capfd):
    import threading

    from benchmarks.stalls import watch_lock

    stop = threading.Event()
    watcher = threading.Thread(target=watch_lock, args=(0.01, True, stop))
    watcher.start()
    err = ""
    try:
        for _ in range(20):  # until the watch has been armed during one of them
            sum(range(5_000_000))  # one call into C: the lock is not handed over meanwhile
            err += capfd.readouterr().err
            if "Timeout" in err:
                break
    finally:
        stop.set()
        watcher.join(10)
    err += capfd.readouterr().err
    assert "Timeout" in err and "test_a_lock_held_in_c_makes" in err and " lock " in err, err


def test_stall_traces_keep_a_variants_own_choice_of_dumps():
    from benchmarks.stalls import TRACES_ENV, with_stall_log

    assert with_stall_log({}, traces=True)[TRACES_ENV] == "1"  # loop traces only
    assert with_stall_log({TRACES_ENV: "all"}, traces=True)[TRACES_ENV] == "all"
    assert TRACES_ENV not in with_stall_log({})


def test_the_phase_probe_reports_the_engine_harness_phases_per_step(tiny_model_dir, tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MLX_PHASE_PROBE_OUT": str(tmp_path / "phases"),
           "MLX_PHASE_PROBE_EVERY": "10",
           "PYTHONPATH": os.pathsep.join([str(root / "benchmarks" / "phase_probe"),
                                          str(root / "src"), str(root)])}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_limit", "--model", str(tiny_model_dir),
         "--concurrency", "2", "--num-requests", "4", "--prompt-tokens", "16",
         "--output-tokens", "16", "--one-array-logprobs", "--early-decode-join"],
        cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("phases.*")  # one file, named after the process
    windows = read_windows(path)
    # 4 requests of 16 tokens, 2 at a time: at least 16 batch steps, one line per 10.
    assert len(windows) >= 2 and all(w["steps"] == 10 for w in windows)
    for w in windows:
        step = w["phases"]["BatchGenerator._next"]
        assert step["calls"] == 1.0 and 0 < step["cpu_ms"] <= step["wall_ms"] + 0.05
        # The inner phases are inside the step: none takes longer than it.
        assert all(p["wall_ms"] <= step["wall_ms"] + 0.01 for p in w["phases"].values()
                   if p["calls"] <= 1)
    # Every step is either one that prefilled or a decode-only one; the first window
    # has the prefills of the first prompts, and the two kinds add up to all steps.
    for w in windows:
        none = {"calls": 0.0, "wall_ms": 0.0}
        kinds = [w["phases"].get(f"BatchGenerator._next ({k})", none)
                 for k in ("prefilled", "decode only")]
        whole = w["phases"]["BatchGenerator._next"]
        assert abs(sum(k["calls"] for k in kinds) - 1.0) < 1e-6
        assert abs(sum(k["wall_ms"] for k in kinds) - whole["wall_ms"]) < 0.01
    assert windows[0]["phases"]["BatchGenerator._next (prefilled)"]["calls"] > 0
    # The decode step ran as mlx_serve's one-array step, bound to the harness's batch,
    # and on mlx_serve's schedule: the early move and the first tokens read after it.
    assert any("GenerationBatch._step (one array)" in w["phases"] for w in windows)
    assert any("early move (move_prefilled)" in w["phases"] for w in windows)
    # Read once a step; a window closes inside a step, before that step's read.
    reads = [w["phases"]["take_first_tokens"]["calls"] for w in windows]
    assert reads[0] == 0.9 and all(r == 1.0 for r in reads[1:])
    # What the wrapper costs a call, measured once on the stepping thread: a wrapped
    # call's own figures hold part of it, an enclosing phase's all of it.
    probe = windows[0]["probe_us"]
    assert all(w["probe_us"] == probe for w in windows)
    assert 0 < probe["own_wall_us"] < probe["enclosing_wall_us"] < 1000
    assert 0 <= probe["own_cpu_us"] and 0 < probe["enclosing_cpu_us"]
    table = format_windows(windows)
    assert "BatchGenerator._next" in table and "probe us/call (own / enclosing)" in table
    assert f"| {probe['own_wall_us']:.1f} / {probe['enclosing_wall_us']:.1f} |" in table


def test_the_admission_probe_splits_each_requests_first_token_in_a_real_server(
        tiny_model_dir, tmp_path):
    import httpx

    from benchmarks.admission_report import by_run, format_runs, format_spans, read_spans
    from tests.server_process import ServerProcess

    root = Path(__file__).resolve().parents[1]
    env = {"MLX_ADMISSION_PROBE_OUT": str(tmp_path / "admission"),
           "PYTHONPATH": os.pathsep.join([str(root / "benchmarks" / "admission_probe"),
                                          str(root / "src"), str(root)])}
    server = ServerProcess(tiny_model_dir, tmp_path / "server.log", env=env)
    try:
        server.wait_ready()
        started = time.time()
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            for n in range(3):
                with client.stream("POST", "/v1/completions", json={
                        "prompt": f"count {n}", "max_tokens": 8, "temperature": 0,
                        "stream": True}) as reply:
                    assert reply.status_code == 200
                    lines = [line for line in reply.iter_lines() if line]
                # The probe changes nothing in the reply: every request runs to its length.
                assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
                assert any('"finish_reason": "length"' in line for line in lines)
    finally:
        server.stop()
    (path,) = tmp_path.glob("admission.*")  # one process: re-executing keeps the pid
    rows = read_spans([path])
    # One line per request that produced text: the tiny model's greedy 8 tokens do. Each
    # has all six spans, in order, from entering the application down to its stream's
    # first frame written.
    assert len(rows) == 3
    assert all(len(r) == 7 and all(span >= 0 for span in r[:6]) for r in rows)
    assert "| entered the application -> submitted |" in format_spans(rows)
    assert "| taken -> admitting step begins |" in format_spans(rows)
    assert "| handed out -> first frame written |" in format_spans(rows)
    # Each request's submission time places it inside the run that sent it.
    results = {"runs": [{"round": 0, "concurrency": 1, "target": "mlx_serve", "result": {
        "summary": {"span": [started, time.time()]}}}]}
    ((name, inside),) = by_run(results, rows)
    assert len(inside) == 3 and name == "round 0 c=1 mlx_serve"
    assert "| round 0 c=1 mlx_serve | 3 |" in format_runs(by_run(results, rows))


def test_the_admission_probe_leaves_no_file_from_a_process_that_serves_nothing(tmp_path):
    # The load generator and the probes start with the same PYTHONPATH; before, each
    # left an empty PATH.<pid> beside the server's.
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MLX_ADMISSION_PROBE_OUT": str(tmp_path / "admission"),
           "PYTHONPATH": os.pathsep.join([str(root / "benchmarks" / "admission_probe"),
                                          str(root / "src"), str(root)])}
    # Nor does such a process import the server to install the probe: with torch
    # installed, that took tens of seconds in every sampler and harness started.
    done = subprocess.run([sys.executable, "-c", "import sys, sitecustomize; "
                           "assert sitecustomize._OUT; "
                           "assert 'mlx_serve.engine' not in sys.modules"],
                          env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not installed" not in done.stderr
    assert not list(tmp_path.glob("admission.*"))


def test_the_admission_probe_installs_only_in_the_server_process():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks/admission_probe/sitecustomize.py"
    spec = importlib.util.spec_from_file_location("admission_probe_site", path)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)  # no MLX_ADMISSION_PROBE_OUT here: nothing installed
    serves, python = probe.serves, sys.executable
    assert serves([python, "-m", "mlx_serve", "--model", "m"])
    assert serves([python, "/venv/bin/mlx-serve", "--port", "8000"])
    assert serves([python, "-u", "/venv/bin/mlx-serve"])
    assert serves([python, "-m", "uvicorn", "mlx_serve.app:app"])
    assert serves([python, "/venv/bin/uvicorn", "mlx_serve.app:app", "--port", "1"])
    assert not serves([python, "-m", "benchmarks.ab", "--targets", "engine,mlx_serve"])
    assert not serves([python, "-m", "benchmarks.host", "--period", "0.2"])
    assert not serves([python, "-m", "uvicorn", "other.app:app"])
    assert not serves([python, "-c", "import mlx_serve"])
    assert not serves([python])


def test_the_phase_report_pools_the_windows_inside_each_runs_span():
    def window(end: float, cpu: float) -> dict:
        # 10 steps of 100 ms: the window covers [end - 1, end].
        return {"time": end, "steps": 10, "wall_ms_per_step": 100.0,
                "phases": {"BatchGenerator._next": {"calls": 1.0, "cpu_ms": cpu,
                                                    "wall_ms": 90.0, "faults": cpu},
                           "BatchGenerator._next (prefilled)": {
                               "calls": 0.25, "cpu_ms": cpu / 2, "wall_ms": 45.0,
                               "faults": 0.0}}}

    windows = [window(101.0, 5.0), window(102.0, 7.0), window(103.5, 9.0), window(110.0, 1.0)]
    # The wrapper's cost a call, as each process measured it (older lines have none).
    windows[0]["probe_us"] = {"own_cpu_us": 1.0, "own_wall_us": 1.0,
                              "enclosing_cpu_us": 2.0, "enclosing_wall_us": 2.0}
    windows[1]["probe_us"] = {"own_cpu_us": 3.0, "own_wall_us": 3.0,
                              "enclosing_cpu_us": 6.0, "enclosing_wall_us": 6.0}
    results = {"runs": [
        {"round": 0, "concurrency": 4, "target": "engine",
         "result": {"summary": {"span": [100.0, 102.5]}}},  # the first two windows
        {"round": 0, "concurrency": 4, "target": "mlx_serve",
         "result": {"summary": {"span": [103.0, 109.0]}}},  # none wholly inside
    ]}
    (engine_name, engine), (server_name, server) = by_run(results, windows)
    assert engine_name == "round 0 c=4 engine" and engine["steps"] == 20
    assert engine["phases"]["BatchGenerator._next"]["cpu_ms"] == pytest.approx(6.0)
    assert server is None
    table = format_runs([(engine_name, engine), (server_name, server)])
    # Columns in label order; a phase called less than once a step says how often.
    assert ("| round 0 c=4 engine | 20 | 2.0 / 4.0 | 6.00 / 90.00 / 6 | "
            "3.00 / 45.00 / 0 (0.25 calls) |") in table
    assert "| round 0 c=4 mlx_serve | 0 | - | - | - |" in table
    assert "| 10 | 100.00 | - |" in format_windows(windows[2:])


def test_the_device_touch_probe_measures_every_pattern():
    from benchmarks.device_touch import measure, patterns

    found = patterns(batch=4)
    assert len(found) == 6
    for fn in found.values():
        wall, cpu, faults = measure(fn, calls=3)
        assert wall > 0 and cpu >= 0 and faults >= 0


def test_the_hop_probe_times_the_event_loop_for_the_bare_hop_and_the_actor(tmp_path, capsys):
    import json

    from benchmarks.actor_hop import TokenRunner, main

    runner = TokenRunner(tokens=2, step_s=0.0, mode="sleep")
    request = type("Request", (), {"request_id": "a"})()
    first = runner.step([request], ())
    last = runner.step([], ())
    assert [d.finish_reason for _, d in first.deltas + last.deltas] == [None, "length"]
    assert runner.live_ids() == []

    out = tmp_path / "hop.json"
    assert main(["--step-ms", "0.2", "--requests", "4", "--tokens", "8", "--concurrency", "2",
                 "--mode", "busy", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bare"]["steps"] == 1000  # at least as many as read the CPU clock well
    # Two streams of 8 tokens, twice: 16 steps if they always overlap, 32 if never.
    assert 16 <= result["actor"]["steps"] <= 32
    assert result["bare"]["cpu_us"] > 0 and result["actor"]["cpu_us"] > 0
    table = capsys.readouterr().out
    assert "| bare | 1000 |" in table and f"| actor | {result['actor']['steps']} |" in table
