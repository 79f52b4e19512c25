#!/usr/bin/env bash
# One batched H200 session (run through the device tool from the repo root):
#   bash scripts/device_session.sh A    sage2 build (background) + NVFP4 tests/bench + attention tests/bench
#                                       + the 50-block canonical forward
#   bash scripts/device_session.sh B    FC2 extension tests/bench + tiny generate on CUDA + the diffusers peer
#   bash scripts/device_session.sh C    sage2 build + FC2 bench + the canonical benchmark (CANON_ARGS, CANON_TIMEOUT)
#   bash scripts/device_session.sh D    sage2 build + W4A8 producer GPU tests + 50-block forward for both
#                                       activation formats (the next step of bench/NOTES.md)
#   bash scripts/device_session.sh E    sage2 build + producer tile sweep (-> tile table) + W4A8/V-pad GPU tests
#                                       + the W4A8 50-block forward with the measured tiles and no V copy
#   bash scripts/device_session.sh F    the canonical benchmark alone (CANON_ARGS; sage2 built if missing)
#   bash scripts/device_session.sh G    sage2 build + fp8 accumulation bench + W4A8 tests + fused-V attention tests
#                                       + the canonical benchmark with the defaults
#   bash scripts/device_session.sh H    sage2 build + tile sweep + this session's GPU tests + the 50-block
#                                       forward with fp32 / fast fp8 accumulation and exact / fast silu (then F)
# Carry .sage (SageAttention source) and .whl (diffusers + deps, sageattention 1.0.6). Logs and JSONs go to
# $OUT (at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/h3_blackwell
export PYTHONPATH=/tmp/site:/tmp/pkg
LOG="$OUT/log.txt"
phase() { echo "=== $1 $(date +%T)" | tee -a "$LOG"; }
phase setup
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$LOG" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$LOG" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/diffusers-*.whl \
  .whl/importlib_metadata-*.whl .whl/zipp-*.whl >> "$LOG" 2>&1
case "${1:-A}" in
A)
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
  phase nvfp4-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_nvfp4_gpu.py -rs 2>&1 | tail -25 >> "$LOG"
  phase nvfp4-bench
  timeout 150 python3 bench/nvfp4_h200.py 2>&1 | tail -15 >> "$LOG"
  wait $SAGE; tail -3 "$OUT/sage_build.log" >> "$LOG"
  python3 -c "import sageattention, sys; print('sageattention', getattr(sageattention, '__version__', '?'), sageattention.__file__)" >> "$LOG" 2>&1
  phase attention-gpu-tests
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py -rs 2>&1 | tail -25 >> "$LOG"
  phase attention-bench
  timeout 120 python3 bench/attention_h200.py 2>&1 | tail -15 >> "$LOG"
  phase forward50
  timeout 200 python3 bench/forward50_h200.py 2>&1 | tail -15 >> "$LOG"
  cp bench/results/nvfp4-h200.json bench/results/attention-h200.json bench/results/forward50-h200.json "$OUT/" 2>>"$LOG"
  ;;
B)
  phase fc2-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fc2_gpu.py -rs 2>&1 | tail -25 >> "$LOG"
  phase fc2-bench
  timeout 270 python3 bench/fc2_h200.py 2>&1 | tail -20 >> "$LOG"
  phase generate-tiny-cuda
  timeout 60 python3 -m h3_blackwell.runtime.cli generate --output /tmp/tiny --runs 2 --warmup 1 2>&1 | tail -8 >> "$LOG"
  cp /tmp/tiny/report.json "$OUT/tiny-cuda-report.json" 2>>"$LOG"
  phase peer
  NL=4 timeout 150 python3 bench/diffusers_peer.py 2>&1 | tail -3 >> "$LOG"
  cp bench/results/fc2-h200.json "$OUT/" 2>>"$LOG"
  ;;
C)
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
  phase fc2-bench
  timeout 140 python3 bench/fc2_h200.py 2>&1 | tail -12 >> "$LOG"
  cp bench/results/fc2-h200.json "$OUT/" 2>>"$LOG"
  wait $SAGE; tail -2 "$OUT/sage_build.log" >> "$LOG"
  phase canonical
  # written straight into $OUT after every stage, so a run cut short still returns what it measured
  timeout "${CANON_TIMEOUT:-390}" python3 bench/canonical.py --out "$OUT/canonical-h200.json" ${CANON_ARGS:-} 2>&1 | tail -8 >> "$LOG"
  ;;
D)
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
  phase fp8-producer-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_producers_gpu.py -rs 2>&1 | tail -20 >> "$LOG"
  wait $SAGE; tail -2 "$OUT/sage_build.log" >> "$LOG"
  phase sage-v-pad-buffer-tests
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py -k "v_pad_buffer or strided_path_makes_no_qkv_copies" -rs 2>&1 | tail -8 >> "$LOG"
  for fmt in nvfp4 fp8; do
    phase "forward50-$fmt (H3_SAGE_V_PAD=buffer: no V copy)"
    H3_SAGE_V_PAD=buffer timeout 180 python3 bench/forward50_h200.py --gemm fp8 --act-format $fmt --out "$OUT/forward50-$fmt.json" 2>&1 | tail -4 >> "$LOG"
  done
  ;;
