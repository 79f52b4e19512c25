#!/usr/bin/env bash
# Build SageAttention2 (thu-ml/SageAttention, setup.py version 2.2.0) for sm_90 ONLY and install it into
# a target folder, on the GPU machine (no internet needed: pip runs without build isolation and
# without dependencies).
#
#   bash scripts/device_build_sage2.sh SRC_DIR [TARGET_DIR]      # TARGET_DIR defaults to /tmp/site
#   export PYTHONPATH=TARGET_DIR:$PYTHONPATH                      # then: import sageattention
#
# SRC_DIR is a checkout of thu-ml/SageAttention carried to the machine in an ignored folder (here
# .sage/, so: bash scripts/device_build_sage2.sh .sage; never committed). Its setup.py (facts read from it):
#   * targets come from TORCH_CUDA_ARCH_LIST ("9.0" -> -gencode arch=compute_90a,code=sm_90a); because
#     its nvcc flags then carry an "arch" flag, torch's cpp_extension adds no arch flags of its own,
#     so nothing is compiled for other GPUs;
#   * with 9.0 it builds four extensions: _qattn_sm80, _qattn_sm89 (8 .cu files), _qattn_sm90
#     (links -lcuda) and _fused; sm_90 itself only calls _qattn_sm90 + _fused, but setup.py builds all
#     four for 9.0 and this script does not edit their sources;
#   * EXT_PARALLEL = extensions built at once (its default 4), MAX_JOBS = ninja jobs per extension;
#   * it reads README.md from SRC_DIR (long_description): the folder must include it;
#   * NVCC_APPEND_FLAGS / CXX_APPEND_FLAGS are appended to its flags (left unset here; nvcc itself
#     also reads NVCC_APPEND_FLAGS, so setting it would apply twice).
# Measured before on this image (H200, torch 2.11+cu130, nvcc 13.0, 16 cores): ~214 s.
#
# sageattention 1.0.6 (the sage1 backend) is a pure-Python wheel and needs no build. Both versions are
# the package "sageattention", so do NOT pip-install 1.0.6 next to this one; carry the wheel instead:
#   pip download sageattention==1.0.6 --no-deps -d .whl/     # on a machine with PyPI (.whl/ is ignored)
#   run(..., carry=[".whl", ".sage"])                         # travels with the working tree
# bench/attention_h200.py and tests/gpu/test_attention_gpu.py load .whl/sageattention-1.*.whl under a
# private module name (runtime.ops.attention.use_sage1_from).
set -euo pipefail

SRC=${1:?usage: $0 SAGEATTENTION_SRC_DIR [TARGET_DIR]}
SITE=${2:-/tmp/site}
PY=${PYTHON:-python3}
SRC=$(cd "$SRC" && pwd)

for f in setup.py README.md sageattention/__init__.py csrc/qattn/qk_int_sv_f8_cuda_sm90.cu; do
  [[ -f "$SRC/$f" ]] || { echo "error: $SRC/$f missing (need a full thu-ml/SageAttention checkout)" >&2; exit 2; }
done

check() {
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import importlib.metadata as md
import torch
import sageattention, sageattention.core as core
assert hasattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda_sm90"), "not SageAttention2"
try:
    ver = md.version("sageattention")
except md.PackageNotFoundError:
    ver = "(no dist-info: build_ext route)"
print(f"sageattention {ver} at {sageattention.__file__}: "
      f"SM90_ENABLED={core.SM90_ENABLED} SM89_ENABLED={core.SM89_ENABLED} torch {torch.__version__}")
assert core.SM90_ENABLED, "the sm90 extension did not load"
EOF
}

if [[ "${FORCE:-0}" != 1 ]] && check 2>/dev/null; then
  echo "already built in $SITE (FORCE=1 rebuilds)"
  exit 0
fi

if [[ -z "${CUDA_HOME:-}" ]]; then
  NVCC=$(command -v nvcc || true)
  [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
  [[ -n "$NVCC" ]] || { echo "error: nvcc not found and CUDA_HOME unset" >&2; exit 2; }
  export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
fi
# _qattn_sm90 links -lcuda: fall back to the driver stub when no unversioned libcuda.so is on the path
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
  for d in "$CUDA_HOME/lib64/stubs" "$CUDA_HOME/targets/x86_64-linux/lib/stubs"; do
    [[ -f "$d/libcuda.so" ]] && export LIBRARY_PATH="$d${LIBRARY_PATH:+:$LIBRARY_PATH}" && break
  done
fi

export TORCH_CUDA_ARCH_LIST="9.0"
export EXT_PARALLEL=${EXT_PARALLEL:-4}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$CUDA_HOME/bin/nvcc" --version | tail -2
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "building $SRC for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (EXT_PARALLEL=$EXT_PARALLEL MAX_JOBS=$MAX_JOBS) -> $SITE"

LOG=${LOG:-/tmp/sage2-build.log}
mkdir -p "$SITE"
# setup.py imports packaging; a wheel build needs setuptools>=70.1 (bdist_wheel built in) or `wheel`.
"$PY" -c "import packaging.version, setuptools" || { echo "error: setup.py needs packaging and setuptools in $PY" >&2; exit 2; }
if "$PY" -c "import setuptools.command.bdist_wheel" 2>/dev/null || "$PY" -c "import wheel" 2>/dev/null; then
  ROUTE=pip
else
  ROUTE=build_ext  # no wheel machinery: compile in place into $SITE and copy the Python package beside it
fi
echo "route: $ROUTE (log: $LOG)"
start=$(date +%s)
# -Xptxas=-v in its flags makes the log long: keep it in a file, show the tail on failure
if [[ $ROUTE == pip ]]; then
  cmd=("$PY" -m pip install --no-build-isolation --no-deps --no-index --target "$SITE" --upgrade -v "$SRC")
else
  cmd=(bash -c "cd '$SRC' && '$PY' setup.py build_ext --build-lib '$SITE' --build-temp '$SRC/build/h3-temp' \
       && mkdir -p '$SITE/sageattention' && cp -r '$SRC/sageattention/.' '$SITE/sageattention/'")
fi
if ! "${cmd[@]}" >"$LOG" 2>&1; then
  echo "build FAILED after $(( $(date +%s) - start )) s; last lines of $LOG:" >&2
  tail -40 "$LOG" >&2
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s (log: $LOG)"
ls "$SITE"/sageattention/*.so
check
echo "use: export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
