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

Over 400 lines: the context, its reused batch buffers and the decode-and-sample step share
the context's lifetime and threading rules; the model file's side is in llama_model.py.
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
from typing import Any

import numpy as np

from ..config import DETERMINISTIC_KV_TYPE, DETERMINISTIC_N_UBATCH, FlashAttn
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
)
from .compute_thread import ComputeThread
from .constraints import ModelVocabulary
from .device_sampling import DeviceGreedy
from .devices import LlamaLog, captures_cuda_graphs, devices, flash_attention_resolved, system_info
from .held_results import HeldResults
from .libllama import llama
from .llama_model import LlamaModel, ModelLoadError, ModelShape, Placement
from .model_card import read_shape
from .pooling import PooledPart, pool_rows
from .step_gaps import StepGaps
from .summary import engine_summary

# Where every layer is on a GPU, a run-ahead step's result is handed back after the next
# step is queued on the device (LlamaEngine._chain).  UMA_HAND_BACK_BEFORE_LAUNCH=1 hands it
# back before, as on a CPU: for A/B runs (docs/BENCHMARKS.md "GPU").
HAND_BACK_AFTER_LAUNCH = not os.environ.get("UMA_HAND_BACK_BEFORE_LAUNCH")
# A chain run with ``hold`` hands its results back together once the first of them has
# waited this long, or when it ends: its caller's view is never staler than that.
# UMA_HOLD_AHEAD_S=0 hands each back at once, as without ``hold``: for A/B runs.
HOLD_AHEAD_S = float(os.environ.get("UMA_HOLD_AHEAD_S", "0.1"))

log = logging.getLogger(__name__)

# The model side lives in llama_model.py; engine.llama stays the one module to import from.
__all__ = [
    "DETERMINISTIC", "KV_TYPES", "ContextConfig", "LlamaEngine", "LlamaModel", "ModelLoadError",
    "ModelShape", "Placement", "read_shape",
]  # fmt: skip

# The abort flag llama.cpp polls between graph nodes (preempt()): a 2-byte buffer handed to
# libc's strlen, installed as the ggml_abort_callback.  strlen(flag) is 0 (go on) or 1
# (stop), returned where the C ABIs return a bool, and it runs without the GIL; a Python
# callback would take the GIL at every node of every step.
_STRLEN_ADDRESS = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value or 0
_STRLEN_AS_ABORT = llama.ggml_abort_callback(_STRLEN_ADDRESS)