E)
  # producers: tile sweep -> a measured tile table (H3_PRODUCER_TILES), bytes vs the reference on the GPU;
  # then the Sage2 V-pad buffer tests and the W4A8 50-block forward with both
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
  phase producers-sweep
  timeout 240 python3 bench/producers_h200.py --out "$OUT/producers-h200.json" --tiles-out /tmp/tiles.json 2>&1 | tail -12 >> "$LOG"
  cp /tmp/tiles.json "$OUT/producer-tiles-h200.json" 2>>"$LOG"
  phase fp8-producer-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_producers_gpu.py -rs 2>&1 | tail -8 >> "$LOG"
  timeout 120 python3 -m pytest -q tests/test_fp8_producers.py tests/test_quant_kernels.py -k "fp8 or tie or tile" 2>&1 | tail -6 >> "$LOG"
  timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_nvfp4_gpu.py -k "fp8" 2>&1 | tail -4 >> "$LOG"
  wait $SAGE; tail -2 "$OUT/sage_build.log" >> "$LOG"
  phase sage-v-pad-buffer-tests
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py -k "v_pad_buffer or strided_path_makes_no_qkv_copies" -rs 2>&1 | tail -8 >> "$LOG"
  phase "forward50-fp8 (H3_SAGE_V_PAD=buffer, measured tiles)"
  H3_PRODUCER_TILES=/tmp/tiles.json H3_SAGE_V_PAD=buffer timeout 200 python3 bench/forward50_h200.py --gemm fp8 \
    --act-format fp8 --out "$OUT/forward50-h200.json" 2>&1 | tail -4 >> "$LOG"
  ;;
F)
  # the canonical benchmark with CANON_ARGS and the environment given (e.g. H3_PRODUCER_TILES, H3_SAGE_V_PAD);
  # on a machine still warm from E the sage build is already there
  bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; tail -2 "$OUT/sage_build.log" >> "$LOG"
  phase canonical
  timeout "${CANON_TIMEOUT:-$(( 585 - SECONDS ))}" python3 bench/canonical.py --out "$OUT/canonical-h200.json" ${CANON_ARGS:-} 2>&1 | tail -8 >> "$LOG"
  ;;
G)
  # fp8 accumulation bench + W4A8 producer tests while sage2 builds; then the fused-V attention tests; then
  # the canonical benchmark with the defaults (act_format auto -> fp8, sage_v_pad fused), or with
  # sage_v_pad=buffer if the fused-V tests failed
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
  phase fp8-accum-bench
  timeout 90 python3 bench/fp8_accum_h200.py --out "$OUT/fp8-accum-h200.json" 2>&1 | tail -5 >> "$LOG"
  phase fp8-producer-gpu-tests
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_fp8_producers_gpu.py 2>&1 | tail -3 >> "$LOG"
  timeout 90 python3 -m pytest -q -x tests/test_fp8_producers.py --tb=short 2>&1 | grep -E "Error|error|passed|failed" | head -12 >> "$LOG"
  wait $SAGE; tail -2 "$OUT/sage_build.log" >> "$LOG"
  phase sage-fused-v-tests
  V=fused
  timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_attention_gpu.py -k "fused_v or v_pad_buffer" -rs 2>&1 \
    | grep -E "S=|rel_l2|passed|failed|Error" | tail -14 >> "$LOG"
  [[ ${PIPESTATUS[0]} == 0 ]] || V=buffer
  phase "canonical (H3_SAGE_V_PAD=$V)"
  H3_SAGE_V_PAD=$V timeout "${CANON_TIMEOUT:-$(( 590 - SECONDS ))}" python3 bench/canonical.py --out "$OUT/canonical-h200.json" ${CANON_ARGS:-} 2>&1 | tail -3 >> "$LOG"
  ;;
H)
  # next measurement (bench/NOTES.md "Next"): tile sweep with the new candidates, the GPU tests of this
  # session's changes (fused V, fast accumulation, no host->device copies), then the 50-block forward with
  # the measured tiles and fp32 vs fast fp8 accumulation. Follow with F on the still-warm machine.
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
  phase producers-sweep
  timeout 240 python3 bench/producers_h200.py --out "$OUT/producers-h200.json" --tiles-out /tmp/tiles.json 2>&1 | tail -8 >> "$LOG"
  cp /tmp/tiles.json "$OUT/producer-tiles-h200.json" 2>>"$LOG"
  phase fp8-producer-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_producers_gpu.py 2>&1 | tail -4 >> "$LOG"
  timeout 90 python3 -m pytest -q tests/test_fp8_producers.py 2>&1 | tail -3 >> "$LOG"
  wait $SAGE; tail -2 "$OUT/sage_build.log" >> "$LOG"
  phase sage-fused-v-tests
  timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_attention_gpu.py -k "fused_v or v_pad_buffer or no_qkv_copies" 2>&1 \
    | grep -E "S=|rel_l2|passed|failed|Error" | tail -14 >> "$LOG"
  for cfg in fp32:exact fast:exact fast:fast; do
    acc=${cfg%:*}; silu=${cfg#*:}
    phase "forward50 (H3_FP8_ACCUM=$acc H3_SILU=$silu, measured tiles)"
    H3_PRODUCER_TILES=/tmp/tiles.json H3_FP8_ACCUM=$acc H3_SILU=$silu timeout 150 python3 bench/forward50_h200.py \
      --out "$OUT/forward50-h200-$acc-$silu.json" 2>&1 | tail -3 >> "$LOG"
  done
  ;;
esac
phase done
