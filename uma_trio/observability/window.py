"""A sliding window made of fixed time slots: each slot holds one accumulator.

Values land in the slot of their timestamp; a window query looks at the slots
that overlap the last ``window_s`` seconds.  Time is passed in, never read, so
the figures are exact under trio's mock clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class SlotWindow(Generic[T]):
    """``slots`` accumulators of ``window_s / slots`` seconds each.

    The window's edge is therefore soft by up to one slot: a query at ``now``
    covers ``(now - window_s - slot, now]`` at most.
    """

    def __init__(self, factory: Callable[[], T], window_s: float, slots: int = 12) -> None:
        if window_s <= 0 or slots < 1:
            raise ValueError("window_s must be positive and slots at least 1")
        self.window_s = window_s
        self.slot_s = window_s / slots
        self._factory = factory
        self._slots: deque[tuple[int, T]] = deque()
        self._span = slots + 1  # the current, partly filled slot plus `slots` whole ones

    def at(self, now: float) -> T:
        """The accumulator for time ``now`` (created on first use)."""
        index = int(now // self.slot_s)
        if self._slots and self._slots[-1][0] == index:
            return self._slots[-1][1]
        self._prune(index)
        accumulator = self._factory()
        self._slots.append((index, accumulator))
        return accumulator

    def start(self, now: float) -> float:
        """Where the window ending at ``now`` begins: the first slot it covers."""
        return (int(now // self.slot_s) - self._span + 1) * self.slot_s

    def within(self, now: float) -> Iterator[T]:
        """The accumulators of the slots inside the window ending at ``now``."""
        first = int(now // self.slot_s) - self._span + 1
        for index, accumulator in self._slots:
            if index >= first:
                yield accumulator

    def _prune(self, index: int) -> None:
        while self._slots and self._slots[0][0] <= index - self._span:
            self._slots.popleft()
