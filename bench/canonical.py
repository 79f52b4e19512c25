#!/usr/bin/env python3
"""The canonical H3 benchmark on one GPU, the seed's measurement policy.

    python3 bench/canonical.py [--runs 3 --warmup 1] [--steps 12] [--peer-blocks 4] [--out bench/results/canonical-h200.json]

1. A full-size H3 (50 blocks) with random weights, quantized to NVFP4 on the GPU by the runtime's own
   prepare step (no download); full-form AdaLN weights kept in host memory, modulation rows per run.
2. The canonical workload: 1344x768, 124 frames -> 37,810 packed rows (100 text), 12 steps, seed
   440420, res_multistep; --warmup resident warm-up runs then --runs measured runs (median), per-step
   deferred CUDA events, peak allocated/reserved, latent hashes compared across runs, FC2 dispatch counts.
3. One warmed step under torch.profiler: kernel time per seed component (attention/sage2, nvfp4_gemms,
   nvfp4_packing, norm_and_rope, remaining_gate_add, other) with launch counts and launch gaps.
4. Accuracy of one full-width forward at the canonical shape against a bf16 dense reference on the same
   dequantized weights (exact SDPA attention): the benchmarked configuration and the exact NVFP4 W4A4
   emulation (emulated GEMMs, exact attention).
5. The peer in the same run: diffusers' MiniMaxH3Transformer3DModel in BF16 with its default SDPA
   (bench/diffusers_peer.py, per-block extrapolation to 50 blocks), after our model is freed.
6. ``--attention sparse`` (LOSSY; writes canonical-h200-sparse.json): after the sparse runs, in the same
   process, dense runs on the same model (sparse switched off: the bound dense backend every step) for
   ``dense_median_step_seconds``, the final-latent rel-L2 sparse vs dense, the rel-L2 of one forward at the
   schedule's first / middle / last sparse steps, and a First-Block Cache run at ``--fbcache`` (steps reused,
   time, final-latent rel-L2 vs the uncached run). Random weights: see ``quality_note`` in the file.
The JSON is rewritten after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, bench_command, build, component, is_annotation, write_json  # noqa: E402
from _sparse_bench import canonical_sparse  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from h3_blackwell.runtime.ops.reference import ReferenceOps, modulate_  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.ops.attention import bind_attention  # noqa: E402
from h3_blackwell.runtime.ops.block_ops import LINEARS, Nvfp4Ops  # noqa: E402
from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402
from h3_blackwell.runtime import Measure, SampleInputs, SamplingSettings, run, tensor_job  # noqa: E402
from h3_blackwell.runtime.sampling.sampler import initial_noise  # noqa: E402

SEED_COMPONENTS = {"attention": "sage2"}  # the seed's name for our attention component when it is Sage2


def profile_step(rt, plan, video, audio) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        rt.model.evaluate(plan, 0, video, audio, rt.ops)  # warm
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            e0.record()
            rt.model.evaluate(plan, 0, video, audio, rt.ops)
            e1.record()
            torch.cuda.synchronize()
    step_ms = e0.elapsed_time(e1)
    sage2 = rt.plan.attention == "sage2"
    kernels = [ev for ev in prof.events() if ev.device_type.name == "CUDA" and not is_annotation(ev.name)]
    comps = defaultdict(lambda: {"milliseconds": 0.0, "launches": 0})
    for ev in kernels:
        c = component(ev.name)
        c = SEED_COMPONENTS.get(c, c) if sage2 else c
        c = "other" if c == "copies" else c
        comps[c]["milliseconds"] += ev.device_time / 1000
        comps[c]["launches"] += 1
    total = sum(v["milliseconds"] for v in comps.values())
    for v in comps.values():
        v["percent_of_kernel_time"] = 100 * v["milliseconds"] / total if total else 0.0
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in kernels)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    span_ms = (spans[-1][1] - spans[0][0]) / 1000 if spans else 0.0
    return {"step_ms_events": step_ms, "gpu_span_ms": span_ms, "kernel_time_ms": total,
            "kernel_count": len(kernels),
            "kernel_busy_percent_of_span": 100 * total / span_ms if span_ms else None,
            "launch_gaps": {"positive_gap_count": len(gaps), "total_us": sum(gaps),
                            "maximum_us": max(gaps) if gaps else 0},
            "components": dict(comps),
            "components_sum_vs_step": total / step_ms if step_ms else None}


class DequantizedReferenceOps(ReferenceOps):
    """The reference block ops on the dequantized NVFP4 weights at the compute dtype (dense GEMMs), with a bound
    dense attention: the accuracy stage's reference. Each linear's weight is dequantized when it is used."""

    def __init__(self, cfg, attention, dtype):
        super().__init__(cfg, attention)
        self.dtype = dtype

    def _w(self, lin):
        return nv.dequantize(lin.weight, torch.float32).to(self.dtype)

    def qkv(self, i, blk, x, shift, scale, segs):
        return F.linear(modulate_(blk.norm1(x), shift, scale, segs), self._w(blk.attn.qkv_proj))

    def out_proj(self, i, blk, o):
        return F.linear(o, self._w(blk.attn.out_proj))

    def fc1(self, i, blk, x, shift, scale, segs):
        return F.linear(modulate_(blk.norm2(x), shift, scale, segs), self._w(blk.mlp.fc1))

    def fc2(self, i, blk, h, lora_active: bool = False):
        gate, up = h.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self._w(blk.mlp.fc2))


def accuracy(rt, plan, video, audio) -> dict:
    """rel-L2 of one forward vs a dense reference on the same dequantized weights, and of the NVFP4 W4A4
    emulation (NVFP4 activations, exact-product GEMMs) vs the same reference."""
    m, cfg = rt.model, rt.config

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    sdpa = bind_attention("sdpa", cfg.head_dim)
    lins = [getattr(getattr(blk, p), n) for blk in m.blocks for p, n in LINEARS]
    saved = [(lin, lin.backend, lin.backend_reason) for lin in lins]
    with torch.no_grad():
        cfg_out = m.evaluate(plan, 0, video, audio, rt.ops)
        for lin in lins:  # the exact NVFP4 products for the emulation, rebound as they were below
            lin.bind_backend("emulated", "the accuracy stage's W4A4 emulation")
        try:
            emu_out = m.evaluate(plan, 0, video, audio, Nvfp4Ops(cfg, sdpa))
        finally:
            for lin, b, why in saved:
                lin.bind_backend(b, why)
        ref_out = m.evaluate(plan, 0, video, audio, DequantizedReferenceOps(cfg, sdpa, rt.dtype))
        # the benchmarked attention alone: reference GEMMs, the run's attention (its ops' bound function)
        att_out = m.evaluate(plan, 0, video, audio, DequantizedReferenceOps(cfg, rt.ops.attention, rt.dtype))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    benchmarked_format = rt.plan.act_format
    r = {"benchmarked": {"video_rel_l2": rel(cfg_out[0], ref_out[0]), "audio_rel_l2": rel(cfg_out[1], ref_out[1]),
                         "act_format": benchmarked_format, "gemm": saved[0][1] if saved else None},
         "nvfp4_w4a4_emulation": {"video_rel_l2": rel(emu_out[0], ref_out[0]),
                                  "audio_rel_l2": rel(emu_out[1], ref_out[1])},
         "attention_alone": {"video_rel_l2": rel(att_out[0], ref_out[0]), "audio_rel_l2": rel(att_out[1], ref_out[1]),
                             "attention": rt.plan.attention,
                             "what": "dense reference GEMMs with the benchmarked (bound) attention"},
         "reference": f"{str(rt.dtype).replace('torch.', '')} dense blocks on the dequantized NVFP4 weights, SDPA "
                      "attention; same plan and inputs",
         "emulation": "NVFP4 activations (W4A4) and emulated NVFP4 GEMMs (exact products, fp32 accumulation), "
                      "SDPA attention"}
    r["ratio_video"] = r["benchmarked"]["video_rel_l2"] / r["nvfp4_w4a4_emulation"]["video_rel_l2"]
    r["benchmarked_no_less_accurate"] = r["ratio_video"] <= 1.5
    return r


def offload_stage(rt, plan, video, audio) -> dict:
    """What a ComfyUI unload of the held MODEL costs (H3Runtime.offload in place, then onload): seconds each way,
    the bytes the allocator freed, and one evaluation after it against one before (bitwise)."""
    with torch.no_grad():
        want = rt.model.evaluate(plan, 0, video, audio, rt.ops)
        torch.cuda.synchronize()
        held, allocated = rt.device_bytes(), torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        freed = rt.offload()
        t1 = time.perf_counter()
        left = torch.cuda.memory_allocated()
        rt.onload()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        got = rt.model.evaluate(plan, 0, video, audio, rt.ops)
    return {"runtime_device_bytes": held, "allocated_before_bytes": allocated, "freed_bytes": freed,
            "allocated_after_offload_bytes": left, "offload_seconds": t1 - t0, "onload_seconds": t2 - t1,
            "evaluation_equal_after_onload": all(torch.equal(a, b) for a, b in zip(want, got)),
            "what": "H3Runtime.offload() (block linears to page-locked host buffers, other tensors to host copies, "
                    "GEMM scratch dropped, allocator cache emptied), then onload(); one evaluation at sigma 0.95 "
                    "before and after"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--peer-blocks", type=int, default=4)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--gemm", default="auto")
    ap.add_argument("--act-format", default=None, choices=["auto", "nvfp4", "fp8"],
                    help="activation format of the block stack (default: RuntimeOptions / H3_ACT_FORMAT)")
    ap.add_argument("--baseline-step-seconds", type=float, default=3.927,
                    help="the step time to hold (re-measured on the H200 at 3d650ee, Sage2: 3.927)")
    ap.add_argument("--skip", default="", help="comma list of stages to skip: profile,offload,accuracy,peer")
    ap.add_argument("--sparse-tau", type=float, default=None,
                    help=f"with --attention sparse (default: core's {RuntimeOptions.sparse_tau})")
    ap.add_argument("--sparse-extra-tokens", type=int, default=None,
                    help=f"with --attention sparse (default {RuntimeOptions.sparse_extra_tokens})")
    ap.add_argument("--dense-runs", type=int, default=1, help="with --attention sparse: measured dense runs")
    ap.add_argument("--fbcache", type=float, default=0.08,
                    help="with --attention sparse: First-Block Cache threshold of the extra cached run (<0: none)")
    ap.add_argument("--out", default=None, help="default bench/results/canonical-h200.json "
                                                "(canonical-h200-sparse.json with --attention sparse)")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    sparse = a.attention == "sparse"
    if sparse:  # they evaluate outside a sampling run, where the sparse backend runs dense: nothing to learn
        skip |= {"profile", "accuracy"}
    name = "canonical-h200-sparse" if sparse else "canonical-h200"
    out = Path(a.out or ROOT / "bench" / "results" / f"{name}.json")
    res = {"name": name,
           "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}}
    t0 = time.perf_counter()
    opts = RuntimeOptions.from_env(device="cuda", attention=a.attention, gemm=a.gemm, act_format=a.act_format,
                                   sparse_tau=a.sparse_tau, sparse_extra_tokens=a.sparse_extra_tokens)
    rt = build(opts, 0)
    torch.cuda.synchronize()
    res["build_seconds"] = time.perf_counter() - t0
    res["backends"] = rt.backends
    res["resident_bytes_after_prepare"] = torch.cuda.memory_allocated()
    write_json(res, out)

    g = torch.Generator().manual_seed(440420)
    text = torch.randn(1, 100, rt.config.text_dim, generator=g)
    vshape, ashape = (1, 24, 37, 48, 84), (1, 32, 2, 207)
    video, audio = torch.zeros(vshape), torch.zeros(ashape)
    sample_kw = dict(sampling=SamplingSettings(seed=440420, steps=a.steps, sampler="res_multistep"),
                     workload_extra={"frames": 124, "text_source": "random (seed 440420)"})
    r = run(tensor_job(rt, SampleInputs(text, None, video, audio), measure=Measure(a.runs, a.warmup), **sample_kw))
    rep = r.report
    steps_flat = [[s["seconds"] for s in run] for run in rep["per_step_seconds"]]
    res.update({
        "workload": rep["workload"],
        "sampling_seconds": rep["sampling_seconds"],
        "median_sampling_seconds": rep["median_sampling_seconds"],
        "median_step_seconds": statistics.median(x for run in steps_flat for x in run),
        "per_step_seconds": rep["per_step_seconds"],
        "peak_allocated_bytes": max(rep["peak_allocated_bytes"]),
        "peak_reserved_bytes": max(rep["peak_reserved_bytes"]),
        "latent_checksums": rep["latent_checksums"],
        "fc2_dispatch": rep["fc2_dispatch"],
        "configuration": rep["configuration"],
        "measurement_policy": rep["measurement_policy"],
    })
    write_json(res, out)
    if sparse:  # LOSSY: dense run, quality and a First-Block Cache run in the same process
        res.update(canonical_sparse(rt, r, text, vshape, ashape, a.steps, sample_kw,
                                    a.fbcache if a.fbcache >= 0 else None, a.dense_runs,
                                    lambda part: write_json({**res, **part}, out)))
        write_json(res, out)

    m = rt.model
    nv_, na_ = initial_noise(440420, vshape, ashape)
    with torch.no_grad():
        plan = m.plan(text, vshape, ashape, [0.95])
    if "profile" not in skip:
        prof = profile_step(rt, plan, nv_, na_)
        res["one_warmed_step"] = prof
        res["components"] = prof["components"]
        write_json(res, out)
    if "offload" not in skip:
        res["offload"] = offload_stage(rt, plan, nv_, na_)
        write_json(res, out)
    if "accuracy" not in skip:
        try:
            res["accuracy"] = accuracy(rt, plan, nv_, na_)
        except Exception as e:  # noqa: BLE001 - keep the timing results
            res["accuracy"] = {"error": f"{type(e).__name__}: {e}"}
        write_json(res, out)

    if "peer" not in skip:
        del m, plan, rt, r
        torch.cuda.empty_cache()
        env = {**os.environ, "NL": str(a.peer_blocks)}
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "diffusers_peer.py")], capture_output=True,
                           text=True, env=env, timeout=400)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("{")), None)
        if line:
            peer = json.loads(line)
            res["peer"] = peer
            res["peer_step_seconds"] = peer["est_step_s_50_blocks"]
            res["speedup_vs_peer"] = res["peer_step_seconds"] / res["median_step_seconds"]
        else:
            res["peer"] = {"error": p.stderr[-2000:]}
    res["baseline_step_seconds"] = a.baseline_step_seconds
    res["acceptance"] = {
        "median_step_seconds_le_4.2": res["median_step_seconds"] <= 4.2,
        "speedup_ge_1.5": (res.get("speedup_vs_peer") or 0) >= 1.5,
        "peak_allocated_le_20e9": res["peak_allocated_bytes"] <= 20e9,
        "hashes_exact_across_runs": res["latent_checksums"]["exact_across_measured_runs"],
        "within_2pct_of_baseline_step": res["median_step_seconds"] <= 1.02 * a.baseline_step_seconds,
        "median_step_seconds_le_3.5": res["median_step_seconds"] <= 3.5,
        "video_rel_l2_le_0.027": (res.get("accuracy", {}).get("benchmarked", {}).get("video_rel_l2", 1.0) <= 0.027
                                  if "accuracy" in res else None),
        "fc2_counts_consistent_with_configuration": res["fc2_dispatch"].get("consistent_with_configuration"),
        "components_sum_within_5pct": (abs(res["one_warmed_step"]["components_sum_vs_step"] - 1) <= 0.05
                                       if "one_warmed_step" in res else None),
        "accuracy_no_worse_than_1.5x_emulation": res.get("accuracy", {}).get("benchmarked_no_less_accurate"),
    }
    if sparse:
        res["acceptance"]["sparse_median_step_seconds_le_3.2"] = res["median_step_seconds"] <= 3.2
    res["total_seconds"] = time.perf_counter() - t0
    write_json(res, out)
    print(json.dumps({k: res.get(k) for k in ("median_step_seconds", "peer_step_seconds", "speedup_vs_peer",
                                               "peak_allocated_bytes", "acceptance")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
