"""LoRA side paths on the DiT block linears as a BlockOps wrapper: ``LoraOps(inner, sides)``.

The four block linears (``blocks.N.attn.qkv_proj``, ``attn.out_proj``, ``mlp.fc1``, ``mlp.fc2``) are only ever
run through the runtime's BlockOps (runtime.ops.block_ops), so their side paths live there: ``apply_loras`` sets
``rt.ops = LoraOps(base_ops, sides)`` and removing the LoRAs puts ``base_ops`` back. The modules get no
forward hook and no attribute. Per block i (x [S, hidden], h [S, 2*ffn], o [S, H*D], at the compute dtype):

- qkv / fc1: ``inner``'s result + the side term on the unquantized modulated rows ``modulate_(rms_norm(x))``
  (the reference block's input of the layer, whatever the inner ops feed their GEMM);
- out_proj: ``inner``'s result + side(o), o as attention returned it (before any AWQ pre_quant_scale);
- fc2: ``inner.fc2(..., lora_active=True)`` when the block's fc2 has a side path (the FC2 guard then refuses its
  pinned cuBLASLt path: the pinned GEMM has no LoRA term) + side(silu(gate) * up);
- every other op (norm_rope_, attention, gate_add_, status, name, counters) is the inner ops'.

Layers outside BlockOps (AdaLN ``adaln_proj.linear``, the token refiner, condition_proj, the final layer) keep
the per-module forward hook of ``runtime.lora.side``.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn.functional as F

from ..ops.reference import modulated
from ..ops.wrapper import OpsWrapper
from .side import LoraSide

BLOCK_LINEAR = re.compile(r"^blocks\.(\d+)\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")


class LoraOps(OpsWrapper):
    """BlockOps = ``inner`` (any BlockOps) + the LoRA side paths ``sides`` {block linear name: LoraSide}.

    Every other BlockOps member is the inner ops' (``runtime.ops.wrapper.OpsWrapper``).
    """

    OWN = ("inner", "sides")

    def __init__(self, inner, sides: dict[str, LoraSide]):
        bad = sorted(n for n in sides if not BLOCK_LINEAR.match(n))
        if bad:
            raise ValueError(f"LoraOps: side paths are for the block linears blocks.N.(attn.qkv_proj|attn.out_proj|"
                             f"mlp.fc1|mlp.fc2); found {bad[:3]}; hook other layers with runtime.lora.side")
        super().__init__(inner, sides={n: s for n, s in sides.items() if s.active})

    def side(self, i: int, layer: str) -> LoraSide | None:
        """The side path of ``blocks.{i}.{layer}`` (layer e.g. "mlp.fc2"), None when it has none."""
        return self.sides.get(f"blocks.{i}.{layer}")

    def with_attention(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "LoraOps":
        """The same side paths around ``inner.with_attention(fn)``."""
        return LoraOps(self.inner.with_attention(fn), self.sides)

    def _add_modulated(self, y, i, layer, norm, x, shift, scale, segs):
        """y += the side term of ``blocks.{i}.{layer}`` on the unquantized modulated rows (in place)."""
        side = self.side(i, layer)
        if side is not None:
            side.add_(modulated(x, norm, shift, scale, segs), y)
        return y

    def qkv(self, i, blk, x, shift, scale, segs):
        y = self.inner.qkv(i, blk, x, shift, scale, segs)
        return self._add_modulated(y, i, "attn.qkv_proj", blk.norm1, x, shift, scale, segs)

    def out_proj(self, i, blk, o):
        y = self.inner.out_proj(i, blk, o)
        side = self.side(i, "attn.out_proj")
        if side is not None:
            side.add_(o, y)
        return y

    def fc1(self, i, blk, x, shift, scale, segs):
        y = self.inner.fc1(i, blk, x, shift, scale, segs)
        return self._add_modulated(y, i, "mlp.fc1", blk.norm2, x, shift, scale, segs)

    def fc2(self, i, blk, h, lora_active: bool = False):
        side = self.side(i, "mlp.fc2")
        m = self.inner.fc2(i, blk, h, lora_active=lora_active or side is not None)
        if side is not None:
            gate, up = h.chunk(2, dim=-1)
            side.add_(F.silu(gate) * up, m)
        return m
