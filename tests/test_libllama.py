"""The engine shares one C++ runtime with everything loaded before it (engine/libllama.py).

On an H100 a CUDA libllama crashed in llama_model_load_from_file when numpy had loaded the
system libstdc++ privately first.  Importing llama_cpp through uma_trio puts that runtime in
the global symbol scope, whatever was imported before: checked here in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, numpy
def global_has(symbol):
    try:
        getattr(ctypes.CDLL(None), symbol)
        return True
    except AttributeError:
        return False
sym = "_ZNSt8ios_base4InitC1Ev"  # std::ios_base::Init::Init(), in every libstdc++
before = global_has(sym)
import uma_trio.engine.libllama
print(before, global_has(sym))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ is Linux's C++ runtime")
def test_the_cxx_runtime_is_global_after_numpy_loaded_it_privately() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    before, after = out.split()
    assert before == "False", "numpy's libstdc++ should start out private (else this test proves nothing)"
    assert after == "True"
