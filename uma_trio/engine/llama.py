"""The real engine, on llama-cpp-python's low-level (ctypes) API.

One model, one context, one ``llama_seq_id`` per active request.

**Exact greedy output.**  A request's tokens must not depend on who shares its
ticks, how its prompt was chunked, or whether its prefix came from the cache.
Two settings give that (docs/SCHEDULER.md):

* each seq id gets its own KV stream (``kv_unified=False``): in one unified
  stream llama.cpp refills freed cells with other requests' tokens, and flash
  attention sums a sequence's cells in cache order, so logits would depend on
  the neighbours' history;
* the KV cache is quantized (``q8_0``, the default).  llama.cpp's CPU flash
  attention has two f16-only kernels besides its per-query one: a tiled one
  for 64+ queries of a stream and a split-KV one for a single query over 512+
  cells (every decode step past 256 tokens of context).  They round
  differently, so with f16 a token computed while decoding differs from the
  same token prefilled.  Quantized K/V always take the per-query kernel, and
  results are bit-identical either way (tests/test_engine.py).

The ``llama_batch`` is built once over numpy-owned buffers and refilled every
tick with slice assignments, so a tick costs no per-token ctypes calls;
logits are read through a zero-copy numpy view of ``llama_get_logits_ith``.
``llama_decode`` runs in a worker thread (ctypes releases the GIL), always the
same one (:mod:`.compute_thread`), which keeps the trio loop serving sockets
meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from ..model_files import sha256_of
from .base import BatchEntry, EngineError, Sampled, SampleFailure, StepResult, TokenArray
from .compute_thread import ComputeThread

log = logging.getLogger(__name__)

_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        # llama-cpp-python prints llama.cpp's log to stderr unless its logger is raised.
        logging.getLogger("llama-cpp-python").setLevel(
            logging.DEBUG if log.isEnabledFor(logging.DEBUG) else logging.ERROR
        )
        llama.llama_backend_init()
        _backend_ready = True


class ModelLoadError(Exception):
    """llama.cpp refused the model file."""


class LlamaModel:
    """Weights and vocabulary, loaded once; read-only, so safe from any thread."""

    def __init__(self, path: Path) -> None:
        _init_backend()
        self.path = path
        params = llama.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported GGUF)")
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self._model))
        self._add_bos = bool(llama.llama_vocab_get_add_bos(self._vocab))
        self._pieces: dict[int, bytes] = {}
        template = llama.llama_model_chat_template(self._model, None)
        self.chat_template: bytes | None = template or None
        self._fingerprint: str | None = None

    @property
    def handle(self) -> Any:  # llama_model_p (an opaque ctypes pointer)
        return self._model

    def tokenize(self, text: str) -> TokenArray:
        data = text.encode("utf-8")
        capacity = len(data) + 2  # a BPE token covers at least one byte, plus BOS/EOS
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, self._add_bos, True)
        if n < 0:  # cannot happen with this capacity, but llama.cpp says how much it needs
            buf = (llama.llama_token * -n)()
            n = llama.llama_tokenize(self._vocab, data, len(data), buf, -n, self._add_bos, True)
        return np.array(buf[:n], dtype=np.int32)

    def piece(self, token: int) -> bytes:
        """The bytes a token renders to (empty for control tokens); cached."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def fingerprint(self) -> str:
        """The sha256 of the model file: what a KV snapshot must match.  Read once (about
        a third of a second per 100 MB), then remembered."""
        if self._fingerprint is None:
            self._fingerprint = sha256_of(self.path)
        return self._fingerprint

    def is_eog(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self._vocab, token))

    def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send `prompt` instead")
        keep = [(role.encode(), content.encode()) for role, content in messages]
        chat = (llama.llama_chat_message * len(keep))(
            *(llama.llama_chat_message(role=r, content=c) for r, c in keep)
        )
        size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama.llama_chat_apply_template(self.chat_template, chat, len(keep), True, buf, size)
            if n < 0:
                raise ValueError("the model's chat template is not supported by llama.cpp")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise ValueError("chat template output kept growing")  # pragma: no cover

    def close(self) -> None:
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None


