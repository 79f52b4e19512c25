"""One rank's model evaluations in a sequence-parallel sampling run.

Per evaluation (every rank, the same calls in the same order):

1. pack the whole residual stream ``x [S, hidden]`` (cheap embeddings; identical on every rank) and keep
   this rank's rows ``[c, hidden]`` (:class:`.shard.RowShard`, zero padding at the tail);
2. run the block stack on those rows with this rank's segment tables and RoPE rows; attention is the
   Ulysses wrapper around the single-device attention op (:class:`.ulysses.UlyssesAttention`), and every
   dynamic NVFP4 activation scale takes the amax of all ranks (:class:`.amax.AmaxAllReduce`);
3. all-gather the rows (one collective per step) and run the final layer on the whole sequence, so
   every rank holds the same velocity and the sampler, the noise and the audio carry stay identical on
   every rank without further communication. Rank 0's latents are the result.

What else could depend on the split, and why it does not: modulation rows and RoPE are per row (the segment
tables are clipped to the rank's rows, a straddling segment keeps its row on both ranks); timesteps, masks,
the text refiner and the final layer run on the whole sequence on every rank; RMSNorm, the W4A8 producers
(one e4m3 scale per row) and the NVFP4 block scales (16 values of one row) are row-local; LoRA side paths
act on each row's unquantized input. What is refused under sequence parallelism instead (before any work):
sparse attention and the First-Block Cache (runtime.sampling.lossy: the routing and the skip decision would
need the whole sequence) and the Fun ControlNet tower (runtime.sampling.sampler).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..ops.reference import ReferenceOps, exact_attention
from .amax import AmaxAllReduce
from .group import ParallelContext
from .shard import RowShard
from .ulysses import CommStats, UlyssesAttention


def sharded_ops(ops, attention: Callable[[torch.Tensor], torch.Tensor], amax_reduce=None):
    """``ops`` (the BlockOps bound at load, LoRA and streaming wrappers included) with its attention replaced by
    ``attention`` (the Ulysses wrapper; ``ops.with_attention``, a copy) and, for ops whose producers take a
    dynamic amax (W4A4: ``Nvfp4Ops.amax_reduce``), ``amax_reduce`` (the all-reduce over the ranks; None keeps
    the local amax) set on that copy (``set_amax_reduce``: a wrapper passes it to its inner ops). Every other op is row-local and
    runs unchanged on the rank's rows. The reference ops take the bound-backend form (they then hand the normed
    qkv buffer to attention)."""
    out = ops.with_attention(attention)
    if amax_reduce is not None and out.takes_amax_reduce:
        out.set_amax_reduce(amax_reduce)
    return out


def numerics(ops) -> str:
    """What splitting the rows does to the numbers, for the report. Every op is row-local but the NVFP4
    producers with a dynamic scale (W4A4), which take one amax per tensor: all-reduced over the ranks."""
    if ops.name == "nvfp4" and ops.act_scale == "dynamic":
        return ("W4A4 with a dynamic activation scale: each per-tensor amax is all-reduced (MAX) over the ranks, "
                "so every rank quantizes with the single-process scale; everything else row-local")
    return "row-local: each rank runs the single-device per-row and per-head math on its rows and heads"


def make_inner(attention: Callable[[torch.Tensor], torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    """The single-device attention as ``inner(qkv, heads, head_dim, seq_len)`` for the Ulysses wrapper: the
    function the load bound for the plan's backend (``H3Runtime.attention``; it takes any head count, so it runs
    this rank's heads as it runs all of them on one device), or exact attention (``attention`` None: the
    reference block ops), so every head is computed as the single-process run computes it."""

    def inner(qkv: torch.Tensor, heads: int, head_dim: int, seq_len: int) -> torch.Tensor:
        qkv = qkv[:seq_len]
        if attention is None:
            return exact_attention(*qkv.view(seq_len, 3, heads, head_dim).unbind(1))
        return attention(qkv)

    return inner


def local_plan(plan, shard: RowShard):
    """``plan`` (a RunPlan) as one rank sees it: RoPE rows and every step's modulation segments clipped to
    the rank's rows (local indices). Everything else (mods, final layer, layout) is shared, unchanged."""
    cos, sin = shard.rope(plan.cos, plan.sin)
    times = [dataclasses.replace(st, mod_segments=shard.local_segments(st.mod_segments)) for st in plan.times]
    return dataclasses.replace(plan, cos=cos, sin=sin, times=times)


class ShardedEvaluator:
    """``evaluate(plan, i, video, audio)`` with the same contract as ``H3Model.evaluate`` (negated velocity,
    fp32, whole latents), computed over the ranks of ``ctx``. Bound to one plan; ``stats`` holds the
    all-to-all time and bytes of the run, ``amax_stats`` the amax all-reduces' (none in a world of one, whose
    ops stay the plain path's). ``attention``: the load's bound attention (``H3Runtime.attention``), None for
    exact attention; ``inner`` replaces both (tests)."""

    def __init__(self, ctx: ParallelContext, model, plan, ops=None, inner: Callable[..., torch.Tensor] | None = None,
                 attention: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.ctx, self.model, self.plan = ctx, model, plan
        self.shard = RowShard(plan.layout.seq_len, ctx.world_size, ctx.rank)
        self.local = local_plan(plan, self.shard)
        self.stats, self.amax_stats = CommStats(), CommStats()
        ops = ops if ops is not None else ReferenceOps(model.cfg)
        inner = inner or make_inner(attention)
        self.attention = UlyssesAttention(self.shard, inner, ctx.group, self.stats)
        reduce = AmaxAllReduce(ctx.group, self.amax_stats) if ctx.world_size > 1 else None
        self.ops = sharded_ops(ops, lambda qkv: self.attention(qkv, model.cfg.num_heads, model.cfg.head_dim), reduce)

    def reset_stats(self) -> None:
        """Start a run's counts and timings afresh (all-to-alls and amax all-reduces)."""
        self.stats.reset()
        self.amax_stats.reset()

    def run_blocks(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The block stack over this rank's rows ``x [c, hidden]`` (in place) with Ulysses attention."""
        return self.model.run_blocks(x, self.local, i, self.ops)

    @torch.no_grad()
    def evaluate(self, plan, i: int, video: torch.Tensor, audio: torch.Tensor):
        if plan is not self.plan:
            raise ValueError("this evaluator is bound to another plan; make one per sampling run")
        self.stats.step = self.amax_stats.step = i
        x = self.shard.take(self.model.pack(plan, video, audio))
        x = self.run_blocks(x, i)
        return self.model.head(self.shard.gather(x, self.ctx.group), plan, i)
