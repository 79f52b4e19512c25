#!/usr/bin/env bash
# One batched H200 session (run through the device tool from the repo root):
#   bash scripts/device_session.sh A    sage2 build (background) + NVFP4 tests/bench + attention tests/bench
#                                       + the 50-block canonical forward
#   bash scripts/device_session.sh B    FC2 extension tests/bench + tiny generate on CUDA + the diffusers peer
#   bash scripts/device_session.sh F    the canonical benchmark (CANON_ARGS, CANON_TIMEOUT and any H3_* in the
#                                       environment; sage2 built first if this machine lacks it)
#   bash scripts/device_session.sh H    sage2 build + producer tile sweep (-> /tmp/tiles.json) + the W4A8 /
#                                       fused-V / accumulation GPU tests + the 50-block forward with fp32 or fast
#                                       fp8 accumulation and exact or fast silu; then F on the still-warm machine
#   bash scripts/device_session.sh V    sage2 build (background) + the GPU tests of the W4A8 producers, the NVFP4
#                                       bytes and the fused-V attention path, then F (H3_* from the environment)
#   bash scripts/device_session.sh L    sage2 build (background) + the load bench (bf16 at H3 width and its NVFP4
#                                       file: peak device memory during the load) + the canonical benchmark
#                                       (CANON_ARGS, default --skip peer)
#   bash scripts/device_session.sh S    comfy-kitchen from .whl (scripts/kitchen_carry.sh) + sparse GPU tests + the sparse
#                                       rows of attention-h200.json (merged) + sage2 build; then Z on the warm machine:
#   bash scripts/device_session.sh Z    the LOSSY sparse canonical (canonical-h200-sparse.json: dense, quality, FBCache)
#   bash scripts/device_session.sh M    comfy-kitchen + sage2 (carried or built) + the sparse-method GPU tests (ours vs
#                                       core's own nodes_sparse_attention.py: carry .core_cache) and the older sparse
#                                       GPU tests; then N on the warm machine:
#   bash scripts/device_session.sh N    bench/sparse_methods.py: canonical + turbo8 x dense, sol-attn, sla, vsa
#                                       (-> $OUT/sparse-methods.json; SPARSE_ARGS passes e.g. --jobs canonical;
#                                       SPARSE_TESTS=1 first records comfy-kitchen's workspace plans
#                                       (scripts/sol_plans.py) and runs the sparse memory GPU test)
#   bash scripts/device_session.sh T    every GPU test (sage2 built alongside the non-attention ones) + the tiny
#                                       model generated twice on CUDA with the defaults
#   bash scripts/device_session.sh R    the canonical job at BASE_TREE (default third_party/head: `git archive REV`) and
#                                       at this tree in one lease (a refactor's hashes and step time)
#   bash scripts/device_session.sh G    the drop-in (core MODEL), control, low-VRAM and Blackwell-guard GPU tests
#   bash scripts/device_session.sh U    issue 37: rows of bench/user_jobs.py (UJ_ARGS, e.g. "--rows turbo8:8:1";
#                                       then UJ_ARGS2, UJ_ARGS3 where set; without a carried sage2 build it is built
#                                       from .sage while both stacks' files are written, and comes back in $OUT),
#                                       merged into UJ_OUT (default bench/results/user-jobs.json; copied to $OUT;
#                                       an UJ_OUT under $OUT starts from this machine's last merged file);
#                                       with UJ_TESTS=1 first the GPU tests of query-row chunks and the memory paths;
#                                       UJ_GPU_TESTS="tests/gpu/a.py ..." first those GPU tests;
#                                       UJ_SMOKE=1 (default) first a tiny CPU row of core's carried stack. Carry third_party/sage2-sm90 and
#                                       .core_peer (scripts/pack_core_peer.sh), or for turbo8_sparse rows .whl
#                                       (scripts/kitchen_carry.sh: our sparse kernel; core's sparse node is absent)
#   bash scripts/device_session.sh P    diffusers' H3 pipeline with our transformer vs generate (issue 39,
#                                       bench/diffusers_pipeline.py): installs carried .whl/pipeline wheels
#                                       (scripts/pipeline_carry.sh) into /tmp/site and unpacks a carried sage2 build
#                                       (or builds .sage), whichever this call carries, then runs the bench and its GPU
#                                       test once both are there (two calls on one warm machine where the wheels and
#                                       sage2 together exceed the carry)
# R, G, U and P unpack a carried SageAttention2 build (third_party/sage2-sm90/*.part-*) where there is one.
# (Sessions C, D, E and G of 2026-11-29 were earlier versions of F and H; their results are in bench/results.)
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
# SageAttention2 for sm_90 into /tmp/site in the background (~3.5 min; a no-op where already built)
sage_build_start() {
  ( bash scripts/device_build_sage2.sh .sage /tmp/site > "$OUT/sage_build.log" 2>&1; echo "sage build rc=$?" >> "$OUT/sage_build.log" ) &
  SAGE=$!
}
sage_build_wait() { wait "$SAGE"; tail -2 "$OUT/sage_build.log" >> "$LOG"; }
# steps more than one mode runs
nvfp4_bytes_tests() {  # the NVFP4 producers' bytes at full width against the reference
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_nvfp4_gpu.py -k "bit_exact or cpu_reference" 2>&1 | tail -4 >> "$LOG"
}
fused_v_tests() {  # needs sage2
  phase sage-fused-v-tests
  timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_attention_gpu.py -k "fused_v or v_pad_buffer or no_qkv_copies" 2>&1 \
    | grep -E "S=|rel_l2|passed|failed|Error" | tail -14 >> "$LOG"
}
tiny_cuda() {
  phase generate-tiny-cuda
  timeout 90 python3 -m h3_blackwell.cli generate --output /tmp/tiny --runs 2 --warmup 1 2>&1 | tail -14 >> "$LOG"
  cp /tmp/tiny/report.json "$OUT/tiny-cuda-report.json" 2>>"$LOG"
}
canonical() {  # needs sage2; CANON_ARGS, CANON_TIMEOUT and any H3_* from the environment
  phase "canonical ($(env | grep ^H3_ | tr '\n' ' '))"
  timeout "${CANON_TIMEOUT:-$(( 585 - SECONDS ))}" python3 bench/canonical.py --out "$OUT/canonical-h200.json" ${CANON_ARGS:-} 2>&1 | tail -8 >> "$LOG"
}
kitchen_unpack() {  # comfy-kitchen (sparse attention's optional dependency) from scripts/kitchen_carry.sh's archive
  phase kitchen
  mkdir -p /tmp/site && tar xzf .whl/comfy_kitchen-*-cuda-cp312.tar.gz -C /tmp/site >> "$LOG" 2>&1
  python3 -c "import torch, comfy_kitchen as ck; print('comfy-kitchen', ck.__file__, 'sol_attn available:', \
ck.sol_attn_is_available(torch.device('cuda')))" >> "$LOG" 2>&1
}
canonical_sparse() {  # LOSSY sparse canonical (issue 17): dense run, quality and a First-Block Cache run inside
  phase "canonical sparse (${CANON_ARGS:---skip profile,accuracy,peer})"
  timeout "${CANON_TIMEOUT:-$(( 585 - SECONDS ))}" python3 bench/canonical.py --attention sparse \
    --out "$OUT/canonical-h200-sparse.json" ${CANON_ARGS:---skip profile,accuracy,peer} 2>&1 | tail -8 >> "$LOG"
}
phase setup
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$LOG" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$LOG" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/diffusers-*.whl \
  .whl/importlib_metadata-*.whl .whl/zipp-*.whl >> "$LOG" 2>&1
