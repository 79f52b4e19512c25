#!/usr/bin/env python3
"""A 50-block forward of the full-size H3 (random weights, NVFP4 on the GPU) at the canonical shape.

    python3 bench/forward50_h200.py [--attention auto] [--gemm auto] [--act-format nvfp4|fp8]
                                    [--fp8-scheme auto|loop|row] [--out bench/results/forward50-h200.json]

--act-format fp8 runs the Hopper W4A8 block (e4m3 rowwise activations, needs the fp8 GEMM backend; refused
loudly otherwise); --fp8-scheme picks the W4A8 producers' tiling (runtime.ops.fp8_producers).

Uses the runtime's own path: the full model is materialised in bf16 on the GPU with random weights
(no download), ``prepare_nvfp4`` quantizes the block linears one layer at a time and installs the NVFP4
stack, ``plan`` precomputes the run (layout, RoPE, modulation rows) and one step's block stack is timed
(CUDA events, median of --iters after a warm-up). One more forward runs under torch.profiler:
- kernel time per component (attention, nvfp4_gemms, nvfp4_packing, norm_and_rope, remaining_gate_add,
  copies, other) with launch counts;
- q/k/v copies on the strided path: aten copy/clone/contiguous/cat/pad ops issued inside the
  ``h3.attention`` ranges (by our wrapper; a library's own internal padding is reported separately by
  kernel name).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, build, component, is_annotation, write_json  # noqa: E402

from h3_blackwell.runtime.model.config import FULL, TINY  # noqa: E402
from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402

def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--gemm", default="auto")
    ap.add_argument("--act-format", default=None, choices=("auto", "nvfp4", "fp8"),
                    help="activation format of the block stack (default: H3_ACT_FORMAT, else nvfp4)")
    ap.add_argument("--fp8-scheme", default="auto", choices=("auto", "loop", "row"),
                    help="tiling of the fp8 producers when --act-format fp8")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="smoke-test this script with the tiny config (CPU ok)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "forward50-h200.json"))
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    cfg = TINY if a.tiny else FULL
    opts = RuntimeOptions.from_env(device="cuda" if cuda else "cpu", attention=a.attention, gemm=a.gemm,
                                   act_format=a.act_format)
    t0 = datetime.datetime.now()
    rt = build(opts, 0, cfg)
    if opts.act_format != "auto" and rt.plan.act_format != opts.act_format:
        raise SystemExit(f"act_format {opts.act_format} unavailable: {rt.backends['act_format']['reason']}")
    if a.fp8_scheme != "auto":
        from h3_blackwell.runtime.ops import fp8_producers

        for fn in ("rms_modulate_fp8", "swiglu_fp8", "quantize_fp8"):
            setattr(fp8_producers, fn, functools.partial(getattr(fp8_producers, fn), scheme=a.fp8_scheme))
        rt.backends["act_format"]["fp8_scheme"] = a.fp8_scheme
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    weights_gb = torch.cuda.memory_allocated() / 1e9 if cuda else 0.0
    m = rt.model
    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, 100, cfg.text_dim, generator=g)
    vshape, ashape = ((1, 24, 37, 48, 84), (1, 32, 2, 207)) if not a.tiny else ((1, 24, 2, 8, 8), (1, 32, 2, 9))
    video, audio = torch.randn(vshape, generator=g), torch.randn(ashape, generator=g)
    with torch.no_grad():
        plan = m.plan(text, vshape, ashape, [0.9])
        x0 = m.pack(plan, video, audio)
        assert a.tiny or plan.layout.seq_len == 37810
        m.run_blocks(x0.clone(), plan, 0, rt.ops)  # warm-up (Triton compiles, cuBLAS heuristics)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(a.iters):
            x = x0.clone()
            sync()
            t1 = time.perf_counter()
            m.run_blocks(x, plan, 0, rt.ops)
            sync()
            times.append(time.perf_counter() - t1)
        peak_extra = (torch.cuda.max_memory_allocated() - base_alloc) if cuda else 0
        from torch.profiler import ProfilerActivity, profile

        x = x0.clone()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            m.run_blocks(x, plan, 0, rt.ops)
            sync()
    comps = defaultdict(lambda: {"milliseconds": 0.0, "launches": 0})
    kernel_names = defaultdict(float)
    copies_in_attention = defaultdict(int)
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and not is_annotation(ev.name):
            c = component(ev.name)
            comps[c]["milliseconds"] += ev.device_time / 1000 if hasattr(ev, "device_time") else ev.cuda_time / 1000
            comps[c]["launches"] += 1
            kernel_names[ev.name[:90]] += (ev.device_time if hasattr(ev, "device_time") else ev.cuda_time) / 1000
        elif ev.name in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::pad",
                         "aten::constant_pad_nd"):
            p = ev.cpu_parent
            while p is not None and p.name != "h3.attention":
                p = p.cpu_parent
            if p is not None:
                copies_in_attention[ev.name] += 1
    total = sum(v["milliseconds"] for v in comps.values())
    for v in comps.values():
        v["percent_of_kernel_time"] = 100 * v["milliseconds"] / total if total else 0.0
    top = sorted(kernel_names.items(), key=lambda kv: -kv[1])[:25]
    res = {
        "name": "forward50-h200",
        "command": "python3 " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])]),
        "date": t0.isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "workload": {"packed_tokens": 37810, "text_tokens": 100, "blocks": 50, "resolution": [1344, 768],
                     "frames": 124},
        "backends": rt.backends,
        "resident_gb_after_prepare": weights_gb,
        "block_stack_seconds": times,
        "median_block_stack_seconds": statistics.median(times),
        "per_block_ms": 1000 * statistics.median(times) / cfg.num_layers,
        "peak_activation_bytes_over_resident": peak_extra,
        "components": dict(comps),
        "kernel_time_total_ms": total,
        "qkv_copies_issued_inside_attention": dict(copies_in_attention),
        "qkv_copies_note": ("aten copy/clone/contiguous/cat/pad ops issued inside the h3.attention ranges; "
                            "an empty dict means q, k, v reached the attention kernel as strided views"),
        "top_kernels_ms": top,
        "fc2": rt.fc2.status() if rt.fc2 is not None else None,
        "fc2_stack": rt.ops.status(),
    }
    if a.tiny:
        res["name"] = "forward-tiny-smoke"
    write_json(res, a.out)
    print(json.dumps({k: res[k] for k in ("median_block_stack_seconds", "per_block_ms",
                                           "qkv_copies_issued_inside_attention")}, default=str))
    print(json.dumps(res["components"], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
