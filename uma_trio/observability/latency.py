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
_FOLD_AT = 256  # values recorded before they are folded into the sketches (or at a read)


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
        # Values not yet in the sketches.  A token's gap is recorded for every token streamed,
        # on the event loop, right after a step has pushed the interpreter out of the CPU
        # caches: there two sketch updates cost ~40 µs a token, a tenth of the loop's work
        # per token, which on two cores runs beside the decode.  Folded in together they
        # cost a fraction of that; every read folds first, so no figure lags.
        self._pending: list[tuple[float, float]] = []

    def add(self, seconds: float, now: float) -> None:
        self._pending.append((seconds, now))
        if len(self._pending) >= _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        pending, self._pending = self._pending, []
        run = self._run
        for seconds, now in pending:
            seconds = max(seconds, 0.0)
            for slot in (run, self._window.at(now)):
                slot.sketch.add(seconds)
                if seconds > slot.max_s:
                    slot.max_s = seconds

    def run(self) -> Percentiles:
        self._fold()
        return _summary(self._run.sketch, self._run.max_s)

    def window(self, now: float) -> Percentiles:
        self._fold()
        merged = _new_slot()
        for slot in self._window.within(now):
            merged.sketch.merge(slot.sketch)
            merged.max_s = max(merged.max_s, slot.max_s)
        return _summary(merged.sketch, merged.max_s)
