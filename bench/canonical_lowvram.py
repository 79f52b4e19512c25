#!/usr/bin/env python3
"""The canonical H3 job inside a device-memory budget, streamed (issue 23), in one process on one GPU.

    python3 bench/canonical_lowvram.py [--budgets 16,8] [--steps 12] [--runs 1] [--warmup 1] [--quick]
                                       [--out bench/results/canonical-h200-lowvram.json]

1. A full-size H3 with random weights (the runtime's own load path, ``_h3bench.model_spec``), loaded once with
   the budget ``auto`` (everything resident on the H200), planned for the canonical workload (1344x768,
   124 frames, 37,810 rows, --steps steps, seed 440420, res_multistep).
2. The resident run: median step seconds, peak allocated bytes, latent hashes (``resident``).
3. The 50-block row: one evaluation of the 50 full-width blocks at the canonical size, the plan's estimate
   against the measured peak (``forward50``), with the peak after each block op (``phase_peaks``) beside the
   estimate's phases.
4. Each budget of --budgets (GB), then the smallest budget the plan accepts (``smallest_budget_that_runs``):
   the same model re-planned at sampling start (``H3Runtime.fit_memory``: blocks move to pinned host memory
   and stream through two device buffers), its median step, peak, hashes, streamed blocks and the copy time
   exposed per step (CUDA events) (``budgets``).
5. ``acceptance``: the 8 GB run peaks at <= 8.0e9 bytes and steps at <= 1.10x the resident run, 16 GB at
   <= 1.03x, every budget gives the resident hashes, the 50-block estimate is within 10 % of the peak.

--quick: a smoke run (10 blocks, 3 steps, no warm-up; budgets: the resident estimate less two blocks, and the
smallest). The JSON is rewritten after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, bench_command, err_text, model_spec, versions, write_json  # noqa: E402

from h3_blackwell.runtime import Measure, RuntimeOptions, SampleInputs, SamplingSettings, run, tensor_job  # noqa: E402
from h3_blackwell.runtime.budget import (SLOTS, ModelMemory, Workload, activation_phases, budget_arg,  # noqa: E402
                                         estimate, smallest_budget)
from h3_blackwell.runtime.model.config import FULL  # noqa: E402

SEED = 440420
VSHAPE, ASHAPE = (1, 24, 37, 48, 84), (1, 32, 2, 207)  # 1344x768, 124 frames
TEXT_TOKENS = 100


def _inputs(cfg):
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(1, TEXT_TOKENS, cfg.text_dim, generator=g), torch.zeros(VSHAPE), torch.zeros(ASHAPE)


def _sample(rt, steps: int, runs: int, warmup: int) -> dict:
    text, video, audio = _inputs(rt.config)
    rep = run(tensor_job(rt, SampleInputs(text, None, video, audio),
                         SamplingSettings(seed=SEED, steps=steps, sampler="res_multistep"),
                         measure=Measure(runs, warmup),
                         workload_extra={"frames": 124, "text_source": f"random (seed {SEED})"})).report
    steps_flat = [s["seconds"] for r in rep["per_step_seconds"] for s in r]
    mem = rep.get("memory") or {}
    mem.pop("per_step", None)
    return {"median_step_seconds": statistics.median(steps_flat),
            "peak_allocated_bytes": max(rep["peak_allocated_bytes"]),
            "peak_reserved_bytes": max(rep["peak_reserved_bytes"]),
            "latent_checksums": {k: rep["latent_checksums"][k] for k in ("video_sha256", "audio_sha256")},
            "streamed_blocks": mem.get("streamed_blocks"),
            "copy_exposed_ms_per_step": mem.get("copy_exposed_ms_per_step"),
            "memory": mem, "per_step_seconds": rep["per_step_seconds"]}


class _PhaseOps:
    """BlockOps wrapper that records the peak allocated bytes of each block op (one synchronized evaluation,
    for the estimate's phases; never used for timing)."""

    def __init__(self, inner, peaks: dict):
        self.inner, self.peaks = inner, peaks

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("qkv", "attention", "out_proj", "fc1", "fc2", "gate_add_", "norm_rope_"):
            return attr

        def call(*a, **kw):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = attr(*a, **kw)
            torch.cuda.synchronize()
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())
            return out

        return call


