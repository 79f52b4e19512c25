# Sourced by run_tiny.sh and test.sh: make ./.venv with torch and this package installed.
# H3_PYTHON picks the interpreter (default python3); H3_TORCH the torch requirement
# (default torch==2.13.0, which on the project's CI machines installs the CPU build from local disk).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${H3_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "${H3_PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "${H3_TORCH:-torch==2.13.0}"
fi
export PATH="$VENV/bin:$PATH"
