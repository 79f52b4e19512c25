"""Finite checks on tensors as they stream in: one reduction per tensor, the bad one named.

A NaN or an Inf in one weight, one LoRA factor or one text state turns every output latent into NaN
(attention mixes every row with every other). These checks refuse such inputs by name at load time, for
the cost of one ``isfinite().all()`` reduction per tensor (no copy of the tensor, no host sync beyond
the one boolean).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, H3Error

def _float_view(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor as a dtype torch can test for finiteness, or None when its dtype cannot hold NaN/Inf
    (integer codes, packed NVFP4 bytes, booleans). fp8 storage is judged through fp16 (exact for e4m3 and
    e5m2, NaN/Inf kept; half the temporary of fp32)."""
    if not t.is_floating_point():
        return None
    return t.to(torch.float16) if t.element_size() == 1 else t


def is_finite(t: torch.Tensor) -> bool:
    """True when every entry of ``t`` is finite (integer and packed dtypes always are). One reduction:
    ``torch.aminmax``, which propagates a NaN to both results and brings an Inf to one of them, with no temporary
    the size of ``t`` (``torch.isfinite(t).all()`` builds a bool tensor of ``t``'s size: about 12x slower on the CPU
    for a 0.3 GB AdaLN weight, where the load checks 26 GB of them). The reference is ``isfinite(t).all()``
    (tests/runtime/io/test_finite.py)."""
    f = _float_view(t)
    if f is None or f.numel() == 0:
        return True
    lo, hi = torch.aminmax(f)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(name: str, tensor: torch.Tensor, error: type[H3Error] = CheckpointError,
                 source: str = "", what_to_do: str = "") -> torch.Tensor:
    """Return ``tensor`` unchanged when every entry is finite; else raise ``error`` naming the tensor, how many
    entries are NaN/Inf, and what to do. ``source`` (a file name) prefixes the message.

    tensor: any shape, dtype and device (fp8 is widened for the test; integer/uint8-packed tensors pass).
    """
    if is_finite(tensor):
        return tensor
    f = _float_view(tensor)
    nan = int(torch.isnan(f).sum())
    inf = int(torch.isinf(f).sum())
    where = f"{source}: " if source else ""
    todo = what_to_do or "the file is damaged or was saved from a diverged run; re-download or re-export it"
    raise error(f"{where}tensor {name!r} {list(tensor.shape)} must be finite; found {nan} NaN and {inf} Inf "
                f"of {tensor.numel()} values; {todo}")
