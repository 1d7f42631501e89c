#!/usr/bin/env bash
# The pure-Python wheels (and msgspec's) that uma-trio needs on a GPU machine whose Python has
# numpy, anyio, httpx, rich, psutil, prometheus-client, pytest and the rest already (the lent
# H100's image: Python 3.12), for run.sh's PAYLOAD/whl.  Run where PyPI is reachable.
#   bash benches/gpu/wheels.sh [PAYLOAD]      # default: .gpu (git-ignored through .git/info/exclude)
set -euo pipefail
out=${1:-.gpu}/whl
mkdir -p "$out"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out" \
    trio outcome sniffio msgspec cyclopts docstring_parser rich_rst docutils platformdirs ddsketch \
    hypercorn h2 hpack hyperframe priority wsproto starlette pytest-trio diskcache jinja2 markupsafe llguidance
ls "$out"
