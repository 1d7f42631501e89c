"""Summaries of a benchmark run several times: each figure's median over the repetitions.

On a shared 2-core VM one run of a scenario moves by ±10 % from the next (the hypervisor's
steal, the host's other tenants), more than the targets its ratios are read against.
``benches/compare.py --reps N`` runs each scenario N times on fresh servers and reports,
per target, scenario, lane and figure, the median of the N runs' figures (ratios included:
a ratio's median is the median of each run's ratio, not a ratio of medians), and each run's
ratio of aggregate tokens/s so the spread is on the page beside the median.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]
_KEY = ("target", "scenario", "lane")


def _key(row: Row) -> tuple[Any, ...]:
    return tuple(row[k] for k in _KEY)


def median_rows(reps: Sequence[Sequence[Row]]) -> list[dict[str, Any]]:
    """One summary row per (target, scenario, lane), in the first repetition's order, each
    numeric figure the median of that figure over the repetitions that have it (a figure
    missing from every repetition stays ``None``).  Rows a later repetition adds come last."""
    grouped: dict[tuple[Any, ...], list[Row]] = {}
    for rows in reps:
        for row in rows:
            grouped.setdefault(_key(row), []).append(row)
    merged: list[dict[str, Any]] = []
    for rows in grouped.values():
        out: dict[str, Any] = dict(rows[0])
        for field in dict.fromkeys(f for row in rows for f in row):
            if field in _KEY:
                continue
            values = [row.get(field) for row in rows]
            numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            if numbers:
                middle = statistics.median(numbers)
                out[field] = round(middle, 3) if isinstance(middle, float) else middle
            else:
                out[field] = next((v for v in values if v is not None), None)
        merged.append(out)
    return merged


def rep_ratios(
    reps: Sequence[Sequence[Row]], target: str, base: str, *, figure: str = "tokens_per_s", lane: str = "all"
) -> dict[str, list[float]]:
    """Per scenario, each repetition's ``target`` / ``base`` ratio of ``figure`` in ``lane``
    (repetitions where either is missing or the base is 0 are left out)."""
    ratios: dict[str, list[float]] = {}
    for rows in reps:
        by_key = {_key(row): row for row in rows}
        scenarios = dict.fromkeys(row["scenario"] for row in rows if row["lane"] == lane)
        for scenario in scenarios:
            mine = by_key.get((target, scenario, lane), {}).get(figure)
            theirs = by_key.get((base, scenario, lane), {}).get(figure)
            if mine is None or not theirs:
                continue
            ratios.setdefault(scenario, []).append(round(mine / theirs, 3))
    return ratios


def spread_line(ratios: Mapping[str, Sequence[float]], what: str) -> str:
    """A line listing each repetition's ratio and their median, scenario by scenario, to three
    decimals: a target of 0.95 is missed by a median of 0.948, which two decimals show as met."""
    parts = [
        f"{scenario} {' / '.join(f'{r:.3f}' for r in values)} (median {statistics.median(values):.3f})"
        for scenario, values in ratios.items()
        if values
    ]
    return f"{what}, each repetition: " + "; ".join(parts) + "\n"
