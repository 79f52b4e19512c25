"""The plain-PyTorch reference of every block operation, and ``ReferenceOps``: the dense reference BlockOps.

These are the oracle every fast path (Triton producers, fused elementwise kernels, attention backends, NVFP4
and W4A8 GEMMs) is tested against, and the math the reference model runs. Conventions (ComfyUI core
``comfy/ldm/minimax/model.py``): qkv_proj output is contiguous thirds ``[q_all | k_all | v_all]``; per-head
RMSNorm of q and k, then split-half RoPE on the first ``rope_dim`` channels; modulation
``norm(x) * (1 + scale) + shift`` per segment; fc1 output ``[gate | up]``, the MLP ``fc2(silu(gate) * up)``.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


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


def modulate_(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment (a, b, row): h[a:b] = h[a:b] * (1 + scale[row]) + shift[row] at h's dtype."""
    for a, b, r in segments:
        h[a:b].mul_(1.0 + scale[r].to(h.dtype)).add_(shift[r].to(h.dtype))
    return h


def modulated(x: torch.Tensor, norm, shift: torch.Tensor, scale: torch.Tensor, segments) -> torch.Tensor:
    """``modulate_(norm(x))`` at x's dtype, a new tensor (x is not changed): the rows qkv_proj / fc1 see in the
    reference block, and the input of their LoRA side paths (runtime.lora.ops) whatever the stack."""
    return modulate_(rms_norm(x, norm.weight, norm.eps), shift, scale, segments)


def gate_add_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, segments) -> torch.Tensor:
    """In place, per segment: x[a:b] += gate[row] * y[a:b] (at x's dtype)."""
    for a, b, r in segments:
        x[a:b].addcmul_(y[a:b], gate[r].to(x.dtype))
    return x


class ReferenceOps:
    """The dense reference BlockOps (see runtime.ops.block_ops for the protocol): torch modules, fp32-math norms,
    exact attention, unless ``attention`` binds a faster dense backend taking the normed qkv buffer
    [S, 3*H*D] -> [S, H*D]. The oracle every other path is tested against. Linears are called as modules
    (no LoRA here: a side path on a block linear is the ``runtime.lora.ops.LoraOps`` wrapper around these ops)."""

    name = "reference"

    def __init__(self, cfg, attention: Callable[[torch.Tensor], torch.Tensor] | None = None):
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