@dataclass(frozen=True)
class ContextConfig:
    n_ctx_seq: int = 4096  # KV cells one sequence may use (prompt + generated tokens)
    n_batch: int = 512  # most tokens one tick may decode
    # llama.cpp's CPU kernels change their arithmetic once a ubatch holds 64+ tokens,
    # so a token's logits would depend on who shares its tick.  Below that every
    # sequence gets bit-identical results alone or batched (docs/SCHEDULER.md).
    n_ubatch: int = 32
    n_seq_max: int = 8  # concurrent sessions, one seq id each
    n_threads: int | None = None  # default: all cores
    # One KV stream shared by all sequences instead of one each.  Same memory
    # (n_ctx_seq * n_seq_max cells); gives up batch invariance (see module doc),
    # gains a per-request context bounded by the free cells rather than n_ctx_seq.
    kv_unified: bool = False
    kv_type: str = "q8_0"  # K and V element type: f16, q8_0 or q4_0 (see KV_TYPES and the module doc)


# llama.cpp's ggml types for the KV cache, and the bytes one element takes (a q8_0 block
# is 32 int8 plus an f16 scale; q4_0 32 nibbles plus one).
KV_TYPES: dict[str, tuple[int, float]] = {
    "f16": (llama.GGML_TYPE_F16, 2.0),
    "q8_0": (llama.GGML_TYPE_Q8_0, 34 / 32),
    "q4_0": (llama.GGML_TYPE_Q4_0, 18 / 32),
}


