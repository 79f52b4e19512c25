"""One DiT block and the modules it is made of (names = ComfyUI checkpoint keys), over BlockOps.

``DiTBlock.forward`` is the only block forward: the operations it calls (QKV, norm+RoPE, attention, out_proj,
gate/add, FC1, FC2) come from a BlockOps object resolved once at load: ``runtime.ops.reference.ReferenceOps``
(the dense reference) or the NVFP4 (W4A4) and W4A8 ones of ``runtime.ops.block_ops``.

Conventions (ComfyUI core ``comfy/ldm/minimax/model.py``): qkv_proj output is contiguous thirds
``[q_all | k_all | v_all]``; per-head RMSNorm of q and k, then split-half RoPE on the first ``rope_dim``
(96 of 128) channels; modulation ``norm(x) * (1 + scale) + shift`` per segment; fc1 output ``[gate | up]``,
the MLP ``fc2(silu(gate) * up)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.reference import exact_attention, rms_norm
from ..ops.rows_kv import rows_kv
from ..ops.sparse_step import SparseBlockCall
from .config import H3Config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: H3Config, dtype, device=None, gate_compress=False):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        inner = cfg.inner_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * inner, bias=False, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps, dtype=dtype, device=device)
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        # VSA's coarse-branch gate (FastH3 checkpoints); unused by the dense forward, read by the sparse path
        self.to_gate_compress = (nn.Linear(cfg.hidden_size, inner, bias=False, dtype=dtype, device=device)
                                 if gate_compress else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The token refiner's attention: q/k RMSNorm, no RoPE, exact attention. (DiT blocks run theirs
        through their BlockOps.)"""
        qkv = self.qkv_proj(h)
        s = qkv.shape[0]
        q, k, v = qkv.view(s, 3, self.heads, self.head_dim).unbind(1)
        return self.out_proj(exact_attention(self.q_norm(q), self.k_norm(k), v))


class MLP(nn.Module):
    def __init__(self, cfg: H3Config, dtype, device=None):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, h):
        gate, up = self.fc1(h).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class AdalnProj(nn.Module):
    """t_emb [M, t_dim] -> [M * modalities, expand * hidden] (SiLU first in full form, not in curve form)."""

    def __init__(self, t_dim, hidden, expand, modalities, apply_silu, dtype, device=None):
        super().__init__()
        self.expand, self.modalities, self.hidden, self.apply_silu = expand, modalities, hidden, apply_silu
        self.linear = nn.Linear(t_dim, expand * hidden * modalities, bias=True, dtype=dtype, device=device)

    def forward(self, t_emb):
        x = F.silu(t_emb) if self.apply_silu else t_emb
        x = self.linear(x.to(self.linear.weight.dtype))
        return x.reshape(x.shape[0] * self.modalities, self.expand * self.hidden)


def clip_segments(segments, start: int, stop: int) -> list[tuple[int, int, int]]:
    """The segments [(a, b, row)] that overlap rows [start, stop), re-based to the slice (local rows)."""
    return [(max(a, start) - start, min(b, stop) - start, r) for a, b, r in segments if a < stop and b > start]


