"""The plain-PyTorch reference of every block operation, and ``ReferenceOps``: the dense reference BlockOps.

These are the oracle every fast path (Triton producers, fused elementwise kernels, attention backends, NVFP4
and W4A8 GEMMs) is tested against, and the math the reference model runs. Two kinds, one module:

* the model's math (``rms_norm``, ``qk_norm_rope``, ``exact_attention``, ``modulate_``, ``gate_add_``): what
  ``ReferenceOps`` and the reference model run, at the block's dtype as ComfyUI core does;
* the fused kernels' definitions (``*_reference``): the exact bytes each Triton kernel must write (fp32 or
  fp64 islands, one rounding per IEEE operation, no FMA), out of place. ``norm_rope_qkv_reference`` is
  ``qk_norm_rope`` on the whole buffer; ``gate_add_reference`` rounds the product and the sum in fp32 where
  the model's ``gate_add_`` works at x's dtype. The NVFP4 format itself (quantize / dequantize) is
  ``runtime.ops.nvfp4``; the inputs are checked by ``runtime.ops.operand_checks``, as the kernels check them. Conventions (ComfyUI core
``comfy/ldm/minimax/model.py``): qkv_proj output is contiguous thirds ``[q_all | k_all | v_all]``; per-head
RMSNorm of q and k, then split-half RoPE on the first ``rope_dim`` channels; modulation
``norm(x) * (1 + scale) + shift`` per segment; fc1 output ``[gate | up]``, the MLP ``fc2(silu(gate) * up)``.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from . import nvfp4
from .interface import OpsState
from .operand_checks import check_gate_add, check_norm_inputs, check_norm_rope

FP32_MIN_NORMAL = 1.1754943508222875e-38  # 2^-126


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


class ReferenceOps(OpsState):
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
        out._attention, out.sparse = fn, None
        out.clear_row_forms()  # the dense backend's row form does not compute fn: no query-row chunks
        return out

    def attention_rows(self, q, k, v):
        """Attention of the query rows q [Sq, H*D] over all of k, v [S, H*D] (``OpsState.attention_rows``); the exact
        reference when no backend is bound."""
        if self._attention is None:
            d = self.cfg.head_dim
            return exact_attention(*(t.unflatten(1, (-1, d)) for t in (q, k, v)))
        return super().attention_rows(q, k, v)

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


# ----------------------------------------------------------------------------------------------
# the fused kernels' definitions (out of place: new tensors, inputs untouched)
# ----------------------------------------------------------------------------------------------

_CONSTS: dict = {}


def const_like(v: float, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    # 0-dim tensor on the data's device: CUDA turns `tensor / python_scalar` into a multiply by the
    # reciprocal, which is not the correctly rounded quotient the kernels compute. On CUDA it is cached:
    # building it is a host->device copy from pageable memory, which makes the host wait for the GPU to
    # drain its queue (and the GPU then idle while the host launches the next kernels).
    if like.device.type != "cuda":
        return torch.tensor(v, dtype=dtype, device=like.device)
    key = (float(v), dtype, like.device)
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) > 256:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.tensor(v, dtype=dtype, device=like.device)
    return t


def norm_rope_qkv_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, eps: float = 1e-5, rope_dim: int = 96) -> torch.Tensor:
    """Definition of ``elementwise.norm_rope_``: a new ``[S, 3*H*D]`` tensor (qkv's dtype) whose q and k thirds
    are :func:`qk_norm_rope`'s (fp32 RMSNorm per head, split-half RoPE on the first ``rope_dim`` channels, one
    cast) and whose v third is copied; ``qkv`` itself is not changed."""
    s, h, d = check_norm_rope(qkv, q_weight, k_weight, cos, sin, rope_dim)
    q, k, v = qk_norm_rope(qkv, q_weight, k_weight, cos, sin, h, d, eps)
    return torch.cat([t.reshape(s, h * d) for t in (q, k, v)], dim=1)


def gate_add_reference(x: torch.Tensor, y: torch.Tensor, gate_rows: torch.Tensor,
                       segments: Sequence[Sequence[int]]) -> torch.Tensor:
    """Definition of ``elementwise.gate_add_``: a new x (x's dtype), per segment (a, b, row)
    ``x[a:b] + gate_rows[row] * y[a:b]`` with the product and the sum each rounded in fp32, then one cast
    (the model's :func:`gate_add_` works at x's dtype instead); ``x`` itself is not changed."""
    segs = check_gate_add(x, y, gate_rows, segments)
    out = x.clone()
    for a, b, r in segs:
        prod = gate_rows[r].float() * y[a:b].float()
        out[a:b] = (x[a:b].float() + prod).to(x.dtype)
    return out


def exp_reference(t: torch.Tensor) -> torch.Tensor:
    """fp32 exp by a fixed operation sequence (Cody-Waite reduction, degree-7 polynomial, argument clamped to
    [-80, 80]; a few ulp from the true exp), so GPU, CPU and interpreter compute the same bits."""
    t = torch.clamp(t.float(), -80.0, 80.0)
    n = torch.round(t * 1.4426950408889634)
    r = t - n * 0.693145751953125
    r = r - n * 1.428606765330187e-06
    p = r * 1.984126984126984e-04 + 1.388888888888889e-03
    for c in (8.333333333333333e-03, 4.166666666666667e-02, 1.666666666666667e-01, 0.5, 1.0, 1.0):
        p = p * r + c
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def silu_reference(a: torch.Tensor) -> torch.Tensor:
    """fp32 ``silu(a) = a / (1 + exp(-a))`` with :func:`exp_reference` (the producers' exact silu)."""
    a = a.float()
    return a / (exp_reference(-a) + 1.0)


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """h [S, 2F] = [gate | up] (any float dtype) -> fp32 [S, F] = silu(gate) * up (:func:`silu_reference`),
    |y| < 2^-126 flushed to a signed zero: the SwiGLU producers' input to their quantizer."""
    f = h.shape[1] // 2
    y = silu_reference(h[:, :f]) * h[:, f:].float()
    return torch.where(y.abs() < 1.1754943508222875e-38, y * 0.0, y)


def rms_modulate_reference(x: torch.Tensor, weight: torch.Tensor | None, scale_rows: torch.Tensor,
                           shift_rows: torch.Tensor, segments: Sequence[Sequence[int]], eps: float) -> torch.Tensor:
    """x [S, K] -> fp32 h [S, K]: RMSNorm * weight, then per segment (a, b, row)
    ``h[a:b] = n[a:b] * (1 + scale_rows[row]) + shift_rows[row]``; the norm+modulate producers' input to their
    quantizer. Steps: ``ss = sum(fp64(x)^2)`` (fp64, so the summation order cannot change the fp32 result except
    in ~1e-16-relative ties), ``rstd = fp32(1 / sqrt(ss / K + eps))`` in fp64, ``n = fp32(x) * rstd``, then
    ``n = n * weight`` when there is a weight, then ``h = n * (1 + scale) + shift`` in fp32 (never rounded to
    bf16 before it is quantized)."""
    segs = check_norm_inputs(x, weight, scale_rows, shift_rows, segments)
    k = x.shape[1]
    xf = x.float()
    ss = xf.double().pow(2).sum(-1)
    rstd = torch.div(const_like(1.0, x, torch.float64),
                     torch.sqrt(ss / const_like(k, x, torch.float64) + const_like(eps, x, torch.float64))).float()
    n = xf * rstd.unsqueeze(1)
    if weight is not None:
        n = n * weight.float()
    h = torch.empty_like(n)
    for a, b, r in segs:
        h[a:b] = n[a:b] * (scale_rows[r].float() + 1.0) + shift_rows[r].float()
    return h


def dequantize_bf16_reference(t: nvfp4.NVFP4Tensor, multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] bf16 = bf16(v * s [* multiplier]) (fp32 product, one rounding); exact without multiplier."""
    v = nvfp4.dequantize_blocks(t, torch.float32)
    if multiplier is not None:
        v = v * multiplier.float()
    return v.to(torch.bfloat16)


def to_fp8_rowwise_reference(t: nvfp4.NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 [N, K] -> (e4m3 [N, K], fp32 row scales [N]) with ``v*s ~= e4m3 * row_scale``:
    ``row_scale = 6 * max(block scales of the row) / 448`` (1 for an all-zero row), each element
    ``e4m3_rne(clamp(v * s * inv, +-448))`` with ``inv = 1 / row_scale`` correctly rounded in fp32 (a
    multiply, not a per-element division: cheaper on the GPU; the fp32 product is within 2 ulp of the
    quotient, and one rounding to 3 mantissa bits follows: relative error <= 2^-4)."""
    v = nvfp4.dequantize_blocks(t, torch.float32)
    smax = t.linear_scales().float().amax(1) if v.shape[1] else torch.zeros(v.shape[0], device=v.device)
    ra = torch.div(smax * 6.0, const_like(448.0, v))
    ra = torch.where(ra == 0, const_like(1.0, v), ra)
    inv = torch.div(const_like(1.0, v), ra)
    return torch.mul(v, inv.unsqueeze(1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), ra


def fp8_rowwise_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 y [S, K] -> (float8_e4m3fn [S, K], fp32 row_scale [S]) with ``y ~= e4m3 * row_scale``: the W4A8
    producers' definition (``fp8_producers``' docstring gives the error bound).

    ``amax = max_k |y[k]|``; ``row_scale = amax / 448`` (one correctly rounded fp32 division), 1 where that is 0
    or subnormal (amax < 448 * 2^-126, the all-zero row included), so the scale is never 0, NaN or subnormal;
    ``inv = 1 / row_scale`` correctly rounded in fp32 (once per row); ``code[k] = e4m3_rne(clamp(y[k] * inv,
    +-448))``: the product rounded in fp32 (within 2 ulp of the exact quotient), then ONE rounding to 3 mantissa
    bits (nearest, ties to even; e4m3 subnormals below 2^-6). Finite inputs only."""
    y = y.float()
    if y.shape[1] == 0:
        raise ValueError("fp8 rowwise quantization needs K >= 1")
    amax = y.abs().amax(1)
    ra = torch.div(amax, const_like(nvfp4.E4M3_MAX, y))
    ra = torch.where(ra < FP32_MIN_NORMAL, const_like(1.0, y), ra)
    inv = torch.div(const_like(1.0, y), ra)
    q = torch.mul(y, inv.unsqueeze(1)).clamp(-nvfp4.E4M3_MAX, nvfp4.E4M3_MAX)
    return q.to(torch.float8_e4m3fn), ra


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition of ``fp8_producers.quantize_fp8``."""
    return fp8_rowwise_reference(x.float())


def rms_modulate_fp8_reference(x, weight, scale_rows, shift_rows, segments, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition of ``fp8_producers.rms_modulate_fp8``."""
    return fp8_rowwise_reference(rms_modulate_reference(x, weight, scale_rows, shift_rows, segments, eps))


def swiglu_fp8_reference(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition of ``fp8_producers.swiglu_fp8`` (the exact silu)."""
    return fp8_rowwise_reference(swiglu_reference(h))
