#!/usr/bin/env bash
# README's Vulkan install line, run as written, and what it gives uma-trio: in a venv of its own
# (VENV, default .vulkan-venv) the pinned llama-cpp-python is built with -DGGML_VULKAN=on, this
# checkout is installed beside it, and then `uma-trio info`, the GPU tests (tests/test_gpu.py)
# and a served smoke run (benches/scenarios/smoke.json over the socket) run on the Vulkan device.
#
#   bash benches/vulkan_check.sh            # results in OUT (default benches/results/vulkan)
#
# Needs a C/C++ toolchain, cmake, Vulkan headers new enough for the pinned llama.cpp (it uses
# VK_EXT_layer_settings: Debian 13's libvulkan-dev 1.4.309 builds, Debian 12's 1.3.239 does not),
# glslc and SPIRV-Headers (Debian: libvulkan-dev glslc spirv-headers), and a Vulkan driver.  On
# a machine without a GPU, Mesa's llvmpipe (mesa-vulkan-drivers) is a Vulkan device that runs on
# the CPU; llama.cpp skips CPU-type devices unless GGML_VK_VISIBLE_DEVICES names them, so this
# script names device 0 when vulkaninfo lists no GPU.  Extra cmake flags (e.g. headers
# elsewhere: -DVulkan_INCLUDE_DIR=... -DCMAKE_PREFIX_PATH=...) go in VULKAN_CMAKE_ARGS.
# The build takes ~8 minutes on 2 cores; REBUILD=0 keeps a venv that already has it.  The served
# run starts a daemon, which on a device it has no cost model for calibrates first and keeps
# the result for the next start: seconds on a GPU, more than 30 minutes on llvmpipe, where
# Mesa 22.3.6's driver crashed during it (BENCHMARKS.md "Vulkan").  COST_MODEL=file skips it
# (docs/data/cost-model-llvmpipe-2026-11-26.json is one for llvmpipe); SMOKE=0 skips the run.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$REPO/.vulkan-venv}
OUT=${OUT:-$REPO/benches/results/vulkan}
PIN=$(grep -o 'llama-cpp-python==[0-9.]*' "$REPO/pyproject.toml" | head -1)
mkdir -p "$OUT"
cd "$REPO"

if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if [ "${REBUILD:-1}" != 0 ] || ! python -c 'import llama_cpp' 2> /dev/null; then
  python -m pip install -q -U pip
  # README's line; --no-cache-dir keeps pip from reusing a CPU wheel built from the same sdist.
  CMAKE_ARGS="-DGGML_VULKAN=on ${VULKAN_CMAKE_ARGS:-}" \
    python -m pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python "$PIN" > "$OUT/build.log" 2>&1 ||
    { echo "build failed: $OUT/build.log" >&2; tail -20 "$OUT/build.log" >&2; exit 1; }
fi
python -m pip install -q -e "$REPO[dev]" > "$OUT/install.log" 2>&1
find "$(python -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')" -name 'libggml-vulkan*' |
  grep -q . || { echo "the installed llama-cpp-python has no Vulkan backend" >&2; exit 1; }

if [ -z "${GGML_VK_VISIBLE_DEVICES:-}" ] && command -v vulkaninfo > /dev/null &&
  ! vulkaninfo --summary 2> /dev/null | grep -q 'PHYSICAL_DEVICE_TYPE_\(DISCRETE\|INTEGRATED\)_GPU'; then
  echo "no Vulkan GPU listed; naming device 0 (GGML_VK_VISIBLE_DEVICES=0), e.g. Mesa's llvmpipe"
  export GGML_VK_VISIBLE_DEVICES=0
fi
{ command -v vulkaninfo > /dev/null && vulkaninfo --summary 2> /dev/null | sed -n '/^Devices:/,$p'; } > "$OUT/vulkaninfo.txt" || true

uma-trio fetch-model > /dev/null
uma-trio info | tee "$OUT/info.txt"
grep -q '^backends .*Vulkan' "$OUT/info.txt" || { echo "uma-trio info shows no Vulkan backend" >&2; exit 1; }
grep -q '^GPU layers *\([0-9]*\) of \1 ' "$OUT/info.txt" || { echo "not every layer is on the Vulkan device" >&2; exit 1; }

python -m pytest -q -p no:cacheprovider -s tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
grep -q '^3 passed' "$OUT/test_gpu.log" || { echo "the GPU tests did not all run and pass" >&2; exit 1; }

if [ "${SMOKE:-1}" = 0 ]; then echo "ok: Vulkan build, info and GPU tests (SMOKE=0: no served run); results in $OUT"; exit 0; fi
SOCK=$(mktemp -d)/uma.sock
# COST_MODEL: a `uma-trio calibrate` file for this device, else serve calibrates at start.
uma-trio serve --socket "$SOCK" --max-sessions 4 --n-ctx 1024 ${COST_MODEL:+--cost-model "$COST_MODEL"} \
  > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2> /dev/null || true' EXIT
# On a device with no cost model for it the daemon calibrates first (minutes on llvmpipe).
echo "waiting for the daemon (it calibrates its cost model on a new device first)"
for _ in $(seq 3600); do
  [ -S "$SOCK" ] && break
  kill -0 $SERVE 2> /dev/null || { echo "serve exited:" >&2; tail -5 "$OUT/serve.log" >&2; exit 1; }
  sleep 1
done
[ -S "$SOCK" ] || { echo "no socket after 60 minutes" >&2; exit 1; }
uma-trio bench smoke --socket "$SOCK" --out "$OUT/smoke" | tee "$OUT/smoke.txt"
grep -m1 'engine:' "$OUT/serve.log" || true
echo "ok: Vulkan build, info, GPU tests and a served smoke run; results in $OUT"
