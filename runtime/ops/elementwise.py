"""Fused elementwise ops of one block: per-head q/k RMSNorm + split-half RoPE, and gate + residual add.

Both work in place on the block's own buffers, each in ONE Triton kernel, and each has a pure-torch
reference that is the oracle of the tests (and of the reference block).

Conventions (the model's; the references implement exactly these):

* ``qkv`` is the QKV projection output ``[S, 3*H*D]``, row-major thirds ``[q_all | k_all | v_all]``;
  head ``h`` of q is columns ``[h*D, (h+1)*D)``, of k ``[H*D + h*D, ...)``. The row stride may be
  larger than ``3*H*D`` (a view); the column stride must be 1.
* per-head RMSNorm of q and k: ``n = x * rsqrt(mean(x^2 over D) + eps) * weight[D]`` in fp32.
* split-half RoPE on the first ``R = rope_dim`` channels of each head, from the fp32 normed values:
  ``out_r = n_r * cos + cat(-n2, n1) * sin`` with ``n1 = n[:R/2]``, ``n2 = n[R/2:R]``; ``cos``/``sin``
  are fp32 ``[S, R]``; channels ``R..D`` pass through (normed). ONE cast to the buffer dtype at the end.
  (diffusers' module, run in bf16, rounds the normed values to bf16 and applies RoPE in bf16
  arithmetic; this fp32 path is the more accurate of the two and differs from it by bf16 rounding
  noise. In fp32 the two are the same math.)
* gate + residual add: ``x[a:b] = dtype(fp32(x[a:b]) + fp32(gate_rows[row]) * fp32(y[a:b]))`` for each
  segment ``(a, b, row)``; the segments tile ``[0, S)``. The product and the sum are rounded separately
  in fp32 (no FMA), so the kernel equals the reference bit for bit.

Triton is imported on first use only; on CPU the kernels run under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

__all__ = [
    "norm_rope_",
    "norm_rope_reference",
    "gate_add_",
    "gate_add_reference",
    "check_segments",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# validation (shared by kernels and references, so both refuse the same inputs)
# ----------------------------------------------------------------------------------------------


def _check_norm_rope(qkv, q_weight, k_weight, cos, sin, rope_dim):
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [S, 3*H*D]; found shape {tuple(qkv.shape)}")
    if qkv.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"qkv dtype must be one of {_FLOAT_DTYPES}; found {qkv.dtype}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv needs unit column stride (row-major); found strides {qkv.stride()}")
    if q_weight.dim() != 1 or k_weight.shape != q_weight.shape:
        raise ValueError(
            f"q_weight and k_weight must both be [D]; found {tuple(q_weight.shape)} and {tuple(k_weight.shape)}"
        )
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        if t.dtype not in _FLOAT_DTYPES or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous float vector; found {t.dtype}, stride {t.stride()}")
    d = q_weight.shape[0]
    s, cols = qkv.shape
    if cols % (3 * d) != 0:
        raise ValueError(f"qkv has {cols} columns, not a multiple of 3*D = {3 * d} (D from q_weight)")
    h = cols // (3 * d)
    if rope_dim % 2 != 0 or not 0 <= rope_dim <= d:
        raise ValueError(f"rope_dim must be even and in [0, D={d}]; found {rope_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (s, rope_dim):
            raise ValueError(f"{name} must be [S, rope_dim] = [{s}, {rope_dim}]; found {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (the model computes angles in fp32); found {t.dtype}")
        if rope_dim and t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit column stride; found strides {t.stride()}")
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin)):
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}")
    return s, h, d


def check_segments(segments: Sequence[Sequence[int]], rows: int, gate_rows: int) -> list[tuple[int, int, int]]:
    """Validate a segment table ``[(a, b, row), ...]``: sorted, contiguous, covering ``[0, rows)``,
    each ``row`` an index into ``gate_rows``. Returns it as a list of int triples."""
    out = []
    pos = 0
    for i, seg in enumerate(segments):
        if len(seg) != 3:
            raise ValueError(f"segment {i} must be (start, stop, gate_row); found {seg!r}")
        a, b, r = (int(v) for v in seg)
        if a != pos or b <= a:
            raise ValueError(
                f"segments must tile [0, {rows}) in order without gaps; segment {i} is [{a}, {b}) "
                f"but the previous one ended at {pos}"
            )
        if not 0 <= r < gate_rows:
            raise ValueError(f"segment {i} uses gate row {r}; gate_rows has {gate_rows} rows")
        out.append((a, b, r))
        pos = b
    if pos != rows:
        raise ValueError(f"segments end at row {pos}; x has {rows} rows (they must cover all of x)")
    return out


def _check_gate_add(x, y, gate_rows, segments):
    if x.dim() != 2 or y.shape != x.shape:
        raise ValueError(f"x and y must both be [S, hidden]; found {tuple(x.shape)} and {tuple(y.shape)}")
    if gate_rows.dim() != 2 or gate_rows.shape[1] != x.shape[1]:
        raise ValueError(f"gate_rows must be [R, hidden={x.shape[1]}]; found {tuple(gate_rows.shape)}")
    for name, t in (("x", x), ("y", y), ("gate_rows", gate_rows)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {_FLOAT_DTYPES}; found {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit column stride; found strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return check_segments(segments, x.shape[0], gate_rows.shape[0])


# ----------------------------------------------------------------------------------------------
# references (fp32 math, out of place: they return new tensors and leave their inputs alone)
# ----------------------------------------------------------------------------------------------


def norm_rope_reference(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-5,
    rope_dim: int = 96,
) -> torch.Tensor:
    """Reference of :func:`norm_rope_`: returns a new ``[S, 3*H*D]`` tensor (qkv's dtype) whose q and k
    thirds are normed + rotated and whose v third is copied; ``qkv`` itself is not changed."""
    s, h, d = _check_norm_rope(qkv, q_weight, k_weight, cos, sin, rope_dim)
    out = qkv.clone()
    half = rope_dim // 2
    for third, w in ((0, q_weight), (1, k_weight)):
        x = qkv[:, third * h * d : (third + 1) * h * d].float().view(s, h, d)
        n = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * w.float()
        if rope_dim:
            n_r = n[..., :rope_dim]
            rotated = torch.cat((-n_r[..., half:], n_r[..., :half]), dim=-1)
            n_r = n_r * cos[:, None, :] + rotated * sin[:, None, :]
            n = torch.cat((n_r, n[..., rope_dim:]), dim=-1)
        out[:, third * h * d : (third + 1) * h * d] = n.reshape(s, h * d).to(qkv.dtype)
    return out


def gate_add_reference(
    x: torch.Tensor, y: torch.Tensor, gate_rows: torch.Tensor, segments: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Reference of :func:`gate_add_`: returns a new x (x's dtype). fp32 product, then fp32 sum, then one
    cast; ``x`` itself is not changed."""
    segs = _check_gate_add(x, y, gate_rows, segments)
    out = x.clone()
    for a, b, r in segs:
        prod = gate_rows[r].float() * y[a:b].float()
        out[a:b] = (x[a:b].float() + prod).to(x.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernels (defined on first use so that importing this module never imports Triton)
# ----------------------------------------------------------------------------------------------


_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, Triton's own switch)."""
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


def _check_kernel_device(t: torch.Tensor, what: str) -> None:
    if not t.is_cuda and not _interpreting():
        raise RuntimeError(
            f"{what} is a Triton kernel and needs a CUDA tensor (found {t.device}); on CPU use the "
            f"*_reference function, or set TRITON_INTERPRET=1 before the first call (tests)"
        )


@functools.lru_cache(maxsize=None)
def _kernels():
    # The jit functions resolve names (tl, _store_rtne) through this module's globals.
    global tl, triton, _store_rtne, _f32
    import triton
    import triton.language as tl

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

    return norm_rope_kernel, gate_add_kernel


# ----------------------------------------------------------------------------------------------
# public kernels
# ----------------------------------------------------------------------------------------------


def norm_rope_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-5,
    rope_dim: int = 96,
    *,
    block_s: int = 8,
    heads_per_program: int = 2,
    num_warps: int = 2,
) -> torch.Tensor:
    """In place on ``qkv [S, 3*H*D]`` (bf16/fp16/fp32, unit column stride): per-head RMSNorm of the q
    and k thirds with ``q_weight``/``k_weight [D]`` then split-half RoPE on channels ``[0, rope_dim)``
    with fp32 ``cos``/``sin [S, rope_dim]``; v untouched. One Triton kernel reading and writing through
    qkv's strides (no copies). Launch defaults: the fastest of the 8 configurations swept on the H200 at
    S=37,810 (bench/results/attention-h200.json: 1.21 ms, 1822 GB/s vs 2.12 ms for 32/2/4). ``H = cols / (3*D)``, ``D = q_weight.numel()``. Returns ``qkv``."""
    s, h, d = _check_norm_rope(qkv, q_weight, k_weight, cos, sin, rope_dim)
    if s == 0:
        return qkv
    _check_kernel_device(qkv, "norm_rope_")
    kernel, _ = _kernels()
    half = rope_dim // 2
    pas = d - rope_dim
    grid = (-(-2 * h // heads_per_program), -(-s // block_s))
    kernel[grid](
        qkv, q_weight, k_weight, cos, sin,
        s, qkv.stride(0), cos.stride(0), sin.stride(0), float(eps),
        H=h, D=d, HALF=half, HALF_P=_next_pow2(half), PASS=pas, PASS_P=_next_pow2(pas),
        HEADS_PER_PROG=heads_per_program, BLOCK_S=block_s, OUT_KIND=_OUT_KIND[qkv.dtype],
        W_KIND=_OUT_KIND[q_weight.dtype],
        num_warps=num_warps,
    )
    return qkv


_SEG_CACHE: dict = {}


def _segment_table(segs: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """int32 [n_seg*3] on the device, cached per (layout, device): one host->device copy per layout."""
    key = (tuple(segs), str(device))
    t = _SEG_CACHE.get(key)
    if t is None:
        if len(_SEG_CACHE) > 64:
            _SEG_CACHE.clear()
        t = torch.tensor([v for seg in segs for v in seg], dtype=torch.int32).to(device)
        _SEG_CACHE[key] = t
    return t


def gate_add_(
    x: torch.Tensor,
    y: torch.Tensor,
    gate_rows: torch.Tensor,
    segments: Sequence[Sequence[int]],
    *,
    block_s: int = 16,
    block_n: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """In place: ``x[a:b] += gate_rows[row] * y[a:b]`` for each segment ``(a, b, row)`` (the segments tile
    ``[0, S)``). ``x, y [S, hidden]``, ``gate_rows [R, hidden]``; any float dtypes, unit column stride.
    Computed as fp32 ``x + (g*y)`` with separate roundings and one cast to x's dtype: bit-equal to
    :func:`gate_add_reference`. One Triton launch for all segments. Returns ``x``."""
    segs = _check_gate_add(x, y, gate_rows, segments)
    s, n = x.shape
    if s == 0 or n == 0:
        return x
    _check_kernel_device(x, "gate_add_")
    _, kernel = _kernels()
    table = _segment_table(segs, x.device)
    grid = (-(-s // block_s), -(-n // block_n))
    kernel[grid](
        x, y, gate_rows, table,
        s, n, x.stride(0), y.stride(0), gate_rows.stride(0),
        N_SEG=len(segs), BLOCK_S=block_s, BLOCK_N=block_n, OUT_KIND=_OUT_KIND[x.dtype],
        Y_KIND=_OUT_KIND[y.dtype], G_KIND=_OUT_KIND[gate_rows.dtype],
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return x
