#!/usr/bin/env bash
# The whole GPU comparison on a machine with CUDA and no internet (docs/BENCHMARKS.md "GPU").
# Needs, in $PAYLOAD (default .gpu): lcp-src.tar.gz (benches/gpu/strip_sdist.sh: the pinned llama-cpp-python,
# stripped; copy it from benches/gpu/payload/) and whl/ (benches/gpu/wheels.sh).  Runs in the background (setsid)
# from the repository root; benches/gpu/poll.sh follows it.  Stages: build llama.cpp with CUDA
# (llama-server, llama-batched-bench, llama-quantize, libllama) while a random-weight
# Llama-3-8B-shaped GGUF is generated and quantized (Q4_K_M); then the import-order probe, the
# GPU tests, `uma-trio info`, and benches/gpu_compare.py.
set -u
REPO=$(pwd)
PAYLOAD=${PAYLOAD:-$REPO/.gpu}
W=${W:-/tmp/w}
JOBS=${JOBS:-16}
PY=${PY:-python3}
PARTS=${PARTS:-ceiling,streams,mixed,long}
mkdir -p "$W/logs" "$W/results"
L=$W/logs
log() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$L/driver.log"; }
stage() { echo "$1" > "$W/STAGE"; log "== $1"; }

stage unpack
{ nvidia-smi 2>&1 | head -15; nproc; $PY --version; nvcc --version | tail -1; } > "$L/env.txt" 2>&1
[ -d "$W/lcp" ] || tar xzf "$PAYLOAD/lcp-src.tar.gz" -C "$W" || { log "untar failed"; echo FAIL > "$W/DONE"; exit 1; }
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$PAYLOAD"/whl/*.whl > "$L/pip.log" 2>&1 || log "wheel install failed"
export PYTHONPATH=/tmp/site:$REPO:$W/lcp
SRC=$W/lcp/vendor/llama.cpp
B=$W/build
MODEL=$W/model-q4km.gguf
if [ -n "${BUILD_TAR:-}" ] && [ ! -f "$W/build.ok" ]; then  # a build packed by DIAG_ONLY on an earlier machine
  stage unpack-build
  mkdir -p "$B/bin" && cat $BUILD_TAR | xz -d | tar xf - -C "$B/bin" && touch "$W/build.ok"
  CUBLAS=$(find /usr /opt -name 'libcublas.so*' 2>/dev/null | grep -v stubs | head -1)
  echo "export LD_LIBRARY_PATH=$B/bin:$(dirname "$CUBLAS"):\${LD_LIBRARY_PATH:-}" > "$W/env.sh"
  ( PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
      --out "$W/model-f16.gguf" --ctx 32768 > "$L/gen.log" 2>&1 && touch "$W/gen.ok" ) || { log "GEN FAILED"; echo FAIL > "$W/DONE"; exit 1; }
fi
if [ ! -f "$W/build.ok" ]; then
  stage build
  CUBLAS=$(find /usr /opt -name 'libcublas.so*' 2>/dev/null | grep -v stubs | head -1)
  CUBLAS_H=$(find "$(dirname "$(dirname "$CUBLAS")")" /usr /opt -name cublas_v2.h 2>/dev/null | head -1)
  LIBCUDA=$( (ldconfig -p | awk '/libcuda\.so\.1 /{print $NF}'; find /usr/local/nvidia -name 'libcuda.so.1' 2>/dev/null) | head -1)
  mkdir -p "$W/inc"; ln -sf "$(dirname "$CUBLAS_H")"/cublas*.h "$W/inc/"
  echo "export LD_LIBRARY_PATH=$B/bin:$(dirname "$CUBLAS"):\${LD_LIBRARY_PATH:-}" > "$W/env.sh"
  ( cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA_NCCL=OFF -DCUDA_cublas_LIBRARY="$CUBLAS" \
      -DCUDA_cublasLt_LIBRARY="$(ls "$(dirname "$CUBLAS")"/libcublasLt.so* | head -1)" -DCUDA_cuda_driver_LIBRARY="$LIBCUDA" \
      -DCMAKE_CUDA_FLAGS="-I$W/inc" -DCMAKE_CXX_FLAGS="-I$W/inc" > "$L/cmake.log" 2>&1 \
    && cmake --build "$B" -j"$JOBS" --target llama-server llama-batched-bench llama-quantize > "$L/build.log" 2>&1 \
    && touch "$W/build.ok" || touch "$W/build.fail" ) &
  BUILD=$!
  ( PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
      --out "$W/model-f16.gguf" --ctx 32768 > "$L/gen.log" 2>&1 && touch "$W/gen.ok" ) &
  GEN=$!
  wait $BUILD; [ -f "$W/build.ok" ] || { log "BUILD FAILED"; tail -30 "$L/cmake.log" "$L/build.log" >> "$L/driver.log"; echo FAIL > "$W/DONE"; exit 1; }
  wait $GEN; [ -f "$W/gen.ok" ] || { log "GEN FAILED"; tail -20 "$L/gen.log" >> "$L/driver.log"; echo FAIL > "$W/DONE"; exit 1; }
