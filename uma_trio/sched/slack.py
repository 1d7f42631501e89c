"""The p95 slack as an error budget (issue 19).

The guard allows interactive gaps up to 1.2 × the same clients alone at p95 and 2 × at most:
so up to 5 % of ticks may run past that p95 line, none past twice the clients' p95.  The
policy spends that 5 % on purpose: ticks that let a new interactive prompt in beside decoding
streams first (time to first token: never held back), then rescue ticks for starving
background work, only while the measured share stays under ``rescue_share`` (3 %), so new
chats always find the rest.  :class:`SlackBudget` counts, over the last ``window`` ticks that
had interactive decoders, how many ran past the line.

The line is measured, not predicted.  The clients' own pace (:class:`ClientPace`) is the
spread of the ticks they ran alone (interactive work only, no background work beside it) over
their predicted decode-only tick: its 95th percentile, times ``latency_cap`` (1.2) × that
prediction, is the gap the guard allows at p95.  Counted against the prediction alone, a
machine's ordinary spread spent the budget: on this 2-core VM 7-8 % of the chats' own
decode-only steps ran past 1.2 × the prediction, so no rescue ever ran and a background
prompt waited for the chats to end however long they streamed (BENCHMARKS.md "The slack
against the clients' pace").  Pure: fed the measured ticks, no clock.
"""

from __future__ import annotations

from collections import deque

# The clients' pace may read at most this × their predicted tick: a machine stalling for
# seconds (BENCHMARKS.md run BF) must not let rescue ticks grow without bound.
MAX_PACE = 2.0


class SlackBudget:
    def __init__(self, share: float = 0.05, rescue_share: float = 0.03, window: int = 400) -> None:
        if not 0.0 <= rescue_share <= share < 1.0 or window < 1:
            raise ValueError("need 0 <= rescue_share <= share < 1 and a positive window")
        self.share, self.rescue_share, self.window = share, rescue_share, window
        self._recorded = 0  # ticks recorded so far; the window is the last ``window`` of them
        self._over_at: deque[int] = deque()  # the window's ticks past the cap, by their number

    def record(self, over_cap: bool) -> None:
        """One tick with interactive decoders ran (past the cap or not)."""
        self._recorded += 1
        if over_cap:
            self._over_at.append(self._recorded)
        while self._over_at and self._over_at[0] <= self._recorded - self.window:
            self._over_at.popleft()  # left the window

    @property
    def over_cap(self) -> int:
        return len(self._over_at)

    @property
    def used(self) -> float:
        """Share of the window's ticks that ran past the cap."""
        return self.over_cap / self.window

    def allows(self, share: float) -> bool:
        """Whether one more stretched tick keeps the window within ``share``."""
        return self.over_cap + 1 <= share * self.window

    @property
    def for_rescue(self) -> bool:
        return self.allows(self.rescue_share)

    def ticks_until_allows(self, share: float) -> int:
        """The fewest ticks to be recorded before :meth:`allows` may hold (0: it holds now):
        on-cap ticks from now on, the oldest over-cap ticks leaving the window."""
        excess = self.over_cap + 1 - int(share * self.window)  # over-cap ticks that must leave
        if excess <= 0:
            return 0
        if excess > self.over_cap:  # a share under one tick of the window: never
            return 10**9
        return self._over_at[excess - 1] + self.window - self._recorded


class ClientPace:
    """How the interactive clients' ticks spread when they run alone: the ratio of each such
    tick's measured step to its predicted decode-only tick (the baseline, waiting
    interactive prompts counted as decoding, so their own new turns count as they would
    alone), over the last ``window`` of them.  :attr:`p95` is at least 1 (the prediction
    itself) and at most :data:`MAX_PACE`, and 1 until ``min_ticks`` were measured."""

    def __init__(self, window: int = 400, min_ticks: int = 50, refresh: int = 16) -> None:
        if not 1 <= min_ticks <= window or refresh < 1:
            raise ValueError("need 1 <= min_ticks <= window and a positive refresh")
        self.min_ticks, self.refresh = min_ticks, refresh
        self._ratios: deque[float] = deque(maxlen=window)
        self._since = 0  # ratios recorded since the p95 was last taken
        self._p95 = 1.0

    def record(self, measured_s: float, baseline_s: float) -> None:
        """One tick with only interactive work in it ran ``measured_s`` against ``baseline_s``."""
        if baseline_s <= 0.0:
            return
        self._ratios.append(measured_s / baseline_s)
        self._since += 1
        # Sorting 400 floats every tick would cost more than the rest of the policy's tick.
        if self._since >= self.refresh and len(self._ratios) >= self.min_ticks:
            self._since = 0
            ranked = sorted(self._ratios)
            self._p95 = min(MAX_PACE, max(1.0, ranked[int(0.95 * (len(ranked) - 1))]))

    @property
    def ticks(self) -> int:
        return len(self._ratios)

    @property
    def p95(self) -> float:
        return self._p95
