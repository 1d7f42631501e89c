"""The KV manager: who holds which sequence id, and the shared prefix cache.

Pure bookkeeping (no engine, no I/O, no clock), so it is tested alone; the
decode task carries out the engine operations each decision names.

Every sequence id is in one of three states: **free** (no KV cells),
**running** (an admitted request's) or **cached**: a finished request left
its prompt and output in the KV cache, indexed by its token ids.  A new
request reuses the longest prefix it shares with any cached *or running*
sequence, so it prefills only the rest:

* a cached sequence that the new prompt covers entirely is **adopted**: the
  request takes over its id and cells, and nothing is copied (the next turn
  of a chat continues its own conversation's KV this way); so is one whose
  whole *prompt* the new prompt repeats (a regenerated answer, a retried or
  re-sent request): only the old answer's cells are lost, which no prompt but
  that answer's own continuation could use, and with a KV stream per sequence
  the alternative, a copy, moves the whole stream (94 MB for 4,096 cells of
  SmolLM2 in f16) at the start of a step every running request waits for;
* otherwise the shared cells are **copied** into the request's own sequence
  (``llama_memory_seq_cp``) and the source stays cached for others.

Cached sequences are evicted least-recently-used first, whenever a request
needs their id or cells, or when they hold more than the cell budget: the
cache only ever uses KV memory no request is asking for.  Pinned sequences
(a snapshot being written) are neither adopted nor evicted.

**Which id a request gets** matters for speed with one KV stream per sequence:
llama.cpp then splits a batch into micro-batches of *consecutive* sequence ids
(each micro-batch reads all the weights once more), so running ids {0, 2, 4}
decode in three passes where {0, 1, 2} take one.  A new request therefore takes
the free id that adds fewest runs of consecutive running ids (lowest on a tie).
When a cached sequence sits on an id that would add fewer (``pack_ids``), the
two swap: that sequence moves into the id the request was given (a
``llama_memory_seq_cp`` of its stream, one memory copy) and the request takes
its place.  Which sequences stay cached is still decided least-recently-used
first; only where they live changes.

Why a linear scan and not a radix tree: each cached prefix occupies a whole
sequence id, so there are at most ``n_seq_max`` candidates (8 by default),
and numpy compares two 4,096-token arrays in microseconds.  A tree would only
pay off with thousands of prefixes sharing cells, which llama.cpp's
per-sequence streams do not allow (docs/SCHEDULER.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

TokenArray = npt.NDArray[np.int32]

# A stream copy costs as much as prefilling a handful of tokens; below this a hit is not worth it.
MIN_REUSE_TOKENS = 16


def common_prefix(a: TokenArray, b: TokenArray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class CachedSequence:
    seq_id: int
    tokens: TokenArray  # exactly the tokens whose KV cells the sequence holds, in position order
    pins: int = 0
    owner: str = ""  # the principal whose request left it: only its own requests reuse it
    prompt_len: int | None = None  # how many of ``tokens`` were its request's prompt (None: all)

    def replaced_by(self, reused: int) -> bool:
        """A new prompt reusing ``reused`` of these tokens covers all of them, or repeats
        this sequence's whole prompt (its last token is always recomputed): adopt it."""
        whole = len(self.tokens) if self.prompt_len is None else min(self.prompt_len, len(self.tokens))
        return reused >= len(self.tokens) or reused >= whole - 1


def _runs_added(seq_id: int, running: set[int]) -> int:
    """How many more runs of consecutive ids ``running`` has with ``seq_id`` in it (-1: it
    joins two runs into one)."""
    return 1 - ((seq_id - 1) in running) - ((seq_id + 1) in running)


@dataclass(frozen=True)
class Move:
    """A cached sequence's ``cells`` move from id ``src`` to id ``dst``."""

    src: int
    dst: int
    cells: int


