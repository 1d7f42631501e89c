"""``uma-trio bench``: a suite of scenarios on one or more targets, side by side.

Targets run one after the other (never at once: they would share the CPU): each
scenario of the suite on every target before the next scenario.  With ``alone`` a
suite first runs each scenario without its background clients, so interactive gaps
can be reported relative to the same clients alone.  Writes, under ``out``:

* ``tokens.csv``: one row per token event (target, scenario, client, request,
  token_idx, t_ms, lane);
* ``requests.csv``: one row per request (:data:`~.stats.CSV_FIELDS` plus target);
* ``summary.csv``: per target, scenario and lane (and ``all``): TTFT p50/p95,
  gap p50/p95/p99/max, tokens/s, requests completed/failed, and the ratios to
  the ``alone`` run;
* PNG plots (:mod:`.plots`): token timelines per client, gap CDFs.

The figures are computed by :mod:`.stats`, which is pure and tested alone.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..client import ConnectionLost
from ..exception_groups import first_leaf
from .runner import CONNECT_FAILED, ScenarioResult, run_scenario
from .scenario import ClientSpec, Scenario, Suite
from .stats import CSV_FIELDS, LANES, TOKEN_CSV_FIELDS, lane_stats, to_csv_rows, token_rows, tokens_per_s
from .targets import Target

SUMMARY_FIELDS: Sequence[str] = (
    "target", "scenario", "lane", "requests", "completed", "failed", "tokens", "tokens_per_s",
    "ttft_p50_ms", "ttft_p95_ms", "completion_p50_ms", "gap_p50_ms", "gap_p95_ms", "gap_p99_ms",
    "gap_max_ms", "gap_p95_vs_alone", "gap_max_vs_alone_p95", "span_s",
)  # fmt: skip


def expected_tokens(scenario: Scenario) -> int:
    """Tokens the scenario asks for (an upper bound: a request may stop early)."""
    return sum(c.max_tokens * c.requests for c in scenario.expanded().clients)


def plan(suite: Suite) -> list[Scenario]:
    """The scenarios one target runs, in order: each one's ``alone`` variant first."""
    runs: list[Scenario] = []
    for scenario in suite.runs:
        alone = scenario.without_lane("background")
        if suite.alone and alone.clients and len(alone.clients) < len(scenario.clients):
            runs.append(alone)
        runs.append(scenario)
    return runs


WARM_UP = Scenario(name="warm-up", clients=[ClientSpec(name="warm-up", prompt_tokens=8, max_tokens=4)])


# A target's failures that end its runs (a dead server, a missing package), not the bench's.
TARGET_ERRORS: tuple[type[Exception], ...] = (ConnectionLost, OSError, RuntimeError, ValueError)


async def run_bench(
    suite: Suite,
    targets: Sequence[Target],
    *,
    on_token: Callable[[], None] | None = None,
    into: list[ScenarioResult] | None = None,
    target_errors: dict[str, str] | None = None,
) -> list[ScenarioResult]:
    """The suite on every target: each target's one short warm-up request first (not
    reported; a fresh server's first request pays one-off costs), then each scenario of
    :func:`plan` on every target in turn before the next scenario, so the runs compared side
    by side are minutes closer in time than target after target (a VM's speed drifts by tens
    of percent over a suite; the later target was measured in another minute of it).

    ``into``: each run is appended to it as it starts (see :func:`run_scenario`), so what
    ran survives an interruption.  ``target_errors``: a target that cannot be reached at its
    warm-up, or whose run fails as a whole (:data:`TARGET_ERRORS`), is skipped from then on
    and its error written there under its label, the other targets' runs going on; without
    it, raised.
    """
    results = [] if into is None else into
    failed: set[str] = set()

    async def attempt(target: Target, scenario: Scenario | None) -> None:
        try:
            if scenario is None:
                warm_up = await run_scenario(target, WARM_UP)
                if all(r.error_code == CONNECT_FAILED for r in warm_up.records):
                    raise ConnectionError(warm_up.records[0].error_message or CONNECT_FAILED)
            else:
                await run_scenario(target, scenario, on_token=on_token, into=results)
        except Exception as exc:
            group = exc if isinstance(exc, ExceptionGroup) else ExceptionGroup("", [exc])
            matched, rest = group.split(TARGET_ERRORS)
            if target_errors is None or matched is None or rest is not None:
                raise
            target_errors[target.label] = str(first_leaf(matched))
            failed.add(target.label)

    for step in [None, *plan(suite)]:
        for target in targets:
            if target.label not in failed:
                await attempt(target, step)
    return results


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000, 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summary_rows(results: Iterable[ScenarioResult]) -> list[dict[str, Any]]:
    """Per target, scenario and lane, plus an ``all`` row per run (aggregate tokens/s)."""
    results = list(results)
    alone = {(r.target, r.scenario.name): r for r in results}
    rows: list[dict[str, Any]] = []
    for result in results:
        for lane in LANES:
            if not any(r.lane == lane for r in result.records):
                continue
            stats = lane_stats(result, lane)
            row: dict[str, Any] = {
                "target": result.target, "scenario": result.scenario.name, "lane": lane,
                "requests": stats.requests, "completed": stats.completed, "failed": stats.failed,
                "tokens": stats.tokens, "tokens_per_s": round(stats.tokens_per_s, 2),
                "ttft_p50_ms": _ms(stats.ttft_p50), "ttft_p95_ms": _ms(stats.ttft_p95),
                "completion_p50_ms": _ms(stats.completion_p50),
                "gap_p50_ms": _ms(stats.gap_p50), "gap_p95_ms": _ms(stats.gap_p95),
                "gap_p99_ms": _ms(stats.gap_p99), "gap_max_ms": _ms(stats.gap_max),
                "span_s": round(result.finished - result.started, 3),
            }  # fmt: skip
            base = alone.get((result.target, f"{result.scenario.name}-alone"))
            if base is not None and lane == "interactive":
                before = lane_stats(base, "interactive")
                row["gap_p95_vs_alone"] = _ratio(row["gap_p95_ms"], _ms(before.gap_p95))
                row["gap_max_vs_alone_p95"] = _ratio(row["gap_max_ms"], _ms(before.gap_p95))
            elif result.scenario.name.endswith("-alone") and lane == "interactive":
                # The same figure for the clients alone: how far past its own p95 this machine
                # stretches a gap with nothing else running, the floor the target is read over.
                row["gap_max_vs_alone_p95"] = _ratio(row["gap_max_ms"], row["gap_p95_ms"])
            rows.append(row)
        completed = sum(r.ok for r in result.records)
        rows.append({
            "target": result.target, "scenario": result.scenario.name, "lane": "all",
            "requests": len(result.records), "completed": completed,
            "failed": len(result.records) - completed,
                "tokens": sum(len(r.token_times) for r in result.records),
            "tokens_per_s": round(tokens_per_s(result), 2),
            "span_s": round(result.finished - result.started, 3),
        })  # fmt: skip
    return rows


