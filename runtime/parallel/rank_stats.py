"""The ``sequence_parallel`` block of a run report: world size, per-rank step times and peak memory, the
all-to-all time per step and its bytes per block, the amax all-reduces (W4A4's dynamic scales) per step and
their time. Every rank contributes its own numbers (one
``all_gather_object`` after the runs, outside the timed region); rank 0 writes the report."""

from __future__ import annotations

import statistics

import torch.distributed as dist

from .group import ParallelContext
from .shard import RowShard
from .ulysses import CommStats


def rank_run(step_seconds: list[float], all_to_all_seconds: list[float], peak_allocated: int | None,
             peak_reserved: int | None, latent_sha256: tuple[str, str], amax_seconds: list[float] | None = None,
             amax_calls: list[int] | None = None) -> dict:
    """One measured run as this rank saw it (plain numbers, gathered later); latent_sha256: (video, audio).
    Peaks are None on the CPU (no allocator statistics). amax_seconds / amax_calls: the amax all-reduces'
    seconds and count per step (None: none were bound)."""
    return {"per_step_seconds": list(step_seconds), "all_to_all_seconds_per_step": list(all_to_all_seconds),
            "amax_all_reduce_seconds_per_step": list(amax_seconds or [0.0] * len(step_seconds)),
            "amax_all_reduce_calls_per_step": list(amax_calls or [0] * len(step_seconds)),
            "peak_allocated_bytes": None if peak_allocated is None else int(peak_allocated),
            "peak_reserved_bytes": None if peak_reserved is None else int(peak_reserved),
            "latent_sha256": list(latent_sha256)}


def gather_ranks(ctx: ParallelContext, runs: list[dict]) -> list[dict]:
    """Every rank's measured runs -> ``[{"rank", "device", "runs": [...]}]`` in rank order (a collective)."""
    mine = {"rank": ctx.rank, "device": str(ctx.device), "runs": runs}
    if ctx.world_size == 1:
        return [mine]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, mine, group=ctx.group)
    return out


def parallel_section(ctx: ParallelContext, shard: RowShard, stats: CommStats, ranks: list[dict],
                     blocks: int, numerics: str = "", amax_stats: CommStats | None = None) -> dict:
    """The report block. bytes_per_block: what one rank hands to the two all-to-alls of one block (qkv out,
    attention output back); offrank_bytes_per_block: the share of it that crosses to other ranks.
    amax_all_reduce: calls per step (every rank makes the same calls in every step; the most seen), bytes
    per call and seconds per step of the all-reduces of W4A4's dynamic amaxes (``amax_stats``)."""
    section = {
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "rows_per_rank": shard.chunk,
        "padding_rows": shard.padded_len - shard.seq_len,
        "numerics": numerics,
        "all_to_all": {
            "calls_per_step": 2 * blocks if ctx.world_size > 1 else 0,
            "bytes_per_block": stats.bytes_per_call,
            "offrank_bytes_per_block": stats.offrank_bytes_per_call,
            "timing": "CUDA events around each collective, read after the run" if ctx.device.type == "cuda"
            else "perf_counter around each collective (CPU)",
        },
        "amax_all_reduce": {
            "what": "one all-reduce (MAX) of one fp32 per quantized linear with a dynamic activation scale (W4A4: "
                    "qkv, out_proj, fc1, fc2 of every block), so each rank quantizes with the whole sequence's amax",
            "bytes_per_call": amax_stats.bytes_per_call if amax_stats is not None else 0,
        },
    }
    return _with_ranks(section, ranks)


def _with_ranks(section: dict, ranks: list[dict]) -> dict:
    """``section`` with ``ranks`` and the figures taken over all their runs (medians, amax calls per step, whether
    the ranks' last latents are the same bytes)."""
    steps_a2a = [s for r in ranks for run in r["runs"] for s in run["all_to_all_seconds_per_step"]]
    amax_secs = [s for r in ranks for run in r["runs"] for s in run.get("amax_all_reduce_seconds_per_step", ())]
    amax_calls = [c for r in ranks for run in r["runs"] for c in run.get("amax_all_reduce_calls_per_step", ())]
    steps = [s for r in ranks for run in r["runs"] for s in run["per_step_seconds"]]
    out = dict(section, ranks=ranks)
    out["median_step_seconds_all_ranks"] = statistics.median(steps) if steps else None
    # every rank runs the sampler on the same gathered velocity: their latents must be the same bytes
    out["latents_identical_across_ranks"] = len({tuple(r["runs"][-1]["latent_sha256"]) for r in ranks
                                                 if r["runs"]}) == 1
    out["all_to_all"] = dict(section["all_to_all"], median_seconds_per_step_all_ranks=statistics.median(steps_a2a)
                             if steps_a2a else None)
    out["amax_all_reduce"] = dict(section["amax_all_reduce"], calls_per_step=max(amax_calls, default=0),
                                  median_seconds_per_step_all_ranks=statistics.median(amax_secs)
                                  if amax_secs else None)
    return out


def merge_sections(sections: list[dict]) -> dict:
    """The ``sequence_parallel`` blocks of several measured runs of one request as one: each rank's runs in
    order, the figures taken over all of them (the last run's block otherwise)."""
    ranks = [dict(r, runs=[run for s in sections for run in s["ranks"][k]["runs"]])
             for k, r in enumerate(sections[-1]["ranks"])]
    return _with_ranks(sections[-1], ranks)
