#!/usr/bin/env bash
# The GPU machine's half of bench/blackwell_build.py (issue 40): SageAttention2 and SageAttention3 built from source
# for sm_100a / sm_120a / sm_121a (no Blackwell card needed: nvcc targets them ahead of time), in parallel, each
# under a time limit, plus SageAttention2 for sm_90 (scripts/device_build_sage2.sh, packed back for later calls),
# the FlashAttention-4 import and bench/blackwell_first_run.py on the card. Run from the repo root:
#
#   bash bench/blackwell_device_builds.sh SAGE_SRC PKG_PARENT [FA4_WHEEL]
#
# SAGE_SRC: a thu-ml/SageAttention tree (never committed) whose sageattention3_blackwell/csrc/cutlass holds CUTLASS's
# include/ and tools/util/include/ (its setup.py would git-clone CUTLASS; the GPU machine has no network).
# PKG_PARENT: a folder holding h3_blackwell/ (the package this script's first-run step imports).
# Writes into $OUT: device-builds.json (per build: ok, rc, seconds, error, produced .so files with the cubin
# architectures cuobjdump lists), logs.tar.gz (every build log, the first run's output, the FA4 import), and
# sage2-sm90.tar.gz.part-* (the sm_90 SageAttention2 site folder, split under 16 MiB).
# SageAttention3's setup.py picks its one target from torch.cuda.get_device_capability(); the build runs it with
# that call answering the target's capability (bench/_sage3_setup.py), which changes nothing else.
set -u
SRC=$(cd "${1:?usage: $0 SAGE_SRC PKG_PARENT [FA4_WHEEL]}" && pwd)
PKG=$(cd "${2:?usage: $0 SAGE_SRC PKG_PARENT [FA4_WHEEL]}" && pwd)
FA4_WHEEL=${3:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-470}   # seconds from start after which every build still running is stopped
W=/tmp/bwbuild; L=$W/logs; rm -rf "$W"; mkdir -p "$L"
T0=$(date +%s)
HERE=$(cd "$(dirname "$0")" && pwd)
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
export PATH="$CUDA_HOME/bin:$PATH"
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then   # -lcuda at link time: the driver stub
  for d in "$CUDA_HOME/lib64/stubs" "$CUDA_HOME/targets/x86_64-linux/lib/stubs"; do
    [[ -f "$d/libcuda.so" ]] && export LIBRARY_PATH="$d${LIBRARY_PATH:+:$LIBRARY_PATH}" && break
  done
fi

{
  echo "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -2 | tr '\n' ' ')"
  echo "gpu_archs: $("$CUDA_HOME/bin/nvcc" --list-gpu-arch | tr '\n' ' ')"
  python3 -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  echo "gcc: $(gcc --version | head -1)"
  echo "nproc: $(nproc)"
  nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1 | head -2 | sed 's/^/gpu: /'
  python3 -c "import wheel; print('wheel', wheel.__version__)" 2>&1 | tail -1
  python3 -c "import ninja; print('ninja', ninja.__version__)" 2>&1 | tail -1
} > "$L/toolchain.txt" 2>&1

# build NAME NICE CMD...: CMD in the background under what is left of the deadline; NAME.rc gets "rc seconds"
build() {
  local name=$1 nice=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - T0) ))
  ( s=$(date +%s); nice -n "$nice" timeout -k 5 "$left" "$@" > "$L/$name.log" 2>&1; rc=$?
    echo "$rc $(( $(date +%s) - s )) $left" > "$L/$name.rc" ) &
}

for t in 90 100 120 121; do cp -r "$SRC" "$W/src$t"; done
# SageAttention2 for sm_90 (the lead's later calls carry it): first, at normal priority
build sage2_sm90 0 env LOG="$L/sage2_sm90.pip.log" EXT_PARALLEL=4 MAX_JOBS=16 \
  bash scripts/device_build_sage2.sh "$W/src90" "$W/site_sage2_sm90"
# SageAttention3 (one target per build, as its setup.py builds) and SageAttention2 for each Blackwell target
for pair in 10.0:100 12.0:120 12.1:121; do
  cc=${pair%:*}; t=${pair#*:}
  build "sage3_sm${t}a" 5 env MAX_JOBS=2 python3 "$HERE/_sage3_setup.py" "$cc" "$W/src$t/sageattention3_blackwell" \
    "$W/site_sage3_sm${t}a" "$W/tmp_sage3_$t"
  build "sage2_sm${t}a" 5 bash -c "cd '$W/src$t' && TORCH_CUDA_ARCH_LIST='$cc' EXT_PARALLEL=3 MAX_JOBS=6 \
    python3 setup.py build_ext --build-lib '$W/site_sage2_sm${t}a' --build-temp '$W/tmp_sage2_$t'"
done

# meanwhile: the FlashAttention-4 import and the first-run script on this card
{
  echo "== pip index: (no network here; recorded on the CPU machine)"
  if [[ -n "$FA4_WHEEL" && -f "$FA4_WHEEL" ]]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/fa4site "$FA4_WHEEL" 2>&1 | tail -2
    echo "== import flash_attn.cute from $(basename "$FA4_WHEEL") (no dependencies installed)"
    PYTHONPATH=/tmp/fa4site python3 -c "import flash_attn.cute as m; print('ok', m.__file__)" 2>&1 | tail -3
  fi
  echo "== dependencies present on this image:"
  for m in cutlass quack tvm_ffi flash_attn; do
    python3 -c "import $m; print('$m', getattr($m, '__version__', '?'), $m.__file__)" 2>&1 | tail -1
  done
  echo "== the guard here"
  PYTHONPATH="/tmp/fa4site:$PKG" python3 -c "
from h3_blackwell.runtime.ops.blackwell_attention import fa4_check
print(fa4_check('cuda:0'))" 2>&1 | tail -3
} > "$L/fa4.txt" 2>&1
PYTHONPATH="$PKG" timeout 120 python3 "$PKG/h3_blackwell/bench/blackwell_first_run.py" > "$L/first_run.txt" 2>&1
echo "first_run rc=$?" >> "$L/first_run.txt"

wait
# the sm_90 site folder back, split under 16 MiB
if [[ -d "$W/site_sage2_sm90" ]]; then
  tar -C "$W/site_sage2_sm90" -czf - . | split -b 15m - "$OUT/sage2-sm90.tar.gz.part-"
fi
python3 "$HERE/_device_builds_report.py" "$W" "$L" "$T0" > "$OUT/device-builds.json"
tar -C "$W" -czf "$OUT/logs.tar.gz" logs
echo "done in $(( $(date +%s) - T0 )) s"; ls -la "$OUT"
cat "$L/first_run.txt"; cat "$L/fa4.txt"; cat "$L"/*.rc
