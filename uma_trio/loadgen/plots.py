"""PNG plots of benchmark runs with matplotlib (headless: the Agg backend).

* ``timeline-SCENARIO.png``: every token event of every client, one row per client,
  one panel per target: stalls show as gaps in a row.
* ``gap_cdf-SCENARIO.png``: the distribution of interactive inter-token gaps, one line
  per target (log time axis).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .runner import ScenarioResult
from .stats import gaps


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def unique_slugs(names: Sequence[str]) -> list[str]:
    """A file-name-safe slug per name, distinct ones for distinct names: scenarios "a/b" and
    "a_b" both slug to "a_b", and the second one's plots overwrote the first's."""
    slugs: list[str] = []
    taken: set[str] = set()
    for name in names:
        slug, k = _slug(name), 1
        while slug in taken:
            k += 1
            slug = f"{_slug(name)}-{k}"
        taken.add(slug)
        slugs.append(slug)
    return slugs


def plot_results(results: Sequence[ScenarioResult], out: Path) -> list[Path]:
    """Raises ImportError without matplotlib (``pip install 'uma-trio[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    scenarios = list(dict.fromkeys(r.scenario.name for r in results))
    for scenario, slug in zip(scenarios, unique_slugs(scenarios), strict=True):
        runs = [r for r in results if r.scenario.name == scenario]
        clients = list(dict.fromkeys(rec.client for r in runs for rec in r.records))
        fig, axes = plt.subplots(
            len(runs), 1, figsize=(10, 1.2 + 0.35 * len(clients) * len(runs)), squeeze=False
        )
        for ax, run in zip(axes[:, 0], runs, strict=True):
            for row, client in enumerate(clients):
                times = [
                    t - run.started for rec in run.records if rec.client == client for t in rec.token_times
                ]
                lane = next((rec.lane for rec in run.records if rec.client == client), "interactive")
                color = "tab:blue" if lane == "interactive" else "tab:orange"
                ax.scatter(times, [row] * len(times), s=2, color=color, marker="|")
            ax.set_yticks(range(len(clients)), clients, fontsize=7)
            ax.set_title(f"{scenario} on {run.target}", fontsize=9)
            ax.set_xlabel("seconds since start (blue: interactive, orange: background)", fontsize=8)
        fig.tight_layout()
        written.append(out / f"timeline-{slug}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4))
        lines = 0
        for run in runs:
            data = np.sort(
                np.concatenate(
                    [gaps(rec) for rec in run.records if rec.lane == "interactive"] or [np.empty(0)]
                )
            )
            if data.size:
                ax.plot(data * 1000, np.arange(1, data.size + 1) / data.size, label=run.target)
                lines += 1
        ax.set_xscale("log")
        ax.set_xlabel("interactive inter-token gap (ms)")
        ax.set_ylabel("fraction of gaps ≤ x")
        ax.set_title(scenario)
        ax.grid(True, which="both", alpha=0.3)
        if lines:  # with none (no interactive gaps) matplotlib warns of an empty legend
            ax.legend()
        fig.tight_layout()
        written.append(out / f"gap_cdf-{slug}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