class DiTBlock(nn.Module):
    def __init__(self, cfg: H3Config, dtype, adaln_dtype, device=None):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.eps, dtype=dtype, device=device)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype, device, gate_compress=cfg.gate_compress)
        self.mlp = MLP(cfg, dtype, device)
        self.adaln_proj = AdalnProj(cfg.time_embed_dim, cfg.hidden_size, 6, 3, not cfg.curve_form, adaln_dtype, device)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, segments, cos, sin, ops, index: int = 0) -> torch.Tensor:
        """x [S, hidden] (updated in place and returned); mod [M*3, 6*hidden] from adaln_proj; segments
        [(start, stop, mod_row)]; cos/sin [S, rope_dim] fp32; ops: the BlockOps resolved at load
        (runtime.ops.reference.ReferenceOps, or runtime.ops.block_ops for the quantized ones); index: this block's number."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        sparse = ops.sparse  # block-sparse attention (runtime.ops.sparse_attention) where this block runs it now
        if sparse is not None and sparse.takes(index, x):
            o = sparse.block_attention(self, SparseBlockCall(ops, index, x, shift_msa, scale_msa, segments, cos, sin))
        elif ops.attn_chunk_rows and ops.attn_chunk_rows < x.shape[0]:  # query-row chunks when the budget asks
            self._attend_in_row_chunks(x, (shift_msa, scale_msa, gate_msa), segments, (cos, sin), ops, index)
            o = None  # the chunks applied out_proj and the gated residual themselves
        else:
            qkv = ops.qkv(index, self, x, shift_msa, scale_msa, segments)
            qkv = ops.norm_rope_(self, qkv, cos, sin)
            o = ops.attention(qkv)
            del qkv
        if o is not None:
            ops.gate_add_(x, ops.out_proj(index, self, o), gate_msa, segments)
            del o
        rows = ops.ffn_chunk_rows or max(1, x.shape[0])  # row chunks when the memory budget asks
        for a in range(0, x.shape[0], rows):  # every FFN op is row-local: the same math per row (the GEMMs' M differs, so fp32 sums may reassociate)
            xs, sg = (x, segments) if rows >= x.shape[0] else (x[a:a + rows], clip_segments(segments, a, a + rows))
            h = ops.fc1(index, self, xs, shift_mlp, scale_mlp, sg)
            m = ops.fc2(index, self, h)
            del h
            ops.gate_add_(xs, m, gate_mlp, sg)
            del m
        return x

    def _attend_in_row_chunks(self, x, msa, segments, rope, ops, index: int) -> None:
        """The attention half of the block over query rows of ``ops.attn_chunk_rows``, never holding the whole qkv
        buffer. The QKV projection and norm+RoPE run chunk by chunk in each pass: first the passes of the holder of
        K and V (``runtime.ops.rows_kv``, in ``ops.attn_kv_form``: at the compute dtype, one pass storing them; or as
        Sage2's operands, one pass for their statistics and one storing them), then one more for each chunk's Q,
        which attends over all of K and V; out_proj and the gated residual apply to the chunk's rows of x (in
        place: later chunks read only their own, not yet updated, rows). Every op is row-local (the plan chunks
        only where the activation scales are per row), so each row's bytes are the unchunked run's wherever the
        K/V form and the kernel are row-exact (``runtime.ops.attention.row_exactness``; the Sage form is not:
        ``runtime.ops.sage_kv``). msa: (shift, scale, gate); rope: (cos, sin)."""
        shift, scale, gate = msa
        cos, sin = rope
        s, rows = x.shape[0], ops.attn_chunk_rows
        spans = [(a, min(s, a + rows)) for a in range(0, s, rows)]

        def qkv_rows(a, b):
            qkv = ops.qkv(index, self, x[a:b], shift, scale, clip_segments(segments, a, b))
            return _qkv_rows(ops.norm_rope_(self, qkv, cos[a:b], sin[a:b]), b - a)

        held = rows_kv(ops, s, self.attn.heads, self.attn.head_dim, x.dtype, x.device)
        for pass_ in held.passes:
            for a, b in spans:
                _, k, v = qkv_rows(a, b)
                held.observe(k, v) if pass_ == "observe" else held.store(a, k, v)
                del _, k, v  # before the next chunk's qkv: one chunk buffer at a time
            if pass_ == "observe":
                held.seal()
        for a, b in spans:
            q = qkv_rows(a, b)[0]
            o = held.attend(q)
            del q
            ops.gate_add_(x[a:b], ops.out_proj(index, self, o), gate, clip_segments(segments, a, b))
            del o


def _qkv_rows(normed, rows: int):
    """What ``ops.norm_rope_`` returned (the normed qkv buffer [rows, 3*H*D], or the reference's (q, k, v) [rows, H,
    D]) -> q, k, v as [rows, H*D]."""
    if isinstance(normed, tuple):
        return tuple(t.reshape(rows, -1) for t in normed)
    return normed.unflatten(1, (3, -1)).unbind(1)
