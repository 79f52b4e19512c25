"""Input checks shared by the fused kernels and their plain-PyTorch references (``runtime.ops.reference``), so
both refuse the same inputs with the same message: shapes, dtypes, strides, devices and segment tables.
Each raises ValueError (TypeError for a wrong dtype of a producer input) naming what was expected and found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_norm_rope(qkv, q_weight, k_weight, cos, sin, rope_dim) -> tuple[int, int, int]:
    """The norm+RoPE inputs (qkv [S, 3*H*D], q/k weights [D], fp32 cos/sin [S, rope_dim]) -> (S, H, D)."""
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [S, 3*H*D]; found shape {tuple(qkv.shape)}")
    if qkv.dtype not in FLOAT_DTYPES:
        raise ValueError(f"qkv dtype must be one of {FLOAT_DTYPES}; found {qkv.dtype}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv needs unit column stride (row-major); found strides {qkv.stride()}")
    if q_weight.dim() != 1 or k_weight.shape != q_weight.shape:
        raise ValueError(
            f"q_weight and k_weight must both be [D]; found {tuple(q_weight.shape)} and {tuple(k_weight.shape)}"
        )
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        if t.dtype not in FLOAT_DTYPES or t.stride(0) != 1:
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


def check_gate_add(x, y, gate_rows, segments) -> list[tuple[int, int, int]]:
    """x, y [S, hidden], gate_rows [R, hidden] and a segment table tiling [0, S) -> the segments."""
    if x.dim() != 2 or y.shape != x.shape:
        raise ValueError(f"x and y must both be [S, hidden]; found {tuple(x.shape)} and {tuple(y.shape)}")
    if gate_rows.dim() != 2 or gate_rows.shape[1] != x.shape[1]:
        raise ValueError(f"gate_rows must be [R, hidden={x.shape[1]}]; found {tuple(gate_rows.shape)}")
    for name, t in (("x", x), ("y", y), ("gate_rows", gate_rows)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}; found {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit column stride; found strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return check_segments(segments, x.shape[0], gate_rows.shape[0])


def check_2d(x: torch.Tensor, name: str) -> None:
    """A float [S, K] matrix with unit column stride."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [S, K]; found shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32/bfloat16/float16; found {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{name} needs unit column stride; found strides {x.stride()}")


@dataclass(frozen=True)
class Modulation:
    """The per-segment modulation the RMSNorm producers apply after the norm: rows ``[start, stop)`` of segment
    ``(start, stop, row)`` take ``h * (1 + scale_rows[row]) + shift_rows[row]``. scale_rows / shift_rows
    [rows, K] float tables of one dtype with unit column stride (e.g. a block's scale_msa / shift_msa for every
    (t, modality) row); segments: (start, stop, row) triples that tile [0, S) in order."""

    scale_rows: torch.Tensor
    shift_rows: torch.Tensor
    segments: Sequence[Sequence[int]]


def check_norm_inputs(x, weight, scale_rows, shift_rows, segments) -> list[tuple[int, int, int]]:
    """RMSNorm + modulate inputs: x [S, K], weight [K] or None, scale/shift tables [rows, K] -> the segments."""
    check_2d(x, "x")
    k = x.shape[1]
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != k):
        raise ValueError(f"norm weight must be [K={k}]; found {tuple(weight.shape)}")
    for name, t in (("scale_rows", scale_rows), ("shift_rows", shift_rows)):
        if t.dim() != 2 or t.shape[1] != k:
            raise ValueError(f"{name} must be [rows, K={k}]; found {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES or t.stride(1) != 1:
            raise ValueError(f"{name} must be a float table with unit column stride; found {t.dtype}, {t.stride()}")
    if scale_rows.shape[0] != shift_rows.shape[0]:
        raise ValueError(f"scale_rows has {scale_rows.shape[0]} rows, shift_rows {shift_rows.shape[0]}")
    for name, t in (("weight", weight), ("scale_rows", scale_rows), ("shift_rows", shift_rows)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return check_segments(segments, x.shape[0], scale_rows.shape[0])
