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

from ..ops.reference import ReferenceOps, exact_attention
from ..ops.attention import bind_attention
from .group import ParallelContext
from .shard import RowShard
from .ulysses import CommStats, UlyssesAttention


def sharded_ops(ops, attention: Callable[[torch.Tensor], torch.Tensor]):
    """``ops`` (the BlockOps bound at load, LoRA wrapper included) with its attention replaced by ``attention``
    (the Ulysses wrapper; ``ops.with_attention``); every other op is row-local and runs unchanged on the rank's
    rows. The reference ops take the bound-backend form (they then hand the normed qkv buffer to attention)."""
    return ops.with_attention(attention)


def numerics(ops) -> str:
    """What splitting the rows does to the numbers, for the report. Every op but one is row-local: the NVFP4
    activation producers with a dynamic scale (W4A4) take one amax per tensor, here per rank."""
    if getattr(ops, "name", None) == "nvfp4" and getattr(ops, "act_scale", None) == "dynamic":
        return ("W4A4 with a dynamic activation scale: each rank quantizes with the amax of its own rows (a valid "
                "NVFP4 quantization, not the single-device bytes); everything else row-local")
    return "row-local: each rank runs the single-device per-row and per-head math on its rows and heads"


def make_inner(backend: str | None, v_handling: str = "none") -> Callable[..., torch.Tensor]:
    """The single-device attention as ``inner(qkv, heads, head_dim, seq_len)`` for the Ulysses wrapper: the
    load plan's backend bound once per local head count, or exact attention (``backend`` None: the reference
    block ops), so every head is computed as the single-process run computes it."""
    bound: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    def inner(qkv: torch.Tensor, heads: int, head_dim: int, seq_len: int) -> torch.Tensor:
        qkv = qkv[:seq_len]
        if backend is None:
            return exact_attention(*qkv.view(seq_len, 3, heads, head_dim).unbind(1))
        if heads not in bound:
            bound[heads] = bind_attention(backend, heads, head_dim, v_handling=v_handling)
        return bound[heads](qkv)

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

    def __init__(self, ctx: ParallelContext, model, plan, ops=None, inner: Callable[..., torch.Tensor] | None = None,
                 attention_backend: str | None = None, v_handling: str = "none"):
        self.ctx, self.model, self.plan = ctx, model, plan
        self.shard = RowShard(plan.layout.seq_len, ctx.world_size, ctx.rank)
        self.local = local_plan(plan, self.shard)
        self.stats = CommStats()
        ops = ops if ops is not None else ReferenceOps(model.cfg)
        inner = inner or make_inner(attention_backend, v_handling)
        self.attention = UlyssesAttention(self.shard, inner, ctx.group, self.stats)
        self.ops = sharded_ops(ops, lambda qkv: self.attention(qkv, model.cfg.num_heads, model.cfg.head_dim))

    def run_blocks(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The block stack over this rank's rows ``x [c, hidden]`` (in place) with Ulysses attention."""
        return self.model.run_blocks(x, self.local, i, self.ops)

    @torch.no_grad()
    def evaluate(self, plan, i: int, video: torch.Tensor, audio: torch.Tensor):
        if plan is not self.plan:
            raise ValueError("this evaluator is bound to another plan; make one per sampling run")
        self.stats.step = i
        x = self.shard.take(self.model.pack(plan, video, audio))
        x = self.run_blocks(x, i)
        return self.model.head(self.shard.gather(x, self.ctx.group), plan, i)
