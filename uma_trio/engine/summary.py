"""What the engine runs on and with which settings, as plain JSON-ready data.

One shape for every place that shows it: the start-up log line, ``uma-trio info`` (before
any daemon runs: the plan), ``/health``, the socket ``metrics`` event and Prometheus
(``uma_engine_info``).  docs/METRICS.md lists the fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .devices import Device, layer_device_indices, placed_devices
from .offload import share_text

MIB = 1024 * 1024


def kv_location(offloaded: int, total: int, gpus: Sequence[Device]) -> str:
    """Where llama.cpp keeps the KV cells: with each layer, on the layer's device."""
    names = ", ".join(d.name for d in gpus) or "GPU"
    if offloaded <= 0 or not gpus:
        return "CPU"
    if offloaded >= total - 1:  # every repeating layer (the output layer holds no KV)
        return names
    return f"{names} ({offloaded - 1 if offloaded == total else offloaded} layers) + CPU"


def engine_summary(
    *,
    system_info: str,
    devices: Sequence[Device],
    layers: tuple[int, int],
    reason: str,
    kv_type: str,
    kv_bytes: int,
    kv_cells: int,
    flash_attn: str,
    settings: dict[str, Any],
    model: dict[str, Any],
    step_overhead: dict[str, Any] | None = None,
) -> dict[str, Any]:
    gpus = list(placed_devices(devices, settings.get("split_mode", "layer"), settings.get("main_gpu", 0)))
    offloaded, total = layers
    return {
        "backends": sorted({d.backend for d in devices}),
        "devices": [
            {
                "name": d.name,
                "description": d.description,
                "kind": d.kind,
                "backend": d.backend,
                "free_mib": d.free_bytes // MIB,
                "total_mib": d.total_bytes // MIB,
            }
            for d in devices
        ],
        "gpu_layers": {"offloaded": offloaded, "total": total, "reason": reason},
        "kv": {
            "location": kv_location(offloaded, total, gpus),
            "type": kv_type,
            "bytes": kv_bytes,
            "cells": kv_cells,
        },
        "flash_attn": flash_attn,
        "settings": settings,
        "model": model,
        "system_info": system_info,
        "step_overhead": step_overhead,  # engine/step_gaps.py; None before the engine runs
    }


def _gpu_entries(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary's devices that take layers (as :func:`~uma_trio.engine.devices.placed_devices`)."""
    entries, settings = summary["devices"], summary.get("settings") or {}
    kinds = [d["kind"] for d in entries]
    split_mode, main_gpu = settings.get("split_mode", "layer"), int(settings.get("main_gpu", 0))
    return [entries[i] for i in layer_device_indices(kinds, split_mode, main_gpu)]


def deterministic_caveat(summary: dict[str, Any]) -> str | None:
    """What ``--deterministic`` does not promise where layers are on a GPU: its exactness is
    the CPU backend's (llama.cpp's GPU kernels round by batch shape; on Vulkan the exactness
    tests fail), so the daemon and ``uma-trio info`` say so rather than let it be assumed."""
    layers = summary["gpu_layers"]
    if not summary["settings"]["deterministic"] or layers["offloaded"] <= 0:
        return None
    gpus = ", ".join(d["name"] for d in _gpu_entries(summary)) or "a GPU"
    return (
        f"--deterministic: exact greedy output is guaranteed on the CPU backend only; with "
        f"{layers['offloaded']} of {layers['total']} layers on {gpus} the output may still change "
        f'with batching (--gpu-layers 0 for the guarantee; CONFIG.md "Two modes")'
    )


def split_description(summary: dict[str, Any]) -> str | None:
    """How the model spreads over several GPUs (``--split-mode``, ``--tensor-split``), or None
    where fewer than two hold layers."""
    gpus = [d["name"] for d in _gpu_entries(summary)]
    if summary["gpu_layers"]["offloaded"] <= 0 or len(gpus) < 2:
        return None
    settings = summary["settings"]
    mode, shares = settings.get("split_mode", "layer"), settings.get("tensor_split")
    what = {
        "tensor": "each layer's matrices and KV cut across",
        "row": "each matrix's rows cut across",
    }.get(mode, "whole layers spread over")
    return f"{mode}: {what} {', '.join(gpus)}, {share_text(mode, shares)}"


def one_line(summary: dict[str, Any]) -> str:
    """The start-up log line."""
    layers, kv, s = summary["gpu_layers"], summary["kv"], summary["settings"]
    gpus = _gpu_entries(summary)
    where = ", ".join(f"{d['name']} ({d['description']})" for d in gpus) or "CPU"
    return (
        f"engine: {'/'.join(summary['backends'])} on {where}; layers on GPU {layers['offloaded']}/"
        f"{layers['total']} ({layers['reason']}); KV {kv['type']} {kv['bytes'] / MIB:.0f} MiB on "
        f"{kv['location']}; flash attention {summary['flash_attn']}; n_ubatch {s['n_ubatch']}, n_batch "
        f"{s['n_batch']}, {s['n_seq_max']} sessions x {s['n_ctx_seq']} cells, "
        f"{'deterministic' if s['deterministic'] else 'fast'} mode; "
        + (f"split {split}; " if (split := split_description(summary)) else "")
        + str(summary["system_info"])
    )
