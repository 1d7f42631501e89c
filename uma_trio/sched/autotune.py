"""Sweet-spot auto-tune: how many background decoders to serve per tick.  Pure.

With no interactive session waiting, the policy wants the most tokens per
second of decode time.  More decoders per tick usually help (the fixed cost
is shared), but past a point attention over many long contexts or memory
bandwidth can make a smaller batch faster.  The climber measures tokens/s
over a period at the current limit, then probes one step away for a period;
it keeps the probe only if it beat the current setting by more than ``gain``
(hysteresis), otherwise it turns around and waits longer before the next
probe (up to ``max_cooldown`` periods), so a flat optimum costs little.

Two rules keep noise from shrinking the batch where more decoders are faster (on a CPU
or a GPU alike, each one added shares the step's fixed cost).  A probe to fewer decoders
must win by ``shrink_gain``, more than a VM's noise over a period: each decoder it leaves
out waits.  And a limit is only kept below the decoders there are: measured with every
decoder running, the setting stays open (None), so a limit learned while two streams ran
does not hold sixteen to two (on this CPU 8-16 background streams decoded 2-5 a tick,
0.70-0.82x llama-server's tokens/s; BENCHMARKS.md "Background chains handed back together").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HillClimber:
    period: int = 16  # ticks per measurement
    gain: float = 0.03  # a probe to more decoders must beat the current rate by this fraction
    shrink_gain: float = 0.10  # and one to fewer by this
    max_cooldown: int = 8  # periods between probes, after repeated failures
    limit: int | None = None  # decoders per tick; None: all of them
    direction: int = -1
    _probing: bool = field(default=False, init=False)
    _base_limit: int | None = field(default=None, init=False)
    _base_rate: float = field(default=0.0, init=False)
    _cooldown: int = field(default=1, init=False)
    _wait: int = field(default=0, init=False)
    _tokens: int = field(default=0, init=False)
    _seconds: float = field(default=0.0, init=False)
    _ticks: int = field(default=0, init=False)

    def reset(self) -> None:
        """Interactive work is back: forget the measurements (not the setting)."""
        if self._probing:
            self.limit = self._base_limit
        self._probing = False
        self._tokens, self._seconds, self._ticks = 0, 0.0, 0

    def observe(self, tokens: int, seconds: float, candidates: int) -> None:
        """One tick of background-only work: ``tokens`` batched in ``seconds``."""
        if candidates <= 0 or seconds <= 0:
            return
        self._tokens += tokens
        self._seconds += seconds
        self._ticks += 1
        if self._ticks < self.period:
            return
        rate = self._tokens / self._seconds
        self._tokens, self._seconds, self._ticks = 0, 0.0, 0
        current = min(self.limit or candidates, candidates)
        # With every decoder running the setting stays open: it says nothing of more.
        setting = None if current >= candidates else current
        if self._probing:
            self._probing = False
            base = min(self._base_limit or candidates, candidates)
            needed = self.shrink_gain if current < base else self.gain
            if rate > self._base_rate * (1.0 + needed):
                self.limit, self._cooldown = setting, 1  # the probe wins: stay there
            else:
                self.limit, self.direction = self._base_limit, -self.direction
                self._cooldown = min(self._cooldown * 2, self.max_cooldown)
            self._wait = self._cooldown
            return
        self.limit = setting
        self._wait -= 1
        if self._wait > 0:
            return
        probe = min(max(current + self.direction, 1), candidates)
        if probe == current:
            self.direction = -self.direction
            probe = min(max(current + self.direction, 1), candidates)
        if probe != current:
            self._probing, self._base_limit, self._base_rate = True, setting, rate
            self.limit = probe
