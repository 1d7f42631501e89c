"""Latency figures from a :class:`~.runner.ScenarioResult`: pure functions, no I/O.

Kept apart from the runner so tests can check the arithmetic on hand-made
records, and simulation tests can assert on exact virtual-time figures.

* **gap**: time between two consecutive token events of one request: what a
  user watching a stream perceives as a stall.  The first token is excluded
  (its wait is the TTFT).
* **TTFT**: first token event - send.
* **completion**: eos (or error) arrival - send; the last token when neither
  arrived.  A lane's completion figures are its completed requests' only: an
  instant refusal is no fast completion.
* **tokens/s**: a lane's token events over the lane's own span (its first send
  to its last end), so a late request of the other lane does not dilute it; all
  lanes together over all requests' span (the first send to the last end), so
  clients that all start late do not count the idle time before.

Percentiles are numpy's default (linear interpolation); figures with no data
are ``nan``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .records import RequestRecord
from .runner import ScenarioResult
from .scenario import Lane

FloatArray = npt.NDArray[np.float64]

LANES: tuple[Lane, ...] = ("interactive", "background")


def gaps(record: RequestRecord) -> FloatArray:
    """Inter-token gaps of one request, in seconds (empty with fewer than two tokens)."""
    return np.diff(np.asarray(record.token_times, dtype=np.float64))


def ttft(record: RequestRecord) -> float | None:
    """Seconds from send to the first token event; None if no token came."""
    return record.token_times[0] - record.sent if record.token_times else None


def completion_time(record: RequestRecord) -> float | None:
    """Seconds from send to the end (eos/error, else last token); None if nothing came."""
    if record.ended is not None:
        return record.ended - record.sent
    return record.token_times[-1] - record.sent if record.token_times else None


def _array(values: Iterable[float] | FloatArray) -> FloatArray:
    return np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)


def percentile(values: Iterable[float] | FloatArray, q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``; nan when empty."""
    data = _array(values)
    return float(np.percentile(data, q)) if data.size else math.nan


def maximum(values: Iterable[float] | FloatArray) -> float:
    """The largest of ``values``; nan when empty."""
    data = _array(values)
    return float(data.max()) if data.size else math.nan


def window_gaps(records: Iterable[RequestRecord], window: tuple[float, float]) -> FloatArray:
    """Gaps (seconds) of ``records`` that overlap ``window`` = (start, end) in clock time.

    A pause that began before the window and ended inside it, or the other
    way round, counts: it was felt during the window.
    """
    start, end = window
    found: list[FloatArray] = []
    for record in records:
        times = np.asarray(record.token_times, dtype=np.float64)
        if times.size < 2:
            continue
        before, after = times[:-1], times[1:]
        overlap = (after >= start) & (before <= end)
        found.append((after - before)[overlap])
    return np.concatenate(found) if found else np.empty(0, dtype=np.float64)


def worst_pause(records: Iterable[RequestRecord], window: tuple[float, float]) -> float:
    """The longest gap of any one request that overlaps ``window``; 0.0 if none does."""
    found = window_gaps(records, window)
    return float(found.max()) if found.size else 0.0


def span(result: ScenarioResult) -> float:
    """Seconds from the scenario's start to its last client being done."""
    return result.finished - result.started


def lane_span(result: ScenarioResult, lane: Lane | None) -> float:
    """Seconds from the lane's first send to its last end (eos, error or last token); with
    ``lane=None``, of all lanes' requests."""
    records = [r for r in result.records if lane is None or r.lane == lane]
    ends = [r.sent + c for r in records if (c := completion_time(r)) is not None]
    return max(ends) - min(r.sent for r in records) if ends else math.nan


def tokens_per_s(result: ScenarioResult, lane: Lane | None = None) -> float:
    """Token events of ``lane`` per second of the lane's own span; with ``lane=None``, of
    all lanes per second of their span together (:func:`lane_span`)."""
    tokens = sum(len(r.token_times) for r in result.records if lane is None or r.lane == lane)
    seconds = lane_span(result, lane)
    return tokens / seconds if seconds > 0 else math.nan


