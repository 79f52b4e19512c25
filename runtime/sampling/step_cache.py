"""First-Block Cache: step reuse for the block stack. LOSSY when it reuses; off by default.

On every step the first block runs. Its residual change ``r1 = first(x) - x`` is compared with the ``r1`` of
the last step whose blocks were all COMPUTED, by relative L1 (the rule of ParaAttention's and WaveSpeed's
First-Block Cache)::

    rel_l1 = mean |r1 - r1_prev| / mean |r1_prev|        (fp32)

When ``rel_l1 < threshold`` the remaining blocks are skipped and their cached residual is added instead:
``x_out = first(x) + (x_out_prev - first(x)_prev)`` (the residual of the remaining blocks at the last
computed step, in the stream's dtype). Otherwise the remaining blocks run and the cache is refreshed. The
first step of a run always computes. Threshold 0 never reuses (``rel_l1 >= 0``), so its latents are exactly
the uncached ones: the bookkeeping reads the stream but never changes what the blocks compute.

Cost when on: per computed step two copies and two differences of the residual stream (``[S, hidden]`` each;
two of them kept until the next step), and one host sync per step (the reuse decision is made on the host). It does not care which attention backend the
blocks use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import H3Error

__all__ = ["FirstBlockCache"]

Blocks = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class FirstBlockCache:
    """Step reuse over ``first`` (the first block) and ``rest`` (the others). ``threshold >= 0``.

    State per run (``reset``): the last computed step's first-block residual and the remaining blocks'
    residual. ``reused_steps``: the steps whose remaining blocks were skipped; ``rel_l1``: ``{step: value}``
    for every step that had a previous computed step to compare with.
    """

    threshold: float
    reused_steps: list = field(default_factory=list)
    rel_l1: dict = field(default_factory=dict)
    _r1: Optional[torch.Tensor] = None
    _rest: Optional[torch.Tensor] = None

    def __post_init__(self):
        t = float(self.threshold)
        if not (t >= 0.0) or math.isnan(t):
            raise H3Error(f"first-block cache threshold={self.threshold}: expected a number >= 0 (0 = never reuse; "
                          f"peers use about 0.05-0.1)")
        self.threshold = t

    def reset(self) -> None:
        """Forget the cached residuals (call at the start of every sampling run)."""
        self.reused_steps = []
        self.rel_l1 = {}
        self._r1 = None
        self._rest = None

    def _similar(self, step: int, r1: torch.Tensor) -> bool:
        if self._r1 is None:
            return False
        prev = self._r1.float()
        rel = float((r1.float() - prev).abs().mean() / prev.abs().mean().clamp_min(1e-30))
        self.rel_l1[step] = rel
        return rel < self.threshold

    def run(self, step: int, x: torch.Tensor, first: Blocks, rest: Blocks) -> torch.Tensor:
        """The stack's output for residual stream ``x [S, hidden]`` at ``step``: ``rest(first(x))`` or, on a
        reuse, ``first(x) + cached``. ``first`` and ``rest`` may update their input in place."""
        x_in = x.clone()
        x1 = first(x)
        r1 = x1 - x_in
        del x_in
        if self._rest is not None and self._similar(step, r1):
            self.reused_steps.append(step)
            return x1.add_(self._rest)
        self._r1 = r1
        x1_copy = x1.clone()
        out = rest(x1)
        self._rest = out - x1_copy
        return out

    def summary(self) -> dict:
        """Report fields: threshold, reused steps and the rel-L1 of each compared step."""
        return {"threshold": self.threshold, "reused_steps": list(self.reused_steps),
                "rel_l1": {str(k): v for k, v in sorted(self.rel_l1.items())}}
