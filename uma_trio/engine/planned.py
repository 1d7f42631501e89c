"""Where the model will go, decided before it loads: ``--gpu-layers`` against this machine's
devices (:func:`offload_plan`, used by ``serve``), and ``uma-trio info``'s engine summary,
made without starting anything.

The model's metadata is read (a vocab-only load, no weights), the devices are asked for
their free memory, and ``--gpu-layers`` is decided exactly as ``serve`` decides it.  Flash
attention ``auto`` is resolved by llama.cpp only when a context is created, so the plan says
``auto``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil

from ..config import ServerConfig, SplitMode, parse_gpu_layers
from .devices import (
    apply_cuda_graphs,
    backends_built,
    captures_cuda_graphs,
    devices,
    layer_devices,
    supports_gpu_offload,
    system_info,
)
from .llama import KV_TYPES, ModelShape, Placement, read_shape
from .offload import OffloadPlan, plan_offload
from .summary import engine_summary


def offload_plan(shape: ModelShape, config: ServerConfig) -> OffloadPlan:
    """``--gpu-layers`` against this machine's devices and the model's size
    (:func:`~uma_trio.engine.llama.read_shape`: no weights read)."""
    return plan_offload(
        parse_gpu_layers(config.gpu_layers),
        supports_offload=supports_gpu_offload(),
        devices=tuple(d.as_memory() for d in layer_devices(devices(), config.split_mode)),
        n_layer=shape.n_layer,
        weight_bytes=shape.file_bytes,
        kv_bytes=kv_cache_bytes(shape, config),
        gpu_backends=tuple(b for b in backends_built() if b != "CPU"),
        split_mode=config.split_mode,
        main_gpu=config.main_gpu,
        tensor_split=config.tensor_split,
    )


def kv_cache_bytes(shape: ModelShape, config: ServerConfig) -> int:
    """The KV cache's bytes: ``--n-ctx`` × ``--max-sessions`` cells of ``--kv-type``."""
    return config.n_ctx * config.max_sessions * shape.kv_bytes_per_cell(KV_TYPES[config.engine_kv_type][1])


def memory_footprint(shape: ModelShape, config: ServerConfig) -> int:
    """Bytes a model takes once loaded with ``config``: its weights (the file) and its KV
    cache, on whichever devices hold them."""
    return shape.file_bytes + kv_cache_bytes(shape, config)


def host_bytes(shape: ModelShape, config: ServerConfig, plan: OffloadPlan) -> tuple[int, int]:
    """The weights' and the KV cache's bytes in host memory: the share of the layers that
    stay on the CPU (llama.cpp keeps a layer's KV cells with the layer)."""
    kv = kv_cache_bytes(shape, config)
    on_host = 1.0 - min(plan.n_gpu_layers, plan.total) / max(plan.total, 1)
    return round(shape.file_bytes * on_host), round(kv * on_host)


_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_memory_bytes() -> int:
    """The memory this process may use: the machine's, or its container's limit where that is
    lower (cgroup v2, else v1), which is where the kernel's OOM killer acts."""
    total = int(psutil.virtual_memory().total)
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))
    return total


def host_memory_problem(shape: ModelShape, config: ServerConfig, plan: OffloadPlan, total: int) -> str | None:
    """Why the model cannot run in ``total`` bytes of host memory; None when it fits.

    llama.cpp allocates the KV cache whole at start-up and the kernel OOM-kills the process
    once it is touched (``--n-ctx 99999999999`` grew to the machine's 23 GB and died, exit
    137), so a cache bigger than the machine is refused with the numbers before it loads."""
    weights, kv = host_bytes(shape, config, plan)
    if weights + kv <= total:
        return None
    gib = 1 << 30
    smaller = ", or use --kv-type q8_0" if config.engine_kv_type == "f16" else ""
    return (
        f"--n-ctx {config.n_ctx} × --max-sessions {config.max_sessions} cells need a "
        f"{kv / gib:.1f} GiB {config.engine_kv_type} KV cache in host memory (with "
        f"{weights / gib:.1f} GiB of weights) and this machine (or its container) has {total / gib:.1f} GiB: "
        f"lower --n-ctx or --max-sessions{smaller}"
    )


def placement_for(plan: OffloadPlan, config: ServerConfig) -> Placement:
    # llama.cpp's tensor split builds one device out of the GPUs and fails the load where
    # there is none; with no layer on a GPU there is nothing to split, so ask for layers.
    split_mode: SplitMode = (
        "layer" if config.split_mode == "tensor" and plan.n_gpu_layers == 0 else config.split_mode
    )
    return Placement(
        n_gpu_layers=plan.n_gpu_layers, main_gpu=config.main_gpu, split_mode=split_mode,
        tensor_split=config.tensor_split, reason=plan.reason, mmap=config.mmap,
    )  # fmt: skip


def planned_summary(model_path: Path, config: ServerConfig) -> dict[str, Any]:
    shape = read_shape(model_path)
    plan = offload_plan(shape, config)
    apply_cuda_graphs(config.cuda_graphs)  # as serve would, so the summary says what it would run
    cells = config.n_ctx * config.max_sessions
    flash = config.engine_flash_attn
    summary = engine_summary(
        system_info=system_info(), devices=devices(),
        layers=(plan.n_gpu_layers, plan.total), reason=plan.reason,
        kv_type=config.engine_kv_type,
        kv_bytes=kv_cache_bytes(shape, config), kv_cells=cells,
        flash_attn="auto (resolved when the context is created)" if flash == "auto" else flash,
        settings={
            "n_ctx_seq": config.n_ctx, "n_seq_max": config.max_sessions, "n_batch": config.n_batch,
            "n_ubatch": config.engine_n_ubatch, "threads": config.threads or os.cpu_count() or 1,
            "kv_unified": config.engine_kv_unified(0 < plan.n_gpu_layers == plan.total),
            "gpu_sampling": config.gpu_sampling, "cuda_graphs": captures_cuda_graphs(plan.n_gpu_layers),
            "deterministic": config.deterministic,
            "main_gpu": config.main_gpu, "split_mode": config.split_mode,
            "tensor_split": list(config.tensor_split) if config.tensor_split else None,
        },
        model={"file": model_path.name, "description": "", "weight_bytes": shape.file_bytes,
               "n_layer": shape.n_layer},
    )  # fmt: skip
    # What serve would refuse at start-up (exit 2), said here before anything loads.
    summary["host_memory_problem"] = host_memory_problem(shape, config, plan, host_memory_bytes())
    return summary
