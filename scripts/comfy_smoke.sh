#!/usr/bin/env bash
# Smoke test of the node pack inside a REAL ComfyUI server on the CPU.
#
# Starts ComfyUI (--cpu) with this repository symlinked into the custom_nodes of a scratch base directory,
# then drives it with `h3-blackwell comfy-run`:
#   1. /object_info lists the five H3B_ nodes
#   2. workflows/h3_smoke_tiny.api.json runs to success; the diagnostics JSON is written to the server's
#      output folder and fetched through /view (compared byte for byte)
#   3. its video sha256 is compared with `h3-blackwell generate` (same tiny model, states, canvas, seed, steps)
#   4. the expected-hash check passes with the right hash and fails loudly with a wrong one
#   5. node errors reach the runner as one message: a non-H3 latent (core EmptyLatentImage); a value over a
#      widget's maximum is rejected at /prompt
#   6. /interrupt stops a long run (execution_interrupted), and the resident model then runs again
#   7. where ComfyUI has core H3 support: core's EmptyMiniMaxH3LatentAV + SetLatentNoiseMask into our sampler
#
# The same checks (and more) run in CI against the vendored ComfyUI: tests/comfyui (`scripts/test.sh -m comfyui`).
#
# Usage: scripts/comfy_smoke.sh [--setup]
#   --setup   create what is missing first: the ComfyUI checkout (from COMFYUI_GIT_DIR, a git dir of
#             Comfy-Org/ComfyUI) and its venv.
# Environment: COMFYUI_DIR (default /work/comfyui), COMFYUI_VENV (default /work/comfyui-venv),
#   COMFYUI_GIT_DIR, PORT (default 8188), H3B (the h3-blackwell command; default .venv/bin/h3-blackwell),
#   WORK (scratch folder; default a new /tmp/h3b-comfy-smoke.*), KEEP_WORK=1 keeps it.
#
# What worked here (Oct-2025 ComfyUI snapshot a125cd8, Python 3.11, x86_64, no GPU):
#   * checkout: `git --git-dir=$COMFYUI_GIT_DIR archive HEAD -- . ':(exclude)comfy/text_encoders/llama_tokenizer/tokenizer.json' | tar -x`
#     (the stored snapshot lacks that >4 MiB file; only llama-tokenizer text encoders need it)
#   * venv: torch 2.14.1 + torchvision 0.29.1 (both from this machine's local wheels; PyPI torchvision does not
#     import beside the local torch 2.13.0), then ComfyUI's requirements.txt without torch/torchvision/torchaudio,
#     plus `transformers<5` and `requests`. torchaudio is left out: core's audio nodes then fail to import
#     (logged, harmless here); the pack needs only torch, safetensors, einops and numpy, all in that list.
#   * start: python main.py --cpu --listen 127.0.0.1 --port 8188 --base-directory <scratch> --database-url sqlite:///:memory:
# Also passes against a ComfyUI with core H3 support (upstream as of 2026-08-15, torch 2.14.1): its
# comfy_extras/nodes_minimax_h3.py imports torchaudio, so without it core's H3 nodes are missing (step 7
# is then skipped); torchaudio 2.11 (`pip install --no-deps torchaudio`) imports beside torch 2.14.1 there.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMFYUI_DIR=${COMFYUI_DIR:-/work/comfyui}
COMFYUI_VENV=${COMFYUI_VENV:-/work/comfyui-venv}
COMFYUI_GIT_DIR=${COMFYUI_GIT_DIR:-}
PORT=${PORT:-8188}
H3B=${H3B:-$REPO/.venv/bin/h3-blackwell}
WORK=${WORK:-$(mktemp -d /tmp/h3b-comfy-smoke.XXXXXX)}
SERVER="http://127.0.0.1:$PORT"
WORKFLOW="$REPO/workflows/h3_smoke_tiny.api.json"
SERVER_PID=""
CHECKS=0

die() { echo "comfy_smoke: FAIL: $*" >&2; [ -f "$WORK/comfyui.log" ] && tail -n 30 "$WORK/comfyui.log" >&2; exit 1; }
ok() { CHECKS=$((CHECKS + 1)); echo "comfy_smoke: ok: $*"; }
py() { "$COMFYUI_VENV/bin/python" - "$@"; }

cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  [ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

setup() {
  if [ ! -f "$COMFYUI_DIR/main.py" ]; then
    [ -n "$COMFYUI_GIT_DIR" ] || die "no ComfyUI in $COMFYUI_DIR; set COMFYUI_GIT_DIR to a git dir of Comfy-Org/ComfyUI"
    mkdir -p "$COMFYUI_DIR"
    git --git-dir="$COMFYUI_GIT_DIR" archive HEAD -- . \
      ':(exclude)comfy/text_encoders/llama_tokenizer/tokenizer.json' | tar -x -C "$COMFYUI_DIR"
  fi
  if [ ! -x "$COMFYUI_VENV/bin/python" ]; then
    python3 -m venv "$COMFYUI_VENV"
    case "$(uname -m)" in
      x86_64) torch_pins=("torch==2.14.1" "torchvision==0.29.1") ;;
      aarch64) torch_pins=("torch==2.9.1" "torchvision==0.24.1") ;;
      *) die "no known torch + torchvision pair for $(uname -m)" ;;
    esac
    "$COMFYUI_VENV/bin/pip" install -q "${torch_pins[@]}"
    grep -v -E '^(torch|torchvision|torchaudio)$' "$COMFYUI_DIR/requirements.txt" > "$WORK/requirements.txt"
    "$COMFYUI_VENV/bin/pip" install -q -r "$WORK/requirements.txt" 'transformers<5' requests
  fi
}

