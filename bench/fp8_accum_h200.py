#!/usr/bin/env python3
"""The four block GEMMs of W4A8 at 37,810 rows: rowwise-scaled e4m3 cuBLAS with and without Hopper's fast
(reduced-precision) fp8 accumulation -- time, and the error of each against an fp64 product of the same e4m3
operands (on a 2048-row slice).

    python3 bench/fp8_accum_h200.py [--out bench/results/fp8-accum-h200.json]

The project runs ``use_fast_accum=False``; this measures what the other setting would buy and cost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import time_ms, versions, write_json  # noqa: E402
from nvfp4_h200 import LAYERS, M  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fp8-accum-h200.json"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"name": "fp8-accum-h200", "command": "python3 " + " ".join(shlex.quote(x) for x in sys.argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
           "versions": versions(), "M": M, "layers": {}}
    total = {False: 0.0, True: 0.0}
    for name, (k, n) in LAYERS.items():
        x8 = torch.randn(M, k, device=dev, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn)
        w8 = torch.randn(n, k, device=dev, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = torch.rand(M, 1, device=dev, generator=g) * 0.01 + 0.001
        sb = torch.rand(1, n, device=dev, generator=g) * 0.01 + 0.001
        ref = ((x8[:2048].double() * sa[:2048].double()) @ (w8.double() * sb.double().t()).t())
        entry = {"K": k, "N": n}
        for fast in (False, True):
            fn = lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,  # noqa: E731
                                          use_fast_accum=fast)
            t = time_ms(fn, a.iters, a.warmup)
            y = fn()[:2048].double()
            err = float((y - ref).norm() / ref.norm())
            entry["fast_accum" if fast else "fp32_accum"] = {
                "ms": round(t["median"], 4), "tflops": round(2.0 * M * n * k / (t["median"] * 1e-3) / 1e12, 1),
                "rel_l2_vs_fp64": err}
            total[fast] += t["median"]
        res["layers"][name] = entry
        print(name, json.dumps(entry), flush=True)
        del x8, w8, ref
    res["block_ms"] = {"fp32_accum": round(total[False], 4), "fast_accum": round(total[True], 4)}
    write_json(res, a.out)
    print(json.dumps(res["block_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
