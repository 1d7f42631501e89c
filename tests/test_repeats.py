"""Medians over repeated benchmark runs (uma_trio/loadgen/repeats.py, compare.py --reps)."""

from __future__ import annotations

from typing import Any

from uma_trio.loadgen.repeats import median_rows, rep_ratios, spread_line


def row(target: str, scenario: str, lane: str, **figures: Any) -> dict[str, Any]:
    return {"target": target, "scenario": scenario, "lane": lane, **figures}


def test_each_figure_is_its_own_median_over_the_runs_in_the_first_runs_order() -> None:
    runs = [
        [
            row("uma", "s1", "all", tokens_per_s=100.0, completed=2),
            row("peer", "s1", "all", tokens_per_s=90.0),
        ],
        # A later run may list the targets the other way round (the order alternates).
        [
            row("peer", "s1", "all", tokens_per_s=120.0),
            row("uma", "s1", "all", tokens_per_s=130.0, completed=2),
        ],
        [
            row("uma", "s1", "all", tokens_per_s=110.0, completed=1),
            row("peer", "s1", "all", tokens_per_s=95.0),
        ],
    ]
    merged = median_rows(runs)
    assert [(r["target"], r["scenario"], r["lane"]) for r in merged] == [
        ("uma", "s1", "all"),
        ("peer", "s1", "all"),
    ]
    assert merged[0]["tokens_per_s"] == 110.0
    assert merged[0]["completed"] == 2
    assert merged[1]["tokens_per_s"] == 95.0


def test_an_even_number_of_runs_takes_the_mean_of_the_middle_two_and_ratios_are_medians_of_ratios() -> None:
    runs = [
        [row("uma", "mixed", "interactive", gap_p95_ms=10.0, gap_p95_vs_alone=1.1)],
        [row("uma", "mixed", "interactive", gap_p95_ms=30.0, gap_p95_vs_alone=1.3)],
    ]
    merged = median_rows(runs)
    assert merged[0]["gap_p95_ms"] == 20.0
    assert merged[0]["gap_p95_vs_alone"] == 1.2


def test_missing_figures_are_left_out_of_the_median_and_stay_none_when_no_run_has_them() -> None:
    runs = [
        [row("uma", "s", "interactive", ttft_p50_ms=None, gap_max_ms=5.0)],
        [row("uma", "s", "interactive", ttft_p50_ms=None, gap_max_ms=None)],
        [row("uma", "s", "interactive", ttft_p50_ms=None, gap_max_ms=7.0)],
    ]
    merged = median_rows(runs)
    assert merged[0]["ttft_p50_ms"] is None
    assert merged[0]["gap_max_ms"] == 6.0


def test_each_runs_ratio_is_listed_per_scenario_and_runs_without_the_base_are_left_out() -> None:
    runs = [
        [
            row("uma", "streams-1", "all", tokens_per_s=95.0),
            row("peer", "streams-1", "all", tokens_per_s=100.0),
        ],
        [
            row("uma", "streams-1", "all", tokens_per_s=99.0),
            row("peer", "streams-1", "all", tokens_per_s=90.0),
        ],
        [
            row("uma", "streams-1", "all", tokens_per_s=99.0),
            row("peer", "streams-1", "all", tokens_per_s=0.0),
        ],
        [row("uma", "streams-1", "interactive", tokens_per_s=1.0), row("peer", "streams-1", "interactive")],
    ]
    ratios = rep_ratios(runs, "uma", "peer")
    assert ratios == {"streams-1": [0.95, 1.1]}
    line = spread_line(ratios, "uma / peer tokens/s")
    assert line == "uma / peer tokens/s, each repetition: streams-1 0.950 / 1.100 (median 1.025)\n"
