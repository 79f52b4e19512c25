#!/usr/bin/env python3
"""NVFP4 GEMM backends and producers at the canonical shapes, one GPU, one run.

    python3 bench/nvfp4_h200.py [--out bench/results/nvfp4-h200.json] [--iters 10] [--warmup 3]

Writes ``{"command", "device", "versions", "M", "backend_table", "copy_bandwidth", "gemm": {layer:
{"shape", "bf16_cublas", "fp8_cublas", "nvfp4_<backend>"...}}, "producers": {...}}``.

* GEMMs at M = 37810 rows: qkv 5376->21504, out_proj 7168->5376, fc1 5376->28672, fc2 14336->5376.
  ms = median of ``--iters`` calls (CUDA events) after ``--warmup``; TFLOP/s = 2*M*N*K / time.
  - bf16_cublas: ``torch.mm`` of bf16 operands (the ceiling the bf16 path chases).
  - fp8_cublas: ``torch._scaled_mm`` e4m3 x e4m3, rowwise fp32 scales, bf16 out, no fast accumulation.
  - nvfp4_<backend>: every NVFP4 backend this GPU can run, through its bound product (``bind_gemm``) on an already
    quantized activation and the resident NVFP4 weight, INCLUDING the per-call expansion into the
    reusable scratch (bf16 / fp8 backends); ``expand_ms`` is that expansion alone.
* Producers on [37810, width] bf16 inputs, dynamic (amax pass + quantize pass) and calibrated (one
  pass) global scale. GB/s = (input bytes read once + packed and scale bytes written) / time, next to
  the device copy bandwidth (read + write) measured in this run; ``input_passes`` counts the kernels
  that read the input (the dynamic scale adds an amax pass; the RMSNorm kernel re-reads its row block,
  from L2, within each pass).
A backend or producer that fails is recorded with its error instead of a number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import bench_copy, err_text, time_ms, versions, write_json  # noqa: E402  (also makes the checkout importable as h3_blackwell)

from h3_blackwell.runtime.ops import gemm_backends as G  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4_producers as qk  # noqa: E402

M = 37810
HIDDEN, INNER, FFN = 5376, 7168, 14336
LAYERS = {"qkv": (HIDDEN, 3 * INNER), "out_proj": (INNER, HIDDEN), "fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}




def _gemm_entry(t: dict, flops: float, **extra) -> dict:
    return {"ms": round(t["median"], 4), "min_ms": round(t["min"], 4),
            "tflops": round(flops / (t["median"] * 1e-3) / 1e12, 1), **extra}


def bench_gemm(dev, layer: str, backends: list[str], iters: int, warmup: int) -> dict:
    k, n = LAYERS[layer]
    flops = 2.0 * M * n * k
    out: dict = {"shape": {"M": M, "K": k, "N": n}, "flop": flops}
    x = torch.randn(M, k, device=dev).bfloat16()
    w = (torch.randn(n, k, device=dev) * k ** -0.5).bfloat16()
    try:
        out["bf16_cublas"] = _gemm_entry(time_ms(lambda: torch.mm(x, w.t()), iters, warmup), flops)
    except Exception as e:
        out["bf16_cublas"] = {"error": err_text(e)}
    try:
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sa = torch.ones(M, 1, device=dev)
        sb = torch.ones(1, n, device=dev)
        fn = lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,  # noqa: E731
                                      use_fast_accum=False)
        out["fp8_cublas"] = _gemm_entry(time_ms(fn, iters, warmup), flops, scaling="rowwise")
        del x8, w8
    except Exception as e:
        out["fp8_cublas"] = {"error": err_text(e)}
    a = qk.quantize(x)
    wq = nv.quantize(w)
    del x, w
    scratch = G.Scratch()
    for backend in backends:
        key = f"nvfp4_{backend}"
        try:
            gemm = G.bind_gemm(backend)
            fn = lambda: gemm(a, wq, torch.bfloat16, scratch)  # noqa: E731
            entry = _gemm_entry(time_ms(fn, iters, warmup), flops)
            if backend == "bf16":
                g = a.global_scale * wq.global_scale
                exp = time_ms(lambda: (qk.dequantize_bf16(a, None, out=scratch.get("a", M * k, torch.bfloat16, dev)),
                                       qk.dequantize_bf16(wq, g, out=scratch.get("w", n * k, torch.bfloat16, dev))),
                              iters, warmup)
                entry["expand_ms"] = round(exp["median"], 4)
            elif backend == "fp8":
                exp = time_ms(lambda: (qk.to_fp8_rowwise(a, out=scratch.get("a", M * k, torch.float8_e4m3fn, dev)),
                                       qk.to_fp8_rowwise(wq, out=scratch.get("w", n * k, torch.float8_e4m3fn, dev))),
                              iters, warmup)
                entry["expand_ms"] = round(exp["median"], 4)
            out[key] = entry
        except Exception as e:
            out[key] = {"error": err_text(e)}
    out["scratch_bytes"] = scratch.nbytes()
    return out


def _producer_entry(t: dict, nbytes: int, copy_gbps: float, passes: int) -> dict:
    gbps = nbytes / (t["median"] * 1e-3) / 1e9
    return {"ms": round(t["median"], 4), "bytes": nbytes, "GBps": round(gbps, 1), "input_passes": passes,
            "fraction_of_copy": round(gbps / copy_gbps, 3)}


def bench_producers(dev, iters: int, warmup: int, copy_gbps: float) -> dict:
    out: dict = {}

    def out_bytes(s, k):
        p = nv.packed_shape(s, k, 1)
        sc = nv.scale_shape(s, k)
        return p[0] * p[1] + sc[0] * sc[1]

    for k in (HIDDEN, INNER):
        x = torch.randn(M, k, device=dev).bfloat16()
        nbytes = x.numel() * 2 + out_bytes(M, k)
        g = nv.global_scale(x)
        for policy, gs, passes in (("dynamic", None, 2), ("calibrated", g, 1)):
            try:
                t = time_ms(lambda: qk.quantize(x, gs, backend="triton"), iters, warmup)
                out[f"quantize_{k}_{policy}"] = _producer_entry(t, nbytes, copy_gbps, passes)
            except Exception as e:
                out[f"quantize_{k}_{policy}"] = {"error": err_text(e)}
        del x
    x = torch.randn(M, HIDDEN, device=dev).bfloat16()
    weight = torch.ones(HIDDEN, device=dev).bfloat16()
    tab = (torch.randn(36, HIDDEN, device=dev) * 0.2).bfloat16()
    segs = [(0, 100, 13), (100, 514, 14), (514, M, 12)]
    nbytes = x.numel() * 2 + out_bytes(M, HIDDEN)  # the tables are tiny and stay in L2
    for policy, gs, passes in (("dynamic", None, 2), ("calibrated", torch.tensor(0.003, device=dev), 1)):
        try:
            mod = qk.Modulation(tab, tab, segs)
            t = time_ms(lambda: qk.rms_modulate_quantize(x, weight, mod, 1e-5, gs, backend="triton"),
                        iters, warmup)
            out[f"rms_modulate_quantize_{HIDDEN}_{policy}"] = _producer_entry(t, nbytes, copy_gbps, passes)
        except Exception as e:
            out[f"rms_modulate_quantize_{HIDDEN}_{policy}"] = {"error": err_text(e)}
    del x
    h = torch.randn(M, 2 * FFN, device=dev).bfloat16()
    nbytes = h.numel() * 2 + out_bytes(M, FFN)
    for policy, gs, passes in (("dynamic", None, 2), ("calibrated", torch.tensor(0.01, device=dev), 1)):
        try:
            t = time_ms(lambda: qk.swiglu_quantize(h, gs, backend="triton"), iters, warmup)
            out[f"swiglu_quantize_{FFN}_{policy}"] = _producer_entry(t, nbytes, copy_gbps, passes)
        except Exception as e:
            out[f"swiglu_quantize_{FFN}_{policy}"] = {"error": err_text(e)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "nvfp4-h200.json"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    cc = torch.cuda.get_device_capability(dev)
    table = G.gemm_capability_table(dev)
    backends = [c.backend for c in table if c.available and c.backend != "reference"]
    result: dict = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"name": torch.cuda.get_device_name(dev), "compute_capability": f"{cc[0]}.{cc[1]}",
                   "sm_count": torch.cuda.get_device_properties(dev).multi_processor_count},
        "versions": versions(), "M": M,
        "backend_table": [{"backend": c.backend, "available": c.available, "reason": c.reason} for c in table],
        "auto_backend": list(G.choose_gemm_backend(dev)),
    }
    print(json.dumps({k: result[k] for k in ("device", "versions", "backend_table")}, indent=1), flush=True)
    result["copy_bandwidth"] = bench_copy(dev, 1 << 31, args.iters, args.warmup)
    print(f"copy: {result['copy_bandwidth']}", flush=True)
    result["gemm"] = {}
    for layer in LAYERS:
        result["gemm"][layer] = bench_gemm(dev, layer, backends, args.iters, args.warmup)
        torch.cuda.empty_cache()
        print(f"{layer}: " + json.dumps({k: v.get("tflops", v.get("error")) for k, v in result["gemm"][layer].items()
                                          if isinstance(v, dict) and k != "shape"}), flush=True)
    result["producers"] = bench_producers(dev, args.iters, args.warmup, result["copy_bandwidth"]["GBps_read_plus_write"])
    for name, v in result["producers"].items():
        print(f"{name}: {v.get('GBps', v.get('error'))} GB/s", flush=True)
    print(f"wrote {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
