"""One rank's model evaluations in a sequence-parallel sampling run.

Per evaluation (every rank, the same calls in the same order):

1. pack the whole residual stream ``x [S, hidden]`` (cheap embeddings; identical on every rank) and keep
   this rank's rows ``[c, hidden]`` (:class:`.shard.RowShard`, zero padding at the tail);
2. run the block stack on those rows with this rank's segment tables and RoPE rows; attention is the
   Ulysses wrapper around the single-device attention op (:class:`.ulysses.UlyssesAttention`);
3. all-gather the rows (one collective per step) and run the final layer on the whole sequence, so
   every rank holds the same velocity and the sampler, the noise and the audio carry stay identical on
   every rank without further communication. Rank 0's latents are the result.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..model.h3 import attention_reference
from .group import ParallelContext
from .shard import RowShard
from .ulysses import CommStats, UlyssesAttention


def model_attention(model) -> Callable[..., torch.Tensor]:
    """The single-device attention op the model itself runs, as ``inner(qkv, heads, head_dim, seq_len)``.

    model.attn_fn (the backend bound at load) when set, else the reference blocks' own SDPA call, so the
    sharded run computes every head exactly as the single-process run does.
    """
    fn = getattr(model, "attn_fn", None)

    def inner(qkv: torch.Tensor, heads: int, head_dim: int, seq_len: int) -> torch.Tensor:
        qkv = qkv[:seq_len]
        if fn is not None:
            return fn(qkv, heads, head_dim)
        q, k, v = qkv.view(seq_len, 3, heads, head_dim).unbind(1)
        return attention_reference(q, k, v)

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
    all-to-all time and bytes of the run."""

    def __init__(self, ctx: ParallelContext, model, plan, inner: Callable[..., torch.Tensor] | None = None):
        self.ctx, self.model, self.plan = ctx, model, plan
        self.shard = RowShard(plan.layout.seq_len, ctx.world_size, ctx.rank)
        self.local = local_plan(plan, self.shard)
        self.stats = CommStats()
        self.attention = UlyssesAttention(self.shard, inner or model_attention(model), ctx.group, self.stats)

    def run_blocks(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The reference block stack over this rank's rows ``x [c, hidden]`` (in place) with Ulysses attention."""
        if getattr(self.model, "stack", None) is not None:
            raise NotImplementedError("sequence parallelism runs the reference block stack only until the "
                                      "block redesign binds attention per run; use --dense")
        lp = self.local
        segs = lp.times[i].mod_segments
        for blk, mod in zip(self.model.blocks, lp.mods[i]):
            x = blk(x, mod, segs, lp.cos, lp.sin, self.attention)
        return x

    @torch.no_grad()
    def evaluate(self, plan, i: int, video: torch.Tensor, audio: torch.Tensor):
        if plan is not self.plan:
            raise ValueError("this evaluator is bound to another plan; make one per sampling run")
        self.stats.step = i
        x = self.shard.take(self.model.pack(plan, video, audio))
        x = self.run_blocks(x, i)
        return self.model.head(self.shard.gather(x, self.ctx.group), plan, i)
