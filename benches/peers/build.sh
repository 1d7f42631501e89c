#!/usr/bin/env bash
# Build llama-server and llama-batched-bench from the llama.cpp that the pinned
# llama-cpp-python sdist vendors, so the peers run the very engine uma-trio runs; and
# install llama-cpp-python's own server (lcp-venv/).
#
#   bash benches/peers/build.sh [OUT_DIR]      # default: ~/.cache/uma-trio/peers
#
# Needs cmake, ninja, a C++ compiler and pip (PyPI only). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
out=${1:-${UMA_CACHE_DIR:-$HOME/.cache/uma-trio}/peers}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON >/dev/null
cmake --build "$work/build" --target llama-server llama-batched-bench -j "$(nproc)"
mkdir -p "$out"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-batched-bench" "$out"/
echo "llama.cpp of llama-cpp-python $version" > "$out/VERSION"
# llama-cpp-python's own OpenAI server (the high-level Llama class), in a venv of its own so
# its server dependencies stay out of uma-trio's; pip reuses the wheel uma-trio's install built.
python3 -m venv "$out/lcp-venv"
"$out/lcp-venv/bin/pip" install --quiet "llama-cpp-python[server]==$version"
echo "built into $out:"
ls "$out"
