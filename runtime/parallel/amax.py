"""The all-reduce that makes W4A4's dynamic activation scales independent of the sharding.

An NVFP4 activation with a dynamic scale takes one global scale per tensor, ``amax(|x|) / 2688``, over all of
its rows. Split over ranks, each rank holds some rows only; :class:`AmaxAllReduce` is the ``amax_reduce`` the
producers call (``runtime.ops.nvfp4_producers``): this rank's amax (fp32 ``[]`` on the device) -> the max over
the ranks of the group, so every rank quantizes its rows with the scale the single process computes, and the
NVFP4 bytes of every row are the single-process bytes. One all-reduce (MAX) of one fp32 per quantized linear
with a dynamic scale: four per block and evaluation (qkv, out_proj, fc1, fc2). MAX is exact and
order-independent, so the result is the same bits on every rank. No host sync: the value stays on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ulysses import CommStats

AMAX_BYTES = 4  # one fp32 per call


class AmaxAllReduce:
    """``amax_reduce`` for the NVFP4 producers over ``group`` (None = world). Each call is one all-reduce MAX of
    one fp32, timed into ``stats`` (a CommStats: calls, per-step seconds) like the all-to-alls."""

    def __init__(self, group=None, stats: CommStats | None = None):
        self.group, self.stats = group, stats

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        t = amax.detach().reshape(1).float().clone()  # the input stays as the caller had it
        st = self.stats
        t0 = st.begin(t.device) if st is not None else None
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if st is not None:
            st.end(t0, t.device)
            st.calls += 1
            st.bytes_per_call = AMAX_BYTES
        return t.reshape(())
