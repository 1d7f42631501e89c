"""The ΣBMT inputs of a loaded model, and how fast this machine moves bytes.

:func:`memory_profile` reads the sizes :mod:`uma_trio.sched.bmt` needs from
llama.cpp's view of the model, so the scheduler's byte estimate follows the
model actually loaded rather than a table.  The bandwidth those bytes are divided
by comes from where the weights live: :func:`probe_bandwidth_gbps` measures host
memory (a CPU engine), :func:`probe_step_bandwidth_gbps` times real one-token
steps (an engine with layers on a GPU, whose bandwidth a host copy says nothing of).
"""

from __future__ import annotations

import time

import numpy as np

from ..sched.bmt import MemoryProfile
from .llama import LlamaEngine, LlamaModel


def memory_profile(model: LlamaModel, n_ubatch: int, kv_type_bytes: float = 2.0) -> MemoryProfile:
    """Weight bytes and KV bytes per cell of ``model``, for micro-batches of ``n_ubatch``.

    ``weight_bytes`` is ``llama_model_size`` (all tensor data, as quantized):
    every micro-batch runs the whole graph, and with tied embeddings even the
    token table is read in full by the output projection.  A cell holds K and
    V for every layer (:meth:`~uma_trio.engine.llama.ModelShape.kv_bytes_per_cell`:
    2.0 bytes an element for f16, 34/32 for q8_0).  Per-layer variations
    (sliding-window layers, varying KV heads) are not modelled: layer 0's head
    counts stand for all layers, an upper bound.
    """
    return MemoryProfile(
        weight_bytes=model.weight_bytes,
        kv_bytes_per_cell=model.shape.kv_bytes_per_cell(kv_type_bytes),
        n_ubatch=n_ubatch,
    )


def probe_step_bandwidth_gbps(engine: LlamaEngine, steps: int = 8) -> float:
    """The bytes a one-token step really moves per second on this engine's device(s).

    On a GPU the guard must divide by the device's bandwidth, not the host's, and a step
    moves the weights once (plus a few KV cells): so this times ``steps`` one-token
    decodes of a scratch sequence at position 0 and divides the weight bytes by the
    median.  It runs before any request, on seq id 0, which it leaves empty.
    """
    from .base import BatchEntry

    token = np.array([0], dtype=np.int32)
    times = []
    try:
        for i in range(steps + 1):
            took = engine.step_sync([BatchEntry(0, token, 0, None)]).decode_s
            engine.free_seq(0)
            if i > 0:  # the first one pays for graph allocation and kernel loading
                times.append(took)
    finally:
        engine.free_seq(0)
    return engine.model.weight_bytes / max(float(np.median(times)), 1e-9) / 1e9


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
