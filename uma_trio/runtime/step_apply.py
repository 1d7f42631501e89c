"""What one engine step did, as plain data: the pure half of turning results into events.

vLLM v1's scheduler applies a step's output with ``update_from_output(plan, output)``; this
is that move here.  :func:`apply_step` advances each session's own sequence state (cells
in the cache, its phase, the tokens it generated and their text) and returns what the
decode loop must then carry out, in order: tokens to deliver, requests that ended or
failed, and tokens sampled for sessions that had already ended while the engine ran
ahead.  No channel, engine, KV manager or metric is touched here, so it is tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..engine.base import Sampled, StepResult
from ..engine.logprobs import LogprobSampler
from ..protocol.messages import FinishReason
from ..sched.state import Plan
from .lifecycle import Phase
from .session import Session


@dataclass(frozen=True, slots=True)
class Token:
    """A generated token: ``text`` is what its stop-string filter lets out now (maybe '')."""

    session: Session
    text: str
    token_id: int
    ttft_s: float | None  # set on the request's first token
    gap_s: float | None  # since its previous token


@dataclass(frozen=True, slots=True)
class Ended:
    session: Session
    reason: FinishReason  # "stop" (end-of-generation or a stop string) or "length"


@dataclass(frozen=True, slots=True)
class Embedded:
    """An embedding request's whole input is pooled: it ends (its eos carries the vector)."""

    session: Session


@dataclass(frozen=True, slots=True)
class Failed:
    session: Session
    message: str  # its sampler raised


@dataclass(frozen=True, slots=True)
class Overran:
    """A token sampled for a sequence whose session ended while the step ran ahead."""

    seq_id: int


StepEvent = Token | Ended | Embedded | Failed | Overran


def apply_step(
    plan: Plan, result: StepResult, active: Mapping[int, Session], *, tick: int, now: float
) -> list[StepEvent]:
    """Advance the sessions ``plan`` ran by ``result``; return what follows, in order."""
    pooled = {part.seq_id: part for part in result.pooled}
    embedded: list[StepEvent] = []
    for seq_id, n in plan.prefill:
        if (session := active.get(seq_id)) is not None:
            session.last_served_tick = tick
            session.n_past += n
            session.computed_tokens += n
            if session.pool is not None and (part := pooled.get(seq_id)) is not None:
                session.pool.add(part)
            if session.n_past < len(session.prompt):
                continue
            if session.pool is not None:
                embedded.append(Embedded(session))
            else:
                session.move_to(Phase.DECODE)
    for seq_id in plan.decode:
        if (session := active.get(seq_id)) is not None:
            session.last_served_tick = tick
            session.n_past += 1
            session.computed_tokens += 1
            session.pending_token = None
    events: list[StepEvent] = [
        Failed(session, failure.message)
        for failure in result.failed
        if (session := active.get(failure.seq_id)) is not None
    ]
    events += embedded
    for sampled in result.sampled:
        session = active.get(sampled.seq_id)
        if session is None:
            events.append(Overran(sampled.seq_id))
        elif session.abort is None:
            events.extend(_sampled(session, sampled, now))
        elif not sampled.is_eog:
            # A cancelled request's tokens are not delivered, but a step run ahead may
            # already have fed this one: its cells must stay accounted for (kv_tokens).
            session.output_ids.append(sampled.token_id)
    return events


def _sampled(session: Session, sampled: Sampled, now: float) -> list[StepEvent]:
    session.last_token_id = sampled.token_id
    # Its sampler's record of this draw, taken in draw order whatever happens to the token.
    record = session.sampler.take() if isinstance(session.sampler, LogprobSampler) else None
    if sampled.is_eog:
        return [Ended(session, "stop")]
    if record is not None:
        session.record_logprob(record)
    session.output_ids.append(sampled.token_id)
    ttft, gap = session.generated_at.record(now, session.created)
    session.generated += 1
    delta = session.text.push(sampled.piece)
    events: list[StepEvent] = [Token(session, delta.text, sampled.token_id, ttft, gap)]
    if delta.stopped:
        session.stop_sequence = delta.stop
        events.append(Ended(session, "stop"))
    elif session.generated >= session.request.max_tokens:
        events.append(Ended(session, "length"))
    else:
        session.pending_token = sampled.token_id
    return events
