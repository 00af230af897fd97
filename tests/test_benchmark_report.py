"""The A/B report's tables from synthetic runs: no model, no server."""

from __future__ import annotations

from benchmarks.report import ENGINE, ENGINE_B, OURS, format_ratios, ratios


def run(rnd: int, target: str, tok_s: float) -> dict:
    summary = {"output_throughput": tok_s, "ttft_ms": {"p50": 10.0},
               "itl_ms": {"p50": 2.0, "p90": 3.0}, "tpot_ms": {"p50": 2.0}, "failed": 0}
    return {"round": rnd, "concurrency": 4, "target": target, "result": {"summary": summary}}


def test_the_report_shows_how_far_apart_each_contenders_own_rounds_ran():
    runs = [run(0, ENGINE, 100.0), run(0, OURS, 90.0),
            run(1, ENGINE, 175.0), run(1, OURS, 180.0)]
    table = ratios(runs)
    own = table["4"]["own_tok_s"]
    assert (own[ENGINE]["min"], own[ENGINE]["max"]) == (100.0, 175.0)
    assert own["mlx_lm"] is None
    text = format_ratios(table)
    # The host ran the engine's two rounds 1.75x apart: ratios from such a run are weak.
    assert "| 4 | 137.5 [100.0-175.0], 1.75x | 135.0 [90.0-180.0], 2.00x | - |" in text
    assert "| 4 | mlx_serve/engine | 2 | 0.96 |" in text


def test_a_second_engine_process_is_compared_with_the_first_only_when_it_ran():
    runs = [run(0, ENGINE, 100.0), run(0, OURS, 90.0), run(0, ENGINE_B, 80.0),
            run(1, ENGINE, 100.0), run(1, OURS, 95.0), run(1, ENGINE_B, 120.0)]
    table = ratios(runs)["4"]
    assert table["output tok/s"]["engine_b/engine"]["min"] == 0.8
    assert table["output tok/s"]["engine_b/engine"]["max"] == 1.2
    text = format_ratios(ratios(runs))
    assert "| conc | metric | mlx_serve/engine | mlx_lm/engine | mlx_serve/mlx_lm " \
           "| engine_b/engine |" in text
    # Without the control the tables keep their three pairs and three contenders.
    plain = format_ratios(ratios([r for r in runs if r["target"] != ENGINE_B]))
    assert "engine_b" not in plain


def test_with_the_control_the_server_is_also_read_against_both_engines_together():
    # Round 0: the engines at 100 and 64 (geometric mean 80); round 1: 100 and 144 (120).
    # Round 2 has no engine_b: it counts for mlx_serve/engine only.
    runs = [run(0, ENGINE, 100.0), run(0, OURS, 72.0), run(0, ENGINE_B, 64.0),
            run(1, ENGINE, 100.0), run(1, OURS, 132.0), run(1, ENGINE_B, 144.0),
            run(2, ENGINE, 100.0), run(2, OURS, 50.0)]
    both = ratios(runs)["4"]["tok_s"]["mlx_serve/engines"]
    assert both["n"] == 2
    assert abs(both["median"] - (72 / 80 + 132 / 120) / 2) < 1e-9
    assert abs(both["pooled"] - (72 + 132) / (80 + 120)) < 1e-9
    assert ratios(runs)["4"]["tok_s"]["mlx_serve/engine"]["n"] == 3
    assert "| 4 | mlx_serve/engines | 2 | 1.00 |" in format_ratios(ratios(runs))
    # Without the control there is no such row.
    plain = ratios([r for r in runs if r["target"] != ENGINE_B])["4"]["tok_s"]
    assert "mlx_serve/engines" not in plain
