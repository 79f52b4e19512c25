#!/usr/bin/env bash
# ComfyUI core's H3 model code, and the two packages it imports that the GPU machine lacks, into .core_peer/
# (git-ignored: /.core_peer/ in .git/info/exclude; never committed) for bench/core_peer.py. Run HERE:
#
#   bash scripts/pack_core_peer.sh [COMFYUI_DIR]            # default: the vendored one scripts/test.sh unpacks
#                                                           # (.comfyui/paths.env), else /work/ext/ComfyUI
#
# then on the device, from the repo root, with run(carry=[".core_peer"]):   python3 bench/core_peer.py
#
# Environment:
#   COMFYUI_PY    a python with ComfyUI's requirements installed (default: .comfyui's venv, else
#                 /work/ext/comfy-venv/bin/python)
#   COMFY_COMMIT  the checkout's commit, recorded in MANIFEST.json (default: `git rev-parse HEAD` in the checkout)
#   COMFY_GIT     a git dir holding that commit: every copied file is compared with its blob there
#   DEVICE_PY     the device's python version for the comfy-kitchen wheel (default 3.12)
#
# What .core_peer/ holds:
#   ComfyUI/...     the checkout's files that core's model path loads: found by importing comfy.ldm.minimax.model
#                   (which imports comfy.ops, comfy.quant_ops and comfy.ldm.modules.attention) with COMFYUI_PY,
#                   running one tiny forward of each weight format on the CPU and loading a tiny fp8 file and a
#                   LoRA as a workflow does (comfy.sd.load_diffusion_model, load_lora_for_models,
#                   load_models_gpu), then listing sys.modules whose files live in the checkout (function-level
#                   imports on those paths included)
#   site/comfy_aimdo    imported by comfy.ops and comfy.model_management at module level; its ctypes libraries are
#                   loaded only by comfy_aimdo.control.init, which main.py calls and the bench does not
#   comfy_kitchen-VER-cuda-cpXY.tar.xz   comfy-kitchen at the version COMFYUI_PY has (ComfyUI's requirements.txt
#                   pin) for the device's python, without its ROCm extension (a CUDA machine never loads it),
#                   xz-compressed (the CUDA extension is 176 MB unpacked); bench/core_peer.py unpacks it under /tmp
#   MANIFEST.json   checkout, commit, file list with sha256, package versions, third-party imports seen
# The other third-party modules core's model path imports (numpy, einops, psutil, safetensors, PIL, sympy, tqdm,
# triton, packaging, typing_extensions) are in the device image (.library/device/KINDS.md).
set -euo pipefail
# defaults: the vendored ComfyUI and its venv that scripts/test.sh builds (.comfyui/paths.env), else /work/ext
PATHS_ENV="$(dirname "$0")/../.comfyui/paths.env"
if [[ -f "$PATHS_ENV" ]]; then source "$PATHS_ENV"; fi
COMFY="$(cd "${1:-${H3_COMFYUI_SRC:-/work/ext/ComfyUI}}" && pwd)"
PY="${COMFYUI_PY:-${H3_COMFYUI_PYTHON:-/work/ext/comfy-venv/bin/python}}"
DEVICE_PY="${DEVICE_PY:-3.12}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$REPO/.core_peer"
DL="${TMPDIR:-/tmp}/core_peer_dl"
if [[ ! -f "$COMFY/comfy/ldm/minimax/model.py" ]]; then
  echo "error: $COMFY has no comfy/ldm/minimax/model.py (need a ComfyUI checkout with core H3)" >&2
  exit 2
fi
EXCLUDE="$(cd "$REPO" && realpath -m "$(git rev-parse --git-path info/exclude)")"  # a worktree's .git is a file
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.core_peer/' "$EXCLUDE" 2>/dev/null || echo '/.core_peer/' >> "$EXCLUDE"
# the checkout's own commit (not that of a repository around it), or the vendored archive's (comfyui-<commit>)
if [[ "$(git -C "$COMFY" rev-parse --show-toplevel 2>/dev/null)" == "$COMFY" ]]; then
  OWN="$(git -C "$COMFY" rev-parse HEAD)"
elif [[ "$(basename "$COMFY")" =~ ^comfyui-([0-9a-f]{7,40})$ ]]; then
  OWN="${BASH_REMATCH[1]}"
else
  OWN=unknown
fi
COMMIT="${COMFY_COMMIT:-$OWN}"