_FLASH_ATTN = {
    "auto": llama.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


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
    device_greedy: bool = False  # greedy rows picked by llama.cpp on the device (device_sampling.py)


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


@dataclass(frozen=True, slots=True)
class _Filled:
    """A batch written into the buffers, and what its step then reads back."""

    entries: Sequence[BatchEntry]  # in batch order
    n_tokens: int
    outputs: list[BatchEntry]  # the sampled entries, in batch order
    on_device: list[int]  # per output: its batch index where the device samples it, else -1
    rows: list[int]  # per output: its row among the rows llama.cpp returns
    embeds: list[tuple[BatchEntry, int]]  # each embedding entry and its first row
    embedding: bool  # the context outputs hidden states for this batch
    began: float  # perf_counter when filling began


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
        # Hidden states per token, pooled by engine/pooling.py across a prompt's chunks; llama.cpp
        # resolves a GGUF that names no pooling to that already (and warns when overridden).
        if model.gguf_pooling not in (None, llama.LLAMA_POOLING_TYPE_NONE):
            params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE
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
        self._device_greedy = DeviceGreedy(self._ctx, config.device_greedy)
        # Read once: it asks every device (and llama.cpp reads its variable once per process).
        self._captures_graphs = captures_cuda_graphs(model.layers_offloaded)
        self._abort = ctypes.create_string_buffer(2)  # b"": go on; b"x": stop (preempt)
        self._preemptible = False  # the step in flight may be preempted
        self._install_abort()
        self._embedding = False  # the context outputs hidden states (a tick with an embedding)
        # Copies between KV streams asked for, and how many of them a llama_decode has made.
        self._copies_asked = self._copies_made = 0
        # A sequence's last tokens can be removed (attention KV, not a recurrent state).
        handle = model.handle
        self._trims_tail = not (llama.llama_model_is_recurrent(handle) or llama.llama_model_is_hybrid(handle))
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
    def captures_graphs(self) -> bool:
        return self._captures_graphs

    @property
    def splits_at_seq_gaps(self) -> bool:
        return not self.config.kv_unified

    @property
    def kv_type(self) -> str:
        return self.config.kv_type

    @property
    def kv_layout(self) -> str:
        streams = 1 if self.config.kv_unified else self._n_seq_max
        v = "plain" if self.flash_attn else "transposed"  # llama.cpp transposes V without flash attention
        return f"{streams} KV stream{'s' if streams > 1 else ''}, V {v}"

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def tokenize(self, text: str) -> TokenArray:
        return self.model.tokenize(text)

    def apply_chat_template(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> str:
        return self.model.apply_chat_template(messages, tools, args)

    @property
    def chat_template_source(self) -> str | None:
        return self.model.template_source

    @property
    def tool_template_source(self) -> str | None:
        return self.model.tool_template_source or self.model.template_source

    def tokenize_chat(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> TokenArray:
        return self.model.tokenize_chat(messages, tools, args)

    def tokenize_infill(
        self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "",
        budget: int | None = None,
    ) -> TokenArray:  # fmt: skip
        return self.model.tokenize_infill(prefix, suffix, extra, middle, budget)

    @property
    def vocabulary(self) -> ModelVocabulary:
        return self.model.vocabulary

    @property
    def max_token_bytes(self) -> int:
        return self.model.max_token_bytes

    @property
    def can_preempt(self) -> bool:
        return self.model.layers_offloaded == 0  # only the CPU backend polls the abort flag

    def preempt(self) -> None:
        if self._preemptible:
            self._abort.value = b"x"  # llama.cpp sees it at the next graph node

    def went_idle(self) -> None:
        self.step_gaps.idle()

    async def step(
        self, entries: Sequence[BatchEntry], follow: Follow | None = None, *, preemptible: bool = False,
        hold: bool = False,
    ) -> StepResult:  # fmt: skip
        # Cleared here, before the compute thread can start: a preempt() after this line
        # is for this step (or the chain it starts), one before it for a step already over.
        self._abort.value = b""
        self._preemptible = preemptible
        started = threading.Event()
        try:
            # Not abandoned on cancel: the context must never be touched by two threads.
            if follow is None:
                return await self._compute.run(self._decode_and_sample, entries, started, started=started)
            first: Future[StepResult] = Future()
            self._compute.submit(self._chain, entries, started, follow, first, hold)
            return await self._compute.wait_started(first, started)
        finally:
            self._preemptible = self._preemptible and self.running_ahead  # a chain stays so to its end

    @property
    def running_ahead(self) -> bool:
        return bool(self._ahead)

    async def next_ahead(self) -> tuple[Sequence[BatchEntry], StepResult]:
        entries, future = self._ahead.popleft()
        try:
            return entries, await self._compute.wait(future)
        finally:
            self._preemptible = self._preemptible and self.running_ahead

    def step_sync(self, entries: Sequence[BatchEntry]) -> StepResult:
        """:meth:`step` for callers outside trio (tests, benchmarks); blocks.  Never preempted."""
        self._abort.value = b""
        return self._compute.call(self._decode_and_sample, entries, None)

    async def rebuild(self) -> None:
        await self._compute.run(self._rebuild)

    def _rebuild(self) -> None:
        # Same parameters, so the same cell counts and sequence ids; the old context's KV
        # memory is freed first, so the two never coexist.
        llama.llama_free(self._ctx)
        self._device_greedy.free()  # the freed context held them
        self._ctx = self._memory = None  # nothing may touch the freed context if the next fails
        self._ctx = llama.llama_init_from_model(self.model.handle, self._params)
        if not self._ctx:
            raise ModelLoadError("llama.cpp could not create a new context")
        self._memory = llama.llama_get_memory(self._ctx)
        self._device_greedy = DeviceGreedy(self._ctx, self.config.device_greedy)
        self._install_abort()
        self._embedding = False
        self._copies_made = self._copies_asked  # the old context's queue went with it
        self.rebuilds += 1

    def _install_abort(self) -> None:
        llama.llama_set_abort_callback(self._ctx, _STRLEN_AS_ABORT, ctypes.cast(self._abort, ctypes.c_void_p))

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
        if not self.config.kv_unified:  # within one stream a copy is only bookkeeping
            self._copies_asked += 1
        self.trim_seq(dst, keep)

    async def save_seq(self, seq_id: int) -> KvState:
        return await self._compute.run(self._save_seq, seq_id)

    async def load_seq(self, seq_id: int, data: KvState) -> None:
        await self._compute.run(self._load_seq, seq_id, data)

    def _make_queued_copies(self, seq_id: int) -> None:
        """Have llama.cpp make the stream copies it holds for its next ``llama_decode``.

        Reading or writing a sequence's saved state does not make them: a saved copy's
        destination would hold what its buffer held before, and a state loaded into a copy's
        source (evicted meanwhile) would be copied instead.  One token decoded (and removed)
        makes them: in an empty sequence, ``seq_id`` itself when it is (a load's), else at the
        end of ``seq_id``; only then is the state read or written."""
        asked = self._copies_asked
        if self._copies_made == asked:
            return
        seqs = (seq_id, *range(self._n_seq_max))
        empty = next((s for s in seqs if llama.llama_memory_seq_pos_max(self._memory, s) < 0), None)
        if empty is None and not self._trims_tail:  # a recurrent state takes the token in for good
            raise EngineError(-1, "no empty sequence to make the queued KV copies in; try again later")
        scratch = seq_id if empty is None else empty
        pos = 0 if empty is not None else int(llama.llama_memory_seq_pos_max(self._memory, seq_id)) + 1
        self._abort.value = b""  # a job runs between steps: nothing may preempt this one
        self._embedding_mode(False)
        buf = self._buffers
        buf.token[0], buf.pos[0], buf.seq[0], buf.logits[0] = 0, pos, scratch, 0
        buf.batch.n_tokens = 1
        status = llama.llama_decode(self._ctx, buf.batch)
        removed = llama.llama_memory_seq_rm(self._memory, scratch, pos, -1)
        if status != 0 or not removed:
            raise EngineError(
                status or -1, f"making the queued KV copies failed (llama_decode returned {status})"
            )
        self._copies_made = asked

    def _save_seq(self, seq_id: int) -> KvState:
        # Read straight into the bytes returned: a ctypes array then string_at held the state
        # (up to gigabytes) twice.
        self._make_queued_copies(seq_id)
        size = llama.llama_state_seq_get_size(self._ctx, seq_id)
        state = bytearray(size)
        into = (ctypes.c_uint8 * size).from_buffer(state)
        n = llama.llama_state_seq_get_data(self._ctx, into, size, seq_id)
        del into  # a buffer exported to ctypes cannot be resized
        del state[n:]
        return state

    def _load_seq(self, seq_id: int, data: KvState) -> None:
        self._make_queued_copies(seq_id)
        # llama.cpp reads the bytes where they are (a const pointer): no copy of the state.
        buf: Any
        if isinstance(data, bytearray):  # save_seq's own
            buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        else:
            buf = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        if llama.llama_state_seq_set_data(self._ctx, buf, len(data), seq_id) == 0:
            self.free_seq(seq_id)
            raise EngineError(-1, "llama.cpp refused the saved KV state (another model shape or KV type?)")

    def seq_cells(self, seq_id: int) -> int:
        hi = llama.llama_memory_seq_pos_max(self._memory, seq_id)
        if hi < 0:
            return 0
        return int(hi - llama.llama_memory_seq_pos_min(self._memory, seq_id) + 1)

    # -- the blocking part -----------------------------------------------------

    def _chain(
        self,
        entries: Sequence[BatchEntry],
        decode_started: threading.Event,
        follow: Follow,
        first: Future[StepResult],
        hold: bool = False,
    ) -> None:
        """Run ``entries``, then each batch ``follow`` asks for, without leaving the compute
        thread (run-ahead, runtime/run_ahead.py).  Each later step's future is queued in
        ``_ahead`` before the step before it is handed back, so the caller sees
        ``running_ahead``.

        The one choice here is where a step's result is handed back.  Handing it back wakes
        the event loop, which takes the GIL (trio's wake-up is a socket write, which drops
        it) and keeps it for up to the switch interval.  On a CPU ``llama_decode`` returns
        only when the step is done, so the result goes back once the next batch is filled,
        just before its ``llama_decode``: the Python between two decodes then never waits for
        the GIL (handed back after that decode instead, the woken event loop took the GIL
        from the compute thread: 0.6 ms between two decodes of a one-stream CPU tick).  Where
        every layer is on a GPU, ``llama_decode`` returns once the step is queued on the
        device; the result then goes back after it, while the device computes, and the
        hand-off leaves the time between two decodes altogether.

        With ``hold`` the results wait instead, each with the time it was ready, and go
        back together (:class:`.HeldResults`): once the oldest has waited :data:`HOLD_AHEAD_S`,
        and at the chain's end, before its last result or its error."""
        future = first
        after_launch = self.step_frees_host and HAND_BACK_AFTER_LAUNCH  # for the whole chain
        held = HeldResults(HOLD_AHEAD_S if hold else 0.0)
        try:
            result = self._run(self._fill(entries), decode_started)
            while after := follow(entries, result):
                filled = self._fill(after)
                following: Future[StepResult] = Future()
                self._ahead.append((after, following))
                if after_launch:
                    try:
                        started = self._launch(filled, None)
                    finally:
                        held.hand_back(future, result)  # its tokens stand, whatever the next step does
                        future, entries = following, after
                    result = self._collect(filled, started)
                else:
                    held.hand_back(future, result)
                    future, entries = following, after
                    result = self._run(filled, None)
        except BaseException as exc:
            held.release()
            future.set_exception(exc)
            return
        held.hand_back(future, result)
        held.release()

    def _decode_and_sample(
        self, entries: Sequence[BatchEntry], decode_started: threading.Event | None
    ) -> StepResult:
        """Fill the batch, run ``llama_decode``, sample.  Runs on the compute thread; sets
        ``decode_started`` just before the decode (see :meth:`ComputeThread.run`)."""
        return self._run(self._fill(entries), decode_started)

    def _fill(self, entries: Sequence[BatchEntry]) -> _Filled:
        """Write ``entries`` into the batch buffers; what the step then samples or pools."""
        began = time.perf_counter()
        if not self.config.kv_unified:
            # With a KV stream per sequence llama.cpp cuts a micro-batch wherever the next
            # token's seq id is not the previous one's + 1: in id order, consecutive running
            # ids (kv_manager keeps them so) decode in one pass over the weights.
            entries = sorted(entries, key=attrgetter("seq_id"))
        buf = self._buffers
        n = 0
        outputs: list[BatchEntry] = []
        on_device: list[int] = []  # batch index of each output the device samples, else -1
        # With an embedding in the batch llama.cpp outputs every token (hidden states and
        # logits): a sampled entry's row is then its last token's batch index.
        embedding = self._embedding_mode(any(entry.embed for entry in entries))
        rows: list[int] = []  # each output's row among those llama.cpp returns
        embeds: list[tuple[BatchEntry, int]] = []  # each embedding entry and its first row
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
                rows.append(n + k - 1 if embedding else len(outputs))
                outputs.append(entry)
                # A device chain takes one output per sequence: none while every token is one.
                device = self._device_greedy.route(entry.seq_id, entry.sampler.is_argmax and not embedding)
                on_device.append(n + k - 1 if device else -1)
            elif entry.embed:
                self._device_greedy.route(entry.seq_id, False)
                embeds.append((entry, n))
            n += k
        buf.batch.n_tokens = n
        if embedding:  # llama.cpp outputs every token then; marked so, it has nothing to say
            buf.logits[:n] = 1
        return _Filled(entries, n, outputs, on_device, rows, embeds, embedding, began)

    def _run(self, filled: _Filled, decode_started: threading.Event | None) -> StepResult:
        """``llama_decode`` the filled batch and sample its outputs."""
        return self._collect(filled, self._launch(filled, decode_started))

    def _launch(self, filled: _Filled, decode_started: threading.Event | None) -> float:
        """``llama_decode`` the filled batch; when it started (perf_counter).  On a GPU it
        returns once the step is queued: :meth:`_collect` waits for the device."""
        started = time.perf_counter()
        self.step_gaps.on_start(filled.began, started)
        asked = self._copies_asked  # llama_decode makes the copies queued by now first
        if decode_started is not None:
            decode_started.set()
        status = llama.llama_decode(self._ctx, self._buffers.batch)
        if status == 0:
            self._copies_made = asked
        else:
            self.step_gaps.on_end(None)
            n = filled.n_tokens
            if status == 2:  # preempted: undo the micro-batches that did finish, too
                for entry in filled.entries:
                    llama.llama_memory_seq_rm(self._memory, entry.seq_id, entry.pos0, -1)
                raise EngineError(2, f"preempted: a batch of {n} tokens stopped early and was undone")
            raise EngineError(status, f"llama_decode returned {status} for a batch of {n} tokens")
        return started

    def _collect(self, filled: _Filled, started: float) -> StepResult:
        """Sample the outputs of the step :meth:`_launch` started at ``started``."""
        n = filled.n_tokens
        outputs = filled.outputs
        if not outputs:  # a GPU's decode returns before the device is done: time all of it
            llama.llama_synchronize(self._ctx)
            sampled: list[Sampled] = []
            failed: list[SampleFailure] = []
        else:
            sampled, failed = self._sample(
                outputs, filled.on_device, filled.rows, n if filled.embedding else len(outputs)
            )
        pooled = self._pool(filled.embeds, n) if filled.embeds else []
        ended = time.perf_counter()
        self.step_gaps.on_end(ended)
        return StepResult(sampled, n, ended - started, failed, pooled)

    def _embedding_mode(self, on: bool) -> bool:
        """Switch the context's hidden-state output on or off (kept between steps alike)."""
        if on != self._embedding:
            llama.llama_set_embeddings(self._ctx, on)
            self._embedding = on
        return on

    def _pool(self, embeds: list[tuple[BatchEntry, int]], n_rows: int) -> list[PooledPart]:
        """Each embedding entry's part of its pooled vector (engine/pooling.py), copied out
        of llama.cpp's output buffer before the next step reuses it."""
        states = llama.llama_get_embeddings(self._ctx)  # waits for the device
        hidden = np.ctypeslib.as_array(states, shape=(n_rows, self.model.n_embd))
        parts = []
        for entry, first in embeds:
            rows = hidden[first : first + len(entry.tokens)]
            if (part := pool_rows(entry.seq_id, self.model.pooling, rows, entry.pos0)) is not None:
                parts.append(part)
        return parts

    def _sample(
        self, outputs: list[BatchEntry], on_device: list[int], out_rows: list[int], n_rows: int
    ) -> tuple[list[Sampled], list[SampleFailure]]:
        """The next token of each output, in order: read back where the device picked it,
        argmax-ed together where greedy on the host, else drawn by the request's sampler."""
        tokens: dict[int, int] = {}
        failed: list[SampleFailure] = []
        for i, index in enumerate(on_device):
            if index < 0:
                continue
            if (token := self._device_greedy.token(index)) is None:  # its logits did not come back either
                failed.append(SampleFailure(outputs[i].seq_id, "llama.cpp sampled no token on the device"))
            else:
                tokens[i] = token
        if len(tokens) + len(failed) < len(outputs):
            # Every output row in batch order, one view (llama_get_logits waits for the device).
            logits = llama.llama_get_logits(self._ctx)
            rows = np.ctypeslib.as_array(logits, shape=(n_rows, self._n_vocab))
            greedy = [
                i for i, e in enumerate(outputs) if on_device[i] < 0 and e.sampler and e.sampler.is_argmax
            ]
            # All greedy (the usual case on a CPU): argmax the view itself; picking rows would
            # copy them (16 rows of a 128k vocabulary: 8 MB, 0.4 ms a step).
            whole = len(greedy) == len(outputs) == n_rows
            picked = rows if whole else rows[[out_rows[i] for i in greedy]]
            if greedy:
                tokens.update(zip(greedy, picked.argmax(axis=1).tolist(), strict=True))
            for i, entry in enumerate(outputs):
                if on_device[i] >= 0 or i in tokens:
                    continue
                assert entry.sampler is not None
                try:
                    tokens[i] = entry.sampler.sample(rows[out_rows[i]])
                except Exception as exc:  # one request's sampler must not cost the others their tokens
                    failed.append(SampleFailure(entry.seq_id, f"sampling failed: {exc}"))
        piece, is_eog = self.model.piece, self.model.is_eog
        sampled = [
            Sampled(entry.seq_id, token, piece(token), is_eog(token))
            for i, entry in enumerate(outputs)
            if (token := tokens.get(i)) is not None
        ]
        return sampled, failed

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
                "gpu_sampling": self._device_greedy.enabled, "cuda_graphs": self.captures_graphs,
                "main_gpu": m.placement.main_gpu, "split_mode": m.placement.split_mode,
                "tensor_split": list(m.placement.tensor_split) if m.placement.tensor_split else None,
            },
            model={"file": m.path.name, "description": m.description, "weight_bytes": m.weight_bytes,
                   "n_layer": m.shape.n_layer, "n_embd": m.n_embd, "pooling": m.pooling},
            step_overhead=self.step_gaps.snapshot(),
        )  # fmt: skip

    def close(self) -> None:
        if self._ctx:
            self._compute.call(llama.llama_free, self._ctx)
            self._compute.call(self._device_greedy.free)  # the freed context held the chains
            self._ctx = None
            self._compute.close()
