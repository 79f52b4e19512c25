#!/usr/bin/env bash
# The tests on a fresh machine: installs the package with its test oracles (diffusers, comfy-kitchen,
# triton for TRITON_INTERPRET, CUDA 13 headers for the extension compile check), then runs pytest.
# GPU-marked tests skip without CUDA. Extra arguments go to pytest.
set -euo pipefail
# torch 2.14.1: the test extra's torchvision 0.29.1 (transformers' Qwen3-VL processor, for the diffusers pipeline
# tests) needs it; both are PyPI's CUDA builds, which run on the CPU (../shared/vendor/VENDOR.md)
export H3_TORCH="${H3_TORCH:-torch==2.14.1}"
source "$(dirname "$0")/_env.sh"
h3_install test,cuda-headers
# the vendored ComfyUI and its venv for the tests marked `comfyui` (they skip, saying why, without ../shared)
source "$ROOT/scripts/comfyui_env.sh"
# the PyPI SageAttention 1.0.6 wheel as a file (never installed: it would shadow SageAttention2's module name),
# for the test that loads a real SageAttention 1 wheel through use_sage1_from
SAGE1_WHL="$ROOT/.whl/sageattention-1.0.6-py3-none-any.whl"
if [ ! -f "$SAGE1_WHL" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/.whl" sageattention==1.0.6 \
    || echo "test.sh: could not download sageattention==1.0.6; its wheel test will skip" >&2
fi
# The browser tests (marker `browser`): Debian's chromium driven by the playwright package. Never `playwright install`
# (it downloads a browser build); a missing piece makes those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test.sh: installing Debian's chromium for the browser tests (apt-get, once)..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "test.sh: could not install chromium; the browser tests will skip" >&2
fi
if ! "$PY" -c "import playwright" 2>/dev/null; then
  "$PY" -m pip install -q playwright >/dev/null 2>&1 || echo "test.sh: could not install playwright; the browser tests will skip" >&2
fi
cd "$ROOT"
"$PY" -m pytest -q -ra "$@"
