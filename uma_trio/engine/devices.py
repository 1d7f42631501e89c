"""What this llama.cpp build can run on: its backends, devices and their free memory.

llama-cpp-python binds ``llama_*`` but not ggml's device registry, so the few
``ggml_backend_dev_*`` calls needed are bound here with ctypes, through the library
llama_cpp already loaded (``dlsym`` on it also finds the symbols of the ggml libraries it
links).  Nothing here loads a model.

llama.cpp writes its own log through one process-wide callback; :class:`LlamaLog` takes
it over so the lines go to Python's logging (``uma_trio.llama_cpp``, DEBUG) and the
few that report a decision (layers offloaded, flash attention resolved) can be read back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .libllama import llama
from .offload import DeviceMemory

log = logging.getLogger("uma_trio.llama_cpp")

# enum ggml_backend_dev_type
_DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}
OFFLOAD_KINDS = ("GPU", "IGPU")  # the device kinds llama.cpp can put layers on (layer_devices: which)


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    description: str
    kind: str  # CPU, GPU, IGPU, ACCEL
    backend: str  # the ggml backend that drives it: CPU, CUDA, Metal, Vulkan, ROCm...
    free_bytes: int
    total_bytes: int
    splits_rows: bool = False  # its backend has a split buffer type (--split-mode row needs one)

    @property
    def offloads(self) -> bool:
        """Whether it is of a kind llama.cpp can put layers on (GPUs, integrated GPUs);
        :func:`layer_devices` says which of them a model load uses."""
        return self.kind in OFFLOAD_KINDS

    def as_memory(self) -> DeviceMemory:
        return DeviceMemory(self.name, self.description, self.free_bytes, self.total_bytes, self.splits_rows)


def layer_device_indices(kinds: Sequence[str], split_mode: str = "layer", main_gpu: int = 0) -> list[int]:
    """Which of the devices of these kinds hold a model's layers, in llama.cpp's order
    (``llama_prepare_model_devices``): the GPUs, or the integrated GPUs where there is no
    other GPU (but for its de-duplication of one GPU that two backends both report), and of
    those only ``main_gpu`` with ``split_mode`` none; with ``tensor``, every GPU and integrated
    GPU alike (its one device is built from every device whose memory is not the CPU's).
    ``--main-gpu`` and ``--tensor-split`` index them."""
    if split_mode == "tensor":
        return [i for i, kind in enumerate(kinds) if kind in OFFLOAD_KINDS]
    gpus = [i for i, kind in enumerate(kinds) if kind == "GPU"]
    used = gpus or [i for i, kind in enumerate(kinds) if kind == "IGPU"]
    return used[main_gpu : main_gpu + 1] if split_mode == "none" else used


def layer_devices(devs: Sequence[Device], split_mode: str = "layer") -> tuple[Device, ...]:
    """The devices llama.cpp chooses a model's places from with this split mode (all of them
    with ``none`` too: :func:`placed_devices` narrows that to ``--main-gpu``)."""
    mode = "tensor" if split_mode == "tensor" else "layer"
    return tuple(devs[i] for i in layer_device_indices([d.kind for d in devs], mode))


def placed_devices(devs: Sequence[Device], split_mode: str, main_gpu: int) -> tuple[Device, ...]:
    """The devices that hold layers with this placement: :func:`layer_devices`, or only
    ``--main-gpu`` with ``--split-mode none``."""
    return tuple(devs[i] for i in layer_device_indices([d.kind for d in devs], split_mode, main_gpu))


def _ggml() -> Any:
    lib = llama.llama_cpp._lib
    try:
        lib.ggml_backend_dev_count  # noqa: B018 - resolved through libllama's dependencies
        return lib
    except AttributeError:  # pragma: no cover - a platform whose dlsym does not search deps
        suffix = Path(lib._name).suffix
        return ctypes.CDLL(str(Path(lib._name).with_name(f"libggml{suffix}")))


def _bind() -> Any:
    lib = _ggml()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.ggml_backend_dev_count.restype = sz
    lib.ggml_backend_dev_get.argtypes = [sz]
    lib.ggml_backend_dev_get.restype = vp
    for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
        fn.argtypes, fn.restype = [vp], ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [vp], ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_backend_reg.argtypes, lib.ggml_backend_dev_backend_reg.restype = [vp], vp
    lib.ggml_backend_reg_name.argtypes, lib.ggml_backend_reg_name.restype = [vp], ctypes.c_char_p
    lib.ggml_backend_reg_count.restype = sz
    lib.ggml_backend_reg_get.argtypes, lib.ggml_backend_reg_get.restype = [sz], vp
    lib.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = vp
    return lib


def backend_offers(reg: Any, function: str) -> bool:
    """Whether a backend's registry exports ``function`` (``ggml_backend_reg_get_proc_address``).
    llama.cpp's row split asks each GPU's backend for ``ggml_backend_split_buffer_type``
    (``make_gpu_buft_list``) and fails the load where it is missing."""
    lib = _bound()
    return bool(reg) and bool(lib.ggml_backend_reg_get_proc_address(reg, function.encode()))


def backend_registries() -> dict[str, Any]:
    """Each registered backend's registry handle, by name."""
    lib = _bound()
    regs = (lib.ggml_backend_reg_get(i) for i in range(int(lib.ggml_backend_reg_count())))
    return {_reg_name(lib, reg): reg for reg in regs}


