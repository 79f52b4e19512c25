#!/usr/bin/env python3
"""The GB10 / RTX 5090 plan (issue 40): what the canonical job should cost per component on each, and why, from
the seed's GB10 profile, our measured H200 components and the vendors' figures. Nothing here was measured on a
Blackwell GPU; every number carries its basis. Writes ``bench/results/blackwell-plan.json`` (read by
``bench/blackwell_first_run.py`` for its "expected" column).

    python3 bench/blackwell_plan.py [--h200 bench/results/canonical-h200.json] [--out bench/results/blackwell-plan.json]

Method, per component:
* attention (SageAttention2's sm_120/sm_121 kernel, the same library kernel the seed ran): GB10 = the seed's
  measured time; RTX 5090 = the seed's GB10 time x the ratio of the two parts' tensor throughput (3,352 / 1,000
  sparse FP4 TOPS), cross-checked with the FLOPs of the job at SageAttention2's own RTX 5090 kernel rate.
* NVFP4 GEMMs (cuBLASLt block-scaled FP4 through scaled_mm; FC2 the seed's pinned plan): GB10 = the seed's
  measured time (same library, same shapes); RTX 5090 = that x the FP4 throughput ratio. Cross-check: the job's
  FLOPs at dense FP4 peak (half the sparse figure).
* memory-bound kernels of ours (norm+RoPE, gate+add, activation producers): our H200 time x (H200 bandwidth /
  target bandwidth). Checked on the seed: H200 x 4.8/0.273 gives norm+RoPE 0.99 s and gate+add 0.53 s against
  the seed's 1.08 s and 0.55 s on GB10 (the same fraction of bandwidth reached on both).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The seed's GB10 profile (shared/seeds/000_3e334eaf6714be9c.txt; one warmed step, Nsight Systems), ms per step
SEED = {"step_s": 21.3, "sampling_s": 255.447, "peak_allocated_bytes": 44445830144,
        "components_ms": {"attention": 13029.2, "nvfp4_gemms": 4167.9, "producers_and_packing": 2026.9,
                          "norm_and_rope": 1084.4, "gate_add": 549.3, "other": 37.4}}
# Vendors' figures (sources in SOURCES): bandwidth GB/s, FP4 tensor TFLOPS with sparsity (dense = half)
PARTS = {
    "h200": {"bandwidth_gbs": 4800, "fp8_sparse_tflops": 3958},
    "gb10": {"bandwidth_gbs": 273, "fp4_sparse_tflops": 1000},
    "rtx5090": {"bandwidth_gbs": 1792, "fp4_sparse_tflops": 3352, "memory_gb": 32},
}
SOURCES = {
    "gb10": "NVIDIA DGX Spark product page / hardware guide as summarised at https://ai-infrastructure.net/dgx-spark/ "
            "(128 GB LPDDR5x unified, 273 GB/s; up to 1 PFLOP FP4 with sparsity; 6,144 CUDA cores) and "
            "https://dgx-spark.warehack.ing/hardware/ ('1 petaFLOP is FP4 with sparsity')",
    "rtx5090": "RTX 5090 datasheet figures at https://www.spheron.network/blog/nvidia-rtx-5090-specs/ (1,792 GB/s "
               "GDDR7, 32 GB, 170 SMs, FP4 3,352 TOPS sparse, FP8 1,676.8 sparse); the same 1,792 GB/s and "
               "3,352 FP8/4 in Linux Format's review (pocketmags.com, May 2025)",
    "h200": "H200 SXM: 4.8 TB/s HBM3e, FP8 3,958 TFLOPS with sparsity (NVIDIA H200 page as summarised at "
            "https://lzwjava.github.io/nvidia-h200-gpu-specs-en and https://aiwiki.ai/wiki/nvidia_h200)",
    "sage2_5090": "SageAttention2 kernel speed on an RTX 5090, 489-554 TOPS (SageAttention README, kernels-facts.md "
                  "s.4.2)",
}
# the canonical job's work per step (H3: 50 blocks, 37,810 rows, 56 heads x 128, hidden 5,376, FFN 14,336)
ROWS, BLOCKS, HEADS, HEAD_DIM = 37810, 50, 56, 128
GEMM_MACS_PER_ROW_BLOCK = 5376 * (3 * 7168 + 7168 + 2 * 14336 + 14336)  # qkv, out, fc1, fc2 (K x N each)
GEMM_FLOPS = 2 * GEMM_MACS_PER_ROW_BLOCK * ROWS * BLOCKS
ATTN_FLOPS = 4 * ROWS * ROWS * HEADS * HEAD_DIM * BLOCKS  # QK^T and PV, non-causal
SAGE2_5090_TOPS = 520  # middle of SageAttention2's 489-554 on RTX 5090


def _h200_components(path: Path) -> dict:
    d = json.loads(path.read_text())
    c = {k: v["milliseconds"] for k, v in d["components"].items()}
    return {"attention": c["sage2"], "nvfp4_gemms": c["nvfp4_gemms"],
            "producers_and_packing": c["nvfp4_packing"] + c["other"], "norm_and_rope": c["norm_and_rope"],
            "gate_add": c["remaining_gate_add"], "step_s": d["median_step_seconds"],
            "peak_allocated_bytes": d["peak_allocated_bytes"], "source": str(path.relative_to(HERE.parent))}


def _bandwidth_scaled(h200_ms: float, part: str) -> float:
    return h200_ms * PARTS["h200"]["bandwidth_gbs"] / PARTS[part]["bandwidth_gbs"]


def plan(h200: dict) -> dict:
    fp4_ratio = PARTS["rtx5090"]["fp4_sparse_tflops"] / PARTS["gb10"]["fp4_sparse_tflops"]
    seed = SEED["components_ms"]
    bw = {p: PARTS["h200"]["bandwidth_gbs"] / PARTS[p]["bandwidth_gbs"] for p in ("gb10", "rtx5090")}
    out: dict = {}
    for part in ("gb10", "rtx5090"):
        tensor = 1.0 if part == "gb10" else fp4_ratio
        comp = {
            "attention": (seed["attention"] / tensor,
                          "the seed's GB10 Sage2 time" + ("" if part == "gb10" else f" / {fp4_ratio:.2f} (tensor "
                          "throughput ratio RTX 5090 : GB10)")),
            "nvfp4_gemms": (seed["nvfp4_gemms"] / tensor,
                            "the seed's GB10 NVFP4 GEMM time (same cuBLASLt block-scaled kernels and FC2 plan)"
                            + ("" if part == "gb10" else f" / {fp4_ratio:.2f} (FP4 throughput ratio)")),
            "producers_and_packing": (_bandwidth_scaled(h200["producers_and_packing"], part),
                                      f"our H200 producers + packing ({h200['producers_and_packing']:.0f} ms) x "
                                      f"{bw[part]:.2f} (bandwidth ratio); NVFP4 activations read bf16 twice for "
                                      "the dynamic scale, so this may be low"),
            "norm_and_rope": (_bandwidth_scaled(h200["norm_and_rope"], part),
                              f"our H200 norm+RoPE ({h200['norm_and_rope']:.0f} ms) x {bw[part]:.2f}"),
            "gate_add": (_bandwidth_scaled(h200["gate_add"], part),
                         f"our H200 gate+add ({h200['gate_add']:.0f} ms) x {bw[part]:.2f}"),
            "other": (seed["other"] / tensor, "the seed's 'other' (launch-bound; kept)"),
        }
        step = sum(v for v, _ in comp.values()) / 1000
        out[part] = {"components_ms": {k: round(v, 1) for k, (v, _) in comp.items()},
                     "basis": {k: why for k, (_, why) in comp.items()},
                     "step_seconds": round(step, 2), "sampling_seconds": round(12 * step, 1),
                     "peak_allocated_bytes": h200["peak_allocated_bytes"],
                     "peak_basis": "allocation does not depend on the GPU: our H200 peak at the canonical job "
                                   f"({h200['peak_allocated_bytes'] / 1e9:.1f} GB; the seed's reference runtime "
                                   "held 44.4 GB)"}
    return out


def cross_checks() -> dict:
    gb10_dense = PARTS["gb10"]["fp4_sparse_tflops"] / 2 * 1e12
    r5090_dense = PARTS["rtx5090"]["fp4_sparse_tflops"] / 2 * 1e12
    return {
        "gemm_pflop_per_step": round(GEMM_FLOPS / 1e15, 3),
        "attention_pflop_per_step": round(ATTN_FLOPS / 1e15, 3),
        "gb10_gemm_at_dense_fp4_peak_ms": round(GEMM_FLOPS / gb10_dense * 1e3, 1),
        "gb10_seed_gemm_fraction_of_dense_peak": round(GEMM_FLOPS / gb10_dense * 1e3 / SEED["components_ms"]
                                                       ["nvfp4_gemms"], 2),
        "rtx5090_gemm_at_dense_fp4_peak_ms": round(GEMM_FLOPS / r5090_dense * 1e3, 1),
        "gb10_seed_attention_effective_tops": round(ATTN_FLOPS / (SEED["components_ms"]["attention"] / 1e3) / 1e12),
        "rtx5090_attention_at_sage2_5090_rate_ms": round(ATTN_FLOPS / (SAGE2_5090_TOPS * 1e12) * 1e3, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--h200", default=str(HERE / "results" / "canonical-h200.json"))
    ap.add_argument("--out", default=str(HERE / "results" / "blackwell-plan.json"))
    a = ap.parse_args(argv)
    h200 = _h200_components(Path(a.h200))
    out = {"name": "blackwell-plan", "command": " ".join(["python3", *sys.argv]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "measured": "nothing: an expectation from the seed's GB10 profile, our H200 run and vendors' figures",
           "seed_gb10": SEED, "h200_measured": h200, "parts": PARTS, "sources": SOURCES,
           "expected": plan(h200), "cross_checks": cross_checks()}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["expected"], indent=1))
    print(json.dumps(out["cross_checks"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
