"""The kernels behind ``flash_attention.fa3_fp8_operands``: per-head statistics of q, k, v read from the strided
views of the qkv buffer, then their e4m3 codes (k and v smoothed by their per-channel means). Contracts are those
of ``flash_attention.fa3_fp8_operands_reference``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ld_f32, e4m3_code

__all__ = ["qkv_stats_kernel", "qkv_fp8_kernel"]


@triton.jit
def qkv_stats_kernel(qkv_ptr, p32_ptr, p64_ptr, S, stride_s, H, KIND: tl.constexpr, D: tl.constexpr,
                     BT: tl.constexpr, NT: tl.constexpr):
    # Program (block b, head h) reads rows [b*NT*BT, (b+1)*NT*BT) of head h's q, k, v ([rows, D] each) and writes
    #   p32[b, 0:5, h, :] = max|q|, max k, min k, max v, min v over its rows (per channel; fp32, exact)
    #   p64[b, 0:2, h, :] = sum k, sum v over its rows (fp64: exact for bf16/fp16 inputs of ordinary range)
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.expand_dims(tl.arange(0, D), 0)
    cols = tl.arange(0, D)
    q_amax = tl.zeros([D], tl.float32)
    k_max = tl.full([D], float("-inf"), tl.float32)
    k_min = tl.full([D], float("inf"), tl.float32)
    v_max = tl.full([D], float("-inf"), tl.float32)
    v_min = tl.full([D], float("inf"), tl.float32)
    k_sum = tl.zeros([D], tl.float64)
    v_sum = tl.zeros([D], tl.float64)
    for i in range(NT):
        t = (b * NT + i) * BT + tl.arange(0, BT)
        m = tl.expand_dims(t < S, 1) & (d < D)
        base = qkv_ptr + tl.expand_dims(t.to(tl.int64), 1) * stride_s + h * D + d
        q = ld_f32(base, m, KIND)
        k = ld_f32(base + H * D, m, KIND)
        v = ld_f32(base + 2 * H * D, m, KIND)
        q_amax = tl.maximum(q_amax, tl.max(tl.abs(q), axis=0))
        k_max = tl.maximum(k_max, tl.max(tl.where(m, k, float("-inf")), axis=0))
        k_min = tl.minimum(k_min, tl.min(tl.where(m, k, float("inf")), axis=0))
        v_max = tl.maximum(v_max, tl.max(tl.where(m, v, float("-inf")), axis=0))
        v_min = tl.minimum(v_min, tl.min(tl.where(m, v, float("inf")), axis=0))
        k_sum += tl.sum(k.to(tl.float64), axis=0)
        v_sum += tl.sum(v.to(tl.float64), axis=0)
    o32 = p32_ptr + (b * 5 * H + h) * D + cols
    tl.store(o32, q_amax)
    tl.store(o32 + H * D, k_max)
    tl.store(o32 + 2 * H * D, k_min)
    tl.store(o32 + 3 * H * D, v_max)
    tl.store(o32 + 4 * H * D, v_min)
    o64 = p64_ptr + (b * 2 * H + h) * D + cols
    tl.store(o64, k_sum)
    tl.store(o64 + H * D, v_sum)


@triton.jit
def qkv_fp8_kernel(qkv_ptr, mean_ptr, inv_ptr, out_ptr, S, stride_s, H, plane, KIND: tl.constexpr, D: tl.constexpr,
                   BT: tl.constexpr, HW: tl.constexpr):
    # out[j, t, h, :] = e4m3(clamp((x_j[t, h, :] - mean_j[h, :]) * inv[j, h], +-448)) for j = q, k, v
    # (mean_q = 0, never loaded); out is uint8 [3, S, H, D] contiguous, plane = S * H * D
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    d = tl.expand_dims(tl.arange(0, D), 0)
    m = tl.expand_dims(t < S, 1) & (d < D)
    t2 = tl.expand_dims(t.to(tl.int64), 1)
    src = qkv_ptr + t2 * stride_s + h * D + d
    dst = out_ptr + t2 * (H * D) + h * D + d
    for j in tl.static_range(3):
        x = ld_f32(src + j * H * D, m, KIND)
        if j > 0:
            x = x - tl.load(mean_ptr + ((j - 1) * H + h) * D + d)
        y = x * tl.load(inv_ptr + j * H + h)
        code = e4m3_code(tl.minimum(tl.maximum(y, -448.0), 448.0), HW).to(tl.uint8)
        tl.store(dst + j * plane, code, mask=m)