def forward50(rt) -> dict:
    """One evaluation of the whole block stack at the canonical size: the plan's estimate vs the peak."""
    text, video, audio = _inputs(rt.config)
    mm = ModelMemory.from_plan(rt.plan)
    wl = Workload.from_shapes(VSHAPE, ASHAPE, TEXT_TOKENS, 1)
    resident = len(rt.plan.memory.resident)
    est = estimate(mm, wl, resident, SLOTS, rt.plan.memory.ffn_chunk_rows)
    with torch.no_grad():
        plan = rt.model.plan(text, VSHAPE, ASHAPE, [0.95])
        rt.model.evaluate(plan, 0, video, audio, rt.ops)  # warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        rt.model.evaluate(plan, 0, video, audio, rt.ops)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        peaks: dict = {}
        rt.model.evaluate(plan, 0, video, audio, _PhaseOps(rt.ops, peaks))
    weights = est.weights_resident + est.stream_buffers
    return {"blocks": rt.config.num_layers, "rows": wl.rows, "resident_blocks": resident,
            "estimate_bytes": est.total, "measured_peak_allocated_bytes": peak,
            "estimate_over_peak": est.total / peak, "within_10_percent": abs(est.total / peak - 1) <= 0.10,
            "allocated_before_bytes": base, "estimate": est.as_dict(),
            "phase_peaks_bytes": peaks,
            "estimate_phases_bytes": {k: v + weights + est.scratch + est.run + est.workspace
                                      for k, v in activation_phases(mm, wl, rt.plan.memory.ffn_chunk_rows).items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="16,8", help="budgets in GB, comma separated (the smallest is added)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=1, help="measured runs per budget (median of their steps)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs before the resident run (not per budget)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 10 blocks, 3 steps, no warm-up")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = FULL.replace(num_layers=10) if a.quick else FULL
    steps, warmup = (3, 0) if a.quick else (a.steps, a.warmup)
    name = "canonical-h200-lowvram" + ("-quick" if a.quick else "")
    out = Path(a.out or ROOT / "bench" / "results" / f"{name}.json")
    res = {"name": name,
           "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
           "versions": versions(), "blocks": cfg.num_layers, "steps": steps,
           "workload": {"resolution": [1344, 768], "frames": 124, "packed_rows": 37810, "seed": SEED,
                        "sampler": "res_multistep"}}
    t0 = time.perf_counter()
    wl = Workload.from_shapes(VSHAPE, ASHAPE, TEXT_TOKENS, steps)
    rt = model_spec(RuntimeOptions.from_env(device="cuda", vram_budget="auto"), 0, cfg).load(workload=wl)
    torch.cuda.synchronize()
    res["build_seconds"] = time.perf_counter() - t0
    res["backends"] = rt.backends
    write_json(res, out)

    res["resident"] = _sample(rt, steps, a.runs, warmup)
    base = res["resident"]
    write_json(res, out)
    try:
        res["forward50"] = forward50(rt)
    except Exception as e:  # noqa: BLE001 - keep the sampling results
        res["forward50"] = {"error": err_text(e)}
    write_json(res, out)

    mm = ModelMemory.from_plan(rt.plan, placed=False)  # AdaLN where a budget without room for it puts it
    least = smallest_budget(mm, wl)
    if a.quick:
        budgets = [float(budget_arg(estimate(mm, wl, cfg.num_layers, SLOTS, None).total - 3 * mm.block_bytes))]
    else:
        budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    res["smallest_budget_planned_bytes"] = least
    entries = [(b, "requested") for b in budgets] + [(float(budget_arg(least)), "smallest that the plan accepts")]
    res["budgets"] = []
    for gb, why in entries:
        rt.plan.options.vram_budget = repr(gb)
        try:
            r = _sample(rt, steps, a.runs, 0)
        except Exception as e:  # noqa: BLE001 - a refusal or a failure is recorded, the others still run
            r = {"error": err_text(e)}
        r = {"vram_budget_bytes": int(gb * 1e9), "what": why, **r}
        if "error" not in r:
            r["step_ratio_vs_resident"] = r["median_step_seconds"] / base["median_step_seconds"]
            r["hashes_equal_resident"] = r["latent_checksums"] == base["latent_checksums"]
            r["peak_within_budget"] = r["peak_allocated_bytes"] <= r["vram_budget_bytes"]
        res["budgets"].append(r)
        write_json(res, out)
    ok = [r for r in res["budgets"] if "error" not in r]
    res["smallest_budget_that_runs"] = min((r["vram_budget_bytes"] for r in ok), default=None)

    def entry(gb):
        return next((r for r in ok if r["vram_budget_bytes"] == int(gb * 1e9)), None)

    e8, e16 = entry(8), entry(16)
    f50 = res.get("forward50", {})
    res["acceptance"] = {
        "8GB_peak_le_8.0e9": None if e8 is None else e8["peak_allocated_bytes"] <= 8.0e9,
        "8GB_step_le_1.10x_resident": None if e8 is None else e8["step_ratio_vs_resident"] <= 1.10,
        "16GB_step_le_1.03x_resident": None if e16 is None else e16["step_ratio_vs_resident"] <= 1.03,
        "every_budget_gives_the_resident_hashes": bool(ok) and all(r["hashes_equal_resident"] for r in ok),
        "every_budget_ran": len(ok) == len(res["budgets"]),
        "forward50_estimate_within_10pct": f50.get("within_10_percent"),
    }
    res["total_seconds"] = time.perf_counter() - t0
    write_json(res, out)
    print({k: res[k] for k in ("smallest_budget_that_runs", "acceptance")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
