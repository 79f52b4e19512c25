# Sourced by test.sh (after _env.sh, which sets ROOT): a real ComfyUI for the tests marked `comfyui`.
#
# Unpacks the vendored ComfyUI source ($H3_SHARED/vendor/comfyui-0f1fa67a.tar.gz; H3_SHARED defaults to the
# repository's sibling folder ../shared) into $H3_COMFY_HOME/src and builds ComfyUI's own virtual environment in
# $H3_COMFY_HOME/venv (H3_COMFY_HOME defaults to $ROOT/.comfyui). A stamp records what was built, so a later
# run starts at once; a changed archive, pin list or Python rebuilds it. Exports for the tests:
#   H3_COMFYUI_SRC     the ComfyUI source folder (its main.py)
#   H3_COMFYUI_PYTHON  the interpreter of ComfyUI's venv
#   H3_COMFYUI_SKIP    set (with the reason) where the archive is absent: the comfyui tests skip and say why
#   H3_COMFYUI_ERROR   set (with the reason) where the build failed: the comfyui tests fail and say why
# The same paths are written to $H3_COMFY_HOME/paths.env for a pytest started without test.sh.
#
# The venv (see ../shared/vendor/VENDOR.md): torch 2.14.1 + torchvision 0.29.1 (CUDA builds from the package index,
# they run on the CPU; a CPU torch does not load PyPI's torchvision), torchaudio 2.11.1 with --no-deps (core's H3
# nodes import it; no torchaudio of torch 2.14's own release is on the index), then ComfyUI's requirements.txt
# without those three.
H3_COMFY_REV=0f1fa67a
H3_COMFY_PINS="torch==2.14.1 torchvision==0.29.1 torchaudio==2.11.1(no-deps)"

_h3_comfy_setup() {
  local shared="${H3_SHARED:-$(dirname "$ROOT")/shared}"
  local home="${H3_COMFY_HOME:-$ROOT/.comfyui}"
  local archive="$shared/vendor/comfyui-$H3_COMFY_REV.tar.gz"
  local src="$home/src/comfyui-$H3_COMFY_REV" venv="$home/venv" stamp="$home/venv/.h3-comfyui-stamp"
  unset H3_COMFYUI_SRC H3_COMFYUI_PYTHON H3_COMFYUI_SKIP H3_COMFYUI_ERROR
  if [ ! -f "$archive" ]; then
    export H3_COMFYUI_SKIP="no vendored ComfyUI at $archive (set H3_SHARED to the folder holding vendor/)"
    return 0
  fi
  mkdir -p "$home"
  local want
  want="$H3_COMFY_REV $(sha256sum "$archive" | cut -c1-16) $H3_COMFY_PINS $(python3 -V 2>&1)"
  # one builder at a time (two test runs sharing H3_COMFY_HOME); the later one finds the stamp and goes on
  exec 8>"$home/.lock"
  flock 8
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ] && [ -f "$src/main.py" ]; then
    exec 8>&-
    _h3_comfy_export "$home" "$src" "$venv/bin/python"
    return 0
  fi
  echo "setting up ComfyUI $H3_COMFY_REV for the comfyui tests (first run, ~3 min; log: $home/install.log)..." >&2
  local t0=$SECONDS
  if _h3_comfy_build "$archive" "$home" "$src" "$venv" >"$home/install.log" 2>&1; then
    echo "$want" >"$stamp"
    echo "ComfyUI $H3_COMFY_REV ready in $((SECONDS - t0)) s" >&2
    _h3_comfy_export "$home" "$src" "$venv/bin/python"
  else
    tail -n 20 "$home/install.log" >&2
    export H3_COMFYUI_ERROR="building ComfyUI's venv in $venv failed (see $home/install.log); delete $home and rerun"
    echo "test.sh: $H3_COMFYUI_ERROR" >&2
  fi
  exec 8>&-  # closing the lock file releases the lock (and keeps it out of the tests' processes)
}

_h3_comfy_build() {  # each step must succeed (set -e does not hold inside an `if` condition)
  local archive="$1" home="$2" src="$3" venv="$4" py="$4/bin/python"
  rm -rf "$home/src" "$venv" && mkdir -p "$home/src" && tar -xzf "$archive" -C "$home/src" || return 1
  [ -f "$src/main.py" ] || { echo "the archive did not unpack to $src"; return 1; }
  grep -v -E '^(torch|torchvision|torchaudio)[[:space:]]*$' "$src/requirements.txt" >"$home/requirements.txt" \
    && python3 -m venv "$venv" \
    && "$py" -m pip install -q --upgrade pip \
    && "$py" -m pip install -q torch==2.14.1 torchvision==0.29.1 \
    && "$py" -m pip install -q --no-deps torchaudio==2.11.1 \
    && "$py" -m pip install -q -r "$home/requirements.txt" \
    && "$py" -c "import torch, torchvision, torchaudio, comfy_kitchen; print('torch', torch.__version__)" \
    && _h3_comfy_share "$py"
}

# The tests' venv and ComfyUI's hold the same torch 2.14.1 + torchvision wheels (5.5 GB, PyPI's CUDA builds): each
# file of 1 MB or more that is byte-identical, with the same mode, at the same place in both site-packages becomes
# one hard link, so the pair costs the disk once (CI's disk ran out with three copies of torch). pip replaces files
# (new inodes) when it changes a package, so neither venv can change the other's. A no-op across filesystems or
# without $PY (the tests' interpreter, from _env.sh).
_h3_comfy_share() {
  [ -n "${PY:-}" ] || return 0
  python3 - "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    "$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'EOF'
import filecmp, os, sys
ours, comfy = sys.argv[1:3]
saved = 0
for root, _, files in os.walk(comfy):
    for name in files:
        b = os.path.join(root, name)
        a = os.path.join(ours, os.path.relpath(b, comfy))
        try:
            sa, sb = os.stat(a), os.stat(b)
        except FileNotFoundError:
            continue
        if sb.st_size < 1 << 20 or (sa.st_size, sa.st_mode, sa.st_dev) != (sb.st_size, sb.st_mode, sb.st_dev) \
                or sa.st_ino == sb.st_ino or not filecmp.cmp(a, b, shallow=False):
            continue
        tmp = b + ".h3link"
        os.link(a, tmp)
        os.replace(tmp, b)
        saved += sb.st_size
print(f"shared {saved / 1e9:.2f} GB of identical files with {ours}")
EOF
}

_h3_comfy_export() {
  export H3_COMFYUI_SRC="$2" H3_COMFYUI_PYTHON="$3"
  printf 'H3_COMFYUI_SRC=%s\nH3_COMFYUI_PYTHON=%s\n' "$2" "$3" >"$1/paths.env"
}

_h3_comfy_setup
