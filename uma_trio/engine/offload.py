"""How many layers go to the GPU: ``--gpu-layers auto|all|N``, decided without llama_cpp.

Pure: the caller hands in what llama.cpp and the devices report (:class:`DeviceMemory`,
the model's layer count and byte sizes), so the ``auto`` decision is tested with made-up
devices.  llama.cpp keeps a layer's KV cells on the device that holds the layer, so a
layer costs its share of the weights plus its share of the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ConfigError, GpuLayersMode, SplitMode

# Room left on the device for llama.cpp's compute buffers, the CUDA context and other apps:
# a share of the free memory, and at least this many bytes.
RESERVE_SHARE = 0.05
RESERVE_MIN_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One accelerator llama.cpp can offload to."""

    name: str  # llama.cpp's device name (CUDA0, Metal, Vulkan0, ...)
    description: str  # e.g. "NVIDIA H100 80GB HBM3"
    free_bytes: int
    total_bytes: int
    # Whether its backend can split a matrix's rows across GPUs (a split buffer type):
    # --split-mode row needs it.  The pinned llama.cpp's CUDA backend has none.
    splits_rows: bool = False


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """What llama.cpp is asked for, and why (the start-up log says it)."""

    n_gpu_layers: int  # passed to llama_model_params.n_gpu_layers: the layers that land on a GPU
    total: int  # n_layer + 1: the repeating layers and the output layer
    reason: str