[ "${1:-}" = "--setup" ] && setup
[ -f "$COMFYUI_DIR/main.py" ] || die "no ComfyUI in $COMFYUI_DIR (run with --setup and COMFYUI_GIT_DIR)"
[ -x "$COMFYUI_VENV/bin/python" ] || die "no venv in $COMFYUI_VENV (run with --setup)"
[ -x "$H3B" ] || die "h3-blackwell not found at $H3B (install the repo: pip install -e .)"
if curl -s -o /dev/null "$SERVER/system_stats"; then die "something already listens on port $PORT"; fi

# --- start ComfyUI with the pack in a scratch base directory ---------------------------------------
mkdir -p "$WORK/base/custom_nodes" "$WORK/base/output" "$WORK/base/input"
ln -s "$REPO" "$WORK/base/custom_nodes/h3-blackwell"  # the folder name the README uses
(cd "$COMFYUI_DIR" && exec "$COMFYUI_VENV/bin/python" main.py --cpu --listen 127.0.0.1 --port "$PORT" \
  --base-directory "$WORK/base" --database-url "sqlite:///:memory:" > "$WORK/comfyui.log" 2>&1) &
SERVER_PID=$!
for _ in $(seq 1 240); do
  curl -s -o /dev/null "$SERVER/system_stats" && break
  kill -0 "$SERVER_PID" 2>/dev/null || die "ComfyUI exited during start"
  sleep 0.5
done
curl -s -o /dev/null "$SERVER/system_stats" || die "ComfyUI did not answer on $SERVER within 120 s"
grep -q "custom_nodes/h3-blackwell" "$WORK/comfyui.log" || die "the pack was not loaded"
if grep -q "IMPORT FAILED.*h3-blackwell" "$WORK/comfyui.log"; then die "the pack failed to import"; fi
ok "ComfyUI is up on $SERVER (pid $SERVER_PID, log $WORK/comfyui.log)"

# --- 1. node definitions -------------------------------------------------------------------------
curl -s "$SERVER/object_info" > "$WORK/object_info.json"
py "$WORK/object_info.json" <<'EOF' || die "/object_info lacks the H3 nodes"
import json, sys
info = json.load(open(sys.argv[1]))
ids = ["H3B_ModelLoader", "H3B_Sampler", "H3B_Diagnostics", "H3B_EmptyLatent", "H3B_TextStatesLoader"]
missing = [i for i in ids if i not in info]
assert not missing, missing
assert all(info[i]["category"] == "H3 Blackwell" for i in ids)
assert info["H3B_Sampler"]["output"] == ["LATENT", "H3_DIAGNOSTICS"]
assert info["H3B_Diagnostics"]["output_node"] is True
EOF
# every served definition against nodes/ (inputs, widget options, outputs): tests/comfyui/test_server.py
ok "/object_info serves the five H3B_ nodes"

# --- 2. the smoke workflow -------------------------------------------------------------------------
"$H3B" comfy-run "$WORKFLOW" --server "$SERVER" --output "$WORK/fetched" || die "comfy-run of $WORKFLOW failed"
written=$(ls "$WORK"/base/output/h3_blackwell/smoke_*_.json 2>/dev/null | head -n 1)
[ -n "$written" ] || die "no diagnostics JSON in the server's output folder"
cmp -s "$written" "$WORK/fetched/h3_blackwell/$(basename "$written")" || die "the fetched diagnostics JSON differs"
VIDEO_SHA=$(py "$written" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["latent_checksums"]["video"]["shape"] == [1, 24, 7, 16, 16], r["latent_checksums"]
print(r["latent_checksums"]["video_sha256"])
EOF
) || die "the diagnostics JSON is not a run report"
ok "smoke workflow succeeded; diagnostics JSON written ($written) and fetched; video sha256 $VIDEO_SHA"

# --- 3. same bytes as the CLI ---------------------------------------------------------------------
"$H3B" generate --output "$WORK/generate" > "$WORK/generate.log" 2>&1 || die "h3-blackwell generate failed"
CLI_SHA=$(py "$WORK/generate/report.json" <<'EOF'
import json, sys
print(json.load(open(sys.argv[1]))["latent_checksums"]["video_sha256"])
EOF
)
if [ "$CLI_SHA" = "$VIDEO_SHA" ]; then
  ok "ComfyUI's latent equals h3-blackwell generate's (sha256 $CLI_SHA)"
else
  echo "comfy_smoke: note: h3-blackwell generate gave $CLI_SHA (its torch build differs from ComfyUI's venv)"
