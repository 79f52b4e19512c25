"""Fused elementwise ops of one block: per-head q/k RMSNorm + split-half RoPE, and gate + residual add.

Both work in place on the block's own buffers, each in ONE Triton kernel; their definitions are
``runtime.ops.reference.norm_rope_qkv_reference`` and ``gate_add_reference`` (the oracles of the tests; the
first is the reference block's ``qk_norm_rope``), and both check their inputs with ``runtime.ops.operand_checks``.

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

The kernels are in ``ops.triton.elementwise_kernels``, loaded at import when triton is installed; on CPU they run
under ``TRITON_INTERPRET=1`` set before import (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .operand_checks import check_gate_add, check_norm_rope
from .triton import MISSING as TRITON_MISSING, interpreting

if TRITON_MISSING is None:  # the kernels, loaded once; without triton only the references run
    from .triton import elementwise_kernels

__all__ = ["NormRopeLaunch", "norm_rope_", "gate_add_", "segment_table"]


# ----------------------------------------------------------------------------------------------
# Triton launches (the kernels: ops.triton.elementwise_kernels)
# ----------------------------------------------------------------------------------------------


_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
GATE_ADD_MAX_SEGMENTS = 32  # segments per gate_add_ launch (its kernel unrolls the segment loop)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _check_kernel_device(t: torch.Tensor, what: str) -> None:
    if TRITON_MISSING is not None:
        raise RuntimeError(f"{what} is a Triton kernel and {TRITON_MISSING}; use runtime.ops.reference")
    if not t.is_cuda and not interpreting():
        raise RuntimeError(
            f"{what} is a Triton kernel and needs a CUDA tensor (found {t.device}); on CPU use the "
            f"runtime.ops.reference function, or set TRITON_INTERPRET=1 before importing h3_blackwell (tests)"
        )


# ----------------------------------------------------------------------------------------------
# public kernels
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormRopeLaunch:
    """``norm_rope_``'s launch: rows per program, heads per program, warps. Speed only, never the bytes; how
    the defaults were chosen: bench/NOTES.md."""

    block_s: int = 8
    heads_per_program: int = 2
    num_warps: int = 2


def norm_rope_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-5,
    rope_dim: int = 96,
    *,
    launch: NormRopeLaunch = NormRopeLaunch(),
) -> torch.Tensor:
    """In place on ``qkv [S, 3*H*D]`` (bf16/fp16/fp32, unit column stride): per-head RMSNorm of the q
    and k thirds with ``q_weight``/``k_weight [D]`` then split-half RoPE on channels ``[0, rope_dim)``
    with fp32 ``cos``/``sin [S, rope_dim]``; v untouched. One Triton kernel reading and writing through
    qkv's strides (no copies). ``launch`` (``NormRopeLaunch``) changes speed only, never the bytes.
    ``H = cols / (3*D)``,
    ``D = q_weight.numel()``. Returns ``qkv``."""
    s, h, d = check_norm_rope(qkv, q_weight, k_weight, cos, sin, rope_dim)
    if s == 0:
        return qkv
    _check_kernel_device(qkv, "norm_rope_")
    kernel = elementwise_kernels.norm_rope_kernel
    half = rope_dim // 2
    pas = d - rope_dim
    grid = (-(-2 * h // launch.heads_per_program), -(-s // launch.block_s))
    kernel[grid](
        qkv, q_weight, k_weight, cos, sin,
        s, qkv.stride(0), cos.stride(0), sin.stride(0), float(eps),
        H=h, D=d, HALF=half, HALF_P=_next_pow2(half), PASS=pas, PASS_P=_next_pow2(pas),
        HEADS_PER_PROG=launch.heads_per_program, BLOCK_S=launch.block_s, OUT_KIND=_OUT_KIND[qkv.dtype],
        W_KIND=_OUT_KIND[q_weight.dtype],
        num_warps=launch.num_warps,
    )
    return qkv


_SEG_CACHE: dict = {}


def segment_table(segs: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
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
    ``reference.gate_add_reference``. One Triton launch for up to GATE_ADD_MAX_SEGMENTS segments (longer tables go
    in chunks of that many, each on its row slice). Returns ``x``."""
    segs = check_gate_add(x, y, gate_rows, segments)
    s, n = x.shape
    if s == 0 or n == 0:
        return x
    _check_kernel_device(x, "gate_add_")
    if len(segs) > GATE_ADD_MAX_SEGMENTS:
        # the kernel unrolls its segment loop: a long table (a masked stream's runs of equal t) goes in chunks
        # of GATE_ADD_MAX_SEGMENTS, each on its own row slice with re-based segments (padded with empty ones,
        # so one compiled kernel serves every chunk)
        for i in range(0, len(segs), GATE_ADD_MAX_SEGMENTS):
            chunk = segs[i:i + GATE_ADD_MAX_SEGMENTS]
            a0, b1 = chunk[0][0], chunk[-1][1]
            rebased = [(a - a0, b - a0, r) for a, b, r in chunk]
            rebased += [(0, 0, 0)] * (GATE_ADD_MAX_SEGMENTS - len(chunk))
            _gate_add_launch(x[a0:b1], y[a0:b1], gate_rows, rebased, block_s, block_n, num_warps)
        return x
    _gate_add_launch(x, y, gate_rows, segs, block_s, block_n, num_warps)
    return x


def _gate_add_launch(x, y, gate_rows, segs, block_s, block_n, num_warps) -> None:
    s, n = x.shape
    kernel = elementwise_kernels.gate_add_kernel
    table = segment_table(segs, x.device)
    grid = (-(-s // block_s), -(-n // block_n))
    kernel[grid](
        x, y, gate_rows, table,
        s, n, x.stride(0), y.stride(0), gate_rows.stride(0),
        N_SEG=len(segs), BLOCK_S=block_s, BLOCK_N=block_n, OUT_KIND=_OUT_KIND[x.dtype],
        Y_KIND=_OUT_KIND[y.dtype], G_KIND=_OUT_KIND[gate_rows.dtype],
        num_warps=num_warps, enable_fp_fusion=False,
    )
