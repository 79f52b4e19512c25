#!/usr/bin/env bash
# The wheels bench/diffusers_pipeline.py needs on a GPU machine without network, for its Python and torch:
# diffusers, transformers (the Qwen3-VL conditioner), accelerate, the torchvision of that torch (transformers'
# Qwen3-VL processor needs it) and their dependencies, into .whl/pipeline/ (ignored by git; ~55 MB: carry it alone).
#   [DROP="numpy pillow"] bash scripts/pipeline_carry.sh [PYTHON_VERSION TORCHVISION_VERSION]
#   # default 3.12 0.26.0: the device's Python and torch 2.11.0+cu130 (bench/results/canonical-h100-structure.json)
# On the device: bash scripts/device_session.sh P (installs them into /tmp/site, then runs the bench).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"; TV="${2:-0.26.0}"
DEST=.whl/pipeline
rm -rf "$DEST"; mkdir -p "$DEST"
PIP=(python3 -m pip download -q -d "$DEST" --only-binary=:all: --python-version "$PYV" --platform manylinux_2_28_x86_64
     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any)
[ -x .venv/bin/python ] && PIP[0]=.venv/bin/python
"${PIP[@]}" "diffusers==0.42.1" "transformers==5.25.0"   # with their dependencies (no torch among them)
"${PIP[@]}" --no-deps accelerate psutil "torchvision==$TV"  # these two would pull a torch: the device has its own
for pkg in ${DROP:-numpy}; do rm -f "$DEST/$pkg"-*.whl; done   # the device's torch brings numpy; DROP="numpy pillow"
                                                             # where the device has Pillow too (7 MB less)
du -sh "$DEST"
