"""Finite checks on tensors as they stream in: one reduction per tensor, the bad one named.

A NaN or an Inf in one weight, one LoRA factor or one text state turns every output latent into NaN
(attention mixes every row with every other). These checks refuse such inputs by name at load time, for
the cost of one ``isfinite().all()`` reduction per tensor (no copy of the tensor, no host sync beyond
the one boolean; ``FiniteChecks`` reads many tensors' booleans back in one sync).
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
    flag = finite_flag(t)
    return flag is None or bool(flag)


def finite_flag(t: torch.Tensor) -> torch.Tensor | None:
    """``is_finite(t)`` as a 0-dim bool tensor on ``t``'s device, without waiting for it (None where ``t``'s dtype
    cannot hold NaN/Inf, or it is empty): a caller that checks many tensors reads all their flags in one sync
    (``FiniteChecks``)."""
    f = _float_view(t)
    if f is None or f.numel() == 0:
        return None
    lo, hi = torch.aminmax(f)
    return torch.isfinite(lo) & torch.isfinite(hi)


class FiniteChecks:
    """``check_finite`` for a stream of tensors, with one host sync per ``flush`` instead of one per tensor (a CUDA
    load then keeps issuing copies while earlier ones run). ``add`` queues a tensor's flag and keeps the tensor
    until the next flush, so a failure names it and counts its NaN/Inf exactly as ``check_finite`` does; ``flush``
    raises for the first bad tensor in the order they were added. The caller flushes before it moves a queued tensor
    elsewhere, and at the end; ``add`` flushes by itself once ``every`` tensors or ``max_bytes`` are queued, which
    bounds the memory a queued temporary keeps alive (a tensor of ``max_bytes`` or more is read back at once)."""

    def __init__(self, every: int = 32, max_bytes: int = 64 << 20, error: type[H3Error] = CheckpointError):
        self.every, self.max_bytes, self.error = every, max_bytes, error
        self._queued: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        flag = finite_flag(tensor)
        if flag is not None:
            self._queued.append((name, tensor, flag))
            self._bytes += tensor.numel() * tensor.element_size()
            if len(self._queued) >= self.every or self._bytes >= self.max_bytes:
                self.flush()
        return tensor

    def flush(self) -> None:
        queued, self._queued, self._bytes = self._queued, [], 0
        if not queued or bool(torch.stack([f.to(queued[0][2].device) for _, _, f in queued]).all()):
            return
        for name, tensor, flag in queued:
            if not bool(flag):
                check_finite(name, tensor, self.error)


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
