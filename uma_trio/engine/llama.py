"""The real engine, on llama-cpp-python's low-level (ctypes) API.

One model, one context, one ``llama_seq_id`` per active request.  The model's layers
go where :class:`Placement` says (``--gpu-layers``; :mod:`.offload` decides ``auto``).

**Two modes** (docs/CONFIG.md).  By default the context is set for speed, as
llama-server sets it: micro-batches of 512 tokens, an f16 KV cache, flash attention
when the backend supports it.  ``--deterministic`` instead keeps a request's greedy
tokens independent of who shares its ticks, how its prompt was chunked and whether its
prefix came from the cache:

* each seq id gets its own KV stream (``kv_unified=False``, also the default): in one
  unified stream llama.cpp refills freed cells with other requests' tokens, and flash
  attention sums a sequence's cells in cache order;
* micro-batches stay under 64 tokens: llama.cpp's CPU matrix kernels change their
  arithmetic from there on;
* the KV cache is quantized (``q8_0``).  llama.cpp's CPU flash attention has two
  f16-only kernels besides its per-query one (a tiled one for 64+ queries of a stream,
  a split-KV one for one query over 512+ cells); they round differently, so with f16 a
  token computed while decoding differs from the same token prefilled.  Quantized K/V
  always take the per-query kernel (tests/test_engine.py).

The ``llama_batch`` is built once over numpy-owned buffers and refilled every
tick with slice assignments, so a tick costs no per-token ctypes calls;
logits are read through one zero-copy numpy view of every output row, and greedy rows
are argmax-ed together.  ``llama_decode`` runs in a worker thread (ctypes releases the
GIL), always the same one (:mod:`.compute_thread`), which keeps the trio loop serving
sockets meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from ..config import DETERMINISTIC_KV_TYPE, DETERMINISTIC_N_UBATCH, FlashAttn, SplitMode
from ..model_files import sha256_of
from .base import BatchEntry, EngineError, Follow, Sampled, SampleFailure, StepResult, TokenArray
from .compute_thread import ComputeThread
from .devices import LlamaLog, devices, flash_attention_resolved, init_backend, offloaded_layers, system_info
from .libllama import llama
from .step_gaps import StepGaps
from .summary import engine_summary

log = logging.getLogger(__name__)

_FLASH_ATTN = {
    "auto": llama.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
_SPLIT_MODE = {
    "none": llama.LLAMA_SPLIT_MODE_NONE,
    "layer": llama.LLAMA_SPLIT_MODE_LAYER,
    "row": llama.LLAMA_SPLIT_MODE_ROW,
}


@dataclass(frozen=True)
class Placement:
    """Where the weights go: llama_model_params' device fields, passed through."""

    n_gpu_layers: int = 0
    main_gpu: int = 0  # the GPU that holds everything with split_mode none (and the scratch)
    split_mode: SplitMode = "layer"  # across several GPUs: whole layers, or rows (tensor parallel)
    tensor_split: tuple[float, ...] | None = None  # share of the model per GPU; None: by free memory
    reason: str = "CPU only"  # why this many layers (the offload decision, for the log and info)


@dataclass(frozen=True)
class ModelShape:
    """What sizing the KV cache and the offload needs, read without loading weights."""

    n_layer: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_ctx_train: int
    file_bytes: int

    def kv_bytes_per_cell(self, kv_type_bytes: float) -> int:
        """K and V of one token over every layer (layer 0's head counts stand for all)."""
        return round(self.n_layer * self.n_head_kv * (self.key_length + self.value_length) * kv_type_bytes)


def _meta_int(model: Any, key: str) -> int | None:
    buf = ctypes.create_string_buffer(64)
    if llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
        return None
    try:
        return int(buf.value.decode())
    except ValueError:
        return None


def _meta_str(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(128)
    n = llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return None if n < 0 else buf.value.decode(errors="replace")


def shape_of(model: Any, path: Path) -> ModelShape:
    """A model's layer and head sizes from its GGUF metadata (which a vocab-only load
    reads too; llama.cpp's hparams getters need the weights).  The head sizes come from
    ``<arch>.attention.key_length`` / ``value_length`` when the GGUF has them (models
    whose K and V heads differ set them), else ``n_embd / n_head``; a per-layer KV head
    array falls back to the head count (an upper bound)."""
    arch = _meta_str(model, "general.architecture") or ""

    def key(name: str) -> int | None:
        return _meta_int(model, f"{arch}.{name}")

    n_head = key("attention.head_count") or 0
    n_embd = key("embedding_length") or 0
    head = n_embd // n_head if n_head > 0 else 0
    return ModelShape(
        n_layer=key("block_count") or 0,
        n_head_kv=key("attention.head_count_kv") or n_head,
        key_length=key("attention.key_length") or head,
        value_length=key("attention.value_length") or head,
        n_ctx_train=key("context_length") or 0,
        file_bytes=path.stat().st_size,
    )


def read_shape(path: Path) -> ModelShape:
    """:class:`ModelShape` from the GGUF's metadata alone (a vocab-only load: no weights)."""
    init_backend()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    params.n_gpu_layers = 0
    handle = llama.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported GGUF)")
    try:
        return shape_of(handle, path)
    finally:
        llama.llama_model_free(handle)


