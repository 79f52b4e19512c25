"""The fp8 (e4m3 rowwise) kernels behind ``fp8_producers``: quantize, RMSNorm + modulate, SwiGLU, and the
SageAttention V quantizer. Contracts are those of the ``fp8_producers`` functions that launch them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ld_f32, e4m3_code, exp_f32, segment_rows, sumsq_f64, rms_rstd, modulate

__all__ = ["quantize_fp8_kernel", "rms_fp8_kernel", "swiglu_fp8_kernel", "v_amax_kernel", "v_quant_kernel"]


@triton.jit
def _row_scale(amax, BM: tl.constexpr):
    """Row amax [BM] -> row scale: amax / 448 correctly rounded; 1 where that is zero or subnormal."""
    ra = tl.div_rn(amax, tl.full([BM], 448.0, tl.float32))
    return tl.where(ra < 1.1754943508222875e-38, 1.0, ra)


@triton.jit
def _cols(kt, rmask, K, BK: tl.constexpr):
    """Columns of tile kt as [1, BK] and the in-bounds mask of the row block [BM, BK]."""
    c2 = tl.expand_dims(kt * BK + tl.arange(0, BK), 0)
    return c2, tl.expand_dims(rmask, 1) & (c2 < K)


@triton.jit
def _e4m3_store(v, ra, r2, c2, m, out_ptr, stride_o, BM: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr):
    """Codes of the fp32 tile v [BM, BK] under row scales ra [BM] -> out (uint8 view of e4m3), masked:
    e4m3_rne(clamp(v * (1 / ra), +-448)), the reciprocal correctly rounded once per row."""
    inv = tl.div_rn(tl.full([BM], 1.0, tl.float32), ra)
    q = v * tl.broadcast_to(tl.expand_dims(inv, 1), [BM, BK])
    code = e4m3_code(tl.minimum(tl.maximum(q, -448.0), 448.0), HW)
    tl.store(out_ptr + r2 * stride_o + c2, code.to(tl.uint8), mask=m)


@triton.jit
def _silu_mul(a, up, m, FAST: tl.constexpr):
    """silu(a) * up as swiglu_reference computes it (|y| < 2^-126 -> signed zero); 0 outside m.
    FAST: the hardware exp2 and an approximate division instead (a few ulp; not the reference's bits)."""
    if FAST:
        e = tl.exp2(a * -1.4426950408889634)
        y = tl.fdiv(a, 1.0 + e, ieee_rounding=False) * up
    else:
        e = exp_f32(0.0 - a)
        y = tl.div_rn(a, 1.0 + e) * up
    y = tl.where(tl.abs(y) < 1.1754943508222875e-38, y * 0.0, y)
    return tl.where(m, y, 0.0)


@triton.jit
def quantize_fp8_kernel(x_ptr, out_ptr, rs_ptr, S, K, stride_x, stride_o, X_KIND: tl.constexpr,
                         BM: tl.constexpr, BK: tl.constexpr, NKT: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < S
    r2 = tl.expand_dims(rows.to(tl.int64), 1)
    if NKT == 1:  # the row stays in registers
        c2, m = _cols(0, rmask, K, BK)
        v = ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND)
        ra = _row_scale(tl.max(tl.abs(v), axis=1), BM)
        tl.store(rs_ptr + rows, ra, mask=rmask)
        _e4m3_store(v, ra, r2, c2, m, out_ptr, stride_o, BM, BK, HW)
    else:
        amax = tl.zeros([BM], dtype=tl.float32)
        for kt in range(NKT):
            c2, m = _cols(kt, rmask, K, BK)
            amax = tl.maximum(amax, tl.max(tl.abs(ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND)), axis=1))
        ra = _row_scale(amax, BM)
        tl.store(rs_ptr + rows, ra, mask=rmask)
        for kt in range(NKT):
            c2, m = _cols(kt, rmask, K, BK)
            _e4m3_store(ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND), ra, r2, c2, m, out_ptr, stride_o, BM, BK, HW)


