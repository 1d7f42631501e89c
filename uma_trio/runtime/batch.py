"""From a plan to the engine's batch, and a claim to the engine's sequence operations.

The two places where the decode loop's plain data (a :class:`~uma_trio.sched.state.Plan`,
a :class:`~uma_trio.sched.kv_manager.Claim`) turns into engine calls, kept apart from the
loop's sequencing so each reads on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from ..engine.base import BatchEntry, Engine, EngineError
from ..sched.kv_manager import Claim
from ..sched.state import Plan
from .session import Session

log = logging.getLogger(__name__)


def batch_entries(plan: Plan, active: Mapping[int, Session]) -> list[BatchEntry]:
    """The engine batch for ``plan``: one fed-back token per decoder, then each prefill
    chunk (sampled only when it is the prompt's last; an embedding's is pooled instead)."""
    entries = []
    for seq_id in plan.decode:
        session = active[seq_id]
        assert session.pending_token is not None
        token = np.array([session.pending_token], dtype=np.int32)
        entries.append(BatchEntry(seq_id, token, session.n_past, session.sampler))
    for seq_id, n in plan.prefill:
        session = active[seq_id]
        start = session.n_past
        last_chunk = start + n == len(session.prompt)
        chunk = session.prompt[start : start + n]
        if session.pool is not None:
            entries.append(BatchEntry(seq_id, chunk, start, None, embed=True))
        else:
            entries.append(BatchEntry(seq_id, chunk, start, session.sampler if last_chunk else None))
    return entries


def set_up_sequence(engine: Engine, claim: Claim) -> tuple[int, list[int]]:
    """Carry out a claim's engine operations, in the order :class:`Claim` gives.  Returns the
    prompt tokens reused (0 when the engine cannot trim: recurrent models) and the evicted
    sequences whose cells the caller must still free."""
    reused = claim.reused
    if (move := claim.moved) is not None:
        if move.dst in claim.evicted:
            engine.free_seq(move.dst)
        engine.copy_seq(move.src, move.dst, move.cells)
        engine.free_seq(claim.seq_id)
    elif claim.seq_id in claim.evicted:
        engine.free_seq(claim.seq_id)
    try:
        if claim.adopted:
            engine.trim_seq(claim.seq_id, claim.reused)
        elif claim.source is not None:
            engine.copy_seq(claim.source, claim.seq_id, claim.reused)
    except EngineError as exc:
        log.warning("prefix reuse failed (%s); prefilling from scratch", exc)
        engine.free_seq(claim.seq_id)
        reused = 0
    done = (claim.seq_id, claim.moved.dst if claim.moved is not None else -1)
    return reused, [s for s in claim.evicted if s not in done]
