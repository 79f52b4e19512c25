#!/usr/bin/env python3
"""comfy-kitchen's Sol-Attn workspace plans (``_C.sol_attn_plan``) for a grid of shapes -> JSON on stdout, beside
``runtime.budget.sol_workspace_bytes`` of each, with the device, command and versions (run where comfy-kitchen's
CUDA extension imports: Python >= 3.12; scripts/device_session.sh N with SPARSE_TESTS=1).

    python3 scripts/sol_plans.py > bench/results/sol-plans.json
"""
import importlib.metadata
import json
import sys
from pathlib import Path

import torch
from comfy_kitchen.backends.cuda import _C

from h3_blackwell.runtime.budget import sol_workspace_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _h3bench import bench_command, versions  # noqa: E402

SHAPES = [(h, n, a) for h in (2, 4, 48) for n in (64, 100, 4458, 5862, 45000, 73486, 140000) for a in (0, 64, 256)]


def main() -> int:
    rows = [{"heads": h, "rows": n, "token_aug": a, "total": _C.sol_attn_plan(1, n, h, token_aug=a)["total"],
             "modelled": sol_workspace_bytes(h, n, a)} for h, n, a in SHAPES]
    ck = importlib.metadata.version("comfy-kitchen")
    json.dump({"name": "sol-plans", "command": bench_command(), "device": torch.cuda.get_device_name(),
               "versions": versions(comfy_kitchen=ck), "comfy_kitchen": ck, "plans": rows}, sys.stdout, indent=1)
    bad = [r for r in rows if r["total"] != r["modelled"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} equal; differ: {bad[:5]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
