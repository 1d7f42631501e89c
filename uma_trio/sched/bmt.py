"""ΣBMT: the bytes a tick moves through memory, and trimming a plan to a byte budget.  Pure.

On a CPU (or any unified-memory machine) decoding is memory-bound: a tick
costs roughly the bytes it drags through the memory bus, not its FLOPs.  Two
things dominate:

* **Weights.**  llama.cpp splits a batch into micro-batches of ``n_ubatch``
  tokens and runs the whole graph once per micro-batch, so every weight is
  read once per micro-batch.  Tokens that share a micro-batch share that read,
  which is why batching decoders is nearly free and why a tick's weight
  traffic is a step function of its token count.
* **KV cache.**  Attention reads the cached K and V of the token's own
  sequence.  A decode token at ``n_past`` reads its ``n_past`` cells.  A
  prefill chunk of ``n`` prompt tokens starting at ``start`` is approximated as
  reading all ``start + n`` cells of its sequence once per micro-batch it spans
  (``ceil(n / n_ubatch)``), as if it had the micro-batches to itself.  That
  slightly over-counts (the causal mask lets early micro-batches skip the
  later cells, and a chunk may share a micro-batch with decoders), which is
  the safe side for a budget.

Activations, logits and the KV writes of new tokens are small next to these
and are ignored.  :func:`trim_to_budget` uses the estimate to shrink a
candidate plan until it fits a byte budget, trimming the work that can best
wait first.  Nothing here does I/O or reads a clock; the numbers for a real
model come from :mod:`uma_trio.engine.memory_profile`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .cost import kv_cells_read
from .state import Plan, SchedulerState

TRIM_REASON = "bmt"


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What one model moves per micro-batch and per cached token."""

    weight_bytes: int  # model weights, read once per llama.cpp micro-batch
    kv_bytes_per_cell: int  # K+V of one token over all layers
    n_ubatch: int  # tokens per micro-batch

    def __post_init__(self) -> None:
        if self.n_ubatch < 1:
            raise ValueError(f"n_ubatch must be >= 1, got {self.n_ubatch}")
        if self.weight_bytes < 0 or self.kv_bytes_per_cell < 0:
            raise ValueError("byte counts must be non-negative")


