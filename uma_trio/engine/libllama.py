"""``llama_cpp``, imported so that llama.cpp's libraries bind to one C++ runtime.

A CUDA build of llama.cpp can carry parts of the C++ runtime inside ``libggml-cuda.so``
(statically linked, and exported).  Which copy a C++ symbol of ``libllama`` binds to then
depends on what the process loaded before: after ``import numpy`` (whose extension loads
the system ``libstdc++`` privately) ``llama_model_load_from_file`` crashed on an H100 inside
an ``std::ostream`` insert resolved from ``libggml-cuda``'s copy while the stream's locale
came from the system's (BENCHMARKS.md "GPU": backtrace from benches/gpu/diagnose_load.sh).
Putting the system ``libstdc++`` in the process's global symbol scope before libllama loads
(``dlopen`` with ``RTLD_GLOBAL``; an already loaded copy is promoted) makes every library
bind to that one runtime, whatever was imported first: the load no longer depends on
import order.  Every uma_trio module imports llama_cpp through here.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys


def share_cxx_runtime() -> None:
    """Put the system C++ runtime in the global symbol scope (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return  # macOS links one libc++; Windows resolves per module
    # No libstdc++ on this system: then nothing can bind to two copies of it.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)


share_cxx_runtime()

import llama_cpp as llama  # noqa: E402  (after the runtime is shared)

__all__ = ["llama", "share_cxx_runtime"]
