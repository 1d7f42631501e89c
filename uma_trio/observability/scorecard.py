"""The seeds' scorecard (brief, section 7): a few figures that say how the daemon holds up.

Each figure is computed from what :class:`~.metrics.Metrics` measured over the
sliding window; a figure with nothing to measure is ``None``, never a guess.
The formulas are in docs/METRICS.md.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import msgspec

from .metrics import Metrics

MB = 1e6
GB = 1e9


class Scorecard(msgspec.Struct, frozen=True):
    window_s: float  # the seconds the figures cover (shorter than the window right after start)
    latency_cap: float
    tokens_per_s: float  # all generated tokens
    tokens_per_s_at_cap: float  # ... those of ticks that kept the latency cap
    cap_kept_pct: float | None  # ticks with interactive decoders that kept the cap
    p95_ms: float | None  # interactive inter-token latency
    p99_ms: float | None
    ttft_p95_ms: float | None  # interactive time to first token
    scheduler_efficiency: float | None  # useful batch tokens / batch tokens spent
    engine_idle_pct: float | None  # time between back-to-back steps / (that + step time)
    sum_bmt_mb_per_token: float | None  # estimated bytes moved per generated token
    rss_gb: float

    def log_line(self) -> str:
        def fmt(value: float | None, spec: str, unit: str = "") -> str:
            return "-" if value is None else format(value, spec) + unit  # no unit on a missing figure

        return (
            f"scorecard: {self.tokens_per_s:.1f} tok/s ({self.tokens_per_s_at_cap:.1f} at cap "
            f"{self.latency_cap:g}x, cap kept {fmt(self.cap_kept_pct, '.1f', '%')}), interactive gap "
            f"p95 {fmt(self.p95_ms, '.1f', ' ms')} p99 {fmt(self.p99_ms, '.1f', ' ms')}, ttft p95 "
            f"{fmt(self.ttft_p95_ms, '.0f', ' ms')}, efficiency {fmt(self.scheduler_efficiency, '.3f')}, "
            f"engine idle {fmt(self.engine_idle_pct, '.1f', '%')}, "
            f"ΣBMT {fmt(self.sum_bmt_mb_per_token, '.1f', ' MB/token')}, rss {self.rss_gb:.3f} GB "
            f"(last {self.window_s:.0f} s)"
        )


CSV_FIELDS = ("unix_time", "uptime_s", *(f.name for f in msgspec.structs.fields(Scorecard)))


def _ratio(numerator: float, denominator: float, scale: float = 1.0, digits: int = 3) -> float | None:
    return round(scale * numerator / denominator, digits) if denominator > 0 else None


def scorecard(metrics: Metrics, now: float, *, latency_cap: float, rss_bytes: int) -> Scorecard:
    sums = metrics.window_sums(now)
    elapsed = metrics.window_elapsed(now)
    itl = metrics.latency["interactive"].itl.window(now)
    ttft = metrics.latency["interactive"].ttft.window(now)
    return Scorecard(
        window_s=round(elapsed, 3),
        latency_cap=latency_cap,
        tokens_per_s=round(sums.generated / elapsed, 3),
        tokens_per_s_at_cap=round(sums.generated_at_cap / elapsed, 3),
        cap_kept_pct=_ratio(sums.kept_cap_ticks, sums.capped_ticks, 100.0, 2),
        p95_ms=itl.p95,
        p99_ms=itl.p99,
        ttft_p95_ms=ttft.p95,
        scheduler_efficiency=_ratio(sums.useful_tokens, sums.computed_tokens),
        engine_idle_pct=_ratio(sums.overhead_s, sums.overhead_s + sums.busy_s, 100.0, 2),
        sum_bmt_mb_per_token=_ratio(sums.bmt_bytes / MB, sums.generated) if sums.bmt_bytes else None,
        rss_gb=round(rss_bytes / GB, 4),
    )


def append_csv_row(path: Path, row: dict[str, Any]) -> None:
    """Append ``row``; write the header first when the file is new or empty."""
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)
