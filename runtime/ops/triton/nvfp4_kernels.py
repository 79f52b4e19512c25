"""The NVFP4 kernels behind ``nvfp4_producers``: the producers (quantize, RMSNorm + modulate + quantize,
SwiGLU + quantize) and the consumers (dequantize to bf16, re-express as e4m3 rowwise, the exact-product GEMM).

Contracts (shapes, layouts, dtypes) are those of the ``nvfp4_producers`` functions that launch them; each writes
exactly the bytes of its torch reference there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ld_f32, bf16_rne_bits, e4m3_rne, e4m3_code, exp_f32, segment_rows, sumsq_f64, rms_rstd, modulate

__all__ = ["quantize_kernel", "rms_modulate_kernel", "swiglu_kernel", "dequant_kernel", "fp8_rowwise_kernel", "gemm_kernel"]


@triton.jit
def _e2m1_code(q):
    """fp32 -> E2M1 code (int32 0..15): round to nearest even, saturate above 5 to 6, sign bit from q."""
    a = tl.abs(q)
    c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return c | (((q.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _e2m1_value_2m14(c):
    """E2M1 code (int32) -> value * 2^-14 as fp32, exactly (the code's bits placed in an fp16)."""
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_value_2m8(b):
    """UE4M3 byte (int32, sign bit ignored) -> value * 2^-8 as fp32, exactly."""
    return ((b & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _swz(rows, scol, CP):
    """Flat offsets of block scales (rows [R,1], scale columns [1,C]) in the 128x4 tiled layout."""
    return ((rows // 128) * (CP // 4) + scol // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + scol % 4


@triton.jit
def _quant_store(v, g, rows, col0, packed_ptr, stride_p, scales_ptr, R_PACK, R_SCALE, KP, CP,
                 BM: tl.constexpr, BK: tl.constexpr):
    """Quantize the fp32 tile v [BM, BK] (columns col0.., col0 % BK == 0, BK % 64 == 0) with global scale
    g; store the packed bytes (rows < R_PACK, bytes < KP/2) and the scale bytes (swizzled, cols < CP)."""
    NB: tl.constexpr = BK // 16
    v3 = tl.reshape(v, [BM, NB, 16])
    amax = tl.max(tl.abs(v3), axis=2)
    s = tl.div_rn(tl.div_rn(amax, tl.full([BM, NB], 6.0, tl.float32)), tl.broadcast_to(g, [BM, NB]))
    code_s, sval = e4m3_rne(tl.minimum(s, 448.0))
    total = g * sval
    zero = total == 0.0
    den = tl.where(zero, 1.0, total)
    q3 = tl.div_rn(v3, tl.broadcast_to(tl.expand_dims(den, 2), [BM, NB, 16]))
    q3 = tl.where(tl.expand_dims(zero, 2), 0.0, q3)
    c = _e2m1_code(tl.reshape(q3, [BM, BK]))
    lo, hi = tl.split(tl.reshape(c, [BM, BK // 2, 2]))
    byte = (lo | (hi << 4)).to(tl.uint8)
    r2 = tl.expand_dims(rows, 1)
    bcols = tl.expand_dims(col0 // 2 + tl.arange(0, BK // 2), 0)
    tl.store(packed_ptr + r2.to(tl.int64) * stride_p + bcols, byte, mask=(r2 < R_PACK) & (bcols < KP // 2))
    scol = tl.expand_dims(col0 // 16 + tl.arange(0, NB), 0)
    tl.store(scales_ptr + _swz(r2.to(tl.int64), scol, CP), code_s.to(tl.uint8), mask=(r2 < R_SCALE) & (scol < CP))


@triton.jit
def _decode_halves(p_ptr, s_ptr, rows, k0, R, KP, CP, stride_p, BR: tl.constexpr, BK: tl.constexpr):
    """Bytes [BR, BK/2] at byte column k0/2 -> (v*s of the LOW nibbles, v*s of the HIGH nibbles), each
    fp32 [BR, BK/2], exact. Low nibble j is element k0 + 2j, high nibble j element k0 + 2j + 1."""
    HB: tl.constexpr = BK // 2
    NB: tl.constexpr = BK // 16
    r2 = tl.expand_dims(rows, 1)
    bc = tl.expand_dims(k0 // 2 + tl.arange(0, HB), 0)
    byte = tl.load(p_ptr + r2.to(tl.int64) * stride_p + bc, mask=(r2 < R) & (bc < KP // 2), other=0).to(tl.int32)
    sc = tl.expand_dims(k0 // 16 + tl.arange(0, NB), 0)
    sb = tl.load(s_ptr + _swz(r2.to(tl.int64), sc, CP), mask=(r2 < R) & (sc < CP), other=0).to(tl.int32)
    s3 = tl.expand_dims(_e4m3_value_2m8(sb) * 4194304.0, 2)  # * 2^22 undoes both 2^-14 and 2^-8
    lo = tl.reshape(tl.reshape(_e2m1_value_2m14(byte & 15), [BR, NB, 8]) * s3, [BR, HB])
    hi = tl.reshape(tl.reshape(_e2m1_value_2m14(byte >> 4), [BR, NB, 8]) * s3, [BR, HB])
    return lo, hi


@triton.jit
def quantize_kernel(x_ptr, g_ptr, packed_ptr, scales_ptr, S, K, stride_x, stride_p, R_PACK, R_SCALE, KP, CP,
                     X_KIND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    col0 = tl.program_id(1) * BK
    cols = col0 + tl.arange(0, BK)
    mask = tl.expand_dims(rows < S, 1) & tl.expand_dims(cols < K, 0)
    ptrs = x_ptr + tl.expand_dims(rows.to(tl.int64), 1) * stride_x + tl.expand_dims(cols, 0)
    v = ld_f32(ptrs, mask, X_KIND)
    _quant_store(v, tl.load(g_ptr), rows, col0, packed_ptr, stride_p, scales_ptr, R_PACK, R_SCALE, KP, CP, BM, BK)


@triton.jit
def rms_modulate_kernel(x_ptr, w_ptr, sc_ptr, sh_ptr, seg_ptr, eps_ptr, g_ptr, packed_ptr, scales_ptr,
                         amax_ptr, S, K, stride_x, stride_sc, stride_sh, stride_p, R_PACK, R_SCALE, KP, CP,
                         MODE: tl.constexpr, HAS_W: tl.constexpr, X_KIND: tl.constexpr, W_KIND: tl.constexpr,
                         T_KIND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NKT: tl.constexpr,
                         NKT_OUT: tl.constexpr, NSEG: tl.constexpr):
    # MODE 0: store each row's amax(|h|) (the dynamic global scale's pass); MODE 1: quantize h.
    # Loop counts are constexpr (NKT = cdiv(K, BK); NKT_OUT = cdiv(CP*16, BK) in MODE 1, else NKT; NSEG >=
    # the segment count, unused entries empty): Triton's interpreter cannot loop over runtime scalars with numpy >= 2.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < S
    r2 = tl.expand_dims(rows.to(tl.int64), 1)
    rstd = rms_rstd(sumsq_f64(x_ptr, r2, stride_x, rmask, K, X_KIND, BM, BK, NKT), K, tl.load(eps_ptr))
    t2 = segment_rows(seg_ptr, rows, BM, NSEG)
    amax = tl.zeros([BM], dtype=tl.float32)
    if MODE == 1:
        g = tl.load(g_ptr)
    else:
        g = 1.0
    for kt in range(NKT_OUT):  # MODE 1 also covers the zero columns of the scale padding
        k0 = kt * BK
        cols = k0 + tl.arange(0, BK)
        c2 = tl.expand_dims(cols, 0)
        m = tl.expand_dims(rmask, 1) & (c2 < K)
        h = modulate(ld_f32(x_ptr + r2 * stride_x + c2, m, X_KIND), rstd, w_ptr, sc_ptr, sh_ptr, t2, c2, m, K,
                      stride_sc, stride_sh, HAS_W, W_KIND, T_KIND)
        if MODE == 0:
            amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
        else:
            _quant_store(h, g, rows, k0, packed_ptr, stride_p, scales_ptr, R_PACK, R_SCALE, KP, CP, BM, BK)
    if MODE == 0:
        tl.store(amax_ptr + rows, amax, mask=rmask)


@triton.jit
def swiglu_kernel(h_ptr, g_ptr, packed_ptr, scales_ptr, amax_ptr, S, F, stride_h, stride_p, R_PACK, R_SCALE,
                   KP, CP, MODE: tl.constexpr, H_KIND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    col0 = pid_k * BK
    c2 = tl.expand_dims(col0 + tl.arange(0, BK), 0)
    m = tl.expand_dims(rows < S, 1) & (c2 < F)
    base = h_ptr + tl.expand_dims(rows.to(tl.int64), 1) * stride_h + c2
    a = ld_f32(base, m, H_KIND)
    up = ld_f32(base + F, m, H_KIND)
    e = exp_f32(0.0 - a)
    y = tl.div_rn(a, 1.0 + e) * up
    y = tl.where(tl.abs(y) < 1.1754943508222875e-38, y * 0.0, y)
    y = tl.where(m, y, 0.0)
    if MODE == 0:
        tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_k, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    else:
        _quant_store(y, tl.load(g_ptr), rows, col0, packed_ptr, stride_p, scales_ptr, R_PACK, R_SCALE, KP, CP, BM, BK)


@triton.jit
def dequant_kernel(p_ptr, s_ptr, gm_ptr, out_ptr, R, K, KP, CP, stride_p, stride_o,
                    HAS_G: tl.constexpr, OUT_KIND: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    k0 = tl.program_id(1) * BK
    lo, hi = _decode_halves(p_ptr, s_ptr, rows, k0, R, KP, CP, stride_p, BM, BK)
    v = tl.reshape(tl.join(lo, hi), [BM, BK])
    if HAS_G:
        v = v * tl.load(gm_ptr)
    r2 = tl.expand_dims(rows, 1)
    c2 = tl.expand_dims(k0 + tl.arange(0, BK), 0)
    ptrs = out_ptr + r2.to(tl.int64) * stride_o + c2
    mask = (r2 < R) & (c2 < K)
    if OUT_KIND == 1:
        tl.store(ptrs, bf16_rne_bits(v).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def fp8_rowwise_kernel(p_ptr, s_ptr, out_ptr, rs_ptr, R, K, KP, CP, stride_p, stride_o,
                        BM: tl.constexpr, BK: tl.constexpr, NKT: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r2 = tl.expand_dims(rows, 1)
    NB: tl.constexpr = BK // 16
    smax = tl.zeros([BM], dtype=tl.float32)
    for kt in range(NKT):
        k0 = kt * BK
        sc = tl.expand_dims(k0 // 16 + tl.arange(0, NB), 0)
        sb = tl.load(s_ptr + _swz(r2.to(tl.int64), sc, CP), mask=(r2 < R) & (sc < KP // 16), other=0).to(tl.int32)
        smax = tl.maximum(smax, tl.max(_e4m3_value_2m8(sb) * 256.0, axis=1))
    ra = tl.div_rn(smax * 6.0, tl.full([BM], 448.0, tl.float32))
    ra = tl.where(ra == 0.0, 1.0, ra)
    tl.store(rs_ptr + rows, ra, mask=rows < R)
    inv3 = tl.broadcast_to(tl.expand_dims(tl.div_rn(tl.full([BM], 1.0, tl.float32), ra), 1), [BM, BK])
    for kt in range(NKT):
        k0 = kt * BK
        lo, hi = _decode_halves(p_ptr, s_ptr, rows, k0, R, KP, CP, stride_p, BM, BK)
        y = tl.reshape(tl.join(lo, hi), [BM, BK]) * inv3
        code = e4m3_code(tl.minimum(tl.maximum(y, -448.0), 448.0), HW)
        c2 = tl.expand_dims(k0 + tl.arange(0, BK), 0)
        tl.store(out_ptr + r2.to(tl.int64) * stride_o + c2, code.to(tl.uint8), mask=(r2 < R) & (c2 < K))


@triton.jit
def gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, ga_ptr, gb_ptr, o_ptr, M, N, KP, A_CP, B_CP,
                 stride_a, stride_b, stride_o, OUT_KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GROUP_M: tl.constexpr, NKT: tl.constexpr, DOT_BF16: tl.constexpr):
    # out[m, n] = ga * gb * sum_k (va*sa)[m, k] * (vb*sb)[n, k]: operands decoded to bf16 exactly (v*s has
    # <= 6 significant bits), products exact, fp32 accumulation. The low and high nibbles of each byte
    # go to two separate dots (the same K permutation on both operands, so no interleave is needed).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kt in range(NKT):
        k0 = kt * BK
        a_lo, a_hi = _decode_halves(a_ptr, as_ptr, rm, k0, M, KP, A_CP, stride_a, BM, BK)
        b_lo, b_hi = _decode_halves(b_ptr, bs_ptr, rn, k0, N, KP, B_CP, stride_b, BN, BK)
        if DOT_BF16:  # exact conversions; bf16 tensor-core MMA with fp32 accumulation
            acc = tl.dot(a_lo.to(tl.bfloat16), tl.trans(b_lo.to(tl.bfloat16)), acc)
            acc = tl.dot(a_hi.to(tl.bfloat16), tl.trans(b_hi.to(tl.bfloat16)), acc)
        else:  # the CPU interpreter's bf16 dot is wrong; fp32 IEEE dot is the same math there
            acc = tl.dot(a_lo, tl.trans(b_lo), acc, input_precision="ieee")
            acc = tl.dot(a_hi, tl.trans(b_hi), acc, input_precision="ieee")
    acc = acc * (tl.load(ga_ptr) * tl.load(gb_ptr))
    r2 = tl.expand_dims(rm, 1)
    c2 = tl.expand_dims(rn, 0)
    ptrs = o_ptr + r2.to(tl.int64) * stride_o + c2
    mask = (r2 < M) & (c2 < N)
    if OUT_KIND == 1:
        tl.store(ptrs, bf16_rne_bits(acc).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)