class ModelLoadError(Exception):
    """llama.cpp refused the model file."""


class LlamaModel:
    """Weights and vocabulary, loaded once; read-only, so safe from any thread."""

    def __init__(self, path: Path, placement: Placement = Placement()) -> None:
        init_backend()
        self.path = path
        self.placement = placement
        params = llama.llama_model_default_params()
        params.n_gpu_layers = placement.n_gpu_layers
        params.main_gpu = placement.main_gpu
        params.split_mode = _SPLIT_MODE[placement.split_mode]
        if placement.tensor_split is not None:
            # llama.cpp reads llama_max_devices() floats; keep the array alive with the params.
            shares = (ctypes.c_float * max(int(llama.llama_max_devices()), len(placement.tensor_split)))()
            for i, share in enumerate(placement.tensor_split):
                shares[i] = share
            self._tensor_split = shares
            params.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
        with LlamaLog.capture() as lines:
            self._model = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported GGUF)")
        self.shape = shape_of(self._model, path)
        # llama.cpp says how many layers it placed on a GPU; without a GPU backend, none.
        said = offloaded_layers(lines)
        self.layers_offloaded, self.layers_total = said or (0, self.shape.n_layer + 1)
        self.weight_bytes = int(llama.llama_model_size(self._model))
        self.description = _model_desc(self._model)
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self._model))
        self._add_bos = bool(llama.llama_vocab_get_add_bos(self._vocab))
        self._pieces: dict[int, bytes] = {}
        template = llama.llama_model_chat_template(self._model, None)
        self.chat_template: bytes | None = template or None
        self._fingerprint: str | None = None
        self._max_token_bytes: int | None = None

    @property
    def handle(self) -> Any:  # llama_model_p (an opaque ctypes pointer)
        return self._model

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> TokenArray:
        """``text`` as tokens; ``special`` parses control-token text (``<|im_end|>``) into
        control tokens, which only text we wrote ourselves may do."""
        data = text.encode("utf-8")
        bos = self._add_bos if add_bos is None else add_bos and self._add_bos
        capacity = len(data) + 2  # a BPE token covers at least one byte, plus BOS/EOS
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, bos, special)
        if n < 0:  # cannot happen with this capacity, but llama.cpp says how much it needs
            buf = (llama.llama_token * -n)()
            n = llama.llama_tokenize(self._vocab, data, len(data), buf, -n, bos, special)
        return np.array(buf[:n], dtype=np.int32)

    @property
    def max_token_bytes(self) -> int:
        """The longest token's text in bytes (read from the vocabulary once, ~50 ms)."""
        if self._max_token_bytes is None:
            n_vocab = llama.llama_vocab_n_tokens(self._vocab)
            self._max_token_bytes = max(1, max(len(self.piece(t)) for t in range(n_vocab)))
        return self._max_token_bytes

    def tokenize_chat(self, messages: Sequence[tuple[str, str]]) -> TokenArray:
        """A chat as tokens: the template's own text with its control tokens, each message's
        content as plain text, so a ``<|im_end|>`` typed into a message cannot close its turn
        or open another (tokenizing the rendered chat whole would parse it).  The template is
        rendered around a marker per content, and the pieces are tokenized apart."""
        markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
        text = self.apply_chat_template([(role, m) for (role, _), m in zip(messages, markers, strict=True)])
        pieces, start = [], 0
        for marker, (_, content) in zip(markers, messages, strict=True):
            at = text.find(marker, start)
            if at < 0 or text.count(marker) != 1:
                raise ValueError(
                    "the model's chat template does not keep message contents whole; send `prompt`"
                )
            pieces.append(self.tokenize(text[start:at], add_bos=start == 0))
            pieces.append(self.tokenize(content, add_bos=False, special=False))
            start = at + len(marker)
        pieces.append(self.tokenize(text[start:], add_bos=not pieces))
        return np.concatenate(pieces)

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


def _model_desc(model: Any) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama.llama_model_desc(model, buf, len(buf))
    return buf.value.decode(errors="replace") if n > 0 else ""