def failure_tally(results: Iterable[ScenarioResult]) -> list[str]:
    """One line per target and scenario with failed requests: how many of each error code (or
    end reason), and the first client-side error message; the table shows only counts."""
    lines = []
    for result in results:
        failed = [r for r in result.records if not r.ok]
        if not failed:
            continue
        counts = Counter(r.error_code or r.eos_reason or "NO_END" for r in failed)
        tally = ", ".join(f"{code} x{n}" for code, n in counts.most_common())
        message = next((r.error_message for r in failed if r.error_message), None)
        why = f" ({message})" if message else ""
        lines.append(f"{result.target} {result.scenario.name}: {tally}{why}")
    return lines


def write_csv(path: Path, rows: Iterable[Mapping[str, Any]], fields: Sequence[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)


def write_results(results: Sequence[ScenarioResult], out: Path) -> list[Path]:
    """The CSVs (and, with matplotlib installed, the plots) for ``results`` under ``out``."""
    written = [out / "tokens.csv", out / "requests.csv", out / "summary.csv"]
    write_csv(written[0], (row for r in results for row in token_rows(r)), TOKEN_CSV_FIELDS)
    write_csv(
        written[1],
        ({"target": r.target, **row} for r in results for row in to_csv_rows(r)),
        ["target", *CSV_FIELDS],
    )
    write_csv(written[2], summary_rows(results), SUMMARY_FIELDS)
    try:
        from .plots import plot_results

        written += plot_results(results, out)
    except ImportError:  # matplotlib is the `bench` extra: the CSVs are still complete
        pass
    return written


# Rows of the side-by-side table: (summary key, label); lower is better except tokens/s.
TABLE_FIGURES: Sequence[tuple[str, str]] = (
    ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p95_ms", "TTFT p95 (ms)"),
    ("completion_p50_ms", "completion p50 (ms)"),
    ("gap_p50_ms", "gap p50 (ms)"), ("gap_p95_ms", "gap p95 (ms)"), ("gap_p99_ms", "gap p99 (ms)"),
    ("gap_max_ms", "gap max (ms)"), ("gap_p95_vs_alone", "gap p95 / alone p95"),
    ("gap_max_vs_alone_p95", "gap max / alone p95"), ("tokens_per_s", "tokens/s"),
    ("completed", "completed"), ("failed", "failed"),
)  # fmt: skip


def side_by_side(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The summary as a table: one row per (scenario, lane, figure), one column per target,
    then each other target's ratio to the first."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    keyed = {(r["target"], r["scenario"], r["lane"]): r for r in rows}
    groups = list(dict.fromkeys((r["scenario"], r["lane"]) for r in rows))
    header = ["scenario", "lane", "figure", *targets, *(f"{t} / {targets[0]}" for t in targets[1:])]
    table: list[list[str]] = []
    for scenario, lane in groups:
        for key, label in TABLE_FIGURES:
            values = [keyed.get((t, scenario, lane), {}).get(key) for t in targets]
            if all(v is None for v in values):
                continue
            cells = ["—" if v is None else f"{v:g}" for v in values]
            ratios = [
                "—" if v is None or not values[0] else f"{v / values[0]:.2f}" for v in values[1:]
            ]  # fmt: skip
            table.append([scenario, lane, label, *cells, *ratios])
    return header, table
