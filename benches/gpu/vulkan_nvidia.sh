#!/usr/bin/env bash
# uma-trio on a real GPU through llama.cpp's Vulkan backend, on a lent NVIDIA machine that has no
# Vulkan toolchain and no internet (docs/BENCHMARKS.md "Vulkan").  The Vulkan build of the pinned
# llama-cpp-python is made elsewhere (benches/vulkan_check.sh) and its libraries carried in:
#
#   tar cJf .vk/vk-libs.tar.xz -C DIR lib   # lib/: libllama.so, libggml*.so, libvulkan.so.1
#
# Then, from the repository root with .gpu (benches/gpu/run.sh's payload) and .vk present:
# it lists the machine's Vulkan drivers (an NVIDIA container has one only where its driver
# capabilities include graphics), points the Vulkan loader at the NVIDIA driver's EGL library
# alone (VK_ICD_FILENAMES, an ICD file it writes), and runs `uma-trio info`, the GPU tests
# (tests/test_gpu.py, a 2-layer F16 random-weight model) and a served smoke run on it.
# Output: $OUT/vulkan.log.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
W=${W:-/tmp/vkw}
PY=${PY:-python3}
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/vulkan.log") 2>&1
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }

say "driver capabilities: ${NVIDIA_DRIVER_CAPABILITIES:-unset}"
nvidia-smi -L 2>&1 | head -4
ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1 | head
# The driver's Vulkan entry points are in its GLX library (the ICD file containers ship names it)
# and in its EGL one.  Without an X server the GLX one fails ("Could not get 'vkCreateInstance'",
# found on the H100 machine); the EGL one works headless, so an ICD file naming it is written.
NV_VK=$( (ls /usr/local/nvidia/lib64/libEGL_nvidia.so.0 2>/dev/null; ldconfig -p | awk '/libEGL_nvidia\.so\.0 /{print $NF}'; find / -xdev -name 'libEGL_nvidia.so.0' 2>/dev/null) | head -1)
say "NVIDIA EGL library: ${NV_VK:-none}"
if [ -z "$NV_VK" ]; then
  say "no NVIDIA Vulkan driver library in this container: nothing to run"
  exit 3
fi
printf '{"file_format_version":"1.0.1","ICD":{"library_path":"%s","api_version":"1.3.0"}}\n' "$NV_VK" > "$W/nvidia_icd.json"
export VK_ICD_FILENAMES=$W/nvidia_icd.json

tar xJf "$REPO/.vk/vk-libs.tar.xz" -C "$W" || { say "no .vk/vk-libs.tar.xz"; exit 1; }
[ -d "$W/lcp" ] || tar xzf "$REPO/.gpu/lcp-src.tar.gz" -C "$W"
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$REPO"/.gpu/whl/*.whl > "$W/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$REPO:$W/lcp LLAMA_CPP_LIB_PATH=$W/lib LD_LIBRARY_PATH=$W/lib:${LD_LIBRARY_PATH:-}
SRC=$W/lcp/vendor/llama.cpp
TINY=$W/tiny-f16.gguf
[ -f "$TINY" ] || PYTHONPATH=$SRC/gguf-py $PY benches/gpu/gen_model.py --vocab "$SRC/models/ggml-vocab-llama-bpe.gguf" \
  --out "$TINY" --layers 2 --embd 256 --heads 4 --kv-heads 2 --ffn 512 --ctx 4096 > "$W/gen-tiny.log" 2>&1

say "llama.cpp: $($PY -c 'from uma_trio.engine import devices as d; print(d.backends_built(), [x.name for x in d.devices()], d.system_info())' 2>&1 | tail -3)"
say "uma-trio info"
timeout 120 $PY -m uma_trio info --model "$TINY" 2>&1 | grep -v '^llama.cpp '
say "GPU tests"
UMA_GPU_TEST_MODEL=$TINY timeout 300 $PY -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 |
  grep -E 'model buffers on|steps had|cosine|passed|failed|Error|skipped'

say "served smoke run"
SOCK=$W/uma.sock
$PY -m uma_trio serve --model "$TINY" --socket "$SOCK" --max-sessions 4 --n-ctx 1024 > "$W/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 240); do [ -S "$SOCK" ] && break; kill -0 $SERVE 2> /dev/null || break; sleep 0.5; done
grep -E 'engine:|cost model|calibrat' "$W/serve.log" | cut -c1-400
if [ -S "$SOCK" ]; then
  timeout 180 $PY -m uma_trio bench smoke --socket "$SOCK" --out "$W/smoke" 2>&1 | tail -12
else
  say "no socket:"; tail -8 "$W/serve.log"
fi
kill $SERVE 2> /dev/null
say "done"
