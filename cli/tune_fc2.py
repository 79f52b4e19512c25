"""``h3-blackwell tune-fc2``: sweep cuBLASLt configurations for FC2 on this GPU and write a table entry.

The sweep itself (candidates, byte-identity with torch's GEMM, determinism, alternating timing) is the
runtime's ``fc2_tune.tune``; this module is its command line. Exit status: 0 an entry was written, 1 no
configuration was byte-identical to the reference (nothing written), 2 a usage or environment error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import torch

from ..runtime import RuntimeOptions, fc2_tune, write_file


def build_parser() -> argparse.ArgumentParser:
    canon = fc2_tune.CANONICAL
    p = argparse.ArgumentParser(prog="h3-blackwell tune-fc2", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto", choices=("auto",) + fc2_tune.KINDS,
                   help="operand dtype; auto = nvfp4 on compute capability >= 10, else bf16")
    p.add_argument("--role", default=fc2_tune.ROLE_FC2)
    p.add_argument("--m", type=int, default=canon["m_logical"],
                   help=f"logical rows (default: canonical {canon['m_logical']})")
    p.add_argument("--m-padded", type=int, default=None, help="descriptor rows (default: --m rounded up to 16)")
    p.add_argument("--n", type=int, default=canon["n"])
    p.add_argument("--k", type=int, default=canon["k"])
    p.add_argument("--scale-mode", default=None, help="fp8: tensor | outer (default tensor)")
    p.add_argument("--producer", default=None, help="record the activation producer this entry requires")
    p.add_argument("--workspace-mb", type=float, default=0.0,
                   help="workspace limit of the pinned candidates (default 0: zero-workspace configs only)")
    p.add_argument("--heuristic-workspace-mb", type=float, default=32.0,
                   help="workspace the unpinned heuristic baseline may use (default 32)")
    p.add_argument("--max-candidates", type=int, default=300, help="legal configurations executed for exactness")
    p.add_argument("--top", type=int, default=6, help="exact configurations carried into the timed rounds")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", type=int, default=3, help="random inputs every finalist must be exact on")
    p.add_argument("--check-seconds", type=float, default=90.0, help="time limit of the AlgoCheck sweep")
    p.add_argument("--run-seconds", type=float, default=120.0, help="time limit of the exactness runs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-dir", default=None, help="overrides H3_CACHE_DIR / RuntimeOptions.cache_dir")
    p.add_argument("--out", default=None, help="entry JSON path (default: <cache_dir>/fc2_lt/table/<name>.json)")
    p.add_argument("--evidence", default=None, help="also write the full evidence (entry or not) to this path")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 entry written, 1 no exact configuration, 2 usage or environment error."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    a = build_parser().parse_args(argv)
    options = RuntimeOptions.from_env(cache_dir=a.cache_dir)
    if not torch.cuda.is_available():
        print("error: tune-fc2 needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    dtype = fc2_tune.auto_dtype(device) if a.dtype == "auto" else a.dtype
    m_padded = a.m_padded if a.m_padded is not None else (a.m + 15) // 16 * 16
    if m_padded < a.m:
        print(f"error: --m-padded {m_padded} < --m {a.m}", file=sys.stderr)
        return 2
    try:
        problem = fc2_tune.TuneProblem(dtype, a.m, m_padded, a.n, a.k, a.role, int(a.workspace_mb * (1 << 20)),
                                       a.scale_mode)
        sweep = fc2_tune.TuneSweep(max_candidates=a.max_candidates, top=a.top, rounds=a.rounds, seeds=a.seeds,
                                   check_seconds=a.check_seconds, run_seconds=a.run_seconds,
                                   heuristic_workspace=int(a.heuristic_workspace_mb * (1 << 20)))
        res = fc2_tune.tune(problem, sweep, cache_dir=options.cache_dir, device=device, producer=a.producer,
                            command="h3-blackwell tune-fc2 " + " ".join(argv), say=lambda s: print(s, file=sys.stderr))
    except Exception as e:  # noqa: BLE001 - one line, exit 2
        print(f"error: tune-fc2: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.evidence:
        text = json.dumps(res, indent=1, default=str)
        write_file(a.evidence, lambda tmp: tmp.write_text(text))  # a unique temporary name, then one rename
    if res["entry"] is None:
        print("no byte-identical configuration found; nothing written", file=sys.stderr)
        return 1
    print(str(fc2_tune.write_entry(res["entry"], options.cache_dir, a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
