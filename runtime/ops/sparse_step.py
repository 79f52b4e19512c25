"""The step-aware block-sparse attention the block stack consults (``SparseStepAttention``): core's "Model Sparse
Attention" rules per run (window frozen, sinks, VSA tiling), per step (the sigma window, min_tokens) and per block
(dense_blocks, bf16 on CUDA), then one sparse call through comfy-kitchen's chunked producer (``SolAttention.chunked``,
runtime.ops.sparse_attention) or, on the CPU, the eager reference (runtime.ops.sparse_methods). LOSSY."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..errors import H3Error
from ..options import SparseSettings
from .reference import modulated, qk_norm_rope
from .sparse_methods import (BLOCK, PRODUCER_CHUNK, KernelArgs, VsaPlan, core_sinks, pad_rows, pooled_stats,
                             rope_freqs, sol_reference, vsa_plan)
from .sparse_routing import percent_to_sigma

__all__ = ["SparseBlockCall", "SparseStepAttention"]

log = logging.getLogger("h3_blackwell")


@dataclass
class SparseBlockCall:
    """One DiT block's inputs to the sparse path: its BlockOps (``ops.qkv`` produces the pre-norm qkv rows), index,
    the residual ``x`` [S, hidden], the attention modulation (shift, scale) and segments, the RoPE tables."""

    ops: Any
    index: int
    x: torch.Tensor
    shift: torch.Tensor
    scale: torch.Tensor
    segments: Any
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class SparseStepAttention:
    """Core's block-sparse attention (sol-attn, sla, vsa; ``SparseSettings``) for the block stack. LOSSY on its
    sparse calls. Bound once per load.

    Per run: ``begin_run(segments, grid, shift_video, settings)`` takes the packed layout (segments, the target
    video grid (T, H/2, W/2)), freezes the sigma window (the settings' frozen sigmas, else from the percents at
    the run's video shift) and clears the carried statistics; per conditioning (CFG's two alternate):
    ``begin_branch(key, segments, grid)`` switches to that conditioning's layout and statistics; per evaluation
    (each step, each conditioning): ``begin_step(i, sigma)`` with the MODEL
    sigma; per block: ``takes(index, x)`` says whether the block runs sparse (window, min_tokens, dense_blocks,
    bf16 on CUDA as core), then ``block_attention(blk, call)`` -> [S, H*D]. Any other attention call
    (``__call__(qkv)``: dense blocks and steps, the tower, the refiner) runs ``dense``. ``kernel``: comfy-kitchen's
    kernels (SolAttention) or None (the eager reference, on the CPU). ``summary()`` is the report's block.
    """

    kernel: Any
    dense: Any
    heads: int
    head_dim: int
    settings: SparseSettings = SparseSettings()
    kernel_name: str = ""
    dense_name: str = ""
    run_settings: Optional[SparseSettings] = None
    segments: list = field(default_factory=list)
    grid: tuple = (0, 0, 0)
    window: tuple = (0.0, 0.0)
    sinks: tuple = ((0, 0), (0, 0))
    sparse_now: bool = False
    pooled: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)  # per run: VSA plans per device, chunk segments, rope tables
    steps: list = field(default_factory=list)
    calls: dict = field(default_factory=lambda: {"sparse": 0, "dense": 0})
    notes: list = field(default_factory=list)
    branch: Any = 0  # the conditioning the calls now belong to (``begin_branch``)
    branches: dict = field(default_factory=dict)  # the other conditionings' (segments, grid, sinks, pooled, cache)

    @property
    def seq_len(self) -> int:
        return self.segments[-1][1] if self.segments else 0

    def begin_run(self, segments: Sequence[tuple[int, int, str]], grid: tuple[int, int, int], shift_video: float,
                  settings: Optional[SparseSettings] = None) -> None:
        s = (settings or self.settings).check()
        hi = percent_to_sigma(s.start_percent, shift_video) if s.sigma_start is None else float(s.sigma_start)
        lo = percent_to_sigma(s.end_percent, shift_video) if s.sigma_end is None else float(s.sigma_end)
        self.run_settings, self.segments, self.grid, self.window = s, list(segments), tuple(grid), (lo, hi)
        self.sinks = core_sinks(self.segments, self.seq_len, s.sinks)
        self.pooled, self.cache, self.steps, self.notes = {}, {}, [], []
        self.calls = {"sparse": 0, "dense": 0}
        self.sparse_now = False
        self.branch, self.branches = 0, {}

    def begin_branch(self, key, segments: Sequence[tuple[int, int, str]], grid: tuple[int, int, int]) -> None:
        """The next calls belong to conditioning ``key`` (a CFG run alternates its conditionings every step; the
        run's first is branch 0): its own layout, sinks and VSA tiling, and its own carried pooled statistics, as
        core keys them per (block, rows, uuids). The window and settings stay the run's. The rope tables of the
        branch left are dropped (rebuilt at its next call, as at every step)."""
        if self.run_settings is None:
            raise H3Error("sparse attention: begin_run(segments, grid, shift) must come before begin_branch")
        if key == self.branch:
            return
        self.cache.pop("rope", None)
        self.branches[self.branch] = (self.segments, self.grid, self.sinks, self.pooled, self.cache)
        hit = self.branches.pop(key, None)
        if hit is None:
            segs = list(segments)
            hit = (segs, tuple(grid), core_sinks(segs, segs[-1][1], self.run_settings.sinks), {}, {})
        self.segments, self.grid, self.sinks, self.pooled, self.cache = hit
        self.branch = key

    def begin_step(self, step: int, sigma: float) -> None:
        if self.run_settings is None:
            raise H3Error("sparse attention: begin_run(segments, grid, shift) must come before begin_step")
        lo, hi = self.window
        reason = None
        if sigma > hi or sigma < lo:
            reason = f"sigma {sigma:.6g} outside the sparse window [{lo:.6g}, {hi:.6g}]"
        elif self.seq_len < self.run_settings.min_tokens:
            reason = f"{self.seq_len} rows < min_tokens {self.run_settings.min_tokens}"
        self.sparse_now = reason is None
        self.steps.append({"step": step, "sigma": float(sigma), "sparse": self.sparse_now, "branch": self.branch,
                           **({} if reason is None else {"dense_because": reason})})

    def end_run(self) -> None:
        """Back to dense until the next begin_run (a forward outside a sampling run stays dense)."""
        self.sparse_now = False

    def takes(self, index: int, x: torch.Tensor) -> bool:
        """Whether block ``index`` runs sparse on ``x`` [S, hidden] now (core's ``h3_eligible``)."""
        s = self.run_settings
        if not self.sparse_now or x.shape[0] != self.seq_len or index in s.dense_blocks:
            return False
        return x.device.type == "cpu" or x.dtype == torch.bfloat16

    def _plan(self, device) -> VsaPlan:
        key = str(device)
        if key not in self.cache:
            self.cache[key] = vsa_plan(self.segments, self.grid, device)
        return self.cache[key]

    def _inputs(self, blk, c: SparseBlockCall):
        """(produce, n, kernel args, VSA plan or None) of one block call (core's H3 block path):
        ``produce()`` yields the pre-norm qkv in 4096-row chunks, the GEMM shapes core's producer runs."""
        s, x, rows = self.run_settings, c.x, c.x.shape[0]
        if not s.vsa:
            def produce():
                for a in range(0, rows, PRODUCER_CHUNK):
                    b = min(rows, a + PRODUCER_CHUNK)
                    yield c.ops.qkv(c.index, blk, x[a:b], c.shift, c.scale, _clip(c.segments, a, b))

            args = KernelArgs(s.tau, s.topk_ratio, *self.sinks, token_aug=s.token_aug)
            return produce, rows, args, None
        plan = self._plan(x.device)
        gate_proj = blk.attn.to_gate_compress
        if gate_proj is None:
            self._note("VSA: the model has no to_gate_compress layers; running the fine stage without the coarse "
                       "branch")
        gate = None if gate_proj is None else x.new_empty(plan.n, self.heads * self.head_dim)
        chunk_segs = self._chunk_segments(plan, c.segments)

        def produce():  # core's order of work: the padded rows' chunks, pad rows zero in qkv and the gate
            for a, segs in zip(range(0, plan.n, PRODUCER_CHUNK), chunk_segs):
                idx, live = plan.src[a:a + PRODUCER_CHUNK], plan.live[a:a + PRODUCER_CHUNK].unsqueeze(1)
                xc = x[idx.clamp_min(0)]
                if gate is not None:
                    hc = modulated(xc, blk.norm1, c.shift, c.scale, segs)
                    gate[a:a + xc.shape[0]] = gate_proj(torch.where(live, hc, torch.zeros_like(hc)))
                y = c.ops.qkv(c.index, blk, xc, c.shift, c.scale, segs)
                yield torch.where(live, y, torch.zeros_like(y))

        args = KernelArgs(s.tau, s.topk_ratio, (0, plan.n_prefix), (0, plan.n_prefix), tail=False,
                          block_len=plan.block_len,
                          coarse_gate=None if gate is None else gate.view(1, plan.n, self.heads, self.head_dim))
        return produce, plan.n, args, plan

    def _chunk_segments(self, plan: VsaPlan, segments) -> list:
        """The modulation segments of each padded 4096-row chunk (host arithmetic, once per run and segments)."""
        key = ("segments", tuple(segments))
        if key not in self.cache:
            src = plan.src.cpu().clamp_min(0)  # one host copy per run and layout
            row_mod = torch.empty(self.seq_len, dtype=torch.int64)
            for a, b, r in segments:
                row_mod[a:b] = r
            self.cache[key] = [_runs(row_mod[src[a:a + PRODUCER_CHUNK]]) for a in range(0, plan.n, PRODUCER_CHUNK)]
        return self.cache[key]

    def _tables(self, c: SparseBlockCall, plan: Optional[VsaPlan]):
        """(cos, sin, the kernel's rope table) in the call's row order, kept while the call's tables are the same
        objects (every block of a step)."""
        hit = self.cache.get("rope")
        if hit is None or hit[0] is not c.cos or hit[1] is not c.sin:
            cos, sin = (c.cos, c.sin) if plan is None else (pad_rows(c.cos, plan), pad_rows(c.sin, plan))
            hit = self.cache["rope"] = (c.cos, c.sin, cos, sin, rope_freqs(cos, sin))
        return hit[2:]

    def block_attention(self, blk, c: SparseBlockCall) -> torch.Tensor:
        """The sparse attention of one block -> [S, H*D] in x's dtype (before out_proj)."""
        produce, n, args, plan = self._inputs(blk, c)
        cos, sin, freqs = self._tables(c, plan)
        key = (c.index, n)
        qw, kw = blk.attn.q_norm.weight, blk.attn.k_norm.weight
        eps = blk.attn.q_norm.eps
        if self.kernel is None:
            q, k, v = qk_norm_rope(torch.cat(list(produce())), qw, kw, cos, sin, self.heads, self.head_dim, eps)
            gate = None if args.coarse_gate is None else args.coarse_gate[0]
            out = sol_reference(q, k, v, dataclasses.replace(args, coarse_gate=gate))
            state = pooled_stats(k, v, args.block_len)
        else:
            out, state = self.kernel.chunked(produce, n, self.heads, freqs, (qw, kw),
                                             self.pooled.get(key), args, eps)
        self.pooled[key] = state
        self.calls["sparse"] += 1
        out = out.reshape(n, self.heads * self.head_dim)
        return (out if plan is None else out[plan.inv]).to(c.x.dtype)

    def _note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)
            log.warning(message)

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        self.calls["dense"] += 1
        return self.dense(qkv)

    def summary(self) -> dict:
        """Report fields: what ran, the settings, the window, which steps were sparse, calls, copies, notes."""
        s = self.run_settings or self.settings
        (s0, s1), (q0, q1) = self.sinks
        out = {"lossy": True, "kernel": self.kernel_name, "dense_backend": self.dense_name, "method": s.method,
               "tau": s.tau, "keep_percent": s.keep_percent if s.method != "sol-attn" else None,
               "extra_tokens": s.token_aug, "start_percent": s.start_percent, "end_percent": s.end_percent,
               "min_tokens": s.min_tokens, "dense_blocks": list(s.dense_blocks), "sink_conditioning": s.sinks,
               "conditionings": 1 + len(self.branches),
               "sparse_steps": [x["step"] for x in self.steps if x["sparse"]],
               "dense_steps": [x["step"] for x in self.steps if not x["sparse"]], "calls": dict(self.calls),
               "sparse_at_or_below_sigma": self.window[1], "sparse_at_or_above_sigma": self.window[0],
               "sink_blocks": [s0, s1], "dense_query_blocks": [q0, q1],
               "sink_rows": [s0 * BLOCK, min(s1 * BLOCK, self.seq_len)],
               "dense_query_rows": [q0 * BLOCK, min(q1 * BLOCK, self.seq_len)], "notes": list(self.notes)}
        copies = getattr(self.kernel, "copies", None)
        if copies is not None:
            out["qkv_copies"] = dict(copies)
        return out


def _runs(rows: torch.Tensor) -> list:
    """Per-row modulation rows [m] (host int64) -> segments [(start, stop, row)] of equal consecutive rows."""
    values, counts = torch.unique_consecutive(rows, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return [(e - n, e, int(v)) for v, n, e in zip(values.tolist(), counts.tolist(), ends)]


def _clip(segments, start: int, stop: int) -> list:
    """The modulation segments [(a, b, row)] overlapping rows [start, stop), re-based to the slice."""
    return [(max(a, start) - start, min(b, stop) - start, r) for a, b, r in segments if a < stop and b > start]
