"""FC2 test operands, the reference GEMM and the byte comparison: shared by the tuner and by
``Fc2Dispatcher.prepare``'s self-test.

Contract: ``synthetic_operands`` gives random ``Fc2Operands`` of the exact FC2 shape for a plan kind
(``KINDS``), rows >= m_logical zero as the producer pads them; ``reference_gemm`` is torch's own GEMM for
that kind (the path the fallback takes), bf16 ``[m_padded, n]``; ``compare_bytes`` compares two bf16
outputs bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from .guard import Fc2Operands
from .table import KINDS

DEFAULT_SCALE_MODE = {"nvfp4": "vec16_ue4m3", "fp8_e4m3": "tensor", "bf16": "none"}
REFERENCE_NAME = {
    "bf16": "torch.nn.functional.linear (cuBLAS heuristic)",
    "fp8_e4m3": "torch._scaled_mm, fp32 tensorwise/outer scales, bf16 out",
    "nvfp4": "torch._scaled_mm, float4_e2m1fn_x2 with swizzled UE4M3 block scales, bf16 out (alpha = 1)",
}


# ----------------------------------------------------------------------------------------------
# operands, reference, comparison (also used by Fc2Dispatcher.prepare's self-test)


def synthetic_operands(dtype: str, m_logical: int, m_padded: int, n: int, k: int, device: torch.device | str,
                       *, seed: int = 0, scale_mode: str | None = None) -> Fc2Operands:
    """Random operands of the exact FC2 shape; rows >= m_logical are zero, as the producer pads them.

    nvfp4: random bytes (every byte is a valid E2M1 pair), block scales drawn from UE4M3 0.25..4 and
    swizzled (128x4), alpha = 1 so torch's _scaled_mm (no global scale) is a valid reference.
    """
    if dtype not in KINDS:
        raise ValueError(f"dtype {dtype!r}; expected one of {KINDS}")
    device = torch.device(device)
    scale_mode = scale_mode or DEFAULT_SCALE_MODE[dtype]
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    if dtype == "nvfp4":
        from ..ops.nvfp4 import swizzle_scales

        if k % 32:
            raise ValueError(f"nvfp4 needs K % 32 == 0; found K={k}")
        u8 = dict(dtype=torch.uint8, device=device, generator=g)
        x = torch.randint(0, 256, (m_padded, k // 2), **u8)
        w = torch.randint(0, 256, (n, k // 2), **u8)
        xs = torch.randint(0x28, 0x48, (m_padded, k // 16), **u8)  # e4m3 0.25 .. 3.75
        ws = torch.randint(0x28, 0x48, (n, k // 16), **u8)
        x[m_logical:] = 0
        xs[m_logical:] = 0
        xs = swizzle_scales(xs.view(torch.float8_e4m3fn)).reshape(-1)
        ws = swizzle_scales(ws.view(torch.float8_e4m3fn)).reshape(-1)
        alpha = torch.ones(1, dtype=torch.float32, device=device)
        return Fc2Operands(x=x, w=w, x_scale=xs, w_scale=ws, alpha=alpha, m_logical=m_logical)
    f32 = dict(dtype=torch.float32, device=device, generator=g)
    x = torch.randn((m_padded, k), **f32)
    w = torch.randn((n, k), **f32)
    x[m_logical:] = 0
    if dtype == "bf16":
        return Fc2Operands(x=x.to(torch.bfloat16), w=(w * k ** -0.5).to(torch.bfloat16), m_logical=m_logical)
    xq = (x * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq = (w * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scale_mode == "outer":
        xs = torch.rand((m_padded,), **f32) + 0.5
        ws = torch.rand((n,), **f32) + 0.5
    elif scale_mode == "tensor":
        xs = torch.full((1,), 0.5, dtype=torch.float32, device=device)
        ws = torch.full((1,), 0.25, dtype=torch.float32, device=device)
    else:
        raise ValueError(f"fp8 scale_mode {scale_mode!r}; expected tensor or outer")
    return Fc2Operands(x=xq, w=wq, x_scale=xs, w_scale=ws, m_logical=m_logical)


def reference_gemm(ops: Fc2Operands, dtype: str, scale_mode: str | None = None) -> torch.Tensor:
    """torch's own GEMM for the dtype, over all m_padded rows: [m_padded, N] bf16."""
    scale_mode = scale_mode or DEFAULT_SCALE_MODE[dtype]
    if dtype == "bf16":
        return torch.nn.functional.linear(ops.x, ops.w)
    if dtype == "fp8_e4m3":
        sa, sb = ops.x_scale, ops.w_scale
        if scale_mode == "outer":
            sa, sb = sa.view(-1, 1), sb.view(1, -1)
        y = torch._scaled_mm(ops.x, ops.w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return y[0] if isinstance(y, tuple) else y
    if dtype == "nvfp4":
        a = ops.alpha
        if a is not None and float(a.item() if isinstance(a, torch.Tensor) else a) != 1.0:
            raise ValueError("the nvfp4 torch reference has no global scale: synthetic operands use alpha = 1")
        f4 = getattr(torch, "float4_e2m1fn_x2", None)
        if f4 is None:
            raise RuntimeError(f"torch {torch.__version__} has no float4_e2m1fn_x2 (needs torch >= 2.8)")
        y = torch._scaled_mm(ops.x.view(f4), ops.w.view(f4).t(), ops.x_scale.view(torch.float8_e4m3fn),
                             ops.w_scale.view(torch.float8_e4m3fn), out_dtype=torch.bfloat16)
        return y[0] if isinstance(y, tuple) else y
    raise ValueError(f"dtype {dtype!r}; expected one of {KINDS}")


def compare_bytes(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Bitwise comparison of two bf16 tensors of the same shape (NaN != anything, -0 != +0)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        why = f"{out.dtype} {tuple(out.shape)} vs {ref.dtype} {tuple(ref.shape)}"
        return {"equal": False, "mismatched": -1, "why": why}
    a, b = out.contiguous().view(torch.int16), ref.contiguous().view(torch.int16)
    mism = int((a != b).sum().item())
    return {"equal": mism == 0, "mismatched": mism}


# ----------------------------------------------------------------------------------------------
# candidates and ordering (pure functions, unit-tested)
