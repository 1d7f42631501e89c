"""Per-step overhead: the time between one step's results being ready and the next
``llama_decode`` starting.

That gap is everything the daemon does on the critical path between two decodes:
handing the results to the event loop, turning tokens into events, planning the next
tick, filling the batch.  The device (or the CPU's compute threads) idles meanwhile, so
it is measured here, on the compute thread, with the same clock as the steps.  A gap
the decode loop reports (:meth:`StepGaps.idle`) means it had nothing to run and slept, and
one longer than :data:`IDLE_S` is counted as such too: neither is overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IDLE_S = 0.25


@dataclass
class StepGaps:
    """Running sums; the metrics snapshot reads them (``engine.step_gap_*``)."""

    steps: int = 0
    step_s: float = 0.0  # llama_decode plus sampling, summed
    gaps: int = 0
    gap_s: float = 0.0  # ready → next decode start, summed over busy gaps
    fill_s: float = 0.0  # of which filling the batch (on the compute thread)
    last_gap_s: float = 0.0
    _ready: float | None = field(default=None, repr=False)
    _decode_started: float = field(default=0.0, repr=False)

    def on_start(self, began: float, decode_started: float) -> None:
        """The compute thread took the next step at ``began`` and called llama_decode at
        ``decode_started``."""
        self._decode_started = decode_started
        if self._ready is not None:
            gap = decode_started - self._ready
            if gap < IDLE_S:
                self.gaps += 1
                self.gap_s += gap
                self.fill_s += decode_started - began
                self.last_gap_s = gap
        self._ready = None

    def on_end(self, ready: float | None) -> None:
        """The step's results were ready at ``ready`` (None: it failed; no gap to count)."""
        if ready is not None:
            self.steps += 1
            self.step_s += ready - self._decode_started
        self._ready = ready

    def idle(self) -> None:
        """The decode loop had nothing to run: the next gap is its sleep (a client's think
        time, say), not overhead."""
        self._ready = None

    def snapshot(self) -> dict[str, float | int]:
        mean_step = self.step_s / self.steps if self.steps else 0.0
        mean_gap = self.gap_s / self.gaps if self.gaps else 0.0
        return {
            "steps": self.steps,
            "gaps": self.gaps,
            "step_s_total": round(self.step_s, 6),
            "gap_s_total": round(self.gap_s, 6),
            "step_ms_mean": round(mean_step * 1000.0, 4),
            "gap_ms_mean": round(mean_gap * 1000.0, 4),
            "gap_ms_last": round(self.last_gap_s * 1000.0, 4),
            "fill_ms_mean": round(self.fill_s / self.gaps * 1000.0, 4) if self.gaps else 0.0,
            # overhead as a share of a step: what the 5 % target is about
            "gap_share": round(mean_gap / mean_step, 4) if mean_step > 0 else 0.0,
        }
