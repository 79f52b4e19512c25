#!/usr/bin/env python3
"""Core's block-sparse methods beside dense, on two jobs, in one lease (issue 38) -> bench/results/sparse-methods.json

    python3 bench/sparse_methods.py [--jobs canonical,turbo8] [--methods dense,sol-attn,sla,vsa] [--runs 2]
                                    [--merge] [--out bench/results/sparse-methods.json] [--tiny]

1. A full-size H3 (random weights, NVFP4 on the GPU, as bench/canonical.py) loaded once with attention=sparse; its
   dense backend is the one auto picks (sage2 where built). ``dense`` rows run every step on that backend (the
   sparse window closed); each sparse method runs at core's "Model Sparse Attention" defaults
   (runtime.SparseSettings(): start 0.2, end 1.0, min_tokens 12288, extra_tokens 256 (vsa 0), sinks
   exact_kv_and_rows; tau 1.3 / keep 10 %). The random model has no to_gate_compress: vsa runs its fine stage
   (core's fallback, with its warning), see ``parity_vs_core.vsa`` for the gated path.
2. Jobs from bench/jobs.py: ``canonical`` (t2va 1344x768, 124 frames, 12 steps) and ``turbo8`` (fl2va, first and
   last keyframes, 8 steps, a random turbo-style LoRA of ``TURBO_LORA_RANK`` merged into the NVFP4 weights).
   Each (job, method) samples ``--runs`` times: rows {job, method, step_seconds (median over the runs' steps),
   hashes_exact_across_runs, final_rel_l2_vs_dense (video; the dense row's latent of the same job)}.
3. ``parity_vs_core``: tests/fixtures/sparse_parity.py (the GPU test's comparison) per method: core's own
   h3_sparse_attention (its nodes_sparse_attention.py, cached outside git: carry .core_cache) vs ours, rel-L2.
The JSON is rewritten after every row. ``--tiny``: the embedded tiny model on the CPU (the eager reference; the
flow end to end, no timing claim). Random weights: the rel-L2 values measure the approximation, not quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _h3bench import ROOT, bench_command, build, err_text, versions, write_json  # noqa: E402
from jobs import TURBO_LORA_RANK_SOURCE, canonical_job, tiny, turbo8_job  # noqa: E402

from h3_blackwell.runtime import (LoraSpec, LoraView, LossySettings, Measure, RuntimeOptions, SampleInputs,  # noqa: E402
                                  SamplingSettings, SparseSettings, conditioning_from_payload, run, tensor_job)
from h3_blackwell.runtime.model.config import FULL, TINY  # noqa: E402

METHODS = ("dense", "sol-attn", "sla", "vsa")
JOBS = {"canonical": canonical_job, "turbo8": turbo8_job}


def method_settings(method: str, tiny_run: bool) -> SparseSettings:
    """Core's node defaults for ``method``; ``dense``: the window closed (start at 100 %: every step on the dense
    backend the sparse runs use for their dense steps). The tiny run takes its few rows sparse (min_tokens 0)."""
    s = SparseSettings(start_percent=1.0) if method == "dense" else SparseSettings(method)
    return dataclasses.replace(s, min_tokens=0) if tiny_run else s


def job_inputs(job, cfg) -> tuple[SampleInputs, dict]:
    """(SampleInputs, workload_extra) of a bench job: random text states (seeded), zero latents of the job's
    canvas, first / last keyframe latents for fl2va (seeded)."""
    g = torch.Generator().manual_seed(job.seed)
    t = 2 if job.frames <= 5 else (job.frames - 5) // 17 * 5 + 2
    vshape, ashape = (1, cfg.video_channels, t, job.height // 16, job.width // 16), (1, cfg.audio_channels, 2,
                                                                                     round(job.frames / 24 * 40))
    text = torch.randn(1, job.text_tokens, cfg.text_dim, generator=g)
    cond = None
    if job.keyframes:
        kfs = [{"resolved_frame_index": k % job.frames, "latent": torch.randn(1, cfg.video_channels, 1, *vshape[3:],
                                                                            generator=g)} for k in job.keyframes]
        cond = conditioning_from_payload({"keyframes": kfs, "seed": job.seed})
    extra = {"frames": job.frames, "text_source": f"random (seed {job.seed})", "job": job.as_dict()}
    return SampleInputs(text, None, torch.zeros(vshape), torch.zeros(ashape), cond), extra


def with_lora(rt, job, folder: Path, cfg):
    """The runtime seen with the job's turbo-style LoRA (random, block linears, rank ``job.lora_rank``), or rt."""
    if job.lora_rank is None:
        return rt
    from fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth

    path = folder / f"turbo_r{job.lora_rank}.safetensors"
    if not path.exists():
        truth = tiny_lora_truth(cfg, seed=3, rank=job.lora_rank, refiner=False, adaln=False, extras=False)
        save_tiny_lora(path, truth, "diffusion_model")
    return LoraView(rt, [LoraSpec(str(path), 1.0, job.lora_mode)])


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_row(model, job, method: str, inputs, extra, runs: int, tiny_run: bool):
    """One (job, method) row -> (row, the last run's video latent)."""
    sampling = SamplingSettings(seed=job.seed, steps=job.steps, sampler=job.sampler)
    r = run(tensor_job(model, inputs, sampling, lossy=LossySettings(sparse=method_settings(method, tiny_run)),
                       measure=Measure(runs, 0), workload_extra=extra))
    rep = r.report
    steps = [s["seconds"] for one in rep["per_step_seconds"] for s in one]
    sa = rep.get("sparse_attention") or {}
    row = {"job": job.name, "method": method, "step_seconds": statistics.median(steps),
           "hashes_exact_across_runs": bool(rep["latent_checksums"]["exact_across_measured_runs"]),
           "runs": runs, "steps": job.steps, "sparse_steps": sa.get("sparse_steps"), "calls": sa.get("calls"),
           "sampling_seconds": rep["sampling_seconds"], "video_sha256": rep["latent_checksums"].get("video_sha256"),
           "notes": sa.get("notes")}
    return row, r.video