fi
. "$W/env.sh"
export LLAMA_CPP_LIB_PATH=$B/bin
if [ -n "${DIAG_ONLY:-}" ]; then
  stage diagnose
  bash benches/gpu/diagnose_load.sh 2>&1 | tee -a "$L/driver.log"
  # The build, stripped and packed, so a later machine can skip it (BUILD_TAR).
  ( cd "$B/bin" && strip --strip-unneeded *.so* llama-server llama-batched-bench llama-quantize 2>/dev/null;
    tar cf - *.so* llama-server llama-batched-bench llama-quantize | xz -T16 -6 > "$W/bin.tar.xz" )
  log "bin.tar.xz $(du -h "$W/bin.tar.xz" | cut -f1)"
  stage done; echo OK > "$W/DONE"; exit 0
fi
if [ -n "${TESTS_ONLY:-}" ]; then  # the GPU tests on the 2-layer model alone: no 8B model, no comparison
  stage gpu-tests
  TINY=$W/tiny-f16.gguf
  [ -f "$TINY" ] || PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
      --out "$TINY" --layers 2 --embd 256 --heads 4 --kv-heads 2 --ffn 512 --ctx 4096 > "$L/gen-tiny.log" 2>&1
  nvidia-smi -L 2>&1 | tee -a "$L/driver.log"
  UMA_GPU_TEST_MODEL=$TINY timeout 300 $PY -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_libllama.py 2>&1 \
    | grep -E 'model buffers on|steps had|cosine|passed|failed|Error' | tee -a "$L/driver.log"
  stage done; echo OK > "$W/DONE"; exit 0
fi
if [ ! -f "$MODEL" ]; then
  stage quantize
  "$B/bin/llama-quantize" "$W/model-f16.gguf" "$MODEL" Q4_K_M "$(nproc)" > "$L/quantize.log" 2>&1 || { log "QUANTIZE FAILED"; echo FAIL > "$W/DONE"; exit 1; }
  rm -f "$W/model-f16.gguf"
fi
log "model $(ls -la "$MODEL")"
if [ -n "${PREP_ONLY:-}" ]; then stage prepared; echo OK > "$W/DONE"; exit 0; fi

if [ -z "${SKIP_DIAG:-}" ]; then
stage diagnose
bash benches/gpu/diagnose_load.sh 2>&1 | grep -E "^diag|^#[0-4] " | tee -a "$L/driver.log"
stage import-order
# Does importing numpy before llama_cpp still break the CUDA libllama?  Each variant loads the model.
probe='import sys, numpy, llama_cpp as l; l.llama_backend_init(); p=l.llama_model_default_params(); p.n_gpu_layers=999; m=l.llama_model_load_from_file(sys.argv[1].encode(), p); print("loaded", bool(m))'
for v in "plain" "OPENBLAS_NUM_THREADS=1" "OMP_NUM_THREADS=1"; do
  if [ "$v" = plain ]; then timeout 120 $PY -c "$probe" "$MODEL" > "$L/probe_$v.log" 2>&1; rc=$?
  else env "$v" timeout 120 $PY -c "$probe" "$MODEL" > "$L/probe_${v%%=*}.log" 2>&1; rc=$?; fi
  log "numpy first, $v: rc=$rc $(tail -1 "$L/probe_${v%%=*}.log" 2>/dev/null | cut -c1-120)"