def plan_offload(
    requested: GpuLayersMode | int,
    *,
    supports_offload: bool,
    devices: tuple[DeviceMemory, ...],
    n_layer: int,
    weight_bytes: int,
    kv_bytes: int,
    gpu_backends: tuple[str, ...] = (),
    split_mode: SplitMode = "layer",
    main_gpu: int = 0,
    tensor_split: tuple[float, ...] | None = None,
) -> OffloadPlan:
    """Layers to offload for ``requested``; ``kv_bytes`` is the whole KV cache the daemon
    will allocate (``n_ctx × max_sessions`` cells); ``gpu_backends``: the build's backends
    other than the CPU's, whether or not they found a device.  ``split_mode``, ``main_gpu``
    and ``tensor_split`` say which GPUs take the layers, as llama.cpp will place them; a
    ``main_gpu`` or a ``tensor_split`` the devices cannot have is a :class:`ConfigError`."""
    total = n_layer + 1
    if not supports_offload or not devices:
        if supports_offload:
            why = "no GPU device found"
        elif gpu_backends and not devices:
            # llama.cpp reports no offload when a GPU backend is built in but found no device.
            why = f"the {'/'.join(gpu_backends)} backend found no GPU device"
        else:
            why = "this llama.cpp build has no GPU backend"
        if requested == 0:
            why = "--gpu-layers 0"
        return OffloadPlan(0, total, f"CPU only: {why}")
    check_placement(devices, split_mode, main_gpu, tensor_split)  # llama.cpp checks even at 0 layers
    if requested == "all":
        return OffloadPlan(total, total, "--gpu-layers all")
    if isinstance(requested, int):
        n = min(requested, total)
        return OffloadPlan(n, total, f"--gpu-layers {requested}")
    used, usable = placement_capacity(devices, split_mode, main_gpu, tensor_split)
    free = sum(d.free_bytes for d in used)
    needed = weight_bytes + kv_bytes
    gib = 1024**3
    if needed <= usable:
        return OffloadPlan(
            total, total,
            f"auto: weights {weight_bytes / gib:.2f} GiB + KV {kv_bytes / gib:.2f} GiB fit in "
            f"{free / gib:.2f} GiB free on {', '.join(d.name for d in used)}",
        )  # fmt: skip
    per_layer = needed / total
    n = max(0, min(total, int(usable // per_layer))) if usable > 0 else 0
    return OffloadPlan(
        n, total,
        f"auto: weights {weight_bytes / gib:.2f} GiB + KV {kv_bytes / gib:.2f} GiB exceed the "
        f"{max(usable, 0) / gib:.2f} GiB usable of {free / gib:.2f} GiB free; offloading the "
        f"{n} of {total} layers that fit (lower --n-ctx or --max-sessions to fit more)",
    )  # fmt: skip


def check_placement(
    devices: tuple[DeviceMemory, ...], split_mode: SplitMode, main_gpu: int, shares: tuple[float, ...] | None
) -> None:
    """Refuse what llama.cpp would fail on (or silently ignore) at load: a ``--main-gpu`` past
    the devices, a ``--tensor-split`` with shares for GPUs that do not exist, row split on a
    backend without split buffers (llama.cpp fails the load on any GPU it would use)."""
    names = f"{len(devices)} GPU(s): {', '.join(d.name for d in devices)}"
    if main_gpu >= len(devices):
        raise ConfigError(f"--main-gpu {main_gpu}: this machine has {names} (0 to {len(devices) - 1})")
    if split_mode == "row" and (cannot := [d.name for d in devices if not d.splits_rows]):
        raise ConfigError(
            f"--split-mode row: the backend of {', '.join(cannot)} cannot split a matrix's rows across "
            "GPUs in this llama.cpp build; --split-mode tensor splits each layer across the GPUs "
            "(tensor parallelism), --split-mode layer gives each GPU whole layers"
        )
    if shares is not None and split_mode != "none" and len(shares) > len(devices):
        raise ConfigError(f"--tensor-split {shares_csv(shares)}: {len(shares)} shares for {names}")


def default_shares(devices: tuple[DeviceMemory, ...], split_mode: SplitMode) -> tuple[float, ...]:
    """llama.cpp's split without ``--tensor-split``: by free memory (layer, row), evenly
    (tensor; its small tensors, norms and a tied output matrix, are copied whole to every GPU,
    which the reserve covers)."""
    if split_mode == "tensor":
        return tuple(1.0 for _ in devices)
    return tuple(float(d.free_bytes) for d in devices)


def share_text(split_mode: str, shares: Sequence[float] | None) -> str:
    """How a split shares the model out, in words: the ``--tensor-split`` given, else the default."""
    if shares:
        return f"shares {shares_csv(shares)}"
    return "evenly" if split_mode == "tensor" else "by free memory"


def shares_csv(shares: Sequence[float]) -> str:
    """Shares as ``--tensor-split`` takes them: ``3,1``."""
    return ",".join(f"{s:g}" for s in shares)


def _usable(free: int) -> int:
    return free - max(int(free * RESERVE_SHARE), RESERVE_MIN_BYTES)


def placement_capacity(
    devices: tuple[DeviceMemory, ...],
    split_mode: SplitMode,
    main_gpu: int,
    tensor_split: tuple[float, ...] | None,
) -> tuple[tuple[DeviceMemory, ...], float]:
    """The GPUs that take layers and how many bytes of the model (weights and KV together,
    spread as llama.cpp spreads them) they hold, each keeping its own reserve.

    ``none``: only ``main_gpu``.  Otherwise each GPU takes its share of the model (the
    ``tensor_split`` given, else llama.cpp's default: its free memory, or equal shares with
    ``tensor``, whose split of each matrix ignores free memory), so the model fits while the
    GPU with the least room for its share does."""
    if split_mode == "none":
        return (devices[main_gpu],), float(_usable(devices[main_gpu].free_bytes))
    given = tensor_split or default_shares(devices, split_mode)
    shares = [given[i] if i < len(given) else 0.0 for i in range(len(devices))]
    pairs = [(d, share) for d, share in zip(devices, shares, strict=True) if share > 0]
    if not pairs:  # no GPU with free memory
        return (), 0.0
    whole = sum(shares)
    return tuple(d for d, _ in pairs), min(_usable(d.free_bytes) * whole / share for d, share in pairs)
