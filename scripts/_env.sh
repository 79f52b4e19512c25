# Sourced by run_tiny.sh and test.sh: make ./.venv and put it first on PATH; `h3_install EXTRAS` then installs
# torch and this package (editable, with the optional-dependency groups EXTRAS, e.g. "preview" or
# "test,cuda-headers") unless that exact install is already there and current.
# H3_PYTHON picks the interpreter (default python3); H3_TORCH the torch requirement
# (default torch==2.13.0, which on the project's CI machines installs the CPU build from local disk).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${H3_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "${H3_PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

# The state an install leaves, in one line: pyproject.toml's hash, the extras, the editable install's source
# folder and version, and every requirement of the base and the extras found installed. "missing" when the
# package is not installed from this folder or a requirement is absent (no import of torch: ~50 ms).
_h3_install_state() {
  "$PY" -I - "$ROOT" "$1" <<'EOF'  # -I: not the repository's own egg-info from the cwd
import hashlib, importlib.metadata as md, json, re, sys
root, extras = sys.argv[1], [e for e in sys.argv[2].split(",") if e]
try:
    dist = md.distribution("h3-blackwell")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    found = []
    for req in dist.requires or []:
        name, _, marker = req.partition(";")
        extra = re.search(r'extra\s*==\s*"([^"]+)"', marker)
        if extra is None or extra.group(1) in extras:
            pkg = re.match(r"[A-Za-z0-9_.-]+", name.strip()).group(0)
            found.append(f"{pkg}={md.version(pkg)}")
except md.PackageNotFoundError:
    print("missing")
    raise SystemExit
if url != f"file://{root}":
    print("missing")
    raise SystemExit
with open(f"{root}/pyproject.toml", "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:16]
print(digest, ",".join(extras), url, dist.version, *sorted(found))
EOF
}

h3_install() {
  local extras="$1" stamp="$VENV/.h3-blackwell-install-${1:-base}" log
  if [ -f "$stamp" ] && [ -x "$VENV/bin/h3-blackwell" ] && [ "$(_h3_install_state "$extras")" = "$(cat "$stamp")" ]; then
    return 0  # installed from this folder with these extras, pyproject.toml unchanged, every requirement present
  fi
  echo "installing h3-blackwell${extras:+[$extras]} into $VENV (torch and what it needs; once, about a minute" \
       "the first time)..." >&2
  log="$(mktemp)"  # pip's and setuptools' chatter, shown only when the install fails
  if ! { { "$PY" -m pip install -q --upgrade pip || true; } \
         && { "$PY" -c "import torch" || "$PY" -m pip install -q "${H3_TORCH:-torch==2.13.0}"; } \
         && "$PY" -m pip install -q -e "$ROOT${extras:+[$extras]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "error: installing h3-blackwell${extras:+[$extras]} into $VENV failed (pip's output above)" >&2
    return 1
  fi
  rm -f "$log"
  _h3_install_state "$extras" >"$stamp"
}