done
# A native backtrace of the crash (cuda-gdb debugs host code too; the image has no gdb).
timeout 300 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args $PY -c "$probe" "$MODEL" > "$L/probe_bt.log" 2>&1
log "backtrace: $(grep -m8 -E '^#[0-9]' "$L/probe_bt.log" | cut -c1-160 | tr '\n' '|')"
timeout 120 $PY -X importtime -c "import uma_trio.daemon" 2> "$L/importtime.log"; log "daemon imports numpy before llama_cpp: $(grep -n -m1 -E '\| (numpy|llama_cpp)$' "$L/importtime.log" | cut -c1-80)"
fi

stage info
timeout 120 $PY -m uma_trio info --model "$MODEL" --max-sessions 16 --n-ctx 512 2>&1 | tee -a "$L/driver.log"

if [ -n "${PLACEMENT:-}" ]; then  # several GPUs: where --split-mode, --main-gpu and --tensor-split put the model
  stage placement
  nvidia-smi -L 2>&1 | tee -a "$L/driver.log"
  for args in "--split-mode none --main-gpu 1" "--tensor-split 1,3" "--split-mode tensor" "--split-mode row" \
      "--main-gpu 2" "--tensor-split 1,1,1"; do
    log "info $args:"
    timeout 120 $PY -m uma_trio info --model "$MODEL" --max-sessions 16 --n-ctx 512 $args 2>&1 \
      | grep -E '^(GPU layers|error)' | tee -a "$L/driver.log"
  done
fi

stage gpu-tests
# The tests' model: a 2-layer F16 random-weight Llama (tests/test_gpu.py says why not the 8B one).
TINY=$W/tiny-f16.gguf
[ -f "$TINY" ] || PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
    --out "$TINY" --layers 2 --embd 256 --heads 4 --kv-heads 2 --ffn 512 --ctx 4096 > "$L/gen-tiny.log" 2>&1
UMA_GPU_TEST_MODEL=$TINY timeout 300 $PY -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_libllama.py 2>&1 | tail -22 | tee -a "$L/driver.log"
log "the same tests on the 8B-shaped random model (for the record; its logits are chaotic):"
UMA_GPU_TEST_MODEL=$MODEL timeout 300 $PY -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | grep -E "passed|failed|rel |assert \(" | tail -6 | tee -a "$L/driver.log"

if [ -n "${PROBE:-}" ]; then  # the engine alone, greedy rows on the host and on the device (--gpu-sampling)
  stage probe
  timeout 400 $PY benches/gpu/step_probe.py "$MODEL" "$W/results/step_probe.jsonl" --streams 1,4,8,16 2>&1 | grep '^{' | tee -a "$L/driver.log"
fi

stage compare
timeout 1500 $PY benches/gpu_compare.py --bin "$B/bin" --model "$MODEL" --out "$W/results" --parts "$PARTS" ${COMPARE_ARGS:-} 2>&1 | tee -a "$L/driver.log" | tail -5
if [ -n "${VARIANT:-}" ]; then  # uma-trio again with other flags (and VARIANT_ENV), e.g. VARIANT=--no-run-ahead (A/B)
  stage compare-variant
  env ${VARIANT_ENV:-} timeout 600 $PY benches/gpu_compare.py --bin "$B/bin" --model "$MODEL" --out "$W/results/variant" --systems uma-trio \
      --parts "${VARIANT_PARTS:-streams}" --reps 1 --uma-arg="$VARIANT" 2>&1 | tee -a "$L/driver.log" | tail -8
fi
stage done
echo OK > "$W/DONE"
