#!/usr/bin/env python3
"""W4A8 activation producers and the per-layer weight expansion at the canonical shapes: a tile sweep.

    python3 bench/producers_h200.py [--out bench/results/producers-h200.json] [--iters 10] [--warmup 3]

For each op (the shapes of one block at 37,810 rows, bf16 inputs) every candidate tile configuration of
``fp8_producers._tiles`` / ``nvfp4_producers._tiles`` is timed (CUDA events, median of ``--iters`` after
``--warmup``), and its output is checked against the torch reference once (``check_passed``: bytes equal;
for the fast-silu SwiGLU, codes within one e4m3 step and at most 1e-3 of them moved), so a configuration that
is fast but wrong is visible. GB/s = (input read once + output written) / time, next to
the device copy bandwidth of the same run. Writes ``{"command", "device", "versions", "copy_bandwidth",
"ops": {op: {"shape", "bytes", "configs": [{"scheme", "BM", "BK", "num_warps", "ms", "GBps", ...}],
"best"}}}``; the best configuration of each op is what ``_tiles`` should return on this GPU.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import bench_copy, err_text, time_ms, versions, write_json  # noqa: E402  (also makes the checkout importable as h3_blackwell)

from h3_blackwell.runtime.ops import fp8_producers as f8  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4_producers as qk  # noqa: E402

M = 37810
HIDDEN, INNER, FFN = 5376, 7168, 14336
WEIGHTS = {"qkv": (3 * INNER, HIDDEN), "out_proj": (HIDDEN, INNER), "fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def candidates(op: str, k: int) -> list[tuple]:
    """(scheme, BM, BK, NKT, num_warps) candidates for an fp8 producer of row width k."""
    row_bk = _pow2(k)
    out = [("row", 1, row_bk, 1, nw) for nw in (4, 8, 16, 32)]
    out += [("row", 2, row_bk, 1, nw) for nw in (8, 16)]
    for bm, bk, nw in ((16, 256, 4), (16, 256, 8), (8, 512, 4), (8, 512, 8), (4, 1024, 4), (4, 1024, 8),
                       (32, 128, 4), (2, 2048, 8)):
        out.append(("loop", bm, bk, -(-k // bk), nw))
    return out


def sweep(name: str, run, check, nbytes: int, cands, patch, iters: int, warmup: int, copy_gbps: float,
          check_text: str = "bytes equal the torch reference") -> dict:
    res: dict = {"bytes": nbytes, "check": check_text, "configs": []}
    for cand in cands:
        entry = {"config": list(cand)}
        try:
            with patch(cand):
                entry["check_passed"] = bool(check())
                t = time_ms(run, iters, warmup)
            gbps = nbytes / (t["median"] * 1e-3) / 1e9
            entry.update(ms=round(t["median"], 4), min_ms=round(t["min"], 4), GBps=round(gbps, 1),
                         fraction_of_copy=round(gbps / copy_gbps, 3))
        except Exception as e:
            entry["error"] = err_text(e)
        res["configs"].append(entry)
        print(f"{name} {cand}: {entry.get('ms', entry.get('error'))} ms", flush=True)
    ok = [c for c in res["configs"] if "ms" in c and c["check_passed"]]
    res["best"] = min(ok, key=lambda c: c["ms"]) if ok else None
    return res


class _F8Tiles:
    def __init__(self, cand):
        self.cand = cand

    def __enter__(self):
        self.saved = f8._tiles
        f8._tiles = lambda op, k, device, scheme: self.cand
        return self

    def __exit__(self, *a):
        f8._tiles = self.saved


class _QkTiles:
    def __init__(self, cand):
        self.cand = cand

    def __enter__(self):
        self.saved = qk._tiles
        cand = self.cand
        qk._tiles = lambda device: {**self.saved(device), "fp8": cand}
        return self

    def __exit__(self, *a):
        qk._tiles = self.saved


def within_one_step(a, b, max_frac: float) -> bool:
    """Row scales within 8 ulp; codes equal except at most max_frac of them one step apart (or +-0)."""
    (q, r), (q0, r0) = a, b
    if not bool(((r.double() - r0.double()).abs() <= 8 * 2.0 ** -23 * r0.double().abs()).all()):
        return False
    x, y = q.view(torch.uint8).int(), q0.view(torch.uint8).int()
    diff = x != y
    zero = ((x & 0x7F) == 0) & ((y & 0x7F) == 0)
    step = ((x - y).abs() == 1) & ((x & 0x80) == (y & 0x80))
    return bool((zero | step | ~diff).all()) and int(diff.sum()) <= max_frac * diff.numel()


def same(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def tile_table(report: dict) -> dict:
    """The fastest byte-exact configuration of each op, in the format ops.producer_tiles.ProducerTiles reads
    ([scheme, BM, BK, num_warps] per fp8 producer, [BM, BK, num_warps] for to_fp8_rowwise: the one with the
    least total time over the four weight shapes)."""
    table: dict = {"device": report["device"]}
    for op, key in (("quantize", "quantize_fp8"), ("rms", "rms_modulate_fp8"), ("swiglu", "swiglu_fp8"),
                    ("swiglu_fast", "swiglu_fp8_fast_silu")):
        best = report["ops"].get(key, {}).get("best")
        if best:
            sch, bm, bk, _nkt, nw = best["config"]
            table[op] = [sch, bm, bk, nw]
    layers = [r for op, r in report["ops"].items() if op.startswith("to_fp8_rowwise_")]
    totals: dict = {}
    for r in layers:
        for c in r["configs"]:
            if "ms" in c and c["check_passed"]:
                key = tuple(c["config"])
                totals.setdefault(key, []).append(c["ms"])
    full = {k: sum(v) for k, v in totals.items() if len(v) == len(layers)}
    if full:
        table["to_fp8_rowwise"] = list(min(full, key=full.get))
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "producers-h200.json"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ops", default="quantize,rms,swiglu,swiglu_fast,weights")
    ap.add_argument("--tiles-out", default=None,
                    help="also write the best tiles as a table for H3_PRODUCER_TILES / RuntimeOptions.producer_tiles")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    copy = bench_copy(dev, 1 << 30, args.iters, args.warmup)
    cg = copy["GBps_read_plus_write"]
    report = {"name": "producers-h200", "command": "python3 " + " ".join(shlex.quote(a) for a in sys.argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev), "versions": versions(), "rows": M,
              "copy_bandwidth": copy, "ops": {}}
    ops = args.ops.split(",")
    it, wu = args.iters, args.warmup
    if "quantize" in ops:
        o = torch.randn(M, INNER, device=dev).bfloat16()
        ref = f8.quantize_fp8(o, backend="reference")
        r = sweep("quantize_fp8", lambda: f8.quantize_fp8(o), lambda: same(f8.quantize_fp8(o), ref),
                  M * INNER * 3 + M * 4, candidates("quantize", INNER), _F8Tiles, it, wu, cg)
        report["ops"]["quantize_fp8"] = {"shape": [M, INNER], **r}
        del o, ref
    if "rms" in ops:
        x = torch.randn(M, HIDDEN, device=dev).bfloat16()
        w = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).bfloat16()
        mod = torch.randn(3, 6 * HIDDEN, device=dev) * 0.1  # the stack's modulation rows, chunked per use
        sc, sh = mod[:, :HIDDEN], mod[:, HIDDEN:2 * HIDDEN]
        segs = [(0, 100, 0), (100, 37000, 1), (37000, M, 2)]
        fn = lambda: f8.rms_modulate_fp8(x, w, f8.Modulation(sc, sh, segs), 1e-6)  # noqa: E731
        ref = f8.rms_modulate_fp8(x, w, f8.Modulation(sc, sh, segs), 1e-6, backend="reference")
        r = sweep("rms_modulate_fp8", fn, lambda: same(fn(), ref), M * HIDDEN * 3 + M * 4,
                  candidates("rms", HIDDEN), _F8Tiles, it, wu, cg)
        report["ops"]["rms_modulate_fp8"] = {"shape": [M, HIDDEN], **r}
        del x, ref
    if "swiglu" in ops:
        h = torch.randn(M, 2 * FFN, device=dev).bfloat16()
        ref = f8.swiglu_fp8(h, backend="reference")
        r = sweep("swiglu_fp8", lambda: f8.swiglu_fp8(h), lambda: same(f8.swiglu_fp8(h), ref),
                  M * 2 * FFN * 2 + M * FFN + M * 4, candidates("swiglu", FFN), _F8Tiles, it, wu, cg)
        report["ops"]["swiglu_fp8"] = {"shape": [M, 2 * FFN], **r}
        del h, ref
    if "swiglu_fast" in ops:
        h = torch.randn(M, 2 * FFN, device=dev).bfloat16()
        ref = f8.swiglu_fp8(h, backend="reference")
        r = sweep("swiglu_fp8[silu=fast]", lambda: f8.swiglu_fp8(h, silu="fast"),
                  lambda: within_one_step(f8.swiglu_fp8(h, silu="fast"), ref, 1e-3),
                  M * 2 * FFN * 2 + M * FFN + M * 4, candidates("swiglu", FFN), _F8Tiles, it, wu, cg,
                  check_text="codes within one e4m3 step of the exact reference, at most 1e-3 of them moved")
        report["ops"]["swiglu_fp8_fast_silu"] = {"shape": [M, 2 * FFN], **r}
        del h, ref
    if "weights" in ops:
        for layer, (n, k) in WEIGHTS.items():
            wq = nv.quantize((torch.randn(n, k, device=dev) * k ** -0.5).bfloat16())
            ref = qk.to_fp8_rowwise(wq, backend="reference")
            scratch = torch.empty(n * k, dtype=torch.float8_e4m3fn, device=dev)
            fn = lambda: qk.to_fp8_rowwise(wq, out=scratch)  # noqa: E731
            cands = [(bm, bk, nw) for bm, bk, nw in ((16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8),
                                                     (4, 1024, 4), (8, 1024, 8), (64, 128, 4))]
            r = sweep(f"to_fp8_rowwise[{layer}]", fn, lambda: same(fn(), ref), n * k // 2 + n * k // 16 + n * k + n * 4,
                      cands, _QkTiles, it, wu, cg)
            report["ops"][f"to_fp8_rowwise_{layer}"] = {"shape": [n, k], **r}
            del wq, ref, scratch
    report["tile_table"] = tile_table(report)
    write_json(report, args.out)
    if args.tiles_out:
        write_json(report["tile_table"], args.tiles_out)
        print(f"tile table {report['tile_table']} -> {args.tiles_out}")
    for op, r in report["ops"].items():
        b = r["best"]
        print(f"{op}: best {b and b['config']} {b and b['ms']} ms {b and b['GBps']} GB/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
