#!/usr/bin/env bash
# comfy-kitchen for the GPU machine, which has no internet: run HERE (where PyPI is reachable), from the repo root:
#
#   bash scripts/kitchen_carry.sh [VERSION=0.2.40] [PYTHON_VERSION=3.12]
#
# Writes .whl/comfy_kitchen-<VERSION>-cuda-cp<PY>.tar.gz (.whl/ is git-ignored; carry it with run(carry=[".whl"])).
# The PyPI wheel (cp312-abi3 manylinux_2_28 x86_64) is ~65 MiB, over the device tool's 64 MiB carry limit, because
# it also holds the ROCm extension (backends/hip/_C.abi3.so, 158 MB unpacked), which a CUDA machine never loads
# (comfy_kitchen imports it only under a ROCm torch). The archive is the wheel's files without it (~35 MiB).
# On the device:   mkdir -p /tmp/site && tar xzf .whl/comfy_kitchen-*-cuda-cp312.tar.gz -C /tmp/site
#                  export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
VER="${1:-0.2.40}"
PYV="${2:-3.12}"
PY="${PY:-python3}"
cd "$(dirname "$0")/.."
mkdir -p .whl
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$PYV" \
  --platform manylinux_2_28_x86_64 -d "$TMP/dl" "comfy-kitchen==$VER"
WHEEL="$(ls "$TMP"/dl/comfy_kitchen-"$VER"-*.whl)"
"$PY" -m zipfile -e "$WHEEL" "$TMP/pkg"
rm -f "$TMP"/pkg/comfy_kitchen/backends/hip/_C*.so
TAG="cp${PYV/./}"
OUT=".whl/comfy_kitchen-$VER-cuda-$TAG.tar.gz"
tar czf "$OUT" -C "$TMP/pkg" .
ls -la "$OUT"
echo "source wheel: $(basename "$WHEEL")"
