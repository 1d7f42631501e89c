"""Run-ahead: the engine's thread decodes the next step before the event loop has seen the
last one.

Between two decodes the event loop turns the sampled tokens into events, plans the next
tick and hands it back to the compute thread: two thread hand-offs and some Python, during
which a GPU idles (on the H100 12 % of a one-stream step).  When the next tick is sure to be
"the same sessions, one more token each" (a steady decode: nobody left out but work the
plan stands for, nothing queued that could start), the compute thread can build that batch
itself from the tokens it just sampled and start it at once; the event loop collects the
results one step behind (vLLM v1's async scheduling makes the same move).

A :class:`RunAhead` is armed by the decode task for one plan, with a budget per session (how
many tokens it may run ahead: never past ``max_tokens`` nor past what its stream buffer
holds), and stopped by anything that could change the next plan: a new request, a
cancellation, a job, a finished session.  A token decoded for a session that has meanwhile
ended (a stop string, a cancellation) is dropped and its KV cell trimmed by the decode task.
:meth:`RunAhead.follow` runs on the compute thread; it reads only the budgets and the flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..engine.base import BatchEntry, StepResult

# Steps the compute thread may run ahead before the event loop plans again: it bounds how
# stale the policy's view may get (its learning, the autotuner) and how long a change waits.
MAX_AHEAD = 16


def ahead_budget(max_tokens: int, generated: int, buffer_room: int | None) -> int:
    """Tokens a session decoding this step may run ahead: none past ``max_tokens`` (this
    step brings it to ``generated + 1``) and none its stream buffer could not take
    beside this step's token and the end-of-stream tail (None: not streamed)."""
    left = max_tokens - generated - 1
    if buffer_room is not None:
        left = min(left, buffer_room - 2)
    return max(0, min(left, MAX_AHEAD))


class RunAhead:
    """The standing order the compute thread follows; see the module docstring."""

    def __init__(self) -> None:
        self._budgets: dict[int, int] = {}
        self._steady = False
        self._stop_when_one_leaves = False

    @property
    def steady(self) -> bool:
        return self._steady

    def arm(self, budgets: dict[int, int], *, stop_when_one_leaves: bool = False) -> None:
        """Allow the next steps: ``budgets`` maps a seq id to the tokens it may run ahead.
        ``stop_when_one_leaves``: end the chain, rather than go on without it, when a session
        reaches its end of generation or budget; set where work waits for what it frees (a
        queued request, a prompt left out), which the next plan should take at once."""
        self._budgets = {seq: n for seq, n in budgets.items() if n > 0}
        self._steady = bool(self._budgets)
        self._stop_when_one_leaves = stop_when_one_leaves

    def stop(self) -> None:
        """Something changed: the compute thread stops after the step it is running."""
        self._steady = False

    def follow(self, entries: Sequence[BatchEntry], result: StepResult) -> list[BatchEntry] | None:
        """The next batch: every session of this one with budget left and a token that is not
        end-of-generation, one position on.  Runs on the compute thread."""
        if not self._steady:
            return None
        sampled = {s.seq_id: s.token_id for s in result.sampled if not s.is_eog}
        after = []
        for entry in entries:
            token = sampled.get(entry.seq_id)
            left = self._budgets.get(entry.seq_id, 0)
            if token is None or left <= 0 or entry.sampler is None:
                if self._stop_when_one_leaves:
                    return None
                continue
            self._budgets[entry.seq_id] = left - 1
            tokens = np.array([token], dtype=np.int32)
            after.append(BatchEntry(entry.seq_id, tokens, entry.pos0 + len(entry.tokens), entry.sampler))
        return after or None


class AheadChain:
    """The event loop's books while the compute thread runs ahead.  The context is then the
    thread's alone, so cells freed meanwhile wait for the chain to end, and a session that
    ends meanwhile is noted, so what was decoded past its end can be trimmed."""

    def __init__(self) -> None:
        self.live = False
        self.steps = 0  # steps the compute thread ran ahead (collected)
        self.dropped = 0  # tokens they decoded for sessions that had ended meanwhile
        self._deferred: list[int] = []
        self._overrun: set[int] = set()  # seq ids with tokens run past their session's end
        self._ended_at: dict[int, int] = {}  # seq id -> n_past of a session that ended in the chain

    def defer(self, seq_ids: Sequence[int]) -> bool:
        """Hold ``seq_ids``' cells for freeing at the chain's end; False when no chain runs."""
        if self.live:
            self._deferred.extend(seq_ids)
        return self.live

    def session_ended(self, seq_id: int, n_past: int) -> None:
        if self.live:
            self._ended_at[seq_id] = n_past  # its own cells, if it ran on

    def overran(self, seq_id: int) -> None:
        """A token was decoded for ``seq_id`` after its session ended."""
        self.dropped += 1
        self._overrun.add(seq_id)

    def end(self) -> tuple[dict[int, int | None], list[int]]:
        """The compute thread is idle again: for each sequence that ran past its session's
        end, the cells to keep (None: unknown), and the sequences freed meanwhile."""
        trims = {seq_id: self._ended_at.get(seq_id) for seq_id in self._overrun}
        deferred = self._deferred
        self.live, self._deferred, self._overrun, self._ended_at = False, [], set(), {}
        return trims, deferred
