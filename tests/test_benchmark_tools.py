"""The benchmark tools on a real server or engine: load generator, /health probe, saved
results, and the in-process comparisons (layers, decode step, prefill, lock, live
buffers, text cost). The A/B runners are in test_benchmark_ab.py."""

from __future__ import annotations

import json
import os
import random
import statistics
from pathlib import Path

import pytest

from benchmarks.loadgen import Target, run_load
from benchmarks.metrics import format_table
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
