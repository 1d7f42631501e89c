"""Every recorded GPU mixed run side by side: the worst interactive gap beside background work
against the same chats with none.

``benches/gpu_compare.py``'s mixed part (3 chats, 2,000- and 8,000-token background prompts)
records, per run, uma-trio's interactive gap p95 and max and the same chats' alone.  Issue 16's
target reads the max against the chats-alone p95 (≤ 2×); this script asks of every CUDA run in
``docs/data/gpu-*.csv`` how often the chats *alone* stayed within 2× their own p95, and how the
worst gap with the background compares with the worst gap without it.  Vulkan runs and runs
with CUDA graphs turned off are left out (another backend, another engine).  No GPU needed: it
reads what the runs wrote.

    python benches/gpu_mixed_runs.py [--since 2026-11-26] [--until 2026-11-27] [--data docs/data]
                                     [--out benches/results]

``--since DATE`` keeps the runs from that day on, ``--until DATE`` those up to that day (a
run's label starts with its date): a table of BENCHMARKS.md written on a day regenerates.

Prints a line per run and the totals; writes ``gpu_mixed_runs.csv`` and
``gpu_mixed_runs.png`` (each run's mixed max against its chats-alone max, both over the
chats-alone p95, with the target's 2× lines).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_output import save_figure, write_csv

ROOT = Path(__file__).resolve().parent.parent
TARGET_MAX = 2.0  # gap max ≤ 2× the chats-alone p95
TARGET_P95 = 1.2  # gap p95 ≤ 1.2× the chats-alone p95
OTHER_ENGINES = ("Vulkan", "no-cuda-graphs", "DISABLE_GRAPHS")  # variants that are not CUDA with graphs


@dataclass(frozen=True)
class MixedRun:
    run: str
    variant: str
    p95_vs_alone_p95: float
    max_vs_alone_p95: float
    alone_max_vs_alone_p95: float
    max_vs_alone_max: float


def mixed_runs(rows: Iterable[Mapping[str, str]]) -> list[MixedRun]:
    """uma-trio's CUDA mixed rows that carry both phases' gaps."""
    out = []
    for r in rows:
        if r.get("part") != "mixed" or r.get("system") != "uma-trio":
            continue
        if not (r.get("gap_ms_max") and r.get("alone_gap_ms_p95") and r.get("alone_gap_ms_max")):
            continue
        variant = r.get("variant") or ""
        if any(word in variant for word in OTHER_ENGINES):
            continue
        p95, mx = float(r["alone_gap_ms_p95"]), float(r["alone_gap_ms_max"])
        out.append(
            MixedRun(
                run=r["run"], variant=variant,
                p95_vs_alone_p95=round(float(r["gap_ms_p95"]) / p95, 3),
                max_vs_alone_p95=round(float(r["gap_ms_max"]) / p95, 3),
                alone_max_vs_alone_p95=round(mx / p95, 3),
                max_vs_alone_max=round(float(r["gap_ms_max"]) / mx, 3),
            )
        )  # fmt: skip
    return out


def totals(runs: list[MixedRun]) -> list[str]:
    """The lines the script ends with."""
    n = len(runs)
    if n == 0:
        return ["no CUDA mixed runs with both phases recorded"]

    def held(values: Iterable[float], limit: float) -> int:
        return sum(v <= limit for v in values)

    return [
        f"{n} CUDA mixed runs",
        f"gap p95 / alone p95 <= {TARGET_P95}: {held((r.p95_vs_alone_p95 for r in runs), TARGET_P95)} of {n}",
        f"gap max / alone p95 <= {TARGET_MAX}: {held((r.max_vs_alone_p95 for r in runs), TARGET_MAX)} of {n}"
        f" (median {statistics.median(r.max_vs_alone_p95 for r in runs):.2f})",
        f"the chats alone, their max / their p95 <= {TARGET_MAX}: "
        f"{held((r.alone_max_vs_alone_p95 for r in runs), TARGET_MAX)} of {n}"
        f" (median {statistics.median(r.alone_max_vs_alone_p95 for r in runs):.2f})",
        f"gap max beside the background / the chats-alone max: median "
        f"{statistics.median(r.max_vs_alone_max for r in runs):.2f}, <= 1.0 in "
        f"{held((r.max_vs_alone_max for r in runs), 1.0)} of {n}",
    ]


def plot(runs: list[MixedRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    xs = [r.alone_max_vs_alone_p95 for r in runs]
    ys = [r.max_vs_alone_p95 for r in runs]
    ax.scatter(xs, ys, s=18)
    top = max([*xs, *ys, TARGET_MAX]) * 1.05
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="as the chats alone")
    ax.axhline(TARGET_MAX, color="red", linewidth=0.8, linestyle="--", label="target: 2x alone p95")
    ax.axvline(TARGET_MAX, color="orange", linewidth=0.8, linestyle=":", label="chats alone at 2x their p95")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("chats alone: gap max / their gap p95")
    ax.set_ylabel("with background: gap max / chats-alone gap p95")
    ax.set_title(f"uma-trio, GPU mixed runs (CUDA, {len(runs)} runs)")
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "docs" / "data")
    ap.add_argument("--out", type=Path, default=ROOT / "benches" / "results")
    ap.add_argument("--since", default="", help="only runs from this date on (YYYY-MM-DD)")
    ap.add_argument("--until", default="9999", help="only runs up to this date (YYYY-MM-DD)")
    args = ap.parse_args(argv)
    rows: list[dict[str, str]] = []
    for path in sorted(args.data.glob("gpu-*.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    runs = [r for r in mixed_runs(rows) if args.since <= r.run[:10] <= args.until]
    for r in runs:
        print(
            f"{r.run[:30]:30} {r.variant[:28]:28} p95 {r.p95_vs_alone_p95:5.2f}"
            f"  max {r.max_vs_alone_p95:5.2f}  alone max {r.alone_max_vs_alone_p95:5.2f}"
            f"  max / alone max {r.max_vs_alone_max:5.2f}"
        )
    for line in totals(runs):
        print(line)
    if runs:
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "gpu_mixed_runs.csv", (asdict(r) for r in runs), list(asdict(runs[0])))
        plot(runs, args.out / "gpu_mixed_runs.png")


if __name__ == "__main__":
    main()
