"""The p95 slack as an error budget (issue 19).

The guard allows interactive gaps up to 1.2 × the same clients alone at p95 and 2 × at most:
so up to 5 % of ticks may run past the cap (``latency_cap`` × the interactive decode-only
baseline), none past ``max_pause``.  The policy spends that 5 % on purpose: ticks that let a
new interactive prompt in beside decoding streams first (time to first token: never held
back), then rescue ticks for starving background work, only while the measured share stays
under ``rescue_share`` (3 %), so new chats always find the rest.  :class:`SlackBudget` counts,
over the last ``window`` ticks that had interactive decoders, how many ran past the cap
(against the clients' own pace: waiting interactive prompts counted as decoding, the
"alone" the guard compares with).  Pure: fed the measured ticks, no clock.
"""

from __future__ import annotations

from collections import deque


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