@dataclass(frozen=True)
class ContextConfig:
    """A context's settings.  The defaults are the fast mode; :data:`DETERMINISTIC` holds
    the settings that keep greedy output batch-invariant (module doc)."""

    n_ctx_seq: int = 4096  # KV cells one sequence may use (prompt + generated tokens)
    n_batch: int = 512  # most tokens one tick may decode
    n_ubatch: int = 512  # llama.cpp micro-batch; under 64 for batch invariance on the CPU
    n_seq_max: int = 8  # concurrent sessions, one seq id each
    n_threads: int | None = None  # default: all cores
    # One KV stream shared by all sequences instead of one each.  Same memory
    # (n_ctx_seq * n_seq_max cells); gives up batch invariance (see module doc),
    # gains a per-request context bounded by the free cells rather than n_ctx_seq.
    kv_unified: bool = False
    kv_type: str = "f16"  # K and V element type: f16, q8_0 or q4_0 (see KV_TYPES and the module doc)
    flash_attn: FlashAttn = "auto"  # auto: where the backend supports it (quantized V needs it)


# The settings --deterministic fixes (module doc); with f16 KV or 64+ token micro-batches
# greedy output depends on the batch.
DETERMINISTIC: dict[str, Any] = {
    "n_ubatch": DETERMINISTIC_N_UBATCH, "kv_type": DETERMINISTIC_KV_TYPE,
    "kv_unified": False, "flash_attn": "on",
}  # fmt: skip


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
        params.flash_attn_type = _FLASH_ATTN[config.flash_attn]
        if config.flash_attn == "off" and config.kv_type != "f16":
            raise ModelLoadError(
                f"--flash-attn off needs --kv-type f16 (a {config.kv_type} V cache needs it)"
            )
        self._params = params
        self._compute = ComputeThread("uma-llama")
        with LlamaLog.capture() as lines:
            self._ctx = self._compute.call(llama.llama_init_from_model, model.handle, params)
        if not self._ctx:
            self._compute.close()
            raise ModelLoadError(
                "llama.cpp could not create a context "
                f"(n_ctx_seq={config.n_ctx_seq}, n_seq_max={config.n_seq_max})"
            )
        resolved = flash_attention_resolved(lines)
        # auto with a quantized V cache is forced on without a probe line; an explicit choice is kept.
        self.flash_attn = resolved if resolved is not None else config.flash_attn != "off"
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
        # Steps queued by run-ahead (`step`'s follow), oldest first: appended on the compute
        # thread, taken by the decode task (a deque's ends are thread-safe).
        self._ahead: deque[tuple[Sequence[BatchEntry], Future[StepResult]]] = deque()
        self._n_vocab = model.n_vocab
        self.kv_bytes = self._n_ctx * model.shape.kv_bytes_per_cell(KV_TYPES[config.kv_type][1])
        self.step_gaps = StepGaps()

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
    def step_frees_host(self) -> bool:
        return 0 < self.model.layers_offloaded == self.model.layers_total

    @property
    def splits_at_seq_gaps(self) -> bool:
        return not self.config.kv_unified

    @property
    def kv_type(self) -> str:
        return self.config.kv_type

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def tokenize(self, text: str) -> TokenArray:
        return self.model.tokenize(text)

    def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> str:
        return self.model.apply_chat_template(messages)

    def tokenize_chat(self, messages: Sequence[tuple[str, str]]) -> TokenArray:
        return self.model.tokenize_chat(messages)

    @property
    def max_token_bytes(self) -> int:
        return self.model.max_token_bytes

    async def step(self, entries: Sequence[BatchEntry], follow: Follow | None = None) -> StepResult:
        # Not abandoned on cancel: the context must never be touched by two threads.
        started = threading.Event()
        return await self._compute.run(self._step, entries, started, follow, started=started)

    @property
    def running_ahead(self) -> bool:
        return bool(self._ahead)

    async def next_ahead(self) -> tuple[Sequence[BatchEntry], StepResult]:
        entries, future = self._ahead.popleft()
        return entries, await self._compute.wait(future)

    def step_sync(self, entries: Sequence[BatchEntry]) -> StepResult:
        """:meth:`step` for callers outside trio (tests, benchmarks); blocks."""
        return self._compute.call(self._step, entries, None, None)

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

    def _step(
        self, entries: Sequence[BatchEntry], decode_started: threading.Event | None, follow: Follow | None
    ) -> StepResult:
        """Fill the batch, run ``llama_decode``, sample, and queue ``follow``'s next batch (it
        starts as this call returns).  Runs on the compute thread; sets ``decode_started``
        just before the decode (see :meth:`ComputeThread.run`)."""
        result = self._decode_and_sample(entries, decode_started)
        if follow is not None and (after := follow(entries, result)):
            # Queued before this result is handed back, so the caller sees running_ahead.
            self._ahead.append((after, self._compute.submit(self._step, after, None, follow)))
        return result

    def _decode_and_sample(
        self, entries: Sequence[BatchEntry], decode_started: threading.Event | None
    ) -> StepResult:
        began = time.perf_counter()
        if not self.config.kv_unified:
            # With a KV stream per sequence llama.cpp cuts a micro-batch wherever the next
            # token's seq id is not the previous one's + 1: in id order, consecutive running
            # ids (kv_manager keeps them so) decode in one pass over the weights.
            entries = sorted(entries, key=attrgetter("seq_id"))
        buf = self._buffers
        n = 0
        outputs: list[BatchEntry] = []
        for entry in entries:
            k = len(entry.tokens)
            if n + k > buf.capacity:
                raise ValueError(f"batch of {n + k} tokens exceeds n_batch={buf.capacity}")
            if k == 1:  # a decode token: scalar stores beat five slice assignments
                buf.token[n] = entry.tokens[0]
                buf.pos[n] = entry.pos0
                buf.seq[n] = entry.seq_id
            else:
                buf.token[n : n + k] = entry.tokens
                buf.pos[n : n + k] = np.arange(entry.pos0, entry.pos0 + k, dtype=np.int32)
                buf.seq[n : n + k] = entry.seq_id
            buf.logits[n : n + k] = 0
            if entry.sampler is not None:
                buf.logits[n + k - 1] = 1
                outputs.append(entry)
            n += k
        buf.batch.n_tokens = n
        started = time.perf_counter()
        self.step_gaps.on_start(began, started)
        if decode_started is not None:
            decode_started.set()
        status = llama.llama_decode(self._ctx, buf.batch)
        if status != 0:
            self.step_gaps.on_end(None)
            raise EngineError(status, f"llama_decode returned {status} for a batch of {n} tokens")
        sampled, failed = [], []
        if not outputs:  # a GPU's decode returns before the device is done: time all of it
            llama.llama_synchronize(self._ctx)
        else:
            # Every output row in batch order, one view (llama_get_logits waits for the device).
            rows = np.ctypeslib.as_array(
                llama.llama_get_logits(self._ctx), shape=(len(outputs), self._n_vocab)
            )
            greedy = [i for i, e in enumerate(outputs) if e.sampler is not None and e.sampler.is_argmax]
            # All greedy (the usual case): argmax the view itself; picking rows would copy them
            # (16 rows of a 128k vocabulary: 8 MB, 0.4 ms a step).
            picked = rows if len(greedy) == len(outputs) else rows[greedy]
            argmax = dict(zip(greedy, picked.argmax(axis=1).tolist(), strict=True)) if greedy else {}
            for i, entry in enumerate(outputs):
                assert entry.sampler is not None
                token = argmax.get(i)
                if token is None:
                    try:
                        token = entry.sampler.sample(rows[i])
                    except Exception as exc:  # one request's sampler must not cost the others their tokens
                        failed.append(SampleFailure(entry.seq_id, f"sampling failed: {exc}"))
                        continue
                sampled.append(
                    Sampled(entry.seq_id, token, self.model.piece(token), self.model.is_eog(token))
                )
        ended = time.perf_counter()
        self.step_gaps.on_end(ended)
        return StepResult(sampled, n, ended - started, failed)

    def describe(self, *, deterministic: bool = False) -> dict[str, Any]:
        """:func:`.summary.engine_summary` of this engine, device memory read now."""
        m, c = self.model, self.config
        return engine_summary(
            system_info=system_info(), devices=devices(),
            layers=(m.layers_offloaded, m.layers_total), reason=m.placement.reason,
            kv_type=c.kv_type, kv_bytes=self.kv_bytes, kv_cells=self._n_ctx,
            flash_attn="on" if self.flash_attn else "off",
            settings={
                "n_ctx_seq": self._n_ctx_seq, "n_seq_max": self._n_seq_max, "n_batch": c.n_batch,
                "n_ubatch": int(llama.llama_n_ubatch(self._ctx)), "threads": self._params.n_threads,
                "kv_unified": c.kv_unified, "deterministic": deterministic,
                "main_gpu": m.placement.main_gpu, "split_mode": m.placement.split_mode,
                "tensor_split": list(m.placement.tensor_split) if m.placement.tensor_split else None,
            },
            model={"file": m.path.name, "description": m.description, "weight_bytes": m.weight_bytes,
                   "n_layer": m.shape.n_layer},
            step_overhead=self.step_gaps.snapshot(),
        )  # fmt: skip

    def close(self) -> None:
        if self._ctx:
            self._compute.call(llama.llama_free, self._ctx)
            self._ctx = None
            self._compute.close()