rm -rf "$OUT"
mkdir -p "$OUT/ComfyUI" "$OUT/site" "$DL"
LIST="$DL/files.json"
# the import closure: run from the checkout with --cpu, as tests/oracles/check_core.py does
(cd "$COMFY" && PYTHONDONTWRITEBYTECODE=1 "$PY" - "$COMFY" "$LIST" <<'EOF'
import json, os, sys, types
root, out = os.path.realpath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, root)
sys.argv = ["main.py", "--cpu", "--use-pytorch-cross-attention"]
before = set(sys.modules)
import comfy.options
comfy.options.enable_args_parsing()
import torch
import comfy.ldm.minimax.model as mm
import comfy.ops

# one tiny forward per weight format, so modules imported inside functions on the forward path are seen too
kw = dict(hidden_size=96, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4, attention_head_dim=32,
          ffn_hidden_size=160, text_dim=64, time_embed_hidden_size=96, time_embed_dim=48, rope_inv_freq_len=4)
for quant in (None, {"mixed_ops": True}):
    ops = comfy.ops.pick_operations(torch.float32, torch.float32 if quant else None,
                                    model_config=types.SimpleNamespace(quant_config=quant))
    m = mm.MiniMaxH3Model(**kw, dtype=torch.float32, device="cpu", operations=ops).requires_grad_(False)  # as BaseModel
    for name, mod in m.named_modules():
        if isinstance(mod, ops.Linear):
            sd = {"weight": torch.randn(mod.out_features, mod.in_features) * 0.05}
            if mod.bias is not None:
                sd["bias"] = torch.zeros(mod.out_features)
            if quant and name.endswith("mlp.fc1"):
                q = json.dumps({"format": "float8_e4m3fn"}).encode()
                sd.update(weight=sd["weight"].to(torch.float8_e4m3fn), weight_scale=torch.tensor(1.0),
                          comfy_quant=torch.tensor(list(q), dtype=torch.uint8))
            mod.load_state_dict(sd, strict=False)
    for name, p in m.named_parameters():
        if p.dtype.is_floating_point and p.dtype.itemsize > 1 and "norm" in name:
            p.data.fill_(1.0)
    m.rope.inv_freq.copy_(10000.0 ** (-torch.arange(4.0) / 4))
    with torch.inference_mode():
        ctx = m.preprocess_text_embeds(torch.randn(1, 5, 64))
        v, a = m([torch.randn(1, 24, 3, 4, 6), torch.randn(1, 32, 2, 5)], torch.tensor([500.0]), ctx,
                 minimax_payload={"layout": mm.PackedLayout(5, 3, 4, 6, 5)})
    assert torch.isfinite(v).all() and torch.isfinite(a).all(), "tiny forward not finite"
# core's model management and LoRA path as bench/user_jobs.py drives them (ModelPatcher, load_models_gpu,
# comfy.lora.load_lora + add_patches), so what they import inside functions is listed too
import comfy.lora, comfy.model_management, comfy.model_patcher, comfy.utils
patcher = comfy.model_patcher.ModelPatcher(m, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
lin = "blocks.0.attn.out_proj"
w = m.get_submodule(lin).weight
lora = {f"{lin}.lora_A.weight": torch.randn(2, w.shape[1]), f"{lin}.lora_B.weight": torch.randn(w.shape[0], 2),
        f"{lin}.alpha": torch.tensor(2.0)}
patcher.add_patches(comfy.lora.load_lora(lora, {lin: f"{lin}.weight"}), 1.0)
comfy.model_management.load_models_gpu([patcher])
# and as a user's workflow loads it (UNETLoader, LoraLoaderModelOnly): core's fp8 file of the last tiny model
import tempfile
import comfy.sd
from safetensors.torch import save_file
with tempfile.TemporaryDirectory() as d:
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file(sd, f"{d}/core.safetensors", metadata={"config": json.dumps({"transformer": kw})})
    loaded = comfy.sd.load_diffusion_model(f"{d}/core.safetensors")
    lora_dm = {f"diffusion_model.{k}": v for k, v in lora.items()}
    loaded, _ = comfy.sd.load_lora_for_models(loaded, None, lora_dm, 1.0, 0)
    assert loaded.patches, "core's LoRA key map matched nothing"
    comfy.model_management.load_models_gpu([loaded])

files, third = [], {}
for name, mod in sorted(sys.modules.items()):
    f = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", None) or ()), None)  # namespace pkgs
    if not f or not os.path.isabs(f):  # torch.classes / torch.ops carry relative pseudo-file names
        continue
    f = os.path.realpath(f)
    if f.startswith(root + os.sep):
        if os.path.isfile(f):  # a namespace package (comfy, comfy.ldm, ...) is a folder: its files are listed
            files.append(os.path.relpath(f, root))
    elif name not in before and "." not in name and not f.startswith(os.path.realpath(sys.base_prefix) + os.sep):
        third[name] = f
import importlib.metadata as md
vers = {p: md.version(p) for p in ("comfy-kitchen", "comfy-aimdo")}
json.dump({"files": sorted(set(files)), "third_party": third, "versions": vers,
           "aimdo_dir": os.path.dirname(sys.modules["comfy_aimdo.control"].__file__)}, open(out, "w"), indent=1)
print(f"core's model path: {len(files)} files of the checkout, third-party {sorted(third)}")
EOF
)

