"""Fault injection: an engine wrapper that makes chosen steps fail, for reliability tests.

It wraps any :class:`~uma_trio.engine.base.Engine` (the simulated one or the
real llama.cpp one) and, once a fault is armed, fires it on the first step
with an entry its ``when`` matches.  Where it can, it makes the wrapped engine
fail for real rather than pretending:

* ``bad_token``: the matched sequence's tokens are replaced by an invalid id
  in this and every later step until the sequence is freed, so
  ``llama_decode`` itself rejects the batch (status -1, nothing changed);
* ``sampling``: the matched entry's sampler raises, inside the engine's own
  sampling loop;
* ``poison``: the step runs, then fails as a fatal ``llama_decode`` error
  would (status -3): the KV cache now holds cells nobody accounted for;
* ``crash``: the step raises an unexpected exception before running.

``when`` sees each :class:`BatchEntry`; a request is easiest to aim at
through its sampling parameters, e.g. a seed no other request uses.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from .base import (
    BatchEntry,
    ChatTurn,
    Engine,
    EngineError,
    Follow,
    KvState,
    StepResult,
    TemplateArgs,
    TokenArray,
    Tools,
)
from .constraints import ModelVocabulary
from .sampling import Sampler

FaultKind = Literal["bad_token", "sampling", "poison", "crash"]
Match = Callable[[BatchEntry], bool]

INVALID_TOKEN = -1


class InjectedFault(RuntimeError):
    """What an injected ``sampling`` or ``crash`` fault raises."""


def seed_is(seed: int) -> Match:
    """Matches the entries of the request sampling with ``seed``."""
    return lambda entry: entry.sampler is not None and entry.sampler.params.seed == seed


def any_entry(entry: BatchEntry) -> bool:
    return True


@dataclass
class Fault:
    kind: FaultKind
    when: Match = any_entry
    fired_on: int | None = None  # the seq id it hit, once fired


class _FailingSampler(Sampler):
    def __init__(self, inner: Sampler) -> None:
        super().__init__(inner.params)

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        raise InjectedFault("injected sampling fault")


class FaultyEngine:
    """An :class:`Engine` that delegates to ``inner`` except where a fault fires."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.armed: list[Fault] = []
        self.fired: list[Fault] = []
        self._bad_seqs: set[int] = set()

    def arm(self, kind: FaultKind, when: Match = any_entry) -> Fault:
        fault = Fault(kind, when)
        self.armed.append(fault)
        return fault

    @property
    def injected(self) -> Counter[str]:
        return Counter(f.kind for f in self.fired)

    # -- the step, with faults ------------------------------------------------------

    @property
    def running_ahead(self) -> bool:
        return False  # faults are injected step by step: this engine never runs ahead

    async def next_ahead(self) -> tuple[Sequence[BatchEntry], StepResult]:
        raise RuntimeError("FaultyEngine does not run ahead")

    @property
    def can_preempt(self) -> bool:
        return False  # likewise: every step it is handed runs whole

    def preempt(self) -> None:
        pass

    def went_idle(self) -> None:
        self.inner.went_idle()

    async def step(
        self, entries: Sequence[BatchEntry], follow: Follow | None = None, *, preemptible: bool = False,
        hold: bool = False,
    ) -> StepResult:  # fmt: skip
        entries = list(entries)
        poison: Fault | None = None
        for fault in list(self.armed):
            hit = next((i for i, e in enumerate(entries) if fault.when(e)), None)
            if hit is None or (fault.kind == "sampling" and entries[hit].sampler is None):
                continue
            if fault.kind == "poison" and poison is not None:
                continue  # one failed context per step: the second waits for a later step
            self.armed.remove(fault)
            self.fired.append(fault)
            fault.fired_on = entries[hit].seq_id
            if fault.kind == "bad_token":
                self._bad_seqs.add(entries[hit].seq_id)
            elif fault.kind == "sampling":
                sampler = entries[hit].sampler
                assert sampler is not None
                entries[hit] = dataclasses.replace(entries[hit], sampler=_FailingSampler(sampler))
            elif fault.kind == "crash":
                raise InjectedFault("injected engine crash")
            else:
                poison = fault
        bad = self._bad_seqs
        entries = [
            dataclasses.replace(e, tokens=np.full_like(e.tokens, INVALID_TOKEN)) if e.seq_id in bad else e
            for e in entries
        ]
        try:
            result = await self.inner.step(entries)
        except EngineError:
            if poison is None:
                raise
        if poison is not None:  # whatever else happened in this step
            raise EngineError(-3, "injected fatal decode failure (the batch ran; the context is in doubt)")
        return result

    async def rebuild(self) -> None:
        self._bad_seqs.clear()
        await self.inner.rebuild()

    def free_seq(self, seq_id: int) -> None:
        self._bad_seqs.discard(seq_id)
        self.inner.free_seq(seq_id)

    # -- plain delegation -------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.inner.n_ctx

    @property
    def n_ctx_seq(self) -> int:
        return self.inner.n_ctx_seq

    @property
    def n_seq_max(self) -> int:
        return self.inner.n_seq_max

    @property
    def n_batch(self) -> int:
        return self.inner.n_batch

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def tokenizer_blocks(self) -> bool:
        return self.inner.tokenizer_blocks

    @property
    def step_frees_host(self) -> bool:
        return self.inner.step_frees_host

    @property
    def captures_graphs(self) -> bool:
        return self.inner.captures_graphs

    @property
    def splits_at_seq_gaps(self) -> bool:
        return self.inner.splits_at_seq_gaps

    @property
    def kv_type(self) -> str:
        return self.inner.kv_type

    def tokenize(self, text: str) -> TokenArray:
        return self.inner.tokenize(text)

    def apply_chat_template(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> str:
        return self.inner.apply_chat_template(messages, tools, args)

    @property
    def chat_template_source(self) -> str | None:
        return self.inner.chat_template_source

    @property
    def tool_template_source(self) -> str | None:
        return self.inner.tool_template_source

    @property
    def vocabulary(self) -> ModelVocabulary | None:
        return self.inner.vocabulary

    @property
    def max_token_bytes(self) -> int:
        return self.inner.max_token_bytes

    def tokenize_chat(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> TokenArray:
        return self.inner.tokenize_chat(messages, tools, args)

    def tokenize_infill(
        self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "",
        budget: int | None = None,
    ) -> TokenArray:  # fmt: skip
        return self.inner.tokenize_infill(prefix, suffix, extra, middle, budget)

    def seq_cells(self, seq_id: int) -> int:
        return self.inner.seq_cells(seq_id)

    def trim_seq(self, seq_id: int, keep: int) -> None:
        self.inner.trim_seq(seq_id, keep)

    def copy_seq(self, src: int, dst: int, keep: int) -> None:
        self.inner.copy_seq(src, dst, keep)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    async def save_seq(self, seq_id: int) -> KvState:
        return await self.inner.save_seq(seq_id)

    async def load_seq(self, seq_id: int, data: KvState) -> None:
        await self.inner.load_seq(seq_id, data)
