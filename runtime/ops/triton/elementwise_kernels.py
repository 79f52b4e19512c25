"""The fused elementwise kernels behind ``elementwise``: per-head q/k RMSNorm + split-half RoPE in place on the
QKV buffer, and gate + residual add over segments. Contracts are those of ``elementwise.norm_rope_`` and
``elementwise.gate_add_``; both equal the torch references there bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["norm_rope_kernel", "gate_add_kernel"]


@triton.jit
def _f32(v, KIND: tl.constexpr):
    """Exact upcast to fp32 (KIND 1: bf16 by bit shift, which the CPU interpreter also gets right)."""
    if KIND == 1:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _store_rtne(ptr, v, mask, OUT_KIND: tl.constexpr):
    """Store fp32 ``v`` as the buffer dtype, rounding to nearest even (OUT_KIND 0 fp32, 1 bf16,
    2 fp16). bf16 is rounded with integer ops (torch's formula, NaN kept NaN) because Triton's
    CPU interpreter truncates fp32->bf16; on the GPU the result equals cvt.rn.bf16.f32."""
    if OUT_KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        tl.store(ptr, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptr, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def norm_rope_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
    S, stride_row, stride_cos, stride_sin, eps,
    H: tl.constexpr, D: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr, BLOCK_S: tl.constexpr, OUT_KIND: tl.constexpr, W_KIND: tl.constexpr,
):
    # program_id(0) walks the 2H q/k heads fastest, so the programs that share a row block (and
    # its cos/sin rows) run back to back and find cos/sin in L2.
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    rmask = rows < S
    rows64 = rows.to(tl.int64)
    c_h = tl.arange(0, HALF_P)
    c_p = tl.arange(0, PASS_P)
    mh = rmask[:, None] & (c_h[None, :] < HALF)
    mp = rmask[:, None] & (c_p[None, :] < PASS)
    cs_off = rows64[:, None] * stride_cos + c_h[None, :]
    sn_off = rows64[:, None] * stride_sin + c_h[None, :]
    cos1 = tl.load(cos_ptr + cs_off, mask=mh, other=0.0)
    cos2 = tl.load(cos_ptr + cs_off + HALF, mask=mh, other=0.0)
    sin1 = tl.load(sin_ptr + sn_off, mask=mh, other=0.0)
    sin2 = tl.load(sin_ptr + sn_off + HALF, mask=mh, other=0.0)
    for i in tl.static_range(HEADS_PER_PROG):
        j = pid_g * HEADS_PER_PROG + i  # 0..H-1: q heads, H..2H-1: k heads (contiguous columns)
        if j < 2 * H:
            is_k = j >= H
            base = qkv_ptr + rows64[:, None] * stride_row + j * D
            x1 = _f32(tl.load(base + c_h[None, :], mask=mh, other=0.0), OUT_KIND)
            x2 = _f32(tl.load(base + HALF + c_h[None, :], mask=mh, other=0.0), OUT_KIND)
            xp = _f32(tl.load(base + 2 * HALF + c_p[None, :], mask=mp, other=0.0), OUT_KIND)
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)
            r = tl.rsqrt(ss / D + eps)
            w1 = tl.where(is_k, _f32(tl.load(kw_ptr + c_h, mask=c_h < HALF, other=0.0), W_KIND),
                          _f32(tl.load(qw_ptr + c_h, mask=c_h < HALF, other=0.0), W_KIND))
            w2 = tl.where(is_k, _f32(tl.load(kw_ptr + HALF + c_h, mask=c_h < HALF, other=0.0), W_KIND),
                          _f32(tl.load(qw_ptr + HALF + c_h, mask=c_h < HALF, other=0.0), W_KIND))
            wp = tl.where(is_k, _f32(tl.load(kw_ptr + 2 * HALF + c_p, mask=c_p < PASS, other=0.0), W_KIND),
                          _f32(tl.load(qw_ptr + 2 * HALF + c_p, mask=c_p < PASS, other=0.0), W_KIND))
            n1 = x1 * r[:, None] * w1[None, :]
            n2 = x2 * r[:, None] * w2[None, :]
            npass = xp * r[:, None] * wp[None, :]
            o1 = n1 * cos1 - n2 * sin1
            o2 = n2 * cos2 + n1 * sin2
            _store_rtne(base + c_h[None, :], o1, mh, OUT_KIND)
            _store_rtne(base + HALF + c_h[None, :], o2, mh, OUT_KIND)
            _store_rtne(base + 2 * HALF + c_p[None, :], npass, mp, OUT_KIND)


@triton.jit
def gate_add_kernel(
    x_ptr, y_ptr, g_ptr, seg_ptr,
    S, N, stride_x, stride_y, stride_g,
    N_SEG: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    OUT_KIND: tl.constexpr, Y_KIND: tl.constexpr, G_KIND: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # gate row of every row from the (few) segments; a tile may straddle a segment boundary
    grow = tl.full([BLOCK_S], -1, tl.int32)
    for i in tl.static_range(N_SEG):
        a = tl.load(seg_ptr + 3 * i)
        b = tl.load(seg_ptr + 3 * i + 1)
        r = tl.load(seg_ptr + 3 * i + 2)
        grow = tl.where((rows >= a) & (rows < b), r, grow)
    rmask = (rows < S) & (grow >= 0)
    m = rmask[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    xo = rows64[:, None] * stride_x + cols[None, :]
    xv = _f32(tl.load(x_ptr + xo, mask=m, other=0.0), OUT_KIND)
    yv = _f32(tl.load(y_ptr + rows64[:, None] * stride_y + cols[None, :], mask=m, other=0.0), Y_KIND)
    gv = _f32(tl.load(g_ptr + grow.to(tl.int64)[:, None] * stride_g + cols[None, :], mask=m, other=0.0), G_KIND)
    # launched with enable_fp_fusion=False: product and sum round separately, as in the reference
    out = xv + gv * yv
    _store_rtne(x_ptr + xo, out, m, OUT_KIND)
