#!/usr/bin/env bash
# uma-trio on a real GPU through llama.cpp's Vulkan backend, on a lent NVIDIA machine that has no
# Vulkan toolchain and no internet (docs/BENCHMARKS.md "Vulkan on a real GPU").  The pinned
# llama.cpp is built with Vulkan elsewhere and carried in, libraries and tools together, so that
# uma-trio (llama-cpp-python pointed at the build's libllama) and llama-server are the same build:
#
#   cmake -S <pinned llama.cpp> -B B -DGGML_VULKAN=ON -DBUILD_SHARED_LIBS=ON ... &&
#   cmake --build B --target llama-server llama-batched-bench llama-quantize
#   mkdir -p pack/bin && cp B/bin/* /usr/lib/x86_64-linux-gnu/libvulkan.so.1 pack/bin/ &&
#   tar cJf .vk/vk-bin.tar.xz -C pack bin
#
# Then, from the repository root with .gpu (benches/gpu/run.sh's payload) and .vk present, in the
# background like run.sh (benches/gpu/poll.sh follows $W/logs/driver.log):
#   setsid nohup bash benches/gpu/vulkan_nvidia.sh > /tmp/vk.out 2>&1 < /dev/null &
# It lists the machine's Vulkan drivers (an NVIDIA container has one only where its driver
# capabilities include graphics), points the Vulkan loader at the NVIDIA driver's EGL library
# alone (VK_ICD_FILENAMES, an ICD file it writes), and runs `uma-trio info`, the GPU tests
# (tests/test_gpu.py, a 2-layer F16 random-weight model) and a served smoke run on it.  With
# COMPARE=1 it then generates the 8B-shaped Q4_K_M model and runs benches/gpu_compare.py against
# the build's llama-server (PARTS, default ceiling,streams,mixed; REPS, default 1).
set -u
REPO=$(pwd)
W=${W:-/tmp/w}
PY=${PY:-python3}
L=$W/logs
mkdir -p "$L" "$W/results"
rm -f "$W/DONE"
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$L/driver.log"; }
stage() { echo "$1" > "$W/STAGE"; say "== $1"; }
finish() { stage done; echo "$1" > "$W/DONE"; exit 0; }

stage probe
say "driver capabilities: ${NVIDIA_DRIVER_CAPABILITIES:-unset}; $(nvidia-smi -L 2>&1 | head -2 | tr '\n' ' ')"
# The driver's Vulkan entry points are in its GLX library (the ICD file containers ship names it)
# and in its EGL one.  Without an X server the GLX one fails ("Could not get 'vkCreateInstance'",
# found on the H100 machine); the EGL one works headless, so an ICD file naming it is written.
NV_VK=$( (ls /usr/local/nvidia/lib64/libEGL_nvidia.so.0 2>/dev/null; ldconfig -p | awk '/libEGL_nvidia\.so\.0 /{print $NF}'; find / -xdev -name 'libEGL_nvidia.so.0' 2>/dev/null) | head -1)
say "NVIDIA EGL library: ${NV_VK:-none}"
[ -n "$NV_VK" ] || { say "no NVIDIA Vulkan driver library in this container: nothing to run"; finish FAIL; }
printf '{"file_format_version":"1.0.1","ICD":{"library_path":"%s","api_version":"1.3.0"}}\n' "$NV_VK" > "$W/nvidia_icd.json"
export VK_ICD_FILENAMES=$W/nvidia_icd.json

[ -d "$W/bin" ] || tar xJf "$REPO/.vk/vk-bin.tar.xz" -C "$W" || { say "no .vk/vk-bin.tar.xz"; finish FAIL; }
[ -d "$W/lcp" ] || tar xzf "$REPO/.gpu/lcp-src.tar.gz" -C "$W"
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$REPO"/.gpu/whl/*.whl > "$L/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$REPO:$W/lcp LLAMA_CPP_LIB_PATH=$W/bin LD_LIBRARY_PATH=$W/bin:${LD_LIBRARY_PATH:-}
SRC=$W/lcp/vendor/llama.cpp
TINY=$W/tiny-f16.gguf
[ -f "$TINY" ] || PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
  --out "$TINY" --layers 2 --embd 256 --heads 4 --kv-heads 2 --ffn 512 --ctx 4096 > "$L/gen-tiny.log" 2>&1
if [ -n "${COMPARE:-}" ] && [ ! -f "$W/model-q4km.gguf" ]; then  # the 8B model, written while the checks run
  ( PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
      --out "$W/model-f16.gguf" --ctx 32768 > "$L/gen.log" 2>&1 &&
    "$W/bin/llama-quantize" "$W/model-f16.gguf" "$W/model-q4km.gguf" Q4_K_M "$(nproc)" > "$L/quantize.log" 2>&1 &&
    rm -f "$W/model-f16.gguf" ) &
  GEN=$!
fi

stage checks
say "uma-trio info"
timeout 120 $PY -m uma_trio info --model "$TINY" 2>&1 | grep -v '^llama.cpp ' | tee -a "$L/driver.log"
say "GPU tests"
UMA_GPU_TEST_MODEL=$TINY timeout 300 $PY -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 |
  grep -E 'model buffers on|steps had|cosine|passed|failed|Error|skipped' | tee -a "$L/driver.log"
say "served smoke run"
SOCK=$W/uma.sock
$PY -m uma_trio serve --model "$TINY" --socket "$SOCK" --max-sessions 4 --n-ctx 1024 > "$L/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 240); do [ -S "$SOCK" ] && break; kill -0 $SERVE 2> /dev/null || break; sleep 0.5; done
grep -E 'engine:|cost model' "$L/serve.log" | cut -c1-300 | tee -a "$L/driver.log"
if [ -S "$SOCK" ]; then
  timeout 180 $PY -m uma_trio bench smoke --socket "$SOCK" --out "$W/results/smoke" 2>&1 | grep -E '│ smoke +│ all' | tee -a "$L/driver.log"
else
  say "no socket:"; tail -8 "$L/serve.log" | tee -a "$L/driver.log"
fi
kill $SERVE 2> /dev/null
[ -n "${COMPARE:-}" ] || finish OK

stage model
wait "$GEN" 2> /dev/null
[ -f "$W/model-q4km.gguf" ] || { say "model generation failed"; tail -5 "$L/gen.log" "$L/quantize.log" | tee -a "$L/driver.log"; finish FAIL; }
say "model $(ls -la "$W/model-q4km.gguf")"
stage compare
timeout 1500 $PY benches/gpu_compare.py --bin "$W/bin" --model "$W/model-q4km.gguf" --out "$W/results" \
  --parts "${PARTS:-ceiling,streams,mixed}" --reps "${REPS:-1}" 2>&1 | tee -a "$L/driver.log" | tail -5
finish OK