class _BatchBuffers:
    """A ``llama_batch`` whose arrays are numpy-owned and refilled by slicing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        int_p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        # seq_id is int32** in C: point entry i at seq[i] (one seq id per token).
        self._seq_ptrs = (int_p * capacity)(*(ctypes.cast(base + 4 * i, int_p) for i in range(capacity)))
        self.batch = llama.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(int_p),
            embd=None,
            pos=self.pos.ctypes.data_as(int_p),
            n_seq_id=self.n_seq_id.ctypes.data_as(int_p),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )


class LlamaEngine:
    """One llama context over a shared :class:`LlamaModel`; see the module doc."""

    def __init__(self, model: LlamaModel, config: ContextConfig) -> None:
        self.model = model
        self.config = config
        params = llama.llama_context_default_params()
        params.n_ctx = config.n_ctx_seq * config.n_seq_max
        params.n_batch = config.n_batch
        params.n_ubatch = min(config.n_ubatch, config.n_batch)
        params.n_seq_max = config.n_seq_max
        params.kv_unified = config.kv_unified
        if config.kv_type not in KV_TYPES:
            raise ModelLoadError(f"unknown KV type {config.kv_type!r}; use one of {', '.join(KV_TYPES)}")
        params.type_k = params.type_v = KV_TYPES[config.kv_type][0]
        threads = config.n_threads or os.cpu_count() or 1
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        # Always on: a quantized V cache requires it.
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._params = params
        self._compute = ComputeThread("uma-llama")
        self._ctx = self._compute.call(llama.llama_init_from_model, model.handle, params)
        if not self._ctx:
            self._compute.close()
            raise ModelLoadError(
                "llama.cpp could not create a context "
                f"(n_ctx_seq={config.n_ctx_seq}, n_seq_max={config.n_seq_max})"
            )
        self._memory = llama.llama_get_memory(self._ctx)
        self.rebuilds = 0
        self._n_ctx = int(llama.llama_n_ctx(self._ctx))
        # llama.cpp pads a stream to 256 cells; the request limit stays what was asked.  One
        # unified stream lets a request use any free cell, up to the model's trained context.
        if config.kv_unified:
            self._n_ctx_seq = min(self._n_ctx, model.n_ctx_train)
        else:
            self._n_ctx_seq = min(config.n_ctx_seq, int(llama.llama_n_ctx_seq(self._ctx)))
        self._n_seq_max = int(llama.llama_n_seq_max(self._ctx))
        self._buffers = _BatchBuffers(config.n_batch)
        self._logits_shape = (model.n_vocab,)

    # -- Engine protocol -------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_ctx_seq(self) -> int:
        return self._n_ctx_seq

    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def n_batch(self) -> int:
        return self._buffers.capacity

    @property
    def model_name(self) -> str:
        return self.model.path.name

    @property
    def tokenizer_blocks(self) -> bool:
        return True

    @property
    def kv_type(self) -> str:
        return self.config.kv_type

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def tokenize(self, text: str) -> TokenArray:
        return self.model.tokenize(text)

    def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> str:
        return self.model.apply_chat_template(messages)

    async def step(self, entries: Sequence[BatchEntry]) -> StepResult:
        # Not abandoned on cancel: the context must never be touched by two threads.
        return await self._compute.run(self._step, entries)

    def step_sync(self, entries: Sequence[BatchEntry]) -> StepResult:
        """:meth:`step` for callers outside trio (tests, benchmarks); blocks."""
        return self._compute.call(self._step, entries)

    async def rebuild(self) -> None:
        await self._compute.run(self._rebuild)

    def _rebuild(self) -> None:
        # Same parameters, so the same cell counts and sequence ids; the old context's KV
        # memory is freed first, so the two never coexist.
        llama.llama_free(self._ctx)
        self._ctx = self._memory = None  # nothing may touch the freed context if the next fails
        self._ctx = llama.llama_init_from_model(self.model.handle, self._params)
        if not self._ctx:
            raise ModelLoadError("llama.cpp could not create a new context")
        self._memory = llama.llama_get_memory(self._ctx)
        self.rebuilds += 1

    def free_seq(self, seq_id: int) -> None:
        llama.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def trim_seq(self, seq_id: int, keep: int) -> None:
        """Drop every cell of ``seq_id`` at position ``keep`` or later."""
        if keep == 0:
            self.free_seq(seq_id)
        elif not llama.llama_memory_seq_rm(self._memory, seq_id, keep, -1):
            raise EngineError(-1, f"llama.cpp refused to trim seq {seq_id} to {keep} cells")

    def copy_seq(self, src: int, dst: int, keep: int) -> None:
        """Make ``dst`` hold ``src``'s first ``keep`` cells.

        Across streams llama.cpp copies the whole stream buffer at the start of the next
        ``llama_decode``, before it computes anything, and in the order copies were asked
        for; so ``src`` may be freed or refilled right after this call."""
        if keep == 0:
            self.free_seq(dst)
            return
        llama.llama_memory_seq_cp(self._memory, src, dst, -1, -1)
        self.trim_seq(dst, keep)

    async def save_seq(self, seq_id: int) -> bytes:
        return await self._compute.run(self._save_seq, seq_id)

    async def load_seq(self, seq_id: int, data: bytes) -> None:
        await self._compute.run(self._load_seq, seq_id, data)

    def _save_seq(self, seq_id: int) -> bytes:
        size = llama.llama_state_seq_get_size(self._ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        n = llama.llama_state_seq_get_data(self._ctx, buf, size, seq_id)
        return ctypes.string_at(buf, n)

    def _load_seq(self, seq_id: int, data: bytes) -> None:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama.llama_state_seq_set_data(self._ctx, buf, len(data), seq_id) == 0:
            self.free_seq(seq_id)
            raise EngineError(-1, "llama.cpp refused the saved KV state (another model shape or KV type?)")

    def seq_cells(self, seq_id: int) -> int:
        hi = llama.llama_memory_seq_pos_max(self._memory, seq_id)
        if hi < 0:
            return 0
        return int(hi - llama.llama_memory_seq_pos_min(self._memory, seq_id) + 1)

    # -- the blocking part -----------------------------------------------------

    def _step(self, entries: Sequence[BatchEntry]) -> StepResult:
        """Fill the batch, run ``llama_decode``, sample.  Runs on the compute thread."""
        buf = self._buffers
        n = 0
        outputs: list[tuple[int, BatchEntry]] = []
        for entry in entries:
            k = len(entry.tokens)
            if n + k > buf.capacity:
                raise ValueError(f"batch of {n + k} tokens exceeds n_batch={buf.capacity}")
            buf.token[n : n + k] = entry.tokens
            buf.pos[n : n + k] = np.arange(entry.pos0, entry.pos0 + k, dtype=np.int32)
            buf.seq[n : n + k] = entry.seq_id
            buf.logits[n : n + k] = 0
            if entry.sampler is not None:
                buf.logits[n + k - 1] = 1
                outputs.append((n + k - 1, entry))
            n += k
        buf.batch.n_tokens = n
        started = time.perf_counter()
        status = llama.llama_decode(self._ctx, buf.batch)
        if status != 0:
            raise EngineError(status, f"llama_decode returned {status} for a batch of {n} tokens")
        sampled, failed = [], []
        for row, entry in outputs:
            assert entry.sampler is not None
            logits = np.ctypeslib.as_array(
                llama.llama_get_logits_ith(self._ctx, row), shape=self._logits_shape
            )
            try:
                token = entry.sampler.sample(logits)
            except Exception as exc:  # one request's sampler must not cost the others their tokens
                failed.append(SampleFailure(entry.seq_id, f"sampling failed: {exc}"))
                continue
            sampled.append(Sampled(entry.seq_id, token, self.model.piece(token), self.model.is_eog(token)))
        return StepResult(sampled, n, time.perf_counter() - started, failed)

    def close(self) -> None:
        if self._ctx:
            self._compute.call(llama.llama_free, self._ctx)
            self._ctx = None
            self._compute.close()