def _micro_batches(n_tokens: int, n_ubatch: int) -> int:
    return -(-n_tokens // n_ubatch)  # ceil without floats


def tick_bytes(
    profile: MemoryProfile,
    decode_ctx: Sequence[int],
    prefill: Sequence[tuple[int, int]],
) -> int:
    """Estimated bytes one tick moves (see the module doc for the model).

    ``decode_ctx`` holds one ``n_past`` per decode token; ``prefill`` holds one
    ``(start, n)`` per prompt chunk (``start`` cells already cached, ``n`` new
    tokens).  An empty tick moves nothing.
    """
    n_tokens = len(decode_ctx) + sum(n for _, n in prefill)
    if n_tokens <= 0:
        return 0
    weights = profile.weight_bytes * _micro_batches(n_tokens, profile.n_ubatch)
    cells = sum(decode_ctx) + sum(
        (start + n) * _micro_batches(n, profile.n_ubatch) for start, n in prefill if n > 0
    )
    return weights + profile.kv_bytes_per_cell * cells


@dataclass(frozen=True, slots=True)
class TrimmedPlan:
    """What :func:`trim_to_budget` kept, and whom it sent away.

    A chunk that was only shrunk stays in ``prefill`` with its smaller ``n``;
    ``trimmed`` lists the keys dropped from the tick entirely, each with the
    reason ``"bmt"`` (the same shape as :attr:`uma_trio.sched.policy.Plan.skipped`).
    """

    interactive: tuple[tuple[int, int], ...]  # (key, n_past), never trimmed
    background: tuple[tuple[int, int], ...]  # (key, n_past)
    prefill: tuple[tuple[int, int, int], ...]  # (key, start, n)
    trimmed: tuple[tuple[int, str], ...]  # (key, "bmt")
    n_bytes: int  # tick_bytes of what was kept
    budget_bytes: int

    @property
    def within_budget(self) -> bool:
        """False only when even the untrimmable part (interactive decoders) is over budget."""
        return self.n_bytes <= self.budget_bytes


def trim_to_budget(
    profile: MemoryProfile,
    budget_bytes: int,
    *,
    interactive: Sequence[tuple[int, int]] = (),
    background: Sequence[tuple[int, int]] = (),
    prefill: Sequence[tuple[int, int, int]] = (),
    min_chunk: int = 1,
) -> TrimmedPlan:
    """Trim a candidate tick until :func:`tick_bytes` fits ``budget_bytes``.

    The candidate is three ordered lists, most important first within each:
    ``interactive`` and ``background`` decoders as ``(key, n_past)`` and
    ``prefill`` chunks as ``(key, start, n)``.  Prompts can wait longest (they
    have no stream to stall), so prefill goes first: the last chunk is shrunk
    to the largest size that fits, never below ``min_chunk`` tokens, and is
    dropped if even that does not fit, moving on to the chunk before it.  Then
    background decoders are dropped from the end.  Interactive decoders are
    never touched, so the result can stay over budget when they alone exceed
    it (see :attr:`TrimmedPlan.within_budget`).
    """
    if min_chunk < 1:
        raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
    inter = list(interactive)
    back = list(background)
    chunks = list(prefill)
    trimmed: list[tuple[int, str]] = []

    def cost(chunk_list: Sequence[tuple[int, int, int]], back_list: Sequence[tuple[int, int]]) -> int:
        decode_ctx = [n_past for _, n_past in inter] + [n_past for _, n_past in back_list]
        return tick_bytes(profile, decode_ctx, [(start, n) for _, start, n in chunk_list])

    while chunks and cost(chunks, back) > budget_bytes:
        key, start, n = chunks.pop()
        # tick_bytes only grows with n, so binary-search the largest size that fits.
        lo, hi, best = min(min_chunk, n), n - 1, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if cost([*chunks, (key, start, mid)], back) <= budget_bytes:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best > 0:
            chunks.append((key, start, best))
        else:
            trimmed.append((key, TRIM_REASON))

    while back and cost(chunks, back) > budget_bytes:
        key, _ = back.pop()
        trimmed.append((key, TRIM_REASON))

    return TrimmedPlan(
        interactive=tuple(inter),
        background=tuple(back),
        prefill=tuple(chunks),
        trimmed=tuple(trimmed),
        n_bytes=cost(chunks, back),
        budget_bytes=budget_bytes,
    )


@dataclass(frozen=True)
class BmtGuard:
    """Stage 7: keep the bytes a tick moves within ``bandwidth × tick budget``.

    With ``bandwidth_gbps`` 0 it only estimates each plan's bytes (for the
    ΣBMT-per-token figure) and trims nothing.
    """

    profile: MemoryProfile
    bandwidth_gbps: float

    @property
    def trims(self) -> bool:
        return self.bandwidth_gbps > 0

    def estimate(self, plan: Plan, state: SchedulerState) -> int:
        n_past = {s.key: s.n_past for s in state.sessions}
        return tick_bytes(
            self.profile, [n_past[k] for k in plan.decode], [(n_past[k], n) for k, n in plan.prefill]
        )

    def budget_bytes(self, plan: Plan) -> int:
        seconds = max(plan.budget_s, plan.predicted_s) if plan.rescue else plan.budget_s
        return int(self.bandwidth_gbps * 1e9 * seconds)

    def apply(self, plan: Plan, state: SchedulerState) -> Plan:
        sessions = {s.key: s for s in state.sessions}
        interactive = [(k, sessions[k].n_past) for k in plan.decode if sessions[k].interactive]
        background = [(k, sessions[k].n_past) for k in plan.decode if not sessions[k].interactive]
        prefill = [(k, sessions[k].n_past, n) for k, n in plan.prefill]
        kept = trim_to_budget(
            self.profile,
            self.budget_bytes(plan),
            interactive=interactive,
            background=background,
            prefill=prefill,
        )
        if not kept.trimmed and len(kept.prefill) == len(prefill) and kept.prefill == tuple(prefill):
            return replace(plan, bmt_bytes=kept.n_bytes)
        decode = {k for k, _ in kept.interactive} | {k for k, _ in kept.background}
        skipped = dict(plan.skipped)
        skipped.update((k, "bmt") for k, _ in kept.trimmed)
        return replace(
            plan,
            decode=tuple(k for k in plan.decode if k in decode),
            prefill=tuple((k, n) for k, _, n in kept.prefill),
            skipped=tuple(sorted(skipped.items())),
            bmt_bytes=kept.n_bytes,
            stands_for=0,  # a trimmed plan says nothing of the ticks after it
            kv_cells=kv_cells_read(
                [n_past for _, n_past in (*kept.interactive, *kept.background)],
                [(start, n) for _, start, n in kept.prefill],
            ),
        )
