"""The ΣBMT inputs of a loaded model, and how fast this machine moves bytes.

:func:`memory_profile` reads the sizes :mod:`uma_trio.sched.bmt` needs from
llama.cpp's view of the model, so the scheduler's byte estimate follows the
model actually loaded rather than a table.  :func:`probe_bandwidth_gbps`
measures the memory bandwidth those bytes are divided by to get seconds.
"""

from __future__ import annotations

import ctypes
import time

import llama_cpp as llama
import numpy as np

from ..sched.bmt import MemoryProfile
from .llama import LlamaModel


def _meta_int(model: LlamaModel, key: str) -> int | None:
    """A GGUF metadata value as an int, or None when the model lacks the key."""
    buf = ctypes.create_string_buffer(64)
    n = llama.llama_model_meta_val_str(model.handle, key.encode(), buf, len(buf))
    if n < 0:
        return None
    try:
        return int(buf.value.decode())
    except ValueError:
        return None


def _meta_str(model: LlamaModel, key: str) -> str | None:
    buf = ctypes.create_string_buffer(128)
    n = llama.llama_model_meta_val_str(model.handle, key.encode(), buf, len(buf))
    return None if n < 0 else buf.value.decode(errors="replace")


def memory_profile(model: LlamaModel, n_ubatch: int, kv_type_bytes: float = 2.0) -> MemoryProfile:
    """Weight bytes and KV bytes per cell of ``model``, for micro-batches of ``n_ubatch``.

    ``weight_bytes`` is ``llama_model_size`` (all tensor data, as quantized):
    every micro-batch runs the whole graph, and with tied embeddings even the
    token table is read in full by the output projection.  A cell holds K and
    V for every layer: ``n_layer · n_head_kv · (key_length + value_length)``
    elements of ``kv_type_bytes`` each (2.0 for the default f16 cache; use
    e.g. 34/32 for q8_0).  The head sizes come from the GGUF keys
    ``<arch>.attention.key_length`` / ``value_length`` when present (models
    whose K and V heads differ set them) and otherwise ``n_embd / n_head``.
    Per-layer variations (sliding-window layers, varying KV heads) are not
    modelled: layer 0's head counts stand for all layers, an upper bound.
    """
    handle = model.handle
    n_layer = int(llama.llama_model_n_layer(handle))
    n_head = int(llama.llama_model_n_head(handle))
    n_head_kv = int(llama.llama_model_n_head_kv(handle))
    n_embd = int(llama.llama_model_n_embd(handle))
    arch = _meta_str(model, "general.architecture") or ""
    default_head = n_embd // n_head if n_head > 0 else 0
    key_length = _meta_int(model, f"{arch}.attention.key_length") or default_head
    value_length = _meta_int(model, f"{arch}.attention.value_length") or default_head
    kv_elements = n_layer * n_head_kv * (key_length + value_length)
    return MemoryProfile(
        weight_bytes=int(llama.llama_model_size(handle)),
        kv_bytes_per_cell=round(kv_elements * kv_type_bytes),
        n_ubatch=n_ubatch,
    )


def probe_bandwidth_gbps(size_mb: int = 256, repeats: int = 3) -> float:
    """Memory-copy bandwidth in GB/s (10⁹ bytes/s): the best of ``repeats`` copies.

    ``size_mb`` MiB is all the probe touches: one buffer whose first half is
    copied onto its second half.  Halving the footprint matters because
    first-touch page faults, not the copies, dominate the run time (on a VM
    they can cost several times the copy itself).  Keep each half well beyond
    the last-level cache so the copy measures DRAM, not cache.  A copy counts
    the bytes it reads plus the bytes it writes, as STREAM's *copy* does
    (write-allocate traffic is not counted).  The source is filled first (an
    untouched page reads as the shared zero page, straight from cache) and one
    untimed copy faults in the destination; the best time is kept because
    anything else running can only slow a copy down.  This is one thread's
    bandwidth.  With the defaults it takes 0.05-0.2 s, up to ~0.6 s when a VM
    host must first back the fresh pages.
    """
    if size_mb < 2 or repeats < 1:
        raise ValueError("size_mb must be >= 2 and repeats >= 1")
    half = size_mb * 1024 * 1024 // 2
    buf = np.empty(2 * half, dtype=np.uint8)
    src, dst = buf[:half], buf[half:]
    src.fill(1)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * half / max(best, 1e-9) / 1e9
