"""Results of a run-ahead chain kept on the compute thread and handed back together.

Each result handed back wakes the event loop (trio's wake-up, then the decode task's
bookkeeping and the writers), and on a 2-core CPU that host work runs beside the next
decode and slows its threads: 0.4 ms of a lone stream's 7-10 ms step, most of it the same
whatever the step carried.  Where nobody watches a chain's tokens one by one (background
work), its results may wait and go back several at a time: one wake-up for all of them,
and the bookkeeping runs warm, step after step.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

from .base import StepResult


class HeldResults:
    """The results a chain keeps; used on the compute thread only.  ``hold_s`` 0 hands
    each back at once."""

    def __init__(self, hold_s: float) -> None:
        self._hold_s = hold_s
        self._held: list[tuple[Future[StepResult], StepResult, float]] = []

    def hand_back(self, future: Future[StepResult], result: StepResult) -> None:
        """``result`` is ready: hand it back now, or keep it with the time it was ready, and
        hand every one kept back once the oldest has waited ``hold_s``."""
        if self._hold_s <= 0:
            future.set_result(result)
            return
        now = time.perf_counter()
        self._held.append((future, result, now))
        if now - self._held[0][2] >= self._hold_s:
            self.release()

    def release(self) -> None:
        """Hand back every result kept, each with how long it waited.  The newest first:
        the caller waits on the oldest, and by the time that one wakes it the others are
        done, so collecting them takes no further wake-up."""
        now = time.perf_counter()
        for future, result, ready in reversed(self._held):
            future.set_result(dataclasses.replace(result, held_s=now - ready))
        self._held.clear()
