#!/usr/bin/env bash
# The tests on a fresh machine: installs the package with its test oracles (diffusers, comfy-kitchen,
# triton for TRITON_INTERPRET, CUDA 13 headers for the extension compile check), then runs pytest.
# GPU-marked tests skip without CUDA. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
"$PY" -m pip install -q -e "$ROOT[test,cuda-headers]"
cd "$ROOT"
"$PY" -m pytest -q -ra "$@"
