"""Fc2Operands: the operands of one FC2 GEMM as its producer left them, handed unchanged to the guarded
pinned path (``runtime.fc2.dispatcher``) or to the layer's own GEMM (the fallback). It lives with the ops, which
build it, so that the block ops need nothing from ``runtime.fc2`` (which imports the ops)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fc2Operands:
    """The bytes the producer made, handed unchanged to either path.

    x:       activation, [m_padded, K/2] uint8 / float4_e2m1fn_x2 (nvfp4), [m_padded, K] float8_e4m3fn or bf16
    w:       weight, [N, K/2] / [N, K], same kind as x
    x_scale: nvfp4: swizzled UE4M3 block scales of x (>= roundup(m_padded,128)*roundup(K/16,4) bytes);
             fp8: fp32, 1 value (tensor) or m_padded values (outer); bf16: None
    w_scale: the same for w (rows N)
    alpha:   nvfp4: decode-direction gsA*gsB, a 1-element fp32 CUDA tensor or a float; else 1.0/None
    m_logical: rows of the result the caller keeps (<= m_padded)
    """

    x: torch.Tensor
    w: torch.Tensor
    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None
    alpha: torch.Tensor | float | None = None
    m_logical: int = 0
    bias: torch.Tensor | None = None