@triton.jit
def rms_fp8_kernel(x_ptr, w_ptr, sc_ptr, sh_ptr, seg_ptr, eps_ptr, out_ptr, rs_ptr, S, K, stride_x, stride_sc,
                    stride_sh, stride_o, HAS_W: tl.constexpr, X_KIND: tl.constexpr, W_KIND: tl.constexpr,
                    T_KIND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NKT: tl.constexpr,
                    NSEG: tl.constexpr, HW: tl.constexpr):
    # Loop counts are constexpr (NKT = cdiv(K, BK), NSEG >= the segment count with empty padding entries):
    # Triton's interpreter cannot loop over runtime scalars with numpy >= 2.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < S
    r2 = tl.expand_dims(rows.to(tl.int64), 1)
    t2 = segment_rows(seg_ptr, rows, BM, NSEG)
    eps = tl.load(eps_ptr)
    if NKT == 1:  # the row stays in registers: x read once
        c2, m = _cols(0, rmask, K, BK)
        xv = ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND)
        xd = xv.to(tl.float64)
        rstd = rms_rstd(tl.sum(xd * xd, axis=1), K, eps)
        h = modulate(xv, rstd, w_ptr, sc_ptr, sh_ptr, t2, c2, m, K, stride_sc, stride_sh, HAS_W, W_KIND, T_KIND)
        ra = _row_scale(tl.max(tl.abs(h), axis=1), BM)
        tl.store(rs_ptr + rows, ra, mask=rmask)
        _e4m3_store(h, ra, r2, c2, m, out_ptr, stride_o, BM, BK, HW)
    else:
        rstd = rms_rstd(sumsq_f64(x_ptr, r2, stride_x, rmask, K, X_KIND, BM, BK, NKT), K, eps)
        amax = tl.zeros([BM], dtype=tl.float32)
        for kt in range(NKT):
            c2, m = _cols(kt, rmask, K, BK)
            xv = ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND)
            h = modulate(xv, rstd, w_ptr, sc_ptr, sh_ptr, t2, c2, m, K, stride_sc, stride_sh, HAS_W, W_KIND,
                          T_KIND)
            amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
        ra = _row_scale(amax, BM)
        tl.store(rs_ptr + rows, ra, mask=rmask)
        for kt in range(NKT):
            c2, m = _cols(kt, rmask, K, BK)
            xv = ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND)
            h = modulate(xv, rstd, w_ptr, sc_ptr, sh_ptr, t2, c2, m, K, stride_sc, stride_sh, HAS_W, W_KIND,
                          T_KIND)
            _e4m3_store(h, ra, r2, c2, m, out_ptr, stride_o, BM, BK, HW)


@triton.jit
def swiglu_fp8_kernel(h_ptr, out_ptr, rs_ptr, S, F, stride_h, stride_o, H_KIND: tl.constexpr, BM: tl.constexpr,
                       BK: tl.constexpr, NKT: tl.constexpr, HW: tl.constexpr, FAST: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < S
    r2 = tl.expand_dims(rows.to(tl.int64), 1)
    base = h_ptr + r2 * stride_h
    if NKT == 1:  # silu evaluated once, the row kept in registers
        c2, m = _cols(0, rmask, F, BK)
        y = _silu_mul(ld_f32(base + c2, m, H_KIND), ld_f32(base + F + c2, m, H_KIND), m, FAST)
        ra = _row_scale(tl.max(tl.abs(y), axis=1), BM)
        tl.store(rs_ptr + rows, ra, mask=rmask)
        _e4m3_store(y, ra, r2, c2, m, out_ptr, stride_o, BM, BK, HW)
    else:
        amax = tl.zeros([BM], dtype=tl.float32)
        for kt in range(NKT):
            c2, m = _cols(kt, rmask, F, BK)
            y = _silu_mul(ld_f32(base + c2, m, H_KIND), ld_f32(base + F + c2, m, H_KIND), m, FAST)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        ra = _row_scale(amax, BM)
        tl.store(rs_ptr + rows, ra, mask=rmask)
        for kt in range(NKT):
            c2, m = _cols(kt, rmask, F, BK)
            y = _silu_mul(ld_f32(base + c2, m, H_KIND), ld_f32(base + F + c2, m, H_KIND), m, FAST)
            _e4m3_store(y, ra, r2, c2, m, out_ptr, stride_o, BM, BK, HW)


@triton.jit
def v_amax_kernel(v_ptr, part_ptr, S, stride_s, stride_h, H, V_KIND: tl.constexpr, D: tl.constexpr,
                   BT: tl.constexpr, HW: tl.constexpr):
    # part[t_block, h, :] = max over the block's tokens of |v[t, h, :]| (tokens >= S count as 0)
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    d = tl.expand_dims(tl.arange(0, D), 0)
    ptrs = v_ptr + tl.expand_dims(t.to(tl.int64), 1) * stride_s + h * stride_h + d
    x = ld_f32(ptrs, tl.expand_dims(t < S, 1) & (d < D), V_KIND)
    tl.store(part_ptr + (pid_t * H + h) * D + tl.arange(0, D), tl.max(tl.abs(x), axis=0))


@triton.jit
def v_quant_kernel(v_ptr, inv_ptr, out_ptr, S, stride_s, stride_h, H, ROWS, V_KIND: tl.constexpr,
                    D: tl.constexpr, BT: tl.constexpr, HW: tl.constexpr):
    # out[d, h, t0 + p] = e4m3(clamp(v[src(p), h, d] * inv[h, d], +-448)), src = SageAttention2's fp8 PV
    # permutation of each 16 tokens ([0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]); 0 past S
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, BT)
    g = p % 16
    src = pid_t * BT + (p // 16) * 16 + (g % 2) + ((g // 2) % 2) * 8 + (g // 4) * 2
    d = tl.arange(0, D)
    d2 = tl.expand_dims(d, 0)
    ptrs = v_ptr + tl.expand_dims(src.to(tl.int64), 1) * stride_s + h * stride_h + d2
    x = ld_f32(ptrs, tl.expand_dims(src < S, 1) & (d2 < D), V_KIND)
    q = x * tl.expand_dims(tl.load(inv_ptr + h * D + d), 0)
    code = e4m3_code(tl.minimum(tl.maximum(q, -448.0), 448.0), HW).to(tl.uint8)  # [BT, D]
    out = (out_ptr + tl.expand_dims(d.to(tl.int64), 1) * (H * ROWS) + h * ROWS + pid_t * BT
           + tl.expand_dims(p, 0))
    tl.store(out, tl.trans(code))
