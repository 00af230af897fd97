"""The A/B runners on a real server and engine: ``ab`` (contenders, rounds, the kept and
the second engine process, pinning) and ``env_ab`` (variants of one server)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.env_ab import parse_variant, relative_table
from benchmarks.servers import BatchConfig
from benchmarks.workload import Workload, build_prompts, load_tokenizer


def test_variants_parse_and_compare_against_the_first():
    assert parse_variant("A=1,B=x=y") == {"A": "1", "B": "x=y"}
    assert parse_variant("-") == {}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant("NOVALUE")

    def run(rnd, variant, tok_s):
        return {"round": rnd, "concurrency": 4, "variant": variant,
                "summary": {"output_throughput": tok_s, "ttft_ms": {"p50": 10.0},
                            "tpot_ms": {"p50": 2.0}}}

    runs = [run(0, "a", 100), run(0, "b", 150), run(1, "a", 200), run(1, "b", 220)]
    table = relative_table(runs, ["a", "b"])
    assert "| 4 | b | 1.30 [1.10-1.50] | 1.00 [1.00-1.00] |" in table
    # b's tok/s over a's: rounds 1.5 and 1.1; pooled 370 / 300.
    assert "| 4 | b | 2 | 1.30 | 1.10-1.50 | 1.23 |" in table


def test_rounds_stop_at_the_time_limit_once_each_contender_has_gone_first_as_often():
    from benchmarks.ab import round_may_start

    assert all(round_may_start(rnd, 2, 1e9, None) for rnd in range(10))  # no limit
    assert round_may_start(4, 2, 99.0, 100.0)  # before the limit, any round
    assert not round_may_start(4, 2, 100.0, 100.0)  # after it, not a new cycle...
    assert round_may_start(5, 2, 150.0, 100.0)  # ...but a cycle begun is completed
    assert round_may_start(1, 3, 150.0, 100.0) and round_may_start(2, 3, 150.0, 100.0)
    assert not round_may_start(3, 3, 150.0, 100.0)
    # A zero limit still runs one whole cycle: a result, each contender first once.
    assert round_may_start(0, 2, 1.0, 0.0) and round_may_start(1, 2, 2.0, 0.0)
    assert not round_may_start(2, 2, 3.0, 0.0)


def _small_ab(model_dir: Path, **overrides: Any) -> Any:
    """An A/B of the engine and mlx_serve: two 8-token requests at two streams, one
    round, on the reference BLAS."""
    from benchmarks import ab

    shape: dict[str, Any] = dict(
        model=str(model_dir), concurrencies=(2,), rounds=1, prompt_tokens=16,
        output_tokens=8, requests_per_stream=1, min_requests=2,
        batch=BatchConfig(8, 8, 512), run_time_limit=60.0, health_probe=None,
        blas="reference", targets=(ab.ENGINE, ab.OURS))
    return ab.ABConfig(**{**shape, **overrides})


def test_the_ab_runner_isolated_measures_engine_and_server_and_stops_the_server(
        tiny_model_dir, tmp_path, monkeypatch):
    import httpx

    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    config = _small_ab(tiny_model_dir, isolate=True, engine_one_array_logprobs=True)
    report = ab.run_ab(config, None, ["--isolate"])
    assert "error" not in report
    runs = {r["target"]: r["result"] for r in report["runs"]}
    assert set(runs) == {ab.ENGINE, ab.OURS}
    assert runs[ab.ENGINE]["target"]["one_array_logprobs"] is True  # the server's step
    for result in runs.values():
        summary = result["summary"]
        assert (summary["completed"], summary["failed"]) == (2, 0)
        # Each contender's CPU over its run, per output token: nonzero work was counted.
        assert summary["cpu_s"] > 0 and summary["cpu_ms_per_token"] > 0
        # Batch steps: 2 requests of 8 tokens take at least 8 steps (side by side) and at
        # most 22: one after the other, each with a prompt step and a step that joins it
        # to the batch, plus the 2 steps that pipelining may have queued behind a finished
        # request. At most 2 tokens a step.
        assert 8 <= summary["steps"] <= 22 and 0 < summary["tokens_per_step"] <= 2
        assert summary["ms_per_step"] > 0
        # Each prompt took at least one step that also prefilled (alone or together);
        # the decode-only steps are most of a run of 8-token outputs.
        assert 1 <= summary["prefill_steps"] < summary["steps"]
        # When the measured load ran (epoch seconds), for matching other logs to it.
        begun, ended = summary["span"]
        assert 0 < ended - begun == pytest.approx(summary["duration_s"], abs=0.01)
        assert summary["prefill_step_share"] == round(
            summary["prefill_steps"] / summary["steps"], 4)
    for run in report["runs"]:  # what the host gave each run was read through it
        probe = run["result"]["summary"]["host"]["cpu_probe_ms"]
        assert probe["samples"] >= 1 and probe["p50"] > 0
    # CPU by thread: mlx_serve's event loop and its MLX thread (found by the name it
    # gives its OS thread) did work; the engine harness steps in its only Python thread.
    served_cpu = runs[ab.OURS]["summary"]["cpu_ms_per_token_by_thread"]
    assert served_cpu["main"] > 0 and served_cpu["stepping"] > 0
    engine_cpu = runs[ab.ENGINE]["summary"]["cpu_ms_per_token_by_thread"]
    assert engine_cpu["stepping"] > 0 and engine_cpu["main"] == 0
    assert report["ratios"]["2"]["CPU ms/token, stepping thread"]["mlx_serve/engine"]["n"] == 1
    assert report["ratios"]["2"]["CPU probe p50"]["mlx_serve/engine"]["n"] == 1
    served = runs[ab.OURS]
    assert served["health_after"]["state"] == "ready"
    # The run's steps are the difference over the run: the warm-ups' are not among them.
    assert served["health_after"]["steps"] > served["summary"]["steps"]
    # So is the MLX thread's busy time: a share of the run's wall time (a step that began
    # before the run may add its few ms), only mlx_serve's.
    assert 0 < served["summary"]["mlx_busy_share"] <= 1.2
    assert runs[ab.ENGINE]["summary"].get("mlx_busy_share") is None
    assert "MLX thread busy share" not in ab.format_ratios(report["ratios"])  # no pair
    with pytest.raises(httpx.ConnectError):  # stopped once its run was over
        httpx.get(served["target"]["base_url"] + "/health", timeout=5)


def test_a_server_that_misses_its_start_in_an_isolated_ab_keeps_the_runs_before(
        tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    config = _small_ab(tiny_model_dir, isolate=True, startup_timeout=0.05)
    report = ab.run_ab(config, None, ["--isolate"])
    # Before, the TimeoutError ended ab with a traceback and no results written.
    assert report["error"].startswith("TimeoutError: mlx_serve not ready")
    assert [r["target"] for r in report["runs"]] == [ab.ENGINE]


def test_ab_over_chat_gives_the_engine_the_chat_templates_tokens(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    config = _small_ab(tiny_model_dir, api="chat", warm_run=False)
    report = ab.run_ab(config, None, [])
    assert "error" not in report
    prompt_tokens = {r["target"]: r["result"]["summary"]["prompt_tokens"]
                     for r in report["runs"]}
    # Before, the engine ran the bare text (16 tokens a prompt) where the server ran the
    # chat template around it: different work under one ratio.
    assert prompt_tokens[ab.ENGINE] == prompt_tokens[ab.OURS] > 2 * 16


def test_the_ab_runner_keeps_one_engine_process_for_every_engine_run_and_stops_it(
        tiny_model_dir, tmp_path, monkeypatch, capsys):

    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    config = ab.ABConfig(model=str(tiny_model_dir), concurrencies=(1, 2), rounds=2,
                         prompt_tokens=16, output_tokens=8, requests_per_stream=1,
                         min_requests=2, batch=BatchConfig(8, 8, 512),
                         run_time_limit=60.0, health_probe=None, blas="reference",
                         targets=(ab.ENGINE,))
    report = ab.run_ab(config, None, [])
    assert "error" not in report
    assert [(r["round"], r["concurrency"]) for r in report["runs"]] == [
        (0, 1), (0, 2), (1, 1), (1, 2)]
    # Before round 0 the contender served one unmeasured run, counted in no figure.
    assert capsys.readouterr().out.count("warm run engine (not counted): 2 ok, 0 failed") == 1
    pids = {r["result"]["target"]["pid"] for r in report["runs"]}
    assert len(pids) == 1  # the model was loaded once
    for run in report["runs"]:
        summary = run["result"]["summary"]
        assert (summary["completed"], summary["failed"]) == (2, 0)
        assert summary["cpu_ms_per_token_by_thread"]["stepping"] > 0
    (pid,) = pids
    assert not os.path.exists(f"/proc/{pid}")  # stopped on the way out


def test_the_ab_runner_runs_a_second_engine_process_as_an_a_a_control(
        tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    config = _small_ab(tiny_model_dir, rounds=2, targets=(ab.ENGINE, ab.ENGINE_B),
                       warm_run=False)
    report = ab.run_ab(config, None, [])
    assert "error" not in report
    pids = {r["target"]: set() for r in report["runs"]}
    for run in report["runs"]:
        pids[run["target"]].add(run["result"]["target"]["pid"])
        assert run["result"]["summary"]["failed"] == 0
    # Two processes, each kept for both of its rounds, stopped on the way out.
    assert len(pids[ab.ENGINE]) == len(pids[ab.ENGINE_B]) == 1
    assert pids[ab.ENGINE] != pids[ab.ENGINE_B]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in set.union(*pids.values()))
    assert report["ratios"]["2"]["tok_s"]["engine_b/engine"]["n"] == 2
    text = ab.format_ratios(report["ratios"])
    assert "| 2 | engine_b/engine | 2 |" in text
    assert "failed requests (engine / mlx_serve / mlx_lm / engine_b)" in text


def test_ab_refuses_an_unknown_or_repeated_contender():
    from benchmarks.ab_config import build_parser

    for targets in ("engine,mlx-serve", "engine,engine", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--targets", targets])
    args = build_parser().parse_args(["--targets", "engine,mlx_serve,engine_b"])
    assert args.targets == ("engine", "mlx_serve", "engine_b")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two vCPUs")
def test_the_ab_runner_pins_both_stepping_threads_to_one_vcpu_and_the_rest_elsewhere(
        tiny_model_dir, tmp_path, monkeypatch):

    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    vcpus = sorted(os.sched_getaffinity(0))
    cpu = vcpus[-1]
    config = _small_ab(tiny_model_dir, settle=0.05, pin_stepping=cpu, warm_run=False)
    try:
        report = ab.run_ab(config, None, [])
        # The load generator (this thread) and what it started were kept off the vCPU.
        assert os.sched_getaffinity(0) == set(vcpus) - {cpu}
    finally:
        os.sched_setaffinity(0, vcpus)
    assert "error" not in report
    assert {r["target"] for r in report["runs"]} == {ab.ENGINE, ab.OURS}
    for run in report["runs"]:
        detail = run["result"]["summary"]["stepping_detail"]
        # Both stepping threads ran on the pinned vCPU from start to end of their run.
        assert (detail["vcpu_start"], detail["vcpu"]) == (cpu, cpu), run["target"]
        assert f"on vCPU {cpu}" in ab.format_runs([run])
        # The quiet before it swept every vCPU with the probe.
        probe = run["quiet_before"]["vcpu_probe_ms"]
        assert sorted(probe) == vcpus and all(ms > 0 for ms in probe.values())


def test_pinning_refuses_a_vcpu_the_process_may_not_use(tiny_model_dir, tmp_path,
                                                       monkeypatch):
    from benchmarks import ab

    monkeypatch.setattr(ab, "RESULTS_DIR", tmp_path)
    outside = max(os.sched_getaffinity(0)) + 1
    config = ab.ABConfig(model=str(tiny_model_dir), targets=(ab.ENGINE,),
                         pin_stepping=outside)
    with pytest.raises(ValueError, match=f"cannot pin to vCPU {outside}"):
        ab.run_ab(config, None, [])
    with pytest.raises(SystemExit, match="kept engine process"):
        ab.run_ab(ab.ABConfig(model=str(tiny_model_dir), targets=(ab.ENGINE,),
                              pin_stepping=0, isolate=True), None, [])


def test_a_failed_engine_job_is_reported_and_the_worker_serves_the_next(tiny_model_dir,
                                                                       tmp_path):

    from benchmarks.engine_worker import EngineWorker, harness_command
    from benchmarks.servers import BatchConfig

    command = harness_command(str(tiny_model_dir), BatchConfig(8, 8, 512), False)
    worker = EngineWorker(command, dict(os.environ), tmp_path / "engine.log", 120.0)
    try:
        workload = Workload(16, 4, num_requests=1, concurrency=1, time_limit=30.0)
        with pytest.raises(RuntimeError, match="FileNotFoundError"):
            worker.run(workload, tmp_path / "missing.json", tmp_path / "out.json")
        prompts = build_prompts(load_tokenizer(str(tiny_model_dir)), 2, 16, seed=5)
        (tmp_path / "prompts.json").write_text(
            json.dumps({"prompts": prompts[1:], "warmup": prompts[:1]}))
        worker.run(workload, tmp_path / "prompts.json", tmp_path / "out.json")
        result = json.loads((tmp_path / "out.json").read_text())
        assert result["summary"]["completed"] == 1
        assert result["target"]["pid"] == worker.pid
    finally:
        worker.stop()
    assert worker.proc.returncode == 0  # it ended at the end of its input


def test_an_engine_worker_that_never_answers_times_out_and_is_stopped(tmp_path):

    from benchmarks.engine_worker import EngineWorker

    pid_file = tmp_path / "pid"
    silent = [sys.executable, "-c", "import os, sys, time; "
              "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)", str(pid_file)]
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        EngineWorker(silent, {}, tmp_path / "engine.log", 5.0)
    assert time.monotonic() - started < 30
    assert not os.path.exists(f"/proc/{pid_file.read_text()}")  # stopped, not left behind


def test_env_ab_isolated_runs_every_variant(tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import env_ab

    monkeypatch.setattr(env_ab, "RESULTS_DIR", tmp_path)
    args = env_ab.build_parser().parse_args([
        "--model", str(tiny_model_dir), "--variant", "-",
        "--variant", "MLX_SERVE_STREAM_INTERVAL=4", "--isolate", "--concurrency", "2",
        "--rounds", "1", "--prompt-tokens", "16", "--output-tokens", "8",
        "--min-requests", "2", "--requests-per-stream", "1", "--decode-batch-size", "8",
        "--run-time-limit", "60", "--stalls"])
    report = env_ab.run(args)
    assert [r["variant"] for r in report["runs"]] == ["-", "MLX_SERVE_STREAM_INTERVAL=4"]
    for r in report["runs"]:
        assert (r["summary"]["completed"], r["summary"]["failed"]) == (2, 0)
        assert r["summary"]["stalls"]["watched"]  # the server ran with the stall log
        assert r["summary"]["cpu_ms_per_token"] > 0
        assert r["summary"]["host"]["cpu_probe_ms"]["samples"] >= 1
        assert r["summary"]["cpu_ms_per_token_by_thread"]["stepping"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two vCPUs")
def test_env_ab_pins_every_variants_mlx_thread_to_one_vcpu(tiny_model_dir, tmp_path,
                                                          monkeypatch):
    from benchmarks import env_ab

    monkeypatch.setattr(env_ab, "RESULTS_DIR", tmp_path)
    vcpus = sorted(os.sched_getaffinity(0))
    cpu = vcpus[-1]
    args = env_ab.build_parser().parse_args([
        "--model", str(tiny_model_dir), "--variant", "-",
        "--variant", "MLX_SERVE_STREAM_INTERVAL=4", "--concurrency", "2", "--rounds", "1",
        "--prompt-tokens", "16", "--output-tokens", "8", "--min-requests", "2",
        "--requests-per-stream", "1", "--decode-batch-size", "8", "--run-time-limit", "60",
        "--no-warm-run", "--pin-stepping", str(cpu)])
    pinned: list[tuple[int, dict[int, set[int]]]] = []
    real_pin = env_ab.pin_stepping

    def pin_and_read_back(pid, stepping_tid, to_cpu, rest):
        stepping = real_pin(pid, stepping_tid, to_cpu, rest)
        affinity = {}
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                affinity[tid] = os.sched_getaffinity(tid)
        pinned.append((stepping, affinity))
        return stepping

    monkeypatch.setattr(env_ab, "pin_stepping", pin_and_read_back)
    try:
        report = env_ab.run(args)
        # The load generator (this thread) and the servers it started kept off the vCPU.
        assert os.sched_getaffinity(0) == set(vcpus) - {cpu}
    finally:
        os.sched_setaffinity(0, vcpus)
    assert [r["variant"] for r in report["runs"]] == ["-", "MLX_SERVE_STREAM_INTERVAL=4"]
    for run in report["runs"]:
        assert (run["summary"]["completed"], run["summary"]["failed"]) == (2, 0)
        detail = run["summary"]["stepping_detail"]
        # Each server's MLX thread ended its run on the pinned vCPU. (Where it was at the
        # start is where it last ran before the pin: an idle thread moves when it wakes.)
        assert detail["vcpu"] == cpu, run["variant"]
    # Before each run its server's MLX thread alone was on the vCPU, all else off it.
    assert len(pinned) == 2
    for stepping, affinity in pinned:
        assert affinity.pop(stepping) == {cpu}
        assert affinity and all(a == set(vcpus) - {cpu} for a in affinity.values())

    outside = max(vcpus) + 1
    with pytest.raises(ValueError, match=f"cannot pin to vCPU {outside}"):
        env_ab.run(env_ab.build_parser().parse_args([
            "--model", str(tiny_model_dir), "--variant", "-", "--variant", "A=1",
            "--pin-stepping", str(outside)]))


def test_an_env_ab_variant_setting_a_flag_of_the_base_command_replaces_it():
    from benchmarks.env_ab import without_flags_set_in
    from benchmarks.servers import mlx_serve_command

    command = mlx_serve_command("m", 8000, BatchConfig(64, 8, 512))
    # A flag wins over its variable: before, this variant ran with --decode-batch-size 64.
    varied = without_flags_set_in(command, {"MLX_SERVE_DECODE_BATCH_SIZE": "8",
                                            "OPENBLAS_NUM_THREADS": "1"})
    assert "--decode-batch-size" not in varied and "64" not in varied
    assert varied == [w for w in command if w not in ("--decode-batch-size", "64")]
    assert without_flags_set_in(command, {"OPENBLAS_NUM_THREADS": "1"}) == command


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_env_ab_stopped_by_sigterm_stops_its_servers(tiny_model_dir, tmp_path):
    # Its servers run in sessions of their own, out of reach of a signal to its group:
    # before, `timeout` (SIGTERM) left both servers running.
    tool = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.env_ab", "--model", str(tiny_model_dir),
         "--variant", "-", "--variant", "OPENBLAS_NUM_THREADS=1", "--concurrency", "2",
         "--rounds", "50", "--prompt-tokens", "16", "--output-tokens", "64",
         "--decode-batch-size", "8", "--out", str(tmp_path / "out.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert tool.stdout is not None
        for line in tool.stdout:  # the first measured run: both servers are up
            if line.startswith("round 0"):
                break
        servers = _children(tool.pid)
        assert len(servers) == 2
        tool.send_signal(signal.SIGTERM)
        tool.communicate(timeout=60)
    finally:
        if tool.poll() is None:
            tool.kill()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in servers):
        assert time.monotonic() < deadline, "a server outlived env_ab"
        time.sleep(0.1)


def test_env_ab_warms_each_shared_server_with_one_uncounted_run(tiny_model_dir, tmp_path,
                                                               monkeypatch, capsys):
    from benchmarks import env_ab

    monkeypatch.setattr(env_ab, "RESULTS_DIR", tmp_path)
    args = env_ab.build_parser().parse_args([
        "--model", str(tiny_model_dir), "--variant", "-",
        "--variant", "MLX_SERVE_STREAM_INTERVAL=4", "--concurrency", "2", "--rounds", "1",
        "--prompt-tokens", "16", "--output-tokens", "8", "--min-requests", "2",
        "--requests-per-stream", "1", "--decode-batch-size", "8", "--run-time-limit", "60",
        "--api", "chat"])
    report = env_ab.run(args)
    out = capsys.readouterr().out
    assert out.count("warm run - (not counted): 2 ok, 0 failed") == 1
    assert out.count("warm run MLX_SERVE_STREAM_INTERVAL=4 (not counted): 2 ok, 0 failed") == 1
    assert [r["summary"]["completed"] for r in report["runs"]] == [2, 2]  # warm runs left out
    # Chat requests: the template wraps each 16-token prompt in more tokens.
    assert all(r["summary"]["prompt_tokens"] > 2 * 16 for r in report["runs"])
    # The results say what the servers parsed HTTP with (h11 without httptools).
    assert report["meta"]["versions"]["httptools"] is not None
    assert "uvloop" in report["meta"]["versions"]


def test_a_host_without_httptools_is_warned_about():
    from benchmarks.environment import http_parser_warning

    assert http_parser_warning({"versions": {"httptools": "0.9.0"}}) is None
    assert "h11" in (http_parser_warning({"versions": {"httptools": None}}) or "")