# SageAttention2 for sm_90 carried as a built site folder (third_party/sage2-sm90/*.part-*, split tar.gz) instead of built
sage_unpack() {
  if ls third_party/sage2-sm90/*.part-* >/dev/null 2>&1; then
    mkdir -p /tmp/site && cat third_party/sage2-sm90/*.part-* | tar -xzf - -C /tmp/site && echo "sage2 unpacked" >> "$LOG"
  else
    sage_build_start; sage_build_wait
  fi
}
case "${1:-A}" in
R)  # a refactor's check: the canonical job at BASE_TREE (a copy of the earlier commit, e.g. third_party/head) and at
    # this tree, in one lease, same card: latent hashes must match, step times within 1 %
  sage_unpack
  mkdir -p /tmp/pkg_base && ln -sfn "$PWD/${BASE_TREE:-third_party/head}" /tmp/pkg_base/h3_blackwell
  phase "canonical at ${BASE_TREE:-third_party/head}"
  ( cd "${BASE_TREE:-third_party/head}" && PYTHONPATH=/tmp/site:/tmp/pkg_base timeout 280 python3 bench/canonical.py \
      --runs 1 --warmup 1 --skip profile,accuracy,peer --out "$OUT/canonical-base.json" 2>&1 | tail -6 >> "$LOG" )
  phase "canonical at this tree"
  timeout 280 python3 bench/canonical.py --runs 1 --warmup 1 --skip profile,accuracy,peer \
    --out "$OUT/canonical-h200-structure.json" 2>&1 | tail -6 >> "$LOG"
  ;;
U)  # the jobs users run against core's stack (issue 37); one checkpoint write per fresh machine (/tmp/h3_user_jobs)
  if python3 -c "import sageattention" >/dev/null 2>&1; then
    :  # built or unpacked by an earlier call on this machine
  elif ls third_party/sage2-sm90/*.part-* >/dev/null 2>&1; then
    sage_unpack
  else  # no carried build: build it (.sage) while both stacks' files are written, then send it back for later calls
    sage_build_start
    phase "files while sage2 builds"
    timeout 400 python3 bench/user_jobs.py --prepare-only --merge --out "$OUT/uj-files.json" \
      --workdir /tmp/h3_user_jobs ${UJ_ARGS:-} --stacks ours,core 2>&1 | tail -4 >> "$LOG"
    sage_build_wait
    ( cd /tmp/site && tar czf - sageattention* ) | split -b 16000000 - "$OUT/sage2-sm90.tgz.part-" && ls -la "$OUT" >> "$LOG"
  fi
  if ls .whl/comfy_kitchen-*-cuda-cp312.tar.gz >/dev/null 2>&1; then kitchen_unpack; fi
  if [ "${UJ_TESTS:-0}" = 1 ]; then  # once per code change: the GPU tests of query-row chunks and the memory paths
    phase gpu-tests-attention-rows-and-memory
    timeout 240 python3 -m pytest -q -s -m gpu tests/gpu/test_attention_rows_gpu.py \
      tests/gpu/test_user_jobs_memory_gpu.py 2>&1 | grep -E "chunk|sage_kv|smallest|row-exact|passed|failed|skipped|Error" \
      | tail -16 >> "$LOG"
  fi
  if [ -n "${UJ_GPU_TESTS:-}" ]; then  # named GPU test files first (e.g. the load and LoRA paths a change touched)
    phase "gpu-tests ${UJ_GPU_TESTS}"
    # the whole output to its own file (the log keeps the summary: a failure's reason must not be cut off)
    timeout "${UJ_GPU_TESTS_TIMEOUT:-180}" python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short \
      ${UJ_GPU_TESTS} > "$OUT/gpu-tests.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -12 >> "$LOG"
  fi
  if [ "${UJ_SMOKE:-1}" = 1 ]; then  # core's carried stack on this machine's packages, tiny, on the CPU (~30 s):
    phase core-stack-smoke           # an import or load failure shows here, before the rows spend minutes
    timeout 120 python3 bench/user_jobs.py --tiny --stacks core --rows turbo8:resident --out "$OUT/uj-core-smoke.json" \
      --workdir /tmp/uj_smoke 2>&1 | tail -3 >> "$LOG"
    python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['rows'][0]['core']; print('core smoke:', c.get('error') or c['loaded_by'], c.get('lora'))" \
      "$OUT/uj-core-smoke.json" >> "$LOG" 2>&1
  fi
  UJ_OUT="${UJ_OUT:-bench/results/user-jobs.json}"  # merged into (copy the returned file back before the next call)
  # an UJ_OUT under $OUT (which comes back even when the call is cut off) starts from this machine's last merged file
  # (/tmp/uj-latest.json: an earlier call of this lease, which started from the tree's), else from the tree's file
  if [ ! -f "$UJ_OUT" ]; then
    if [ -f /tmp/uj-latest.json ]; then cp /tmp/uj-latest.json "$UJ_OUT"
    elif [ -f bench/results/user-jobs.json ]; then cp bench/results/user-jobs.json "$UJ_OUT"; fi
  fi
  # UJ_ARGS, then UJ_ARGS2 and UJ_ARGS3 where set: one bench call each, in turn, on what time is left (e.g. one
  # stack's rows, then the other stack's other rows; --merge keeps each row's other stack)
  n=0
  for args in "${UJ_ARGS:-}" "${UJ_ARGS2:-}" "${UJ_ARGS3:-}"; do
    n=$(( n + 1 )); [ "$n" -gt 1 ] && [ -z "$args" ] && continue
    phase "user-jobs $args"
    timeout $(( 590 - SECONDS )) python3 bench/user_jobs.py --merge --out "$UJ_OUT" --workdir /tmp/h3_user_jobs \
      $args 2>&1 | tail -20 >> "$LOG"
    # each call's result kept apart too: a later call cut off, or a command that writes over UJ_OUT, loses nothing
    [ -f "$UJ_OUT" ] && cp "$UJ_OUT" "$OUT/user-jobs.after-$n.json" && cp "$UJ_OUT" /tmp/uj-latest.json
  done
  [ "$(dirname "$UJ_OUT")" -ef "$OUT" ] || cp "$UJ_OUT" "$OUT/" 2>>"$LOG"
  ;;
G)  # the drop-in (core MODEL), control and low-VRAM (streaming) GPU tests + the Blackwell guards
  sage_unpack
  ls .whl/comfy_kitchen-*-cuda-cp312.tar.gz >/dev/null 2>&1 && kitchen_unpack  # the control test's sparse case
  for t in core_model_gpu control_gpu streaming_gpu blackwell_guards; do
    phase "gpu-tests $t"
    timeout 200 python3 -m pytest -q -m gpu "tests/gpu/test_${t}.py" -rfs 2>&1 | tail -8 >> "$LOG"
  done
  ;;
P)
  if ls .whl/pipeline/*.whl >/dev/null 2>&1; then
    phase pipeline-wheels
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/pipeline/*.whl \
      >> "$LOG" 2>&1
  fi
  if ls third_party/sage2-sm90/*.part-* >/dev/null 2>&1; then
    sage_unpack
  elif [ -d .sage ] && ! python3 -c "import sageattention" >/dev/null 2>&1; then
    sage_build_start; sage_build_wait
  fi
  if python3 -c "import diffusers, transformers, torchvision, sageattention" >> "$LOG" 2>&1; then
    phase diffusers-pipeline-bench
    timeout "${PIPE_TIMEOUT:-$(( 585 - SECONDS ))}" python3 bench/diffusers_pipeline.py \
      --out-dir "$OUT" ${PIPE_ARGS:-} 2>&1 | tail -6 >> "$LOG"
    phase diffusers-pipeline-gpu-test
    timeout 120 python3 -m pytest -q -s -m gpu tests/gpu/test_diffusers_pipeline_gpu.py -p no:cacheprovider 2>&1 \
      | grep -E "rel-L2|passed|failed|Error" | tail -6 >> "$LOG"
  else
    echo "diffusers-pipeline bench waits for the other carry (wheels or sage2)" >> "$LOG"
  fi
  ;;
A)
  sage_build_start
  phase nvfp4-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_nvfp4_gpu.py -rs 2>&1 | tail -25 >> "$LOG"
  phase nvfp4-bench
  timeout 150 python3 bench/nvfp4_h200.py 2>&1 | tail -15 >> "$LOG"
  sage_build_wait
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
  tiny_cuda
  phase peer
  NL=4 timeout 150 python3 bench/diffusers_peer.py 2>&1 | tail -3 >> "$LOG"
  cp bench/results/fc2-h200.json "$OUT/" 2>>"$LOG"
  ;;
F)
  sage_build_start; sage_build_wait
  canonical
  ;;
H)
  sage_build_start
  phase producers-sweep
  timeout 240 python3 bench/producers_h200.py --out "$OUT/producers-h200.json" --tiles-out /tmp/tiles.json 2>&1 | tail -8 >> "$LOG"
  cp /tmp/tiles.json "$OUT/producer-tiles-h200.json" 2>>"$LOG"
  phase fp8-producer-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_producers_gpu.py 2>&1 | tail -4 >> "$LOG"
  timeout 90 python3 -m pytest -q tests/runtime/ops/test_fp8_producers.py 2>&1 | tail -3 >> "$LOG"
  phase elementwise-sweep
  timeout 120 python3 bench/attention_h200.py --backends --out "$OUT/elementwise-h200.json" 2>&1 | grep -E "norm_rope|gate_add" >> "$LOG"
  # the NVFP4 RMSNorm producer now calls the shared _modulate helper: its bytes again, at full width
  nvfp4_bytes_tests
  sage_build_wait
  fused_v_tests
  for cfg in fp32:exact fast:exact fast:fast; do
    acc=${cfg%:*}; silu=${cfg#*:}
    phase "forward50 (H3_FP8_ACCUM=$acc H3_SILU=$silu, measured tiles)"
    H3_PRODUCER_TILES=/tmp/tiles.json H3_FP8_ACCUM=$acc H3_SILU=$silu timeout 150 python3 bench/forward50_h200.py \
      --out "$OUT/forward50-h200-$acc-$silu.json" 2>&1 | tail -3 >> "$LOG"
  done
  ;;
V)
  sage_build_start
  phase fp8-producer-gpu-tests
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_producers_gpu.py -rs 2>&1 | tail -6 >> "$LOG"
  phase nvfp4-bytes-gpu-tests
  nvfp4_bytes_tests
  sage_build_wait
  fused_v_tests
  canonical
  ;;
T)
  sage_build_start
  for t in nvfp4 fp8_producers fc2; do
    phase "gpu-tests $t"
    timeout 200 python3 -m pytest -q -m gpu "tests/gpu/test_${t}_gpu.py" -rfs 2>&1 | grep -v "h3_fc2_lt\] run" | tail -8 >> "$LOG"
  done
  sage_build_wait
  phase "gpu-tests attention"
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py -rfs 2>&1 | tail -8 >> "$LOG"
  tiny_cuda
  ;;
L)
  sage_build_start
  phase load-bench
  timeout 300 python3 bench/load_h200.py --out "$OUT/load-h200.json" 2>&1 | tail -6 >> "$LOG"
  sage_build_wait
  CANON_ARGS="${CANON_ARGS:---skip peer}" canonical
  ;;
S)  # sparse attention (issue 17), part 1: GPU tests + the sparse rows merged into attention-h200.json (+ sage2 build)
  kitchen_unpack
  sage_build_start
  phase sparse-gpu-tests
  timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_sparse_attention_gpu.py -rs 2>&1 \
    | grep -E "probe|rel_l2|passed|failed|skipped|Error" | tail -12 >> "$LOG"
  phase sparse-attention-bench
  cp bench/results/attention-h200.json "$OUT/attention-h200.json"
  timeout 300 python3 bench/attention_h200.py --backends sparse --merge --out "$OUT/attention-h200.json" 2>&1 \
    | tail -22 >> "$LOG"
  sage_build_wait
  ;;
Z)  # sparse attention (issue 17), part 2: the sparse canonical (sage2 for the dense steps; a no-op build if S ran here)
  kitchen_unpack
  sage_build_start; sage_build_wait
  canonical_sparse
  ;;
M)  # core's sparse methods (issue 38), part 1: GPU tests (sage2 carried, or built while they run)
  kitchen_unpack
  if ls third_party/sage2-sm90/*.part-* >/dev/null 2>&1; then sage_unpack; else sage_build_start; fi
  phase sparse-methods-gpu-tests
  timeout 240 python3 -m pytest -q -s -m gpu tests/gpu/test_sparse_methods_gpu.py tests/gpu/test_sparse_attention_gpu.py \
    -rs 2>&1 | grep -E "rel_l2|passed|failed|skipped|Error|assert" | tail -20 >> "$LOG"
  [ -n "${SAGE:-}" ] && sage_build_wait
  ;;
N)  # core's sparse methods (issue 38), part 2: the bench (sage2 for the dense steps; a no-op where M ran here)
  kitchen_unpack
  python3 -c "import sageattention" 2>/dev/null || sage_unpack
  if [ "${SPARSE_TESTS:-0}" = 1 ]; then  # the sparse working set against comfy-kitchen's plan (the memory model)
    phase sol-plans
    python3 scripts/sol_plans.py > "$OUT/sol-plans.json" 2>> "$LOG"
    phase sparse-memory-gpu-test
    timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_sparse_memory_gpu.py -rs 2>&1 \
      | grep -E "modelled|bytes|passed|failed|skipped|Error|assert" | tail -12 >> "$LOG"
  fi
  phase "sparse-methods bench ${SPARSE_ARGS:-}"
  # --merge keeps the rows of the tree's bench/results/sparse-methods.json (an earlier lease's other job)
  case " ${SPARSE_ARGS:-} " in *" --merge "*) cp bench/results/sparse-methods.json "$OUT/" 2>>"$LOG" ;; esac
  timeout "$(( 590 - SECONDS ))" python3 bench/sparse_methods.py --out "$OUT/sparse-methods.json" ${SPARSE_ARGS:-} \
    2>&1 | grep -v "^VSA: the model has no" | tail -14 >> "$LOG"  # a warning line; the vsa rows name it too
  ;;
*)
  echo "usage: $0 A|B|F|G|H|L|M|N|R|S|T|V|Z" >&2; exit 2
  ;;
esac
phase done