fi

# --- 4. expected-hash regression check --------------------------------------------------------------
"$H3B" comfy-run "$WORKFLOW" --server "$SERVER" --output "$WORK/fetched2" --quiet \
  --set "5.expected_video_sha256=$VIDEO_SHA" || die "the matching expected hash was refused"
set +e
"$H3B" comfy-run "$WORKFLOW" --server "$SERVER" --output "$WORK/fetched3" --quiet \
  --set "5.expected_video_sha256=$(printf '0%.0s' $(seq 64))" 2> "$WORK/mismatch.err"
rc=$?
set -e
[ "$rc" = 1 ] && grep -q "H3 Diagnostics: video latent sha256 mismatch" "$WORK/mismatch.err" \
  || die "a wrong expected hash did not fail loudly (rc $rc): $(cat "$WORK/mismatch.err")"
ok "expected_video_sha256 passes when right and fails loudly when wrong"

# --- 5. errors reach the user as one message --------------------------------------------------------
py "$WORKFLOW" "$WORK/not_h3.api.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
p["3"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
json.dump(p, open(sys.argv[2], "w"))
EOF
set +e
"$H3B" comfy-run "$WORK/not_h3.api.json" --server "$SERVER" --output "$WORK/fetched4" --quiet 2> "$WORK/not_h3.err"
rc=$?
set -e
[ "$rc" = 1 ] && grep -q "node 4 (H3B_Sampler) failed: H3NodeError: H3 Sampler: expected an H3 audio+video LATENT" \
  "$WORK/not_h3.err" || die "a non-H3 latent did not give the sampler's message (rc $rc): $(cat "$WORK/not_h3.err")"
set +e
"$H3B" comfy-run "$WORKFLOW" --server "$SERVER" --output "$WORK/fetched5" --quiet --set 4.steps=500 \
  2> "$WORK/rejected.err"
rc=$?
set -e
[ "$rc" = 1 ] && grep -q "node 4 (H3B_Sampler) \[input steps\]: Value 500 bigger than max of 200" "$WORK/rejected.err" \
  || die "an out-of-range widget was not reported (rc $rc): $(cat "$WORK/rejected.err")"
ok "node errors arrive as one message (non-H3 latent; steps over the maximum)"

# --- 6. interruption ----------------------------------------------------------------------------------
set +e
"$H3B" comfy-run "$WORKFLOW" --server "$SERVER" --output "$WORK/fetched6" --quiet --set 4.steps=200 \
  --set 4.seed=2 2> "$WORK/interrupt.err" &
runner=$!
# interrupt only once the server runs the prompt: an /interrupt that arrives before it (a slow runner start on
# a loaded machine) clears nothing and the 200 steps run to the end
for _ in $(seq 1 240); do
  curl -s "$SERVER/queue" > "$WORK/queue.json" || true
  py "$WORK/queue.json" <<'EOF' && break
import json, sys
sys.exit(0 if json.load(open(sys.argv[1])).get("queue_running") else 1)
EOF
  sleep 0.5
done
sleep 2  # the loaders are cached: the sampler is into its 200 steps by now
curl -s -X POST "$SERVER/interrupt" > /dev/null
wait "$runner"
rc=$?
set -e
[ "$rc" = 1 ] && grep -q "interrupted at node 4 (H3B_Sampler)" "$WORK/interrupt.err" \
  || die "/interrupt did not stop the sampler (rc $rc): $(cat "$WORK/interrupt.err")"
"$H3B" comfy-run "$WORKFLOW" --server "$SERVER" --output "$WORK/fetched7" --quiet --set 4.seed=3 \
  || die "the resident model did not run again after the interruption"
ok "/interrupt stops the sampler between steps; the resident model runs again afterwards"

# --- 7. core's H3 nodes into our sampler (only where this ComfyUI has core H3 support) ----------------------
if py "$WORK/object_info.json" <<'EOF'
import json, sys
sys.exit(0 if "EmptyMiniMaxH3LatentAV" in json.load(open(sys.argv[1])) else 1)
EOF
then
  py "$WORKFLOW" "$WORK/core_latent.api.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
p["3"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 128, "height": 96, "length": 22}}
p["6"] = {"class_type": "SolidMask", "inputs": {"value": 0.5, "width": 128, "height": 96}}
p["7"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["3", 0], "mask": ["6", 0]}}
p["4"]["inputs"].update(latent=["7", 0], steps=2)
json.dump(p, open(sys.argv[2], "w"))
EOF
  "$H3B" comfy-run "$WORK/core_latent.api.json" --server "$SERVER" --output "$WORK/fetched8" --quiet \
    || die "core's EmptyMiniMaxH3LatentAV + SetLatentNoiseMask into the H3 Sampler failed"
  ok "core's EmptyMiniMaxH3LatentAV with SetLatentNoiseMask runs through the H3 Sampler"
else
  echo "comfy_smoke: note: this ComfyUI has no core H3 nodes; step 7 (core latent + noise mask) skipped"
fi

echo "comfy_smoke: all $CHECKS checks passed"
