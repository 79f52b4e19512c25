"""Full-form AdaLN weights left in the checkpoint file (the memory plan's ``adaln_from_file``, issue 37).

The 50 blocks' ``adaln_proj.linear`` weights of a full-form H3 are 26 GB in bf16: more than a 32 GB machine can
keep beside the streamed blocks. When the plan's host figure does not fit (``runtime.budget._check_host``), the
load leaves them in the file (the modules keep meta tensors) and each sampling run computes its modulation rows
(``H3Model._block_mods``) from the weights read here one block at a time: a plain read into a buffer of the
tensor's size (``Checkpoint.tensor``: no mmap, nothing kept), converted to the model's AdaLN dtype exactly as the
load converts it into host memory, checked finite and moved to the device. A LoRA merged into an AdaLN weight
(merge mode) is applied on each read by the function the LoRA code registers (``merges``): the same merged weight
the in-memory path would hold, with nothing kept between runs.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from .finite import check_finite

ADALN_KEY = re.compile(r"^blocks\.\d+\.adaln_proj\.linear\.(weight|bias)$")


class AdalnFromFile:
    """The AdaLN weights of ``model``'s blocks read from ``checkpoint`` (a ``runtime.io.checkpoint.Checkpoint``).

    ``merges``: {tensor name: fn(weight on the device) -> merged weight}, set and cleared by ``runtime.lora``."""

    def __init__(self, checkpoint, model):
        self.checkpoint = checkpoint
        self.dtypes = {j: (b.adaln_proj.linear.weight.dtype, b.adaln_proj.linear.bias.dtype)
                       for j, b in enumerate(model.blocks)}
        self.merges: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.reads = 0  # tensors read (a test counts them)

    def names(self, j: int) -> tuple[str, str]:
        return f"blocks.{j}.adaln_proj.linear.weight", f"blocks.{j}.adaln_proj.linear.bias"

    def holds(self, name: str) -> bool:
        """Whether ``name`` (a block AdaLN weight or bias) is read from the file rather than held by the model."""
        return ADALN_KEY.match(name) is not None

    def read(self, j: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block j's AdaLN (weight [6*3*hidden, t_dim], bias) on ``device`` at the model's AdaLN dtypes, merged LoRA
        updates applied."""
        out = []
        for name, dtype in zip(self.names(j), self.dtypes[j]):
            t = check_finite(name, self.checkpoint.tensor(name, "cpu").to(dtype).to(device))
            fn = self.merges.get(name)
            out.append(t if fn is None else fn(t))
            self.reads += 1
        return out[0], out[1]
