#!/usr/bin/env bash
# Why does loading a model through llama_cpp segfault on the CUDA build (BENCHMARKS.md "GPU")?
# Loads one small random-weight model in a fresh python per variant and records how it ends,
# plus a native backtrace and which libstdc++ each side maps.  Needs run.sh's build in $W.
set -u
W=${W:-/tmp/w}; L=$W/logs; PY=${PY:-python3}; B=$W/build; SRC=$W/lcp/vendor/llama.cpp
. "$W/env.sh"; export LLAMA_CPP_LIB_PATH=$B/bin PYTHONPATH=/tmp/site:$(pwd):$W/lcp
M=$W/tiny-f16.gguf
[ -f "$M" ] || PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
    --out "$M" --layers 2 --embd 256 --heads 4 --kv-heads 2 --ffn 512 > "$L/tiny.log" 2>&1
load='import llama_cpp as l; l.llama_backend_init(); p=l.llama_model_default_params(); p.n_gpu_layers=999; m=l.llama_model_load_from_file(sys.argv[1].encode(), p); print("LOADED", bool(m))'
v() {  # name, python prefix statements, [env]
  local name=$1 pre=$2; shift 2
  env "$@" timeout 120 $PY -c "import sys; $pre; $load" "$M" > "$L/diag_$name.log" 2>&1; local rc=$?
  echo "diag $name: rc=$rc $(grep -c LOADED "$L/diag_$name.log") $(tail -1 "$L/diag_$name.log" | cut -c1-100)"
}
STDCXX=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/{print $NF; exit}')
v llama_only "pass"
v numpy_first "import numpy"
v numpy_after "import llama_cpp, numpy"
v trio_first "import trio"
v ssl_first "import ssl"
v ctypes_first "import ctypes"
v numpy_preload_stdcxx "import numpy" LD_PRELOAD="$STDCXX"
v numpy_lc_all_c "import numpy" LC_ALL=C
v uma_daemon "import uma_trio.daemon"
v numpy_then_uma_libllama "import numpy; import uma_trio.engine.libllama"
v numpy_then_uma_llama_engine "import numpy; import uma_trio.engine.llama"
v numpy_global "import ctypes; ctypes.CDLL('$STDCXX', ctypes.RTLD_GLOBAL); import numpy"
echo "python: $($PY -c 'import sys; print(sys.executable, sys.prefix, sys.version)')"
echo "sitecustomize: $($PY -c 'import sitecustomize; print(sitecustomize.__file__)' 2>&1)"
echo "libstdc++ mapped with numpy + llama_cpp: $($PY -c 'import numpy, llama_cpp; print(sorted({l.split()[-1] for l in open("/proc/self/maps") if "stdc++" in l or "libgcc" in l or "libgomp" in l}))')"
echo "ldd libllama: $(ldd $B/bin/libllama.so | grep -E 'stdc|gomp|gcc' | tr -s ' ' | tr '\n' ';')"
echo "ldd libggml-cuda: $(ldd $B/bin/libggml-cuda.so | grep -E 'stdc|gomp|gcc|cudart|cublas' | tr -s ' ' | tr '\n' ';')"
echo "numpy ext: $(ldd $($PY -c 'import numpy._core._multiarray_umath as m; print(m.__file__)') | grep -E 'stdc|gomp|gcc|openblas' | tr -s ' ' | tr '\n' ';')"
echo "env LD: ${LD_LIBRARY_PATH:-} | PRELOAD ${LD_PRELOAD:-}"
timeout 240 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args $PY -c "import sys; import numpy; $load" "$M" > "$L/diag_bt.log" 2>&1
echo "backtrace:"; grep -E '^#[0-9]+' "$L/diag_bt.log" | head -25 | cut -c1-220
echo "shared libs with stdc++/gcc:"; grep -E 'stdc\+\+|libgcc|gomp' "$L/diag_bt.log" | head
