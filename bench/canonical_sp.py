#!/usr/bin/env python3
"""The canonical H3 workload with sequence parallelism (issue 19), beside the same host's single-GPU run.

    python3 bench/canonical_sp.py --sequence-parallel 2 [--runs 3 --warmup 1 --steps 12]   # 2 GPUs
    python3 bench/canonical_sp.py --sequence-parallel 1 --out bench/results/canonical-h200-sp1.json   # 1 GPU

1. The plain single-GPU run in this process (cuda:0, no process group): the random full-size model of
   bench/canonical.py (`_h3bench.build`, seed 0), the canonical workload (1344x768, 124 frames, 37,810
   packed rows, 12 steps, seed 440420, res_multistep), --warmup + --runs resident runs. Then it is freed.
2. The same workload through the distributed code path on N local ranks (`runtime.parallel.launch`, NCCL,
   rank r on cuda:r): every rank builds the same random model (same seed, same device generator) and runs
   the runtime's job there (`runtime.job.run_rank`); rank 0's latents and report come back.
3. The JSON (rewritten after each stage): median_step_seconds (all ranks' measured steps),
   single_gpu_median_step_seconds, speedup, peak allocated bytes per rank, all-to-all seconds per step and
   bytes per block, latent hashes exact across the measured runs and across the ranks, rel-L2 of the final
   latents against the single-GPU run, and the cost model of bench/NOTES.md evaluated on this run's own
   single-GPU step and bytes. N = 1 measures what the distributed path costs when nothing is split
   (issue 19: within 2 % of the plain path).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, bench_command, build, err_text, versions, write_json  # noqa: E402

from h3_blackwell.runtime.model.config import FULL, TINY  # noqa: E402
from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402
from h3_blackwell.runtime import Measure, SampleInputs, SamplingSettings, tensor_job  # noqa: E402
from h3_blackwell.runtime.job import run_rank  # noqa: E402
from h3_blackwell.runtime.parallel import check_degree, launch  # noqa: E402

SEED = 440420
# the canonical workload (1344x768, 124 frames, 100 text rows); --smoke: the tiny model's small canvas on the CPU
SHAPES = {"canonical": ((1, 24, 37, 48, 84), (1, 32, 2, 207), 100), "smoke": ((1, 24, 2, 4, 4), (1, 32, 2, 8), 9)}
NVLINK_BYTES_PER_S = {"900GBps": 900e9, "450GBps": 450e9}  # bench/NOTES.md: the figure, and half of it
RESHUFFLE_BYTES_PER_S = 3e12  # local permute copies, read + write (bench/NOTES.md)


def _options(a, device: str) -> RuntimeOptions:
    return RuntimeOptions.from_env(device=device, attention=a.attention, gemm=a.gemm, act_format=a.act_format)


def _build(a, device: str):
    return build(_options(a, device), 0, TINY if a.smoke else FULL)


def _memory_allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if torch.device(device).type == "cuda" else 0


def _sample(rt, a, ctx=None):
    """The canonical job on the resident ``rt``: this process's run (``ctx`` None) or one rank's (the runtime's
    ``run_rank``, what each worker of a sequence-parallel ``run`` executes)."""
    vshape, ashape, text_rows = SHAPES["smoke" if a.smoke else "canonical"]
    text = torch.randn(1, text_rows, rt.config.text_dim, generator=torch.Generator().manual_seed(SEED))
    job = tensor_job(rt, SampleInputs(text, None, torch.zeros(vshape), torch.zeros(ashape)),
                     SamplingSettings(seed=SEED, steps=a.steps, sampler="res_multistep"),
                     measure=Measure(a.runs, a.warmup),
                     workload_extra={"frames": 5 if a.smoke else 124, "text_source": f"random (seed {SEED})"})
    return run_rank(ctx, job)


def sp_rank(ctx, a) -> dict:
    """One rank of the sequence-parallel run (started by ``launch``); rank 0's dict comes back."""
    rt = _build(a, str(ctx.device))
    resident = _memory_allocated(ctx.device)
    r = _sample(rt, a, ctx)
    return {"video": r.video, "audio": r.audio, "report": r.report, "backends": rt.backends,
            "resident_bytes_after_prepare": resident}


