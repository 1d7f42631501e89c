"""One machine, several models: when a model with only background work may take a tick while
another model's interactive streams decode (issue 22, point 4; docs/SCHEDULER.md "Several
models").

Each loaded model has its own decode loop, and their steps take turns on the machine (one
lock: on unified memory the models share the bandwidth and the cores, and two steps at once
only slow each other).  A model's own policy keeps its own streams' gaps under the guard; this
arbiter keeps them there across models.  While model A streams, a tick of model B lands in the
middle of A's gap: the guard allows such a stretched gap in at most ``share`` of A's ticks
(the p95 slack) and never longer than
``max_pause`` × A's tick, so B's tick is given ``(max_pause - 1)`` × A's tick at most.  B's
smallest step (one token) is what B's policy cannot cut: one predicted past ``(max_gap - 1)``
× A's tick (``max_gap``: the guard's bound on any gap) would break the guard, so B then waits
for A's streams to pause.  With
no interactive stream elsewhere a model runs unconstrained.  With interactive work of its own
(then both models' chats pay for each other, as two chats of one model do) it gets no grant
but :meth:`Arbiter.beside`, the other models' stream ticks, which its policy counts into its
streams' pace: a long prompt of its own is then read in ticks that fit the others' gaps, not
in one burst (a 3,000-token chat on one model held another's stream for 1.7-3.0 s a gap).
Pure: fed the measured ticks, no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Standing:
    streams: bool = False  # interactive sessions waiting or decoding
    tick_s: float = 0.0  # its last such tick's time: its streams' gap with nobody else (0: none yet)


class Arbiter:
    def __init__(
        self, latency_cap: float = 1.2, max_pause: float = 1.8, share: float = 0.04, window: int = 100,
        max_gap: float = 2.0,
    ) -> None:  # fmt: skip
        if latency_cap < 1.0 or max_pause < latency_cap or max_gap < max_pause:
            raise ValueError("need 1 <= latency_cap <= max_pause <= max_gap")
        self.latency_cap, self.max_pause, self.share, self.max_gap = latency_cap, max_pause, share, max_gap
        # The last `window` stream gaps, True where another model's tick stretched one past the
        # cap; and how many gaps since the last stretched one.  A gap is stretched at most once
        # in 1 / share: spread out so, even a short run keeps its p95 (a burst spent at once
        # would not, as the first 100 ticks of a run are all there is to its p95).
        self.gaps: deque[bool] = deque(maxlen=window)
        self._since_stretched = 0
        self._standing: dict[str, _Standing] = {}
        self._listeners: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
        self.granted = self.refused = 0  # foreign ticks allowed, and turns waited

    def join(self, model: str, wake: Callable[[], None], preempt: Callable[[], None]) -> None:
        """``model``'s loop takes part: ``wake`` is called whenever another model's tick ends
        (its turn may have come), ``preempt`` when another model's interactive work arrives
        (a background step in flight that can stop midway should)."""
        self._standing[model] = _Standing()
        self._listeners[model] = (wake, preempt)

    def leave(self, model: str) -> None:
        """``model``'s loop is gone (unloaded, or failed): the others may no longer wait for it."""
        self._standing.pop(model, None)
        self._listeners.pop(model, None)
        self._wake_others(model)  # a failed tick never reached ran(), which would have woken them

    def wants(self, model: str, tick_s: float = 0.0) -> None:
        """An interactive request arrived for ``model``: from now the others' background
        ticks wait for its first tick, then fit its gaps.  ``tick_s``: its streams' last tick,
        where known (a loop that joins while it streams: the others fit it at once)."""
        standing = self._standing.setdefault(model, _Standing())
        if not standing.streams:
            standing.streams, standing.tick_s = True, tick_s
        for name, (_, preempt) in list(self._listeners.items()):
            if name != model:
                preempt()

    def grant(self, model: str, *, interactive: bool, smallest_s: float = 0.0) -> float | None:
        """The longest tick ``model`` may take now: None for no limit, 0.0 to wait for its
        turn (the next tick of another model wakes it).  ``smallest_s``: its cheapest step."""
        streaming = [s.tick_s for name, s in self._standing.items() if name != model and s.streams]
        if interactive or not streaming:
            return None
        tick = min(streaming)
        fits = smallest_s <= (self.max_gap - 1.0) * tick
        if tick <= 0.0 or self._since_stretched * self.share < 1.0 or not fits:
            self.refused += 1  # its first tick is not done yet, the slack is spent, or no step fits
            return 0.0
        self.granted += 1
        return (self.max_pause - 1.0) * tick

    def beside(self, model: str) -> float:
        """What the other models' streams add to every gap of ``model``'s own streams, and
        every gap of theirs holds one tick of ``model``: the sum of their last stream ticks
        (0.0: none streams, or none has ticked yet).  ``model``'s policy keeps its ticks with
        interactive work inside these gaps as one model fits a new chat's prompt between its
        streams' tokens (SchedulerState.beside_s)."""
        return sum(s.tick_s for name, s in self._standing.items() if name != model and s.streams)

    def ran(self, model: str, *, streams: bool, seconds: float, limited: bool) -> None:
        """A tick of ``model`` ended: ``streams``, whether interactive sessions decoded in it;
        ``limited``, whether it was a granted tick inside another model's stream gap."""
        standing = self._standing.setdefault(model, _Standing())
        if streams:  # its pace: a tick slowed by something else (a tokenizer beside it) counts less
            pace = seconds if standing.tick_s <= 0.0 else 0.8 * standing.tick_s + 0.2 * seconds
            standing.streams, standing.tick_s = True, min(seconds, pace)
        if limited:
            others = [s.tick_s for name, s in self._standing.items() if name != model and s.streams]
            free = (self.latency_cap - 1.0) * min(others, default=0.0)
            stretched = seconds > free  # the gap it landed in went past the cap
            self.gaps.append(stretched)
            self._since_stretched = 0 if stretched else self._since_stretched + 1
        elif streams:
            self.gaps.append(False)
            self._since_stretched += 1
        self._wake_others(model)

    def quiet(self, model: str) -> None:
        """``model`` has no interactive session left (or nothing to run at all)."""
        if (standing := self._standing.get(model)) is not None and standing.streams:
            standing.streams = False
            self._wake_others(model)

    def _wake_others(self, model: str) -> None:
        for name, (wake, _) in list(self._listeners.items()):
            if name != model:
                wake()
