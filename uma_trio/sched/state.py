"""What the policy sees (a snapshot) and what it answers (a plan).  Pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..protocol.messages import Lane

__all__ = ["Lane", "Plan", "SchedulerState", "SessionState", "SkipReason"]
SkipReason = Literal["parked", "budget", "hold", "share", "autotune", "bmt"]


@dataclass(frozen=True, slots=True)
class SessionState:
    """One admitted session, as the decode task sees it between two ticks."""

    key: int  # the session's seq id
    lane: Lane = "interactive"
    prompt_remaining: int = 0  # prompt tokens not yet in the KV cache (0 ⇒ decoding)
    n_past: int = 0  # tokens already in its KV cache
    age_s: float = 0.0  # since it was admitted
    since_last_token_s: float | None = None  # None before its first token
    ticks_waiting: int = 0  # ticks since it was last in a batch (0: served last tick)
    parked: bool = False  # its client is not draining its stream

    @property
    def decoding(self) -> bool:
        return self.prompt_remaining == 0

    @property
    def interactive(self) -> bool:
        return self.lane == "interactive"


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """The snapshot handed to the policy each tick.  Time is passed in, never read."""

    sessions: tuple[SessionState, ...]
    tick: int = 0
    max_batch: int = 512  # hard cap on tokens in one batch
    micro_batch: int = 512  # llama.cpp's n_ubatch: the prompt tokens one tick takes when nobody decodes
    preemptible: bool = False  # the engine can stop a step midway (Engine.can_preempt)
    # Another model's streams decode and this model has only background work: the longest
    # tick the machine's arbiter allows it (sched/arbiter.py); None: no such limit.
    foreign_cap_s: float | None = None
    # This model has interactive work and other models' streams decode: the time their ticks
    # add to every gap of a stream here, and theirs hold a tick of this model (Arbiter.beside).
    # 0.0: no other model streams.
    beside_s: float = 0.0
    # (tokens, logits) of the last step when it was the first of its shape and the engine
    # captures a step's graph on its second run in a row (llama.cpp's CUDA graphs): a tick
    # carrying prompt tokens avoids that shape (sched/graph_shapes.py).  None: no such shape.
    capture_shape: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """One tick's batch.  Empty when nothing can run."""

    decode: tuple[int, ...] = ()  # sessions that feed one token each
    prefill: tuple[tuple[int, int], ...] = ()  # (session, prompt tokens this tick)
    skipped: tuple[tuple[int, SkipReason], ...] = ()  # (session, why it sits out)
    budget_s: float = 0.0  # the tick-time budget the plan was built for
    predicted_s: float = 0.0  # the cost model's estimate of this batch
    rescue: bool = False  # over budget on purpose, so a starving session moves
    bmt_bytes: int = 0  # estimated bytes the batch moves (0: no memory profile)
    # latency_cap × the interactive decode-only baseline, with waiting interactive prompts
    # counted as decoding (the clients' own pace); 0: no interactive decoder
    cap_s: float = 0.0
    kv_cells: int = 0  # KV cells the batch's attention reads (cost.kv_cells_read), for observe
    # No interactive session in the batch, on an engine that can stop a step midway: the loop
    # stops it when an interactive request arrives (its work is undone and planned again).
    preemptible: bool = False
    # Ticks after this one the policy would plan the same decoders and nothing else while only
    # the tick count moves: the background prompts it left out get no room and no rescue is due
    # before then.  The loop may run that many steps ahead with those prompts waiting (0: none).
    stands_for: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + self.prefill_tokens

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)