@dataclass(frozen=True)
class LaneStats:
    """One lane's figures; times in seconds."""

    lane: Lane
    requests: int
    completed: int  # eos with reason stop or length
    failed: int  # error event, cancelled, or connection lost
    tokens: int  # token events
    completion_tokens: int  # from the eos usage
    gap_count: int
    gap_p50: float
    gap_p95: float
    gap_max: float
    gap_p99: float
    ttft: tuple[float, ...]  # per request with a first token, in record order
    completion: tuple[float, ...]  # per completed request (``ok``), in record order
    tokens_per_s: float  # over the lane's own span (first send to last end)

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttft, 50)

    @property
    def ttft_p95(self) -> float:
        return percentile(self.ttft, 95)

    @property
    def ttft_max(self) -> float:
        return maximum(self.ttft)

    @property
    def completion_p50(self) -> float:
        return percentile(self.completion, 50)

    @property
    def completion_max(self) -> float:
        return maximum(self.completion)


def lane_stats(result: ScenarioResult, lane: Lane, *, window: tuple[float, float] | None = None) -> LaneStats:
    """Figures for one lane; ``window`` restricts the gap figures to gaps overlapping it."""
    records = [r for r in result.records if r.lane == lane]
    if window is None:
        all_gaps = np.concatenate([gaps(r) for r in records]) if records else np.empty(0)
    else:
        all_gaps = window_gaps(records, window)
    ttfts = [t for t in map(ttft, records) if t is not None]
    completions = [c for r in records if r.ok and (c := completion_time(r)) is not None]
    completed = sum(r.ok for r in records)
    return LaneStats(
        lane=lane,
        requests=len(records),
        completed=completed,
        failed=len(records) - completed,
        tokens=sum(len(r.token_times) for r in records),
        completion_tokens=sum(r.completion_tokens or 0 for r in records),
        gap_count=int(all_gaps.size),
        gap_p50=percentile(all_gaps, 50),
        gap_p95=percentile(all_gaps, 95),
        gap_max=maximum(all_gaps),
        gap_p99=percentile(all_gaps, 99),
        ttft=tuple(ttfts),
        completion=tuple(completions),
        tokens_per_s=tokens_per_s(result, lane),
    )


def summarize(result: ScenarioResult) -> dict[Lane, LaneStats]:
    """:func:`lane_stats` for every lane that has requests."""
    present = {r.lane for r in result.records}
    return {lane: lane_stats(result, lane) for lane in LANES if lane in present}


CsvValue = str | int | float | None

CSV_FIELDS: Sequence[str] = (
    "scenario", "client", "lane", "index", "sent_s", "eos_reason", "error_code", "tokens",
    "completion_tokens", "ttft_ms", "completion_ms", "gap_p50_ms", "gap_p95_ms", "gap_max_ms",
)  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000, 3)


def to_csv_rows(result: ScenarioResult) -> list[dict[str, CsvValue]]:
    """One row per request (keys :data:`CSV_FIELDS`); times in ms, send time from the start."""
    rows: list[dict[str, CsvValue]] = []
    for record in result.records:
        own = gaps(record)
        rows.append(
            {
                "scenario": result.scenario.name,
                "client": record.client,
                "lane": record.lane,
                "index": record.index,
                "sent_s": round(record.sent - result.started, 6),
                "eos_reason": record.eos_reason,
                "error_code": record.error_code,
                "tokens": len(record.token_times),
                "completion_tokens": record.completion_tokens,
                "ttft_ms": _ms(ttft(record)),
                "completion_ms": _ms(completion_time(record)),
                "gap_p50_ms": _ms(percentile(own, 50)),
                "gap_p95_ms": _ms(percentile(own, 95)),
                "gap_max_ms": _ms(maximum(own)),
            }
        )
    return rows


TOKEN_CSV_FIELDS: Sequence[str] = ("target", "scenario", "client", "request", "token_idx", "t_ms", "lane")


def token_rows(result: ScenarioResult) -> list[dict[str, CsvValue]]:
    """One row per token event (keys :data:`TOKEN_CSV_FIELDS`); ``t_ms`` from the start."""
    return [
        {
            "target": result.target,
            "scenario": result.scenario.name,
            "client": record.client,
            "request": record.index,
            "token_idx": i,
            "t_ms": round((t - result.started) * 1000, 3),
            "lane": record.lane,
        }
        for record in result.records
        for i, t in enumerate(record.token_times)
    ]
