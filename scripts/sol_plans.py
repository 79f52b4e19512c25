#!/usr/bin/env python3
"""comfy-kitchen's Sol-Attn workspace plans (``_C.sol_attn_plan``) for a grid of shapes -> JSON on stdout, beside
``runtime.budget.sol_workspace_bytes`` of each (run where comfy-kitchen's CUDA extension imports: Python >= 3.12).

    python3 scripts/sol_plans.py > tests/fixtures/sol_plans_ck0240.json
"""
import importlib.metadata
import json
import sys

from comfy_kitchen.backends.cuda import _C

from h3_blackwell.runtime.budget import sol_workspace_bytes

SHAPES = [(h, n, a) for h in (2, 4, 48) for n in (64, 100, 4458, 5862, 45000, 73486, 140000) for a in (0, 64, 256)]


def main() -> int:
    rows = [{"heads": h, "rows": n, "token_aug": a, "total": _C.sol_attn_plan(1, n, h, token_aug=a)["total"],
             "modelled": sol_workspace_bytes(h, n, a)} for h, n, a in SHAPES]
    json.dump({"comfy_kitchen": importlib.metadata.version("comfy-kitchen"), "plans": rows}, sys.stdout, indent=1)
    bad = [r for r in rows if r["total"] != r["modelled"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} equal; differ: {bad[:5]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
