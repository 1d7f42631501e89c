"""Continuous-batching policy v1: one pure function from state to plan.

Theory of operation
-------------------
Every tick the decode task hands :func:`plan_tick` a snapshot of the sessions
and a token budget, and gets back what goes into the one ``llama_batch``:

1. **Decode first.**  Every decoding session gets one token, so streams keep
   moving.  If there are more decoders than budget, a rotating start (the
   tick number) shares the shortfall fairly.
2. **Prefill fills the rest.**  The remaining budget is water-filled over the
   sessions still reading their prompt, shortest remaining prompt first: each
   gets an equal share, and what a short prompt does not need flows on to the
   longer ones.  A short request that arrives behind a long prompt therefore
   gets its first token after a tick or two instead of waiting for the whole
   long prompt, and a long prompt is never starved (it always gets its share,
   and at least ``min_prefill_chunk`` tokens when the budget is exhausted).
3. **The budget adapts** (:class:`BudgetController`) toward a tick-time target
   from an EWMA of the measured time per token, so one long prompt never
   freezes the decoding streams for much more than one tick.

Parked sessions (a client not reading its stream) are skipped, not dropped.
Nothing here reads a clock or does I/O; the scheduling-policy issue grows this
into a pipeline of transformers with QoS lanes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SessionView:
    """What the policy may know about one active session."""

    key: int  # the session's seq id
    prompt_remaining: int  # prompt tokens not yet in the KV cache (0 ⇒ decoding)
    parked: bool = False  # its client is not draining its stream


@dataclass(frozen=True, slots=True)
class Plan:
    """One tick's batch.  Empty when nothing can run."""

    decode: tuple[int, ...] = ()  # sessions that feed one token each
    prefill: tuple[tuple[int, int], ...] = ()  # (session, prompt tokens this tick)
    skipped: tuple[tuple[int, str], ...] = ()  # (session, why it sits out)

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


def plan_tick(
    sessions: Sequence[SessionView],
    *,
    token_budget: int,
    max_batch: int,
    tick: int = 0,
    min_prefill_chunk: int = 8,
) -> Plan:
    """Choose this tick's batch; see the module docstring."""
    skipped = [(s.key, "parked") for s in sessions if s.parked]
    runnable = [s for s in sessions if not s.parked]
    decoders = [s.key for s in runnable if s.prompt_remaining == 0]
    prefilling = [s for s in runnable if s.prompt_remaining > 0]

    budget = max(1, min(token_budget, max_batch))
    if len(decoders) > budget:
        start = tick % len(decoders)
        rotated = decoders[start:] + decoders[:start]
        decoders, left_out = rotated[:budget], rotated[budget:]
        skipped += [(k, "budget") for k in left_out]

    room = budget - len(decoders)
    if prefilling and room < min_prefill_chunk:
        room = min(min_prefill_chunk, max_batch - len(decoders))
    prefill = _water_fill(prefilling, room)
    skipped += [(s.key, "budget") for s in prefilling if s.key not in dict(prefill)]
    return Plan(tuple(decoders), tuple(prefill), tuple(skipped))


def _water_fill(prefilling: Sequence[SessionView], room: int) -> list[tuple[int, int]]:
    """Max-min fair split of ``room`` tokens, shortest remaining prompt first."""
    chunks: list[tuple[int, int]] = []
    ordered = sorted(prefilling, key=lambda s: s.prompt_remaining)
    for i, session in enumerate(ordered):
        if room <= 0:
            break
        share = max(1, room // (len(ordered) - i))
        take = min(session.prompt_remaining, share)
        chunks.append((session.key, take))
        room -= take
    return chunks


@dataclass
class BudgetController:
    """Adapts the tick's token budget toward ``target_s`` of decode time.

    Keeps an EWMA of seconds per batched token; the budget is the number of
    tokens predicted to fit in the target, clamped to ``[floor, ceiling]``.
    """

    target_s: float = 0.050
    floor: int = 16
    ceiling: int = 512
    alpha: float = 0.25
    initial_s_per_token: float = 0.004
    s_per_token: float = field(init=False)
    last_s: float = field(init=False, default=0.0)
    ewma_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.s_per_token = self.initial_s_per_token

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0:
            return
        self.last_s = seconds
        self.ewma_s = seconds if self.ewma_s == 0.0 else self._mix(self.ewma_s, seconds)
        self.s_per_token = self._mix(self.s_per_token, seconds / n_tokens)

    @property
    def budget(self) -> int:
        return max(self.floor, min(self.ceiling, int(self.target_s / self.s_per_token)))

    def _mix(self, old: float, new: float) -> float:
        return (1.0 - self.alpha) * old + self.alpha * new
