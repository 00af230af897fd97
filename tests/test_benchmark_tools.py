"""The benchmark tools on a real server or engine: load generator, /health probe, A/B
runners, and the in-process comparisons (layers, decode step, prefill, lock, live
buffers, text cost)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.env_ab import parse_variant, relative_table
from benchmarks.loadgen import Target, run_load
from benchmarks.metrics import format_table
from benchmarks.servers import BatchConfig
from benchmarks.workload import Workload, build_prompts, load_tokenizer

pytestmark = pytest.mark.anyio


async def test_the_load_generator_counts_streamed_tokens_and_probes_health(
        tiny_server, tiny_model_dir):
    workload = Workload(prompt_tokens=16, output_tokens=8, num_requests=6, concurrency=3,
                        time_limit=60.0)
    prompts = build_prompts(load_tokenizer(str(tiny_model_dir)), 6, 16, seed=3)
    target = Target(tiny_server.base_url, request_timeout=30.0, health_probe=0.02)
    summary = (await run_load(target, workload, prompts))["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert 1 <= summary["mean_output_tokens"] <= 8
    assert summary["ttft_ms"]["p50"] > 0 and summary["output_throughput"] > 0
    assert summary["client_cpu"] > 0
    assert summary["health"]["probes"] > 0 and summary["health"]["failed"] == 0
    assert summary["health"]["probe_priority"] in ("fifo", "normal")
    assert len(summary["health"]["in_order_ms"]) == summary["health"]["probes"]
    assert max(summary["health"]["in_order_ms"]) > 0
    slowest = max(summary["health"]["in_order_ms"])
    table = format_table(summary, "run").splitlines()
    assert f"max {slowest:.1f} ms" in table[-1]
    header = next(line for line in table if line.startswith("ms"))
    ttft = next(line for line in table if line.startswith("TTFT"))
    assert len(header.split()) == len(ttft.split())  # a label over every column


def test_the_health_probe_runs_real_time_where_it_may_and_says_which():
    from benchmarks.health_probe import HealthProbe

    probe = HealthProbe("http://127.0.0.1:9", 0.05)  # discard port: every probe fails
    probe.start()
    try:
        assert probe._process is not None
        policy = os.sched_getscheduler(probe._process.pid)
        assert probe.priority == ("fifo" if policy == os.SCHED_FIFO else "normal")
        if os.geteuid() == 0:  # root may use the real-time scheduler
            assert probe.priority == "fifo"
    finally:
        samples = probe.stop()
    assert samples and not any(ok for _, ok in samples)


async def test_a_server_that_is_not_there_fails_every_request_without_hanging():
    workload = Workload(16, 8, num_requests=2, concurrency=1, time_limit=10.0)
    target = Target("http://127.0.0.1:9", request_timeout=5.0)  # discard port: refused
    summary = (await run_load(target, workload, ["a b c", "d e f"]))["summary"]
    assert (summary["completed"], summary["failed"]) == (0, 2)


def test_the_deep_model_has_the_1b_llamas_layers_at_the_tiny_models_width(tmp_path):
    from benchmarks.contenders import DEEP_LAYERS, resolve_model_path

    deep = json.loads((Path(resolve_model_path("deep", tmp_path)) / "config.json").read_text())
    tiny = json.loads((Path(resolve_model_path("tiny", tmp_path)) / "config.json").read_text())
    assert DEEP_LAYERS == 16  # the GPU benchmarks' 1B llama's
    assert (deep["num_hidden_layers"], tiny["num_hidden_layers"]) == (16, 2)
    assert deep["hidden_size"] == tiny["hidden_size"]
    assert resolve_model_path("/some/folder", tmp_path) == "/some/folder"


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


def _saved_ab(date: str, tok_s: list[tuple[float, float]]) -> dict:
    """A saved A/B at one stream: (engine, mlx_serve) output tok/s for each round."""
    def summary(value: float) -> dict:
        return {"output_throughput": value, "ttft_ms": {"p50": 10.0},
                "itl_ms": {"p50": 3.0, "p90": 4.0}, "tpot_ms": {"p50": 3.0}, "failed": 0,
                "completed": 12, "mean_output_tokens": 128.0}
    runs = [{"round": rnd, "concurrency": 1, "target": target,
             "result": {"summary": summary(value)}}
            for rnd, pair in enumerate(tok_s)
            for target, value in zip(("engine", "mlx_serve"), pair, strict=True)]
    return {"meta": {"date": date}, "runs": runs}


def test_saved_ab_runs_are_reprinted_and_pooled_round_by_round(tmp_path, capsys):
    from benchmarks import report

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    # Run A: ratios 0.5 and 0.7; run B, on a faster machine: 0.9 (its own round 0).
    first.write_text(json.dumps(_saved_ab("A", [(100.0, 50.0), (100.0, 70.0)])))
    second.write_text(json.dumps(_saved_ab("B", [(300.0, 270.0)])))
    assert report.main([str(first)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | output tok/s | 0.60 [0.50-0.70] |" in out
    # Two rounds: resampled medians are 0.5, 0.6 or 0.7; pooled 120 / 200 tok/s.
    assert "| 1 | mlx_serve/engine | 2 | 0.60 | 0.50-0.70 | 0.60 |" in out
    assert report.main([str(first), str(second), "--runs"]) == 0
    out = capsys.readouterr().out
    # Each ratio stays within its round (B's round 0 is not paired with A's round 0).
    assert "every round of the 2 runs above, pooled:" in out
    assert "| 1 | output tok/s | 0.70 [0.50-0.90] |" in out
    # Pooled, the fast machine's round weighs more: 390 / 500 tok/s.
    assert "| 1 | mlx_serve/engine | 3 | 0.70 | 0.50-0.90 | 0.78 |" in out
    assert out.count("c=1") == 6  # --runs lists all six runs


def test_the_interval_of_a_median_narrows_with_more_rounds_and_holds_the_median():
    from benchmarks.report import median_interval

    rng = random.Random(7)
    few = [rng.gauss(1.0, 0.2) for _ in range(6)]
    many = few + [rng.gauss(1.0, 0.2) for _ in range(90)]
    for values in (few, many):
        low, high = median_interval(values)
        assert low <= statistics.median(values) <= high
    assert median_interval(many)[1] - median_interval(many)[0] < \
        median_interval(few)[1] - median_interval(few)[0]
    assert median_interval([0.9] * 5) == (0.9, 0.9)
    assert median_interval(few) == median_interval(few)  # seeded: a reprint is the same


def test_the_live_buffer_probe_decodes_beside_held_and_churning_buffers(tiny_model_dir):
    from benchmarks.live_buffers import HeldBuffers, probe

    rows = probe(str(tiny_model_dir), [0, 4], buffer_bytes=4096, batch=2, steps=5, churn=1)
    assert [(r["pass"], r["buffers"]) for r in rows] == [
        ("up", 0), ("up", 4), ("down", 4), ("down", 0)]
    assert all(r["cpu_ms_per_step"] > 0 and r["wall_ms_per_step"] > 0 for r in rows)
    held = HeldBuffers(4096)
    held.resize(3)
    first = held.arrays[0]
    held.replace(2)  # the two oldest freed, two new ones made
    assert len(held.arrays) == 3 and all(a is not first for a in held.arrays)
    assert len({id(a) for a in held.arrays}) == 3


def test_the_prefill_probe_times_the_forward_pass_and_the_newcomers_way_to_a_token(
        tiny_model_dir, tmp_path):
    from benchmarks import prefill_step

    out = tmp_path / "prefill.json"
    assert prefill_step.main(["--model", str(tiny_model_dir), "--prompts", "3", "--tokens", "6",
                              "--decoding", "2", "--rounds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["prompts"], result["decoding"], result["rounds"]) == (3, 2, 2)
    # mlx-lm's schedule: a call that prefills, then more until the first tokens appear.
    assert result["calls_to_first_tokens"] >= 2
    for part in ("forward", "admitting_step", "to_first_tokens", "decode_step"):
        assert 0 < result[part]["wall_ms_min"] <= result[part]["wall_ms_p50"]
    # The calls up to the first tokens include the admitting one.
    assert result["to_first_tokens"]["wall_ms_p50"] >= result["admitting_step"]["wall_ms_min"]


def test_the_lock_probe_times_decoding_alone_and_beside_a_spinning_thread(tiny_model_dir):
    from benchmarks.lock_probe import probe

    rows = probe(str(tiny_model_dir), [2], steps=10, prompt_tokens=8, solo_seconds=0.1)
    assert [(r["batch"], r["spinner"]) for r in rows] == [(2, False), (2, True)] * 2
    assert all(r["step_ms"] > 0 and 0 < r["async_eval_share"] < 1 for r in rows)
    # The spinner made progress while MLX ran: its rate is measured, not assumed.
    assert all(r["spinner_rate"] > 0 for r in rows if r["spinner"])


def test_the_decode_step_comparison_times_both_steps_and_finds_the_same_tokens(
        tiny_model_dir, tmp_path):
    from benchmarks import decode_step

    out = tmp_path / "steps.json"
    assert decode_step.main(["--model", str(tiny_model_dir), "--batches", "3",
                             "--steps", "4", "--rounds", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 3 and row["same_tokens"] is True
    for name in ("mlx_lm", "one_array"):
        assert row[name]["ms_per_step"] > 0 and row[name]["cpu_ms_per_step"] >= 0


def test_the_layer_comparison_runs_every_layer_on_the_same_tokens(tiny_model_dir, tmp_path):
    from benchmarks import layers

    out = tmp_path / "layers.json"
    assert layers.main(["--model", str(tiny_model_dir), "--native", "off", "--rounds", "2",
                        "--concurrency", "2", "--requests", "3", "--prompt-tokens", "12",
                        "--output-tokens", "6", "--run-time-limit", "60",
                        "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["command"].startswith("python -m benchmarks.layers --model")
    runs = result["runs"]
    # Every layer ran in every round, the order rotating between rounds.
    assert sorted((r["round"], r["layer"]) for r in runs) == sorted(
        (rnd, layer) for rnd in (0, 1) for layer in layers.LAYERS)
    n = len(layers.LAYERS)
    assert [r["layer"] for r in runs[:n]] != [r["layer"] for r in runs[n:]]
    # Each run decoded its own three prompts (an EOS may end one early) in counted steps.
    assert all(3 <= r["tokens"] <= 18 for r in runs)
    assert all(r["steps"] > 0 and r["ms_per_step"] > 0 for r in runs)
    # Every layer timed its requests' first text, within the run's own time.
    assert all(0 < r["ttft_p50_ms"] <= r["wall_s"] * 1e3 for r in runs)
    # The thread that stepped the batch used CPU in every run; in the harness's runs that
    # is this thread, so no separate event-loop time is counted there.
    assert all(r["cpu_ms_per_step"]["stepping"] > 0 for r in runs)
    assert all(r["cpu_ms_per_step"]["main"] == 0 for r in runs if r["layer"] == "engine")
    # The busy neighbour ran beside the harness, and only there.
    assert all((r["neighbour_cpu_s"] or 0) > 0 for r in runs if r["layer"] == "engine-busy")
    assert all(r["neighbour_cpu_s"] is None for r in runs if r["layer"] != "engine-busy")
    # The stepping thread's kernel counters, per step of the run they describe.
    assert all(r["stepping_detail"]["steps"] == r["steps"] for r in runs)
    table = result["ratios"]
    assert table["engine"]["ms_per_step"]["median"] == 1.0
    assert all(table[layer]["tok_s"]["n"] == 2 for layer in layers.LAYERS)
    assert all(table[layer]["ttft_p50_ms"]["n"] == 2 for layer in layers.LAYERS)


def test_the_text_cost_times_each_tokens_text_for_every_stream(tiny_model_dir):
    from benchmarks.text_cost import measure

    result = measure(tiny_model_dir, streams=3, tokens=5, rounds=2)
    assert result["detokenizer"] == "TabledBPEStreamingDetokenizer"
    assert result["mlx_lm_detokenizer"] == "BPEStreamingDetokenizer"
    assert len(result["rounds"]) == len(result["mlx_lm_rounds"]) == 2
    for ours, theirs in zip(result["rounds"], result["mlx_lm_rounds"], strict=True):
        assert ours["calls"] == theirs["calls"] == 15
        assert ours["chars"] == theirs["chars"] > 0  # the same text either way
        assert 0 < ours["cpu_us_per_token"] and 0 < ours["wall_us_per_token"]


def test_large_reply_measures_health_while_a_whole_reply_is_made(tiny_server, tmp_path):
    from benchmarks.large_reply import main

    out = tmp_path / "large.json"
    assert main(["--base-url", tiny_server.base_url, "--n", "2", "--max-tokens", "40",
                 "--top-logprobs", "3", "--rounds", "1", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["rounds"]
    assert result["status"] == 200 and result["failed_probes"] == 0
    assert result["probes"] >= 1 and result["probe_max_ms"] > 0
    reply_tokens = 2 * 40
    assert result["reply_bytes"] > reply_tokens * 4 * 20  # every token with 3 alternatives


def test_the_recovery_simulation_reports_who_ends_under_each_fault_model():
    from benchmarks.recovery_sim import flaky_engine, flaky_request

    request = flaky_request(batch=8, rate=0.7, runs=20)
    assert request["culprit_found"] + request["culprit_worn_out"] == 1.0  # it always ends
    assert 0 <= request["innocents_lost_share"] < 0.2
    always = flaky_engine(batch=8, rate=1.0, runs=5)  # every step and self-test fails
    assert always["engine_failed"] == 1.0 and always["wrongly_found_cause"] == 0.0
    never = flaky_engine(batch=8, rate=0.0, runs=5)
    assert never["engine_failed"] == 0.0 and never["worn_out"] == 0.0