def parity(methods) -> dict:
    """tests/fixtures/sparse_parity.compare per method (the GPU test's comparison), errors recorded."""
    from fixtures.sparse_parity import METHODS as PARITY, compare

    out = {}
    for m in PARITY:
        if m.split("_")[0] not in methods:
            continue
        try:
            out[m] = compare(m)
        except Exception as e:  # noqa: BLE001 - the timing rows stand without it
            out[m] = {"error": err_text(e)}
    return out


def _load(a):
    if a.tiny:
        return build(RuntimeOptions.from_env(device="cpu", attention="sparse", quantize=False), 0, TINY), TINY
    return build(RuntimeOptions.from_env(device="cuda", attention="sparse"), 0), FULL


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="canonical,turbo8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--merge", action="store_true", help="keep the rows of an existing --out file (others' jobs)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model on the CPU (flow check)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sparse-methods.json"))
    a = ap.parse_args(argv)
    out, jobs, methods = Path(a.out), a.jobs.split(","), a.methods.split(",")
    t0 = time.perf_counter()
    res = json.loads(out.read_text()) if a.merge and out.exists() else {}
    res.update(name="sparse-methods", command=bench_command(argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name() if not a.tiny else "cpu (--tiny: embedded tiny model)",
               versions=versions(comfy_kitchen=_kitchen_version()), lora_rank_source=TURBO_LORA_RANK_SOURCE,
               settings={m: dataclasses.asdict(method_settings(m, a.tiny)) for m in methods})
    res.setdefault("rows", [])
    res["calls"] = res.get("calls", []) + [{"command": res["command"], "date": res["date"], "jobs": jobs}]
    rt, cfg = _load(a)
    res["backends"] = rt.backends
    folder = Path(tempfile.mkdtemp(prefix="h3b-sparse-bench-"))
    for name in jobs:
        job = tiny(JOBS[name]()) if a.tiny else JOBS[name]()
        inputs, extra = job_inputs(job, cfg)
        model = with_lora(rt, job, folder, cfg)
        latents = {}
        for method in ["dense"] + [m for m in methods if m != "dense"]:
            row, latents[method] = run_row(model, job, method, inputs, extra, a.runs, a.tiny)
            row["final_rel_l2_vs_dense"] = _rel(latents[method], latents["dense"])
            res["rows"] = [r for r in res["rows"] if (r["job"], r["method"]) != (job.name, method)] + [row]
            res["total_seconds"] = time.perf_counter() - t0
            write_json(res, out)
            print(json.dumps(row), flush=True)
    if not (a.skip_parity or a.tiny):
        detail = parity(methods)
        res["parity_vs_core"] = {m: d.get("rel_l2") for m, d in detail.items()}
        res["parity_detail"] = detail
    res["total_seconds"] = time.perf_counter() - t0
    write_json(res, out)
    return 0


def _kitchen_version():
    try:
        import importlib.metadata

        return importlib.metadata.version("comfy-kitchen")
    except Exception as e:  # noqa: BLE001
        return err_text(e)


if __name__ == "__main__":
    sys.exit(main())