read -r KVER AIMDO_DIR < <("$PY" -c "import json, sys; d = json.load(open(sys.argv[1]))
print(d['versions']['comfy-kitchen'], d['aimdo_dir'])" "$LIST")
"$PY" -c "import json,sys; print('\n'.join(json.load(open(sys.argv[1]))['files']))" "$LIST" | while read -r f; do
  mkdir -p "$OUT/ComfyUI/$(dirname "$f")" && cp "$COMFY/$f" "$OUT/ComfyUI/$f"
done
# comfy_aimdo: abi3 (cp39) wheel contents, the same files on the device's python
cp -r "$AIMDO_DIR" "$OUT/site/comfy_aimdo"

# comfy-kitchen for the device's python (cp312-abi3 wheel), ROCm extension dropped, xz
TAG="cp${DEVICE_PY/./}"
KARCH="$OUT/comfy_kitchen-$KVER-cuda-$TAG.tar.xz"
WHEEL="$(ls "$DL"/comfy_kitchen-"$KVER"-*.whl 2>/dev/null | head -1 || true)"
if [[ -z "$WHEEL" ]]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$DEVICE_PY" \
    --platform manylinux_2_28_x86_64 -d "$DL" "comfy-kitchen==$KVER"
  WHEEL="$(ls "$DL"/comfy_kitchen-"$KVER"-*.whl | head -1)"
fi
KTMP="$(mktemp -d)"
trap 'rm -rf "$KTMP"' EXIT
"$PY" -m zipfile -e "$WHEEL" "$KTMP"
rm -f "$KTMP"/comfy_kitchen/backends/hip/_C*.so
tar -cf - -C "$KTMP" . | xz -T0 -6 > "$KARCH"

# the manifest: commit, files with sha256 (and whether each matches the commit's blob), versions
"$PY" - "$COMFY" "$OUT" "$LIST" "$COMMIT" "${COMFY_GIT:-}" "$(basename "$WHEEL")" "$(basename "$KARCH")" <<'EOF'
import hashlib, json, subprocess, sys
comfy, out, lst, commit, git, wheel, arch = sys.argv[1:8]
d = json.load(open(lst))
files = {}
for f in d["files"]:
    data = open(f"{out}/ComfyUI/{f}", "rb").read()
    e = {"sha256": hashlib.sha256(data).hexdigest()}
    if git:
        def git_out(*cmd):
            return subprocess.run(["git", *cmd], capture_output=True, text=True).stdout.strip()
        blob = git_out("--git-dir", git, "rev-parse", f"{commit}:{f}")
        own = git_out("hash-object", f"{out}/ComfyUI/{f}")
        e["matches_commit"] = bool(blob) and blob == own
    files[f] = e
m = {"checkout": comfy, "commit": commit, "files": files, "versions": d["versions"],
     "kitchen_wheel": wheel, "kitchen_archive": arch,
     "third_party_imports": sorted(d["third_party"]),
     "carried_packages": ["comfy_aimdo (site/)", f"comfy_kitchen ({arch})"]}
if git:
    m["all_files_match_commit"] = all(e["matches_commit"] for e in files.values())
json.dump(m, open(f"{out}/MANIFEST.json", "w"), indent=1)
print(f"commit {commit}" + (f"; all files match it: {m['all_files_match_commit']}" if git else ""))
EOF
find "$OUT" -name __pycache__ -prune -exec rm -rf {} +
for p in "$OUT/ComfyUI" "$OUT/site" "$KARCH" "$OUT"; do du -sh "$p"; done
echo "carry: run(carry=[\".core_peer\"], ...)  (counts towards the 64 MiB the working tree may carry)"
