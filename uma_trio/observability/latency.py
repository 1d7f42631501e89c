"""Latency distributions: DDSketch quantiles over the whole run and a sliding window.

Why DDSketch (DataDog's ``ddsketch``): quantiles with a guaranteed relative
error (1 %), constant memory, and cheap merges, which is what a sliding
window of per-slot sketches needs.  Prometheus histograms (fixed ``le``
buckets) are kept beside it by :mod:`.prometheus`; the two answer different
questions (exact quantiles here, aggregatable buckets there).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from ddsketch import DDSketch

from .window import SlotWindow

RELATIVE_ACCURACY = 0.01  # a reported quantile is within 1 % of a recorded value of that rank
# One sketch bucket spans [x, x * GAMMA): the "bucket width" tests compare against.
GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)


class Percentiles(msgspec.Struct, frozen=True):
    """A distribution's summary in milliseconds; the quantiles are ``None`` with no samples."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


@dataclass
class _Slot:
    sketch: DDSketch
    max_s: float = 0.0


def _new_slot() -> _Slot:
    return _Slot(DDSketch(RELATIVE_ACCURACY))


def _summary(sketch: DDSketch, max_s: float) -> Percentiles:
    count = int(sketch.count)
    if count == 0:
        return Percentiles(0)
    ms = 1000.0

    def q(quantile: float) -> float:
        value = sketch.get_quantile_value(quantile)
        assert value is not None  # the sketch is not empty
        return round(min(value, max_s) * ms, 3)  # a bucket's midpoint can exceed the max

    return Percentiles(count, round(sketch.avg * ms, 3), q(0.50), q(0.95), q(0.99), round(max_s * ms, 3))


class LatencyDigest:
    """One latency (seconds in, milliseconds out) over the run and the last ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self._run = _new_slot()
        self._window: SlotWindow[_Slot] = SlotWindow(_new_slot, window_s)

    def add(self, seconds: float, now: float) -> None:
        seconds = max(seconds, 0.0)
        for slot in (self._run, self._window.at(now)):
            slot.sketch.add(seconds)
            slot.max_s = max(slot.max_s, seconds)

    def run(self) -> Percentiles:
        return _summary(self._run.sketch, self._run.max_s)

    def window(self, now: float) -> Percentiles:
        merged = _new_slot()
        for slot in self._window.within(now):
            merged.sketch.merge(slot.sketch)
            merged.max_s = max(merged.max_s, slot.max_s)
        return _summary(merged.sketch, merged.max_s)
