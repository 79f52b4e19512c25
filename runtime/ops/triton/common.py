"""Device helpers shared by the NVFP4 and fp8 kernels: exact loads, IEEE rounding to bf16 and e4m3, our fp32
exp, and the fused RMSNorm + per-segment modulate of the producers.

Every step is one correctly rounded IEEE operation (launches pass ``enable_fp_fusion=False``), so the GPU,
Triton's CPU interpreter and the torch references (``nvfp4_producers.*_reference``) agree bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ld_f32", "bf16_rne_bits", "e4m3_rne", "e4m3_code", "exp_f32", "segment_rows", "sumsq_f64", "rms_rstd", "modulate"]


@triton.jit
def ld_f32(ptr, mask, KIND: tl.constexpr):
    """Load and upcast exactly to fp32 (bf16 by bit shift, which the CPU interpreter also gets right)."""
    if KIND == 1:
        raw = tl.load(ptr, mask=mask, other=0.0)
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def bf16_rne_bits(v):
    """fp32 -> bf16 bit pattern (uint16), round to nearest even (finite inputs)."""
    b = v.to(tl.uint32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def e4m3_rne(s):
    """s fp32 in [0, 448] -> (e4m3 code int32, its value fp32), round to nearest even."""
    b = s.to(tl.int32, bitcast=True)
    r = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # keep 3 mantissa bits (RNE); -1048576 = 0xFFF00000
    code_n = (r >> 20) - 960  # rebias the exponent 127 -> 7: (e - 120) << 3 | m
    t = s * 512.0  # subnormals: multiples of 2^-9
    k = (t + 8388608.0) - 8388608.0  # round to nearest even integer (t < 2^22)
    sub = s < 0.015625
    return tl.where(sub, k.to(tl.int32), code_n), tl.where(sub, k * 0.001953125, r.to(tl.float32, bitcast=True))


@triton.jit
def e4m3_code(q, HW: tl.constexpr):
    """q fp32 in [-448, 448] -> e4m3 code (int32 0..255), round to nearest even, sign kept (-0 -> 0x80).
    HW: the hardware conversion (cvt.rn.satfinite.e4m3x2.f32 on sm_89+; Triton's interpreter rounds some
    values near binade boundaries wrongly, so it gets the integer arithmetic of e4m3_rne instead). The
    two give the same bytes (tests/gpu compare the hardware path with the torch reference)."""
    if HW:
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code, _ = e4m3_rne(tl.abs(q))
        return code | (((q.to(tl.int32, bitcast=True) >> 31) & 1) << 7)


@triton.jit
def exp_f32(t):
    """exp(t) in fp32 by the fixed operation sequence of exp_reference."""
    t = tl.minimum(tl.maximum(t, -80.0), 80.0)
    n = t * 1.4426950408889634
    n = (n + 12582912.0) - 12582912.0  # round to nearest even integer
    r = t - n * 0.693145751953125
    r = r - n * 1.428606765330187e-06
    p = r * 1.984126984126984e-04 + 1.388888888888889e-03
    p = p * r + 8.333333333333333e-03
    p = p * r + 4.166666666666667e-02
    p = p * r + 1.666666666666667e-01
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return p * ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def segment_rows(seg_ptr, rows, BM: tl.constexpr, NSEG: tl.constexpr):
    """Modulation-table row of each of ``rows`` from NSEG (start, stop, row) int32 triples -> [BM, 1] int64."""
    trow = tl.zeros([BM], dtype=tl.int32)
    for i in range(NSEG):
        a = tl.load(seg_ptr + 3 * i)
        b = tl.load(seg_ptr + 3 * i + 1)
        trow = tl.where((rows >= a) & (rows < b), tl.load(seg_ptr + 3 * i + 2), trow)
    return tl.expand_dims(trow.to(tl.int64), 1)


@triton.jit
def sumsq_f64(x_ptr, r2, stride_x, rmask, K, X_KIND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
               NKT: tl.constexpr):
    """sum_k fp64(x[row, k])^2 over the row block, in NKT tiles of BK columns -> [BM] fp64."""
    ss = tl.zeros([BM], dtype=tl.float64)
    for kt in range(NKT):
        c2 = tl.expand_dims(kt * BK + tl.arange(0, BK), 0)
        v = ld_f32(x_ptr + r2 * stride_x + c2, tl.expand_dims(rmask, 1) & (c2 < K), X_KIND).to(tl.float64)
        ss += tl.sum(v * v, axis=1)
    return ss


@triton.jit
def rms_rstd(ss, K, eps):
    """fp32(1 / sqrt(ss / K + eps)) computed in fp64 (sqrt.rn.f64, div.rn.f64): rms_modulate_reference's rstd."""
    return (1.0 / tl.sqrt(ss / K + eps)).to(tl.float32)


@triton.jit
def modulate(xv, rstd, w_ptr, sc_ptr, sh_ptr, t2, c2, m, K, stride_sc, stride_sh, HAS_W: tl.constexpr,
              W_KIND: tl.constexpr, T_KIND: tl.constexpr):
    """h = (x * rstd [* w]) * (1 + scale[row]) + shift[row] in fp32, each step rounded; 0 outside m."""
    n = xv * tl.expand_dims(rstd, 1)
    if HAS_W:
        n = n * ld_f32(w_ptr + c2, c2 < K, W_KIND)
    sc = ld_f32(sc_ptr + t2 * stride_sc + c2, m, T_KIND)
    sh = ld_f32(sh_ptr + t2 * stride_sh + c2, m, T_KIND)
    h = n * (1.0 + sc)
    h = h + sh
    return tl.where(m, h, 0.0)