def _median_step(report: dict) -> float:
    return statistics.median(s["seconds"] for run in report["per_step_seconds"] for s in run)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def single_gpu(a, res: dict, out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    rt = _build(a, "cpu" if a.smoke else "cuda:0")
    r = _sample(rt, a)
    rep = r.report
    res["single_gpu"] = {"median_step_seconds": _median_step(rep), "per_step_seconds": rep["per_step_seconds"],
                         "sampling_seconds": rep["sampling_seconds"], "peak_allocated_bytes": rep["peak_allocated_bytes"],
                         "latent_checksums": rep["latent_checksums"], "backends": rt.backends}
    res["single_gpu_median_step_seconds"] = res["single_gpu"]["median_step_seconds"]
    write_json(res, out)
    video, audio = r.video, r.audio
    del rt, r
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return video, audio


def cost_model(single_step: float, n: int, blocks: int, hidden_bytes: int, sp: dict) -> dict:
    """bench/NOTES.md's model on this run's numbers: single step / N + per block (off-rank bytes / bandwidth +
    local reshuffles of the rank's buffers) + the per-step all-gather of the hidden rows."""
    a2a = sp["all_to_all"]
    gather = sp["rows_per_rank"] * n * hidden_bytes * (n - 1) / n
    out = {}
    for name, bw in NVLINK_BYTES_PER_S.items():
        per_block = a2a["offrank_bytes_per_block"] / bw + 2 * a2a["bytes_per_block"] / RESHUFFLE_BYTES_PER_S
        step = single_step / n + blocks * per_block + gather / bw
        out[name] = {"predicted_step_seconds": step, "predicted_speedup": single_step / step,
                     "predicted_all_to_all_seconds_per_step": blocks * a2a["offrank_bytes_per_block"] / bw}
    return out


def _peak(values) -> Optional[int]:
    """The largest of a rank's per-run peaks; None where the runs had none (the CPU smoke: no device allocator)."""
    got = [v for v in values if v is not None]
    return max(got) if got else None


def sequence_parallel(a, res: dict, single: tuple, out: Path) -> None:
    # the workers import this file as the module ``canonical_sp`` (the bench folder is on their sys.path); a
    # function of ``__main__`` could not be found there
    import canonical_sp

    got = launch(canonical_sp.sp_rank, (a,), world_size=a.sequence_parallel, device_type="cpu" if a.smoke else "cuda")
    rep = got["report"]
    sp = rep["sequence_parallel"]
    runs = [run for r in sp["ranks"] for run in r["runs"]]
    res.update({
        "backends": got["backends"],
        "resident_bytes_after_prepare_rank0": got["resident_bytes_after_prepare"],
        "workload": rep["workload"],
        "median_step_seconds": sp["median_step_seconds_all_ranks"],
        "median_step_seconds_rank0": _median_step(rep),
        "per_step_seconds_per_rank": {r["rank"]: [run["per_step_seconds"] for run in r["runs"]] for r in sp["ranks"]},
        "peak_allocated_bytes_per_rank": {r["rank"]: _peak(run["peak_allocated_bytes"] for run in r["runs"])
                                          for r in sp["ranks"]},
        "peak_reserved_bytes_per_rank": {r["rank"]: _peak(run["peak_reserved_bytes"] for run in r["runs"])
                                         for r in sp["ranks"]},
        "all_to_all_seconds_per_step": statistics.median(s for run in runs for s in run["all_to_all_seconds_per_step"]),
        "all_to_all_bytes_per_block": sp["all_to_all"]["bytes_per_block"],
        "all_to_all_offrank_bytes_per_block": sp["all_to_all"]["offrank_bytes_per_block"],
        "latent_checksums": rep["latent_checksums"],
        "latents_identical_across_ranks": sp["latents_identical_across_ranks"],
        "rel_l2_vs_single_gpu": {"video": _rel_l2(got["video"], single[0]), "audio": _rel_l2(got["audio"], single[1])},
        "sequence_parallel": sp,
        "configuration": rep["configuration"],
    })
    res["speedup"] = res["single_gpu_median_step_seconds"] / res["median_step_seconds"]
    if a.sequence_parallel == 1:  # nothing is split: what the distributed path itself costs
        res["overhead_vs_plain"] = res["median_step_seconds"] / res["single_gpu_median_step_seconds"] - 1
    hidden_bytes = rep["model"]["hidden"] * (4 if a.smoke else 2)  # the all-gathered rows: fp32 CPU, bf16 GPU
    res["cost_model"] = cost_model(res["single_gpu_median_step_seconds"], a.sequence_parallel,
                                   rep["model"]["blocks"], hidden_bytes, sp)
    write_json(res, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequence-parallel", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--gemm", default="auto")
    ap.add_argument("--act-format", default=None, choices=["auto", "nvfp4", "fp8"])
    ap.add_argument("--smoke", action="store_true", help="the embedded tiny config on the CPU (gloo): checks this "
                                                          "script's plumbing in seconds, measures nothing")
    ap.add_argument("--out", default=None, help="default: bench/results/canonical-h200x{N}.json "
                                                "(N = 1: canonical-h200-sp1.json)")
    a = ap.parse_args(argv)
    n = a.sequence_parallel
    check_degree(n, (TINY if a.smoke else FULL).num_heads, "cpu" if a.smoke else "cuda")  # before anything is built
    out = Path(a.out or ROOT / "bench" / "results" / (f"canonical-h200x{n}.json" if n > 1 else "canonical-h200-sp1.json"))
    res = {"name": out.stem,
           "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "devices": ["cpu"] * n if a.smoke else [torch.cuda.get_device_name(i) for i in range(n)],
           "versions": versions(**({} if a.smoke else {"nccl": ".".join(map(str, torch.cuda.nccl.version()))})),
           "world_size": n}
    t0 = time.perf_counter()
    single = single_gpu(a, res, out)
    try:
        sequence_parallel(a, res, single, out)
    except Exception as e:  # noqa: BLE001 - keep the single-GPU half and say why the other is missing
        res["sequence_parallel_error"] = err_text(e)
        write_json(res, out)
        raise
    if a.smoke:
        res["acceptance"] = "none: a --smoke run checks the plumbing on the CPU and measures nothing"
    else:
        res["acceptance"] = {
            "hashes_exact_across_measured_runs": res["latent_checksums"]["exact_across_measured_runs"],
            "latents_identical_across_ranks": res["latents_identical_across_ranks"],
        }
        if n > 1:
            res["acceptance"]["speedup_ge_1.7"] = res["speedup"] >= 1.7
        else:
            res["acceptance"]["distributed_path_within_2pct_of_plain"] = res["speedup"] >= 1 / 1.02
    res["total_seconds"] = time.perf_counter() - t0
    write_json(res, out)
    print({k: res.get(k) for k in ("median_step_seconds", "single_gpu_median_step_seconds", "speedup",
                                   "all_to_all_seconds_per_step", "rel_l2_vs_single_gpu", "acceptance")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
