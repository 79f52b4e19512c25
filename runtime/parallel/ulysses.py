"""Ulysses attention: rows-split -> heads-split around the attention op, one all-to-all each way.

Rank r holds rows ``[r*c, (r+1)*c)`` of every head (:class:`.shard.RowShard`; the last rank may hold fewer,
and its send buffer's tail is zero). Before attention one
all-to-all sends head group j (heads ``[j*H/N, (j+1)*H/N)``) of q, k AND v, as one buffer, to rank j;
rank r then holds every row of its H/N heads as a qkv buffer ``[S_pad, 3*(H/N)*D]`` in the same contiguous
thirds layout ``[q | k | v]`` the single-GPU op reads. The local attention op attends the first S rows
(``seq_len=S``: the padding sits at the tail and is excluded exactly). One all-to-all brings the output
rows home: ``[c, H*D]``, head-major columns like the single-process output.

Bytes per call and rank: ``c*3*H*D`` elements out and in for qkv, ``c*H*D`` for the output; the share
``(N-1)/N`` of each crosses to other ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .shard import RowShard

# inner(qkv [S_pad, 3*h*D], h, D, seq_len=S) -> [S, h*D]: attention of h heads over the first S rows
InnerAttention = Callable[..., torch.Tensor]


@dataclass
class CommStats:
    """All-to-all time and bytes of one run, per step.

    Records are appended without synchronising (CUDA events on GPUs); :meth:`per_step_seconds` reads them
    once at the end. ``bytes_per_call``: elements x element size of the qkv and output buffers a rank hands
    to its two all-to-alls (the same for every call of a run).
    """

    step: int = 0
    calls: int = 0
    bytes_per_call: int = 0
    offrank_bytes_per_call: int = 0
    _records: list = field(default_factory=list)  # (step, start, end): events or perf_counter floats

    def begin(self, device: torch.device):
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def end(self, start, device: torch.device) -> None:
        self._records.append((self.step, start, self.begin(device)))

    def per_step_seconds(self, steps: int) -> list[float]:
        """Seconds spent inside all-to-alls in each step (synchronises CUDA once)."""
        out = [0.0] * steps
        if self._records and not isinstance(self._records[0][1], float):
            torch.cuda.synchronize()
        for s, a, b in self._records:
            if 0 <= s < steps:
                out[s] += (b - a) if isinstance(a, float) else a.elapsed_time(b) / 1e3
        return out

    def per_step_calls(self, steps: int) -> list[int]:
        """Collectives recorded in each step."""
        out = [0] * steps
        for s, _, _ in self._records:
            if 0 <= s < steps:
                out[s] += 1
        return out

    def reset(self) -> None:
        self.step, self.calls = 0, 0
        self._records.clear()


class UlyssesAttention:
    """An attention function over a rank's rows ``qkv [r, 3*H*D] -> [r, H*D]`` that attends the full sequence.

    shard: this rank's RowShard (r = shard.real_rows, at most shard.chunk); inner: the single-device attention op (see
    InnerAttention); group: the process group (None = world); stats: where time and bytes go (optional).
    """

    def __init__(self, shard: RowShard, inner: InnerAttention, group=None, stats: CommStats | None = None):
        self.shard, self.inner, self.group, self.stats = shard, inner, group, stats

    def _exchange(self, inp: torch.Tensor) -> torch.Tensor:
        """One all-to-all of ``inp [N, ...]`` (block j goes to rank j) -> the blocks received, in rank order.
        A world of one exchanges nothing: the buffer is returned as it is (no copy, no collective)."""
        if self.shard.world_size == 1:
            return inp
        out = torch.empty_like(inp)
        st = self.stats
        t0 = st.begin(inp.device) if st is not None else None
        dist.all_to_all_single(out, inp, group=self.group)
        if st is not None:
            st.end(t0, inp.device)
        return out

    def __call__(self, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        n, c, s, r = self.shard.world_size, self.shard.chunk, self.shard.seq_len, self.shard.real_rows
        if heads % n:
            raise ValueError(f"{heads} heads do not split over {n} ranks; the degree must divide the head count")
        if qkv.shape != (r, 3 * heads * head_dim):
            raise ValueError(f"qkv must be [{r}, {3 * heads * head_dim}] (this rank's rows, 3*H*D); "
                             f"found {list(qkv.shape)}")
        hl = heads // n
        # [r, 3, n, hl, D] -> [n, c, 3, hl, D]: block j = head group j of q, k and v, one buffer (zero tail
        # rows when this rank holds fewer than c); no copy at all when n == 1
        parts = qkv.reshape(r, 3, n, hl, head_dim).permute(2, 0, 1, 3, 4)
        if r == c:
            send = parts.contiguous()
        else:
            send = qkv.new_empty((n, c, 3, hl, head_dim))
            send[:, :r] = parts
            send[:, r:] = 0
        recv = self._exchange(send)  # recv[i] = rank i's rows of my head group
        o = self.inner(recv.view(n * c, 3 * hl * head_dim), hl, head_dim, seq_len=s)  # [S, hl*D]
        if n * c == s:
            back = o.contiguous()
        else:
            back = o.new_empty((n * c, hl * head_dim))
            back[:s] = o
            back[s:] = 0
        home = self._exchange(back)  # home[j] = my rows of head group j
        if self.stats is not None and n > 1:  # a world of one hands nothing to a collective
            self.stats.calls += 1
            self.stats.bytes_per_call = (send.numel() + back.numel()) * qkv.element_size()
            self.stats.offrank_bytes_per_call = self.stats.bytes_per_call * (n - 1) // n
        return home.view(n, c, hl, head_dim)[:, :r].permute(1, 0, 2, 3).reshape(r, heads * head_dim)
