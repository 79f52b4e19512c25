"""One DiT block and the modules it is made of (names = ComfyUI checkpoint keys), over BlockOps.

``DiTBlock.forward`` is the only block forward: the operations it calls (QKV, norm+RoPE, attention, out_proj,
gate/add, FC1, FC2) come from a BlockOps object resolved once at load. ``ReferenceOps`` here is the dense
reference; runtime.ops.block has the NVFP4 (W4A4) and W4A8 ones.

Conventions (ComfyUI core ``comfy/ldm/minimax/model.py``): qkv_proj output is contiguous thirds
``[q_all | k_all | v_all]``; per-head RMSNorm of q and k, then split-half RoPE on the first ``rope_dim``
(96 of 128) channels; modulation ``norm(x) * (1 + scale) + shift`` per segment; fc1 output ``[gate | up]``,
the MLP ``fc2(silu(gate) * up)``.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import H3Config


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def qk_norm_rope(qkv: torch.Tensor, q_weight, k_weight, cos, sin, heads: int, head_dim: int,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [S, H, D] from the fused qkv [S, 3*H*D]: per-head RMSNorm of q, k then split-half RoPE on the
    first cos.shape[-1] channels; fp32 math, cast once to qkv.dtype. v is a view of the buffer."""
    s = qkv.shape[0]
    q, k, v = qkv.view(s, 3, heads, head_dim).unbind(1)
    r = cos.shape[-1]
    c, sn = cos.float()[:, None, :], sin.float()[:, None, :]

    def one(x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        xr = xf[..., :r]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        rot = xr * c + torch.cat([-x2, x1], dim=-1) * sn
        return torch.cat([rot, xf[..., r:]], dim=-1).to(qkv.dtype)

    return one(q, q_weight), one(k, k_weight), v


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full unmasked attention; q, k, v [S, H, D] -> [S, H*D] (softmax scale 1/sqrt(D))."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0))
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


class Attention(nn.Module):
    def __init__(self, cfg: H3Config, dtype, device=None, gate_compress=False):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        inner = cfg.inner_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * inner, bias=False, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps, dtype=dtype, device=device)
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        if gate_compress:
            # VSA gate; unused by the dense forward (kept so such checkpoints load)
            self.to_gate_compress = nn.Linear(cfg.hidden_size, inner, bias=False, dtype=dtype, device=device)

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


def modulate_(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment (a, b, row): h[a:b] = h[a:b] * (1 + scale[row]) + shift[row] at h's dtype."""
    for a, b, r in segments:
        h[a:b].mul_(1.0 + scale[r].to(h.dtype)).add_(shift[r].to(h.dtype))
    return h


def modulated(x: torch.Tensor, norm: RMSNorm, shift: torch.Tensor, scale: torch.Tensor, segments) -> torch.Tensor:
    """``modulate_(norm(x))`` at x's dtype, a new tensor (x is not changed): the rows qkv_proj / fc1 see in the
    reference block, and the input of their LoRA side paths (runtime.lora.ops) whatever the stack."""
    return modulate_(rms_norm(x, norm.weight, norm.eps), shift, scale, segments)


def gate_add_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment: x[a:b] += gate[row] * y[a:b] (at x's dtype)."""
    for a, b, r in segments:
        x[a:b].addcmul_(y[a:b], gate[r].to(x.dtype))
    return x


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
        (ReferenceOps here, runtime.ops.block for the quantized ones); index: this block's number."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        qkv = ops.qkv(index, self, x, shift_msa, scale_msa, segments)
        qkv = ops.norm_rope_(self, qkv, cos, sin)
        o = ops.attention(qkv)
        del qkv
        ops.gate_add_(x, ops.out_proj(index, self, o), gate_msa, segments)
        del o
        h = ops.fc1(index, self, x, shift_mlp, scale_mlp, segments)
        m = ops.fc2(index, self, h)
        del h
        return ops.gate_add_(x, m, gate_mlp, segments)


class ReferenceOps:
    """The dense reference BlockOps (see runtime.ops.block for the protocol): torch modules, fp32-math norms,
    exact attention, unless ``attention`` binds a faster dense backend taking the normed qkv buffer
    [S, 3*H*D] -> [S, H*D]. The oracle every other path is tested against. Linears are called as modules
    (no LoRA here: a side path on a block linear is the ``runtime.lora.ops.LoraOps`` wrapper around these ops)."""

    name = "reference"

    def __init__(self, cfg: H3Config, attention: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.cfg = cfg
        self._attention = attention

    @property
    def attends_exactly(self) -> bool:
        """True when attention is the exact reference (no bound backend): the oracle's attention."""
        return self._attention is None

    def with_attention(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ReferenceOps":
        """New ops of the same kind (a copy: a subclass keeps its linears) whose attention is the bound ``fn``
        (normed qkv buffer [S, 3*H*D] -> [S, H*D]); everything else unchanged."""
        out = copy.copy(self)
        out._attention = fn
        return out

    def qkv(self, i, blk, x, shift, scale, segs):
        return blk.attn.qkv_proj(modulate_(blk.norm1(x), shift, scale, segs))

    def norm_rope_(self, blk, qkv, cos, sin):
        """-> (q, k, v) [S, H, D] (exact attention) or the normed qkv buffer (a bound dense backend)."""
        c = self.cfg
        q, k, v = qk_norm_rope(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, cos, sin, c.num_heads,
                               c.head_dim, c.eps)
        if self._attention is None:
            return q, k, v
        return torch.stack([q, k, v], dim=1).reshape(qkv.shape)

    def attention(self, qkv):
        if self._attention is None:
            return exact_attention(*qkv)
        return self._attention(qkv)

    def out_proj(self, i, blk, o):
        return blk.attn.out_proj(o)

    def gate_add_(self, x, y, gate, segs):
        return gate_add_(x, y, gate, segs)

    def fc1(self, i, blk, x, shift, scale, segs):
        return blk.mlp.fc1(modulate_(blk.norm2(x), shift, scale, segs))

    def fc2(self, i, blk, h, lora_active: bool = False):
        """silu(gate) * up -> fc2 (lora_active: unused, the dense fc2 has no guarded path to refuse)."""
        gate, up = h.chunk(2, dim=-1)
        return blk.mlp.fc2(F.silu(gate) * up)

    def status(self) -> dict:
        return {"lt_path": "none (dense linears)", "direct_calls": 0}
