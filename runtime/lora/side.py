"""The exact bf16 low-rank side path: ``LoraSide`` adds ``scale * (x @ A^T) @ B^T`` to rows of a layer's
output at the layer's compute dtype, without touching its weights.

Contract: ``install_side(name, module, side)`` hooks a per-instance ``forward`` (names, types and state-dict
keys stay) and records the side on the module (attribute ``SIDE_ATTR``) where ``lora_side`` / ``side_active``
find it; ``uninstall_side`` undoes it. This hook is for the layers outside BlockOps (token refiner, AdaLN,
whose offloaded form ``H3Model._block_mods`` reads SIDE_ATTR itself, condition_proj, final layer). The DiT
block linears never get it: their side paths are the BlockOps wrapper ``runtime.lora.ops.LoraOps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .key_forms import LoraUpdate

SIDE_ATTR = "_h3_lora_side"


@dataclass
class _SideTerm:
    down: torch.Tensor  # [r, K] at the side dtype
    up: torch.Tensor  # [b - a, r]
    scale: float  # strength * alpha / r
    rows: tuple[int, int]
    source: str


class LoraSide:
    """The low-rank terms added to one layer's output: ``y[..., a:b] += scale * (x @ A^T) @ B^T``.

    dtype: the layer's compute dtype (A, B and the [S, r] intermediate); x [..., K] any float dtype,
    y [..., N] the layer's output, updated in place (the fp32-accumulating GEMM writes ``y + scale * t @ B^T``
    with one rounding when y has the side dtype).
    """

    def __init__(self, module_name: str, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device):
        self.module_name, self.in_features, self.out_features = module_name, in_features, out_features
        self.dtype, self.device = dtype, device
        self.terms: list[_SideTerm] = []

    def add_term(self, u: LoraUpdate, strength: float, source: str) -> None:
        self.terms.append(_SideTerm(u.down.to(self.device, self.dtype).contiguous(),
                                    u.up.to(self.device, self.dtype).contiguous(),
                                    strength * u.unit_scale, u.rows, source))

    @property
    def active(self) -> bool:
        return bool(self.terms)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += the side path of x (in place; returns y)."""
        if x.shape[-1] != self.in_features or y.shape[-1] != self.out_features:
            raise ValueError(f"LoRA side path of {self.module_name}: x [..., {x.shape[-1]}] / y [..., {y.shape[-1]}]; "
                             f"expected [..., {self.in_features}] / [..., {self.out_features}]")
        xs = x.reshape(-1, self.in_features).to(self.dtype)
        y2 = y if y.dim() == 2 else y.reshape(-1, self.out_features)
        for t in self.terms:
            h = xs @ t.down.t()  # [S, r]
            ys = y2[:, t.rows[0]:t.rows[1]]
            if ys.dtype == h.dtype:
                ys.addmm_(h, t.up.t(), alpha=t.scale)
            else:
                ys.add_((h @ t.up.t()).to(ys.dtype), alpha=t.scale)
        if y2.data_ptr() != y.data_ptr():  # reshape had to copy (a non-viewable y): write back
            y.copy_(y2.view(y.shape))
        return y

    def nbytes(self) -> int:
        return sum(t.down.numel() * t.down.element_size() + t.up.numel() * t.up.element_size() for t in self.terms)


def lora_side(module: nn.Module) -> LoraSide | None:
    """The side path active on ``module`` (None when there is none)."""
    s = getattr(module, SIDE_ATTR, None)
    return s if isinstance(s, LoraSide) and s.active else None


def side_active(module: nn.Module) -> bool:
    """True while a side-path LoRA is active on ``module`` (the FC2 guard's ``lora_active``)."""
    return lora_side(module) is not None


def module_device(module: nn.Module) -> torch.device:
    t = getattr(module, "packed", None)
    t = t if isinstance(t, torch.Tensor) else getattr(module, "weight", None)
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


def install_side(name: str, module: nn.Module, side: LoraSide) -> dict:
    """Hook ``module``'s forward to add ``side`` (per instance; returns what ``uninstall_side`` needs)."""
    prev = {"forward": module.__dict__.get("forward")}
    cls = type(module)

    def forward(x):
        f = prev["forward"]
        y = f(x) if f is not None else cls.forward(module, x)
        side.add_(x, y)
        return y

    module.forward = forward
    setattr(module, SIDE_ATTR, side)
    return prev


def uninstall_side(module: nn.Module, prev: dict) -> None:
    for k, f in prev.items():
        module.__dict__.pop(k, None)
        if f is not None:
            module.__dict__[k] = f
    module.__dict__.pop(SIDE_ATTR, None)
