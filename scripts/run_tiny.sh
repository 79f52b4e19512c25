#!/usr/bin/env bash
# The main job on a fresh machine: installs what it needs (once), then samples the embedded tiny H3 model
# end to end (GPU if there is one, else CPU) and writes out/tiny/{latents.safetensors,report.json}.
# Extra arguments go to `h3-blackwell generate` (e.g. --runs 3 --warmup 1).
set -euo pipefail
source "$(dirname "$0")/_env.sh"
h3_install preview  # Pillow for --preview; skipped (~0.1 s) when this install is already there and current
cd "$ROOT"
h3-blackwell generate --output out/tiny "$@"