@dataclass(frozen=True)
class Claim:
    """A new request's sequence and the engine operations that set it up, in order:
    free ``seq_id`` (or, when ``moved``, the move's destination) if it is in ``evicted``;
    carry out ``moved`` and free ``seq_id``; copy ``source``'s first ``reused`` cells into
    it (or, when adopted, trim it to ``reused``); then free the other evicted ids."""

    seq_id: int
    source: int | None = None  # the sequence whose cells it starts from (None: from scratch)
    reused: int = 0  # prompt tokens it need not prefill
    evicted: tuple[int, ...] = ()  # cached sequences dropped to make room
    moved: Move | None = None  # the cached sequence that held seq_id, moved out of its way

    @property
    def adopted(self) -> bool:
        return self.source == self.seq_id


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    moves: int = 0  # cached sequences moved to keep running ids together


@dataclass
class KvManager:
    """Sequence ids and cells of one context; see the module docstring.

    ``budget_cells``: most cells cached sequences may hold (None: whatever no
    request needs; 0: no prefix cache).  ``n_cells`` is the whole context.
    ``pack_ids``: move cached sequences out of the way of running ids (per-sequence
    KV streams; with one unified stream ids cost nothing).
    """

    n_seqs: int
    n_cells: int
    budget_cells: int | None = None
    min_reuse: int = MIN_REUSE_TOKENS
    pack_ids: bool = True
    stats: CacheStats = field(default_factory=CacheStats)
    _free: set[int] = field(init=False)
    _cached: OrderedDict[int, CachedSequence] = field(init=False, default_factory=OrderedDict)  # LRU first

    def __post_init__(self) -> None:
        self._free = set(range(self.n_seqs))

    @property
    def enabled(self) -> bool:
        return self.budget_cells != 0

    # -- figures -------------------------------------------------------------------

    @property
    def free_seqs(self) -> int:
        return len(self._free)

    @property
    def cached_seqs(self) -> int:
        return len(self._cached)

    @property
    def cached_cells(self) -> int:
        return sum(len(c.tokens) for c in self._cached.values())

    @property
    def pinned_cells(self) -> int:
        return sum(len(c.tokens) for c in self._cached.values() if c.pins)

    def available_seqs(self) -> int:
        """Ids a new request could get now: free ones plus those the cache would yield."""
        return len(self._free) + sum(1 for c in self._cached.values() if not c.pins)

    def cached(self) -> dict[int, TokenArray]:
        return {seq: c.tokens for seq, c in self._cached.items()}

    # -- decisions -------------------------------------------------------------------

    def claim(
        self,
        prompt: TokenArray,
        running: Mapping[int, TokenArray],
        *,
        cells_needed: int,
        cells_reserved: int,
        owner: str = "",
        reuse: bool = True,
    ) -> Claim | None:
        """A sequence for a request with ``prompt`` that reserves ``cells_needed`` cells
        (running requests reserve ``cells_reserved``), reusing the longest shared prefix
        of any cached sequence of the same ``owner`` or ``running`` one (the caller passes
        only the owner's own); None when no id or cells can be had.  Without ``reuse`` (an
        embedding, which needs every token's hidden state) it starts empty, uncounted."""
        if not reuse:
            claim = self._claim(prompt[:0], {}, cells_needed, cells_reserved, owner)
            return self._pack(claim) if claim is not None and self.pack_ids else claim
        claim = self._claim(prompt, running, cells_needed, cells_reserved, owner)
        if claim is not None:
            if claim.reused:
                self.stats.hits += 1
                self.stats.reused_tokens += claim.reused
            else:
                self.stats.misses += 1
            if self.pack_ids and not claim.adopted:
                claim = self._pack(claim)
        return claim

    def claim_empty(self, *, cells_needed: int, cells_reserved: int) -> tuple[int, tuple[int, ...]] | None:
        """An id holding no cells, for a snapshot restore of ``cells_needed`` cells, and the
        cached ids evicted for it; None when none can be had."""
        claim = self._claim(np.empty(0, dtype=np.int32), {}, cells_needed, cells_reserved, "")
        return None if claim is None else (claim.seq_id, claim.evicted)

    def _claim(
        self,
        prompt: TokenArray,
        running: Mapping[int, TokenArray],
        cells_needed: int,
        cells_reserved: int,
        owner: str,
    ) -> Claim | None:
        """:meth:`claim`'s decision; changes nothing until it is sure to succeed."""
        source, reused = self._best_match(prompt, running, owner)
        entry = self._cached.get(source) if source is not None else None
        adoptable = entry is not None and not entry.pins
        evictable = [s for s, c in self._cached.items() if not c.pins and s != source]  # LRU first
        evicted: list[int] = []
        adopt = entry is not None and adoptable and entry.replaced_by(reused)
        if entry is not None and adopt:
            seq_id = entry.seq_id
        elif self._free:
            running_ids = self._running()
            seq_id = min(self._free, key=lambda s: (_runs_added(s, running_ids), s))
        elif evictable:
            seq_id = evictable.pop(0)
            evicted.append(seq_id)
        elif entry is not None and adoptable:  # the match's own id is the only one left: go on in it
            seq_id, adopt = entry.seq_id, True
        else:
            return None
        # Cached cells yield to reservations (in per-sequence streams they always fit).  The
        # source goes last: it is copied before it is freed, so even then the reuse stands.
        if entry is not None and adoptable and not adopt:
            evictable.append(entry.seq_id)
        leaving = [*evicted, *([seq_id] if adopt else [])]
        held = self.cached_cells - sum(len(self._cached[s].tokens) for s in leaving)
        while cells_reserved + cells_needed + held > self.n_cells:
            if not evictable:
                return None
            victim = evictable.pop(0)
            evicted.append(victim)
            held -= len(self._cached[victim].tokens)
        # Commit.
        if adopt:
            del self._cached[seq_id]
        elif not evicted or evicted[0] != seq_id:
            self._free.remove(seq_id)
        for victim in evicted:
            del self._cached[victim]
        self._free.update(v for v in evicted if v != seq_id)  # the caller frees their cells now
        if source is not None and source in self._cached:
            self._cached.move_to_end(source)  # a hit counts as a use
        self.stats.evictions += len(evicted)
        return Claim(seq_id, seq_id if adopt else source, reused, tuple(evicted))

    def release(
        self,
        seq_id: int,
        tokens: TokenArray,
        *,
        pin: bool = False,
        owner: str = "",
        prompt_len: int | None = None,
    ) -> list[int]:
        """A request of ``owner`` ended holding ``tokens`` in ``seq_id``, the first
        ``prompt_len`` of them its prompt: cache it (always when ``pin``) and return the ids
        whose cells must now be freed."""
        if len(tokens) == 0 or not (self.enabled or pin):
            self._free.add(seq_id)
            return [seq_id]
        entry = CachedSequence(seq_id, tokens, pins=int(pin), owner=owner, prompt_len=prompt_len)
        self._cached[seq_id] = entry
        return self._enforce_budget()

    def add(self, seq_id: int, tokens: TokenArray, owner: str = "") -> list[int]:
        """A restored snapshot now fills ``seq_id`` (claimed with :meth:`claim_empty`)."""
        self._cached[seq_id] = CachedSequence(seq_id, tokens, owner=owner)
        return self._enforce_budget()

    def find(self, tokens: TokenArray, owner: str = "") -> int | None:
        """``owner``'s cached sequence holding exactly ``tokens``, if any."""
        return next(
            (
                seq for seq, entry in self._cached.items()
                if entry.owner == owner and np.array_equal(entry.tokens, tokens)
            ),
            None,
        )  # fmt: skip

    def unpin(self, seq_id: int) -> list[int]:
        entry = self._cached.get(seq_id)
        if entry is not None and entry.pins:
            entry.pins -= 1
        if not self.enabled and entry is not None and not entry.pins:
            del self._cached[seq_id]
            self._free.add(seq_id)
            return [seq_id]
        return self._enforce_budget()

    def drop(self, seq_id: int) -> list[int]:
        """Forget ``seq_id``'s cached prefix (its cells are in doubt); the ids to free."""
        if self._cached.pop(seq_id, None) is None:
            return []
        self._free.add(seq_id)
        return [seq_id]

    def forget_cached(self) -> None:
        """The context was replaced and holds nothing: cached sequences are free again (no
        cells to free).  A pinned one keeps its id, empty, until its pin is released: its
        snapshot then finds no cells and fails, rather than reading another request's."""
        for seq_id, entry in list(self._cached.items()):
            if entry.pins:
                entry.tokens = entry.tokens[:0]
            else:
                del self._cached[seq_id]
                self._free.add(seq_id)

    # -- internals -------------------------------------------------------------------

    def _best_match(
        self, prompt: TokenArray, running: Mapping[int, TokenArray], owner: str
    ) -> tuple[int | None, int]:
        """The longest prefix of ``prompt`` (less its last token, whose logits are
        needed) held by any of ``owner``'s sequences; cached ones win ties (they can be
        adopted), and among those the one whose id keeps the running ids in fewest runs
        (identical prompts, as in a benchmark, would otherwise scatter them).  Under
        ``min_reuse`` tokens only a sequence that would be adopted counts."""
        if not self.enabled:
            return None, 0
        limit = len(prompt) - 1
        running_ids = self._running()
        best: tuple[int | None, int] = (None, 0)
        best_runs = 2
        mine = ((s, c.tokens) for s, c in self._cached.items() if c.owner == owner)
        for seq_id, tokens in [*mine, *running.items()]:
            n = min(common_prefix(tokens, prompt), limit)
            runs = _runs_added(seq_id, running_ids) if seq_id in self._cached else 2
            if n > best[1] or (n == best[1] > 0 and runs < best_runs):
                best, best_runs = (seq_id, n), runs
        if best[1] >= self.min_reuse:
            return best
        # A copy that short is not worth it, but adopting costs nothing (the id and its cells
        # are taken over, trimmed): a short prompt sent again, or grown by a few tokens (a
        # warm-up, "hi"), still skips its prefill, as llama-server's slot reuse does, where
        # that id keeps the running ids together as well as a free one would.
        entry = self._cached.get(best[0]) if best[0] is not None else None
        if entry is None or entry.pins or not entry.replaced_by(best[1]):
            return None, 0
        fresh = min((_runs_added(s, running_ids) for s in self._free), default=2)
        return best if best_runs <= fresh else (None, 0)

    def _pack(self, claim: Claim) -> Claim:
        """``claim`` with a cached sequence's id instead, if that id keeps the running ids
        in fewer runs; the cached sequence moves into the id the claim had."""
        running = self._running() - {claim.seq_id}
        added = _runs_added(claim.seq_id, running)
        better = [
            s for s, c in self._cached.items()
            if not c.pins and s != claim.source and _runs_added(s, running) < added
        ]  # fmt: skip
        if not better:
            return claim
        take = min(better, key=lambda s: _runs_added(s, running))  # min keeps LRU order on ties
        entry = self._cached[take]
        entry.seq_id = claim.seq_id
        self._cached = OrderedDict((claim.seq_id if s == take else s, c) for s, c in self._cached.items())
        self.stats.moves += 1
        return replace(claim, seq_id=take, moved=Move(take, claim.seq_id, len(entry.tokens)))

    def _running(self) -> set[int]:
        return set(range(self.n_seqs)).difference(self._free, self._cached)

    def _lru_victim(self) -> int | None:
        for seq_id, entry in self._cached.items():
            if not entry.pins:
                del self._cached[seq_id]
                return seq_id
        return None

    def _enforce_budget(self) -> list[int]:
        freed: list[int] = []
        while self.budget_cells is not None and self.cached_cells > self.budget_cells:
            victim = self._lru_victim()
            if victim is None:
                break
            self.stats.evictions += 1
            self._free.add(victim)
            freed.append(victim)
        return freed
