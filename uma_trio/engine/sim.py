"""A simulated engine on virtual time, for policy and timing simulations.

It implements the :class:`~uma_trio.engine.base.Engine` protocol, but a step
costs ``CostCoefficients.predict(batch)`` seconds of *trio* time (``await
trio.sleep``, on the event loop, not in a thread), so under
``trio.testing.MockClock(autojump_threshold=0)`` the whole daemon (real
connections, real policy, real decode loop) runs minutes of load in
milliseconds with exact, repeatable latencies.  The coefficients come from
``uma-trio calibrate`` on the real engine, so the simulated machine is this one.

It is not a language model: one token per whitespace-separated word, and
every generated token is the word ``" tok"``.  End-to-end behaviour is tested
on the real model; this engine only answers "when", never "what".
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from ..sched.cost import CostCoefficients, kv_cells_read
from .base import (
    BatchEntry,
    ChatTurn,
    EngineError,
    Follow,
    KvState,
    Sampled,
    SampleFailure,
    StepResult,
    TemplateArgs,
    TokenArray,
    Tools,
    split_prefill,
    turn_fields,
)
from .infill import infill_tokens
from .pooling import PooledPart

GENERATED_TOKEN = 7
GENERATED_PIECE = b" tok"
SIM_VOCAB = 30100  # tokenize() yields ids 100 .. 30099
SIM_EMBD = 8  # an embedding's size
_ONE_LOGIT = np.zeros(1, dtype=np.float32)  # the samplers still run: their failures must show


@dataclass
class StepNoise:
    """How a real daemon's steps differ from the cost model's prediction, as measured on a
    machine (``benches/sim_vs_real.py`` takes them from a real run's ``--tick-trace``):
    ``ratios``, measured over predicted step times, drawn at random (seeded) for each step,
    ``overhead_s``, the event loop's own time between two steps, and ``request_s``, the time
    a request spends outside the engine before its first token can come (the client's and the
    daemon's own work: connecting, framing, tokenizing, delivering; the simulated clients wait
    it out before they send).  The default is none of these: every step takes exactly its
    prediction, as the simulation tests assume."""

    ratios: Sequence[float] = ()
    overhead_s: float = 0.0
    request_s: float = 0.0
    seed: int = 0
    # Kinds of step whose spread differs from the streaming decode steps' (``ratios``); empty:
    # as ``ratios``.  On the 2-core CPU planned decode steps ran 1.16-1.19 × the engine-alone
    # calibration, steps run ahead 0.93-0.97 × and steps carrying prompt tokens 0.61-0.91 ×
    # (BENCHMARKS.md "The simulator against the real daemon", runs 10 and 11).
    ahead_ratios: Sequence[float] = ()  # steps the engine ran ahead (runtime/run_ahead.py)
    prompt_ratios: Sequence[float] = ()  # steps that carry prompt tokens, streaming or not
    _rng: np.random.Generator | None = field(default=None, repr=False)

    def step_seconds(
        self, predicted: float, *, streaming: bool = True, prompt: bool = False, ahead: bool = False
    ) -> float:
        """``streaming``: the step samples tokens for running requests, whose delivery to
        their clients competes with it for the cores; without ``prompt_ratios`` a prompt-only
        step takes its prediction.  ``prompt``: it carries prompt tokens; ``ahead``: the
        engine ran it ahead."""
        ratios = self.ratios if streaming else ()
        if prompt and self.prompt_ratios:
            ratios = self.prompt_ratios
        elif ahead and self.ahead_ratios:
            ratios = self.ahead_ratios
        if not ratios:
            return predicted + self.overhead_s
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        return predicted * ratios[int(self._rng.integers(len(ratios)))] + self.overhead_s


class SimEngine:
    def __init__(
        self,
        cost: CostCoefficients,
        *,
        n_ctx_seq: int = 4096,
        n_seq_max: int = 8,
        n_batch: int = 512,
    ) -> None:
        self.cost = cost
        self._n_ctx_seq = n_ctx_seq
        self._n_seq_max = n_seq_max
        self._n_batch = n_batch
        self._cells: dict[int, int] = {}  # seq id -> cells held
        self._sampled_once: set[int] = set()  # sequences past their prompt
        self.steps: list[tuple[int, int, float]] = []  # (decode tokens, prefill tokens, seconds)
        self.rebuilds = 0
        self._ahead: deque[tuple[Sequence[BatchEntry], Follow, bool]] = deque()  # run-ahead steps to run
        self.preemptible_steps = True  # as llama.cpp's CPU backend: preempt() stops a step midway
        self._preempt_scope: trio.CancelScope | None = None
        self.preempted = 0  # steps preempt() stopped
        self._stop_ahead = False  # preempt() came between two steps of a preemptible chain
        self.machine = StepNoise()
        self.graph_capture = False  # as llama.cpp's CUDA backend (Engine.captures_graphs), for tests

    @property
    def n_ctx(self) -> int:
        return self._n_ctx_seq * self._n_seq_max

    @property
    def n_ctx_seq(self) -> int:
        return self._n_ctx_seq

    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def n_batch(self) -> int:
        return self._n_batch

    @property
    def model_name(self) -> str:
        return "sim"

    @property
    def tokenizer_blocks(self) -> bool:
        return False

    @property
    def step_frees_host(self) -> bool:
        return False

    @property
    def captures_graphs(self) -> bool:
        return self.graph_capture

    @property
    def splits_at_seq_gaps(self) -> bool:
        return True  # the runtime's id packing runs in simulations too (the timing ignores it)

    def tokenize(self, text: str) -> TokenArray:
        words = text.split()
        return np.array([100 + zlib.crc32(w.encode()) % 30000 for w in words], dtype=np.int32)

    def apply_chat_template(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> str:
        turns = [turn_fields(m) for m in messages]
        return " ".join(f"{t['role']}: {t['content']}" for t in turns) + " assistant:"

    @property
    def chat_template_source(self) -> None:
        return None

    @property
    def tool_template_source(self) -> None:
        return None

    @property
    def vocabulary(self) -> None:
        return None  # its one-candidate rows have no vocabulary to constrain

    @property
    def max_token_bytes(self) -> int:
        return 1 << 20  # a token per word, and a word may be long: no useful bound

    def tokenize_infill(
        self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "",
        budget: int | None = None,
    ) -> TokenArray:  # fmt: skip
        return infill_tokens(None, lambda text: [], prefix, suffix)  # no FIM tokens: refused

    def tokenize_chat(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> TokenArray:
        # The simulation has no control tokens; a last assistant message is continued.
        head, prefill = split_prefill([turn_fields(m) for m in messages])
        return self.tokenize(self.apply_chat_template(head, tools) + prefill)

    @property
    def can_preempt(self) -> bool:
        return self.preemptible_steps

    def went_idle(self) -> None:
        pass  # the simulation keeps no per-step overhead

    def preempt(self) -> None:
        if self._preempt_scope is not None:
            self._preempt_scope.cancel()
        elif self._ahead and self._ahead[0][2]:
            # Between two steps of a preemptible chain: as llama.cpp's flag, it stops the next.
            self._stop_ahead = True

    async def step(
        self, entries: Sequence[BatchEntry], follow: Follow | None = None, *, preemptible: bool = False,
        hold: bool = False,
    ) -> StepResult:  # fmt: skip
        self._stop_ahead = False  # as the real engine's abort flag: cleared for each new step
        return await self._step_and_follow(entries, follow, preemptible=preemptible)

    async def _step_and_follow(
        self, entries: Sequence[BatchEntry], follow: Follow | None, *, preemptible: bool = False,
        ahead: bool = False,
    ) -> StepResult:  # fmt: skip
        result = await self._step(entries, preemptible=preemptible, ahead=ahead)
        if follow is not None and (after := follow(entries, result)):
            self._ahead.append((after, follow, preemptible))  # a chain stays preemptible to its end
        return result

    @property
    def running_ahead(self) -> bool:
        return bool(self._ahead)

    async def next_ahead(self) -> tuple[Sequence[BatchEntry], StepResult]:
        # Run when collected: in virtual time the event loop's own work takes none, so the
        # overlap a real engine gains is not modelled, only the order of events.
        entries, follow, preemptible = self._ahead.popleft()
        if self._stop_ahead:
            self._stop_ahead = False
            self._ahead.clear()
            self.preempted += 1
            await trio.lowlevel.checkpoint()
            raise EngineError(
                2, f"preempted: a batch of {len(entries)} entries stopped at once and was undone"
            )
        return entries, await self._step_and_follow(entries, follow, preemptible=preemptible, ahead=True)

    async def _step(
        self, entries: Sequence[BatchEntry], *, preemptible: bool = False, ahead: bool = False
    ) -> StepResult:
        decode_ctx: list[int] = []
        prefill: list[tuple[int, int]] = []
        n_tokens = 0
        for entry in entries:
            n = len(entry.tokens)
            n_tokens += n
            if entry.pos0 + n > self._n_ctx_seq:
                raise EngineError(1, f"sequence {entry.seq_id} would exceed {self._n_ctx_seq} cells")
            if n and (int(entry.tokens.min()) < 0 or int(entry.tokens.max()) >= SIM_VOCAB):  # as llama.cpp
                raise EngineError(-1, f"invalid token in the batch of sequence {entry.seq_id}")
            if entry.seq_id in self._sampled_once and n == 1:
                decode_ctx.append(entry.pos0)
            else:
                prefill.append((entry.pos0, n))
        if n_tokens > self._n_batch:
            raise ValueError(f"batch of {n_tokens} tokens exceeds n_batch={self._n_batch}")
        prefill_tokens = sum(n for _, n in prefill)
        predicted = self.cost.predict(len(decode_ctx), prefill_tokens, kv_cells_read(decode_ctx, prefill))
        seconds = self.machine.step_seconds(
            predicted, streaming=bool(decode_ctx), prompt=prefill_tokens > 0, ahead=ahead
        )
        with trio.CancelScope(shield=True):  # like the real engine: a started step finishes...
            with trio.CancelScope() as preempt:  # ...unless preempted, which undoes it
                self._preempt_scope = preempt if preemptible else None
                await trio.sleep(seconds)
            self._preempt_scope = None
        if preempt.cancelled_caught:
            self.preempted += 1
            raise EngineError(2, f"preempted: a batch of {n_tokens} tokens stopped early and was undone")
        sampled, failed, pooled = [], [], []
        for entry in entries:
            self._cells[entry.seq_id] = entry.pos0 + len(entry.tokens)
            if entry.embed:  # a made-up hidden state per token: the mechanics, not the meaning
                hidden = np.outer(entry.tokens + 1, np.arange(1, SIM_EMBD + 1, dtype=np.float64))
                pooled.append(PooledPart(entry.seq_id, "mean", hidden.sum(axis=0), len(hidden)))
            if entry.sampler is not None:
                self._sampled_once.add(entry.seq_id)
                try:
                    entry.sampler.sample(_ONE_LOGIT)
                except Exception as exc:  # as the real engine: only this entry fails
                    failed.append(SampleFailure(entry.seq_id, f"sampling failed: {exc}"))
                    continue
                sampled.append(Sampled(entry.seq_id, GENERATED_TOKEN, GENERATED_PIECE, False))
        self.steps.append((len(decode_ctx), prefill_tokens, seconds))
        return StepResult(sampled, n_tokens, seconds, failed, pooled)

    async def rebuild(self) -> None:
        await trio.lowlevel.checkpoint()
        self._cells.clear()
        self._sampled_once.clear()
        self.rebuilds += 1

    def free_seq(self, seq_id: int) -> None:
        self._cells.pop(seq_id, None)
        self._sampled_once.discard(seq_id)

    def seq_cells(self, seq_id: int) -> int:
        return self._cells.get(seq_id, 0)

    def trim_seq(self, seq_id: int, keep: int) -> None:
        if keep == 0:
            self.free_seq(seq_id)
        elif seq_id in self._cells:
            self._cells[seq_id] = min(self._cells[seq_id], keep)

    def copy_seq(self, src: int, dst: int, keep: int) -> None:
        self.free_seq(dst)
        if keep > 0:
            self._cells[dst] = min(self._cells.get(src, 0), keep)

    @property
    def kv_type(self) -> str:
        return "q8_0"

    @property
    def kv_layout(self) -> str:
        return "sim"

    def fingerprint(self) -> str:
        return "sim"

    async def save_seq(self, seq_id: int) -> KvState:
        await trio.lowlevel.checkpoint()
        return str(self._cells.get(seq_id, 0)).encode()

    async def load_seq(self, seq_id: int, data: KvState) -> None:
        await trio.lowlevel.checkpoint()
        if not data.isdigit():
            raise EngineError(-1, "not a simulated sequence state")
        self._cells[seq_id] = int(data)

    def close(self) -> None:
        self._cells.clear()