def _reg_name(lib: Any, reg: Any) -> str:
    return (lib.ggml_backend_reg_name(reg) or b"?").decode(errors="replace") if reg else "?"


_lib: Any = None
_backend_ready = False


def init_backend() -> None:
    """``llama_backend_init`` once per process, with llama.cpp's log routed to :data:`log`."""
    global _backend_ready
    if not _backend_ready:
        LlamaLog.install()
        llama.llama_backend_init()
        _backend_ready = True


def _bound() -> Any:
    """ggml's device and registry calls, bound once, with llama.cpp's backends initialised."""
    global _lib
    init_backend()
    if _lib is None:
        _lib = _bind()
    return _lib


def devices() -> tuple[Device, ...]:
    """Every device llama.cpp's backends registered, CPU included, with free memory now."""
    lib = _bound()
    found = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        found.append(
            Device(
                name=(lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                kind=_DEVICE_TYPES.get(int(lib.ggml_backend_dev_type(dev)), "?"),
                backend=_reg_name(lib, reg),
                free_bytes=int(free.value),
                total_bytes=int(total.value),
                splits_rows=backend_offers(reg, "ggml_backend_split_buffer_type"),
            )
        )
    return tuple(found)


def backends_built() -> tuple[str, ...]:
    """Every backend this llama.cpp build registered, those that found no device included
    (a Vulkan build on a machine whose only Vulkan device is a CPU: llama.cpp skips it)."""
    return tuple(backend_registries())


def apply_cuda_graphs(enabled: bool) -> None:
    """``--no-cuda-graphs``: llama.cpp's CUDA backend runs every step kernel by kernel, in
    this process.  ggml-cuda reads ``GGML_CUDA_DISABLE_GRAPHS`` once, at the first step of
    any model, so this must run before a model loads.  ``enabled`` changes nothing: the
    variable, where the environment sets it, still turns the graphs off."""
    if not enabled:
        os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"


def captures_cuda_graphs(layers_offloaded: int) -> bool:
    """Whether llama.cpp will capture and replay CUDA graphs for this model's steps: layers on a
    CUDA device, and ggml-cuda's ``GGML_CUDA_DISABLE_GRAPHS`` unset (sched/graph_shapes.py)."""
    if layers_offloaded <= 0 or "GGML_CUDA_DISABLE_GRAPHS" in os.environ:
        return False
    return any(d.backend == "CUDA" and d.offloads for d in devices())


def supports_gpu_offload() -> bool:
    init_backend()
    return bool(llama.llama_supports_gpu_offload())


def system_info() -> str:
    """llama.cpp's one-line build summary (SIMD features, backends)."""
    init_backend()
    return bytes(llama.llama_print_system_info()).decode(errors="replace").strip()


class LlamaLog:
    """llama.cpp's log, forwarded to Python logging and readable while :meth:`capture` runs."""

    _callback: Any = None
    _captures: tuple[list[str], ...] = ()  # every capture open now, outermost first
    _partial = ""

    @classmethod
    def install(cls) -> None:
        if cls._callback is not None:
            return

        @llama.llama_log_callback  # type: ignore[untyped-decorator]
        def forward(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            cls._on_text(level, text.decode(errors="replace"))

        cls._callback = forward  # kept alive: llama.cpp holds a raw pointer to it
        llama.llama_log_set(forward, ctypes.c_void_p(0))

    @classmethod
    def _on_text(cls, level: int, text: str) -> None:
        cls._partial += text
        if not cls._partial.endswith("\n"):
            return
        for line in cls._partial.splitlines():
            for lines in cls._captures:
                lines.append(line)
            if level == 3:  # GGML_LOG_LEVEL_ERROR
                log.warning("%s", line)
            else:
                log.debug("%s", line)
        cls._partial = ""

    @classmethod
    @contextmanager
    def capture(cls) -> Iterator[list[str]]:
        """The lines llama.cpp logs inside the block.  Captures nest (a model load inside a
        test's feeds both) and may overlap across threads: each gets every line logged while
        it is open, its own load's and any other's at the same time."""
        cls.install()
        lines: list[str] = []
        cls._captures = (*cls._captures, lines)
        try:
            yield lines
        finally:  # by identity: captures on other threads may have closed in between
            cls._captures = tuple(c for c in cls._captures if c is not lines)


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_FLASH = re.compile(r"Flash Attention (enabled|not supported)")


def offloaded_layers(lines: list[str]) -> tuple[int, int] | None:
    """``(offloaded, total)`` from llama.cpp's model-load log, if it said."""
    for line in lines:
        if m := _OFFLOADED.search(line):
            return int(m.group(1)), int(m.group(2))
    return None


def flash_attention_resolved(lines: list[str]) -> bool | None:
    """What ``flash_attn auto`` became at context creation, if llama.cpp said."""
    for line in lines:
        if m := _FLASH.search(line):
            return m.group(1) == "enabled"
    return None
