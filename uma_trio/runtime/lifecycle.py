"""A request's phases and the only moves between them, in one table (h11-style: explicit
states, guarded transitions, no I/O).

    WAITING --admitted--> PREFILL --prompt read--> DECODE
       |                     |                       |
       +------ finished (stop, length, cancelled, error, shutdown) ------> DONE

Parking (a client not reading its events) is not a phase: a prefilling or decoding
session sits out while parked and goes on where it was (``Session.parked``).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    WAITING = "waiting"  # accepted, no session slot yet
    PREFILL = "prefill"  # reading its prompt into the KV cache
    DECODE = "decode"  # generating
    DONE = "done"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.PREFILL, Phase.DONE}),  # admitted; or cancelled in the queue
    Phase.PREFILL: frozenset({Phase.DECODE, Phase.DONE}),  # its first token; or ended early
    Phase.DECODE: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug: the runtime tried a move the table does not allow."""


def advance(current: Phase, to: Phase) -> Phase:
    """``to``, if the table allows the move from ``current``; else :class:`IllegalTransition`."""
    if to not in ALLOWED[current]:
        raise IllegalTransition(f"a request cannot go from {current.value} to {to.value}")
    return to
