"""Row sharding of the packed sequence: each rank holds one contiguous share.

Rank r holds global rows ``[r*c, min((r+1)*c, S))`` with ``c = ceil(S / N)``: every rank c rows except the
last, which may hold fewer. The blocks' row-local ops (norms, producers, GEMMs, gates, RoPE) run on exactly
those rows, so the segment tables tile them. Padding to ``S_pad = N * c`` rows (fewer than N, all at the
tail of the sequence) exists only inside the collectives, which need equal shares: the all-to-all send
buffers and the final all-gather. After the all-to-all the sequence is in global order with the padding
last, and attention excludes it exactly by attending the first S rows only.

Segment tables ``[(start, stop, payload)]`` are clipped to a rank's rows and shifted to local indices; a
segment that straddles a boundary appears on both ranks with the same payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


# torch >= 2.12 names it all_gather_single (the old name warns); older torch has only all_gather_into_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class RowShard:
    """Rank ``rank``'s share of ``seq_len`` packed rows split over ``world_size`` ranks."""

    seq_len: int
    world_size: int
    rank: int

    def __post_init__(self):
        if self.seq_len < 1 or self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RowShard(seq_len={self.seq_len}, world_size={self.world_size}, rank={self.rank}): "
                             "expected seq_len >= 1, world_size >= 1, 0 <= rank < world_size")

    @property
    def chunk(self) -> int:
        """Rows per rank, padding included: ceil(S / N)."""
        return -(-self.seq_len // self.world_size)

    @property
    def padded_len(self) -> int:
        return self.chunk * self.world_size

    @property
    def start(self) -> int:
        """First global row of this rank."""
        return self.rank * self.chunk

    @property
    def stop(self) -> int:
        """One past the last REAL global row of this rank (start when it holds only padding)."""
        return max(self.start, min(self.start + self.chunk, self.seq_len))

    @property
    def real_rows(self) -> int:
        return self.stop - self.start

    def local_segments(self, segments) -> list:
        """Global ``[(start, stop, payload)]`` -> this rank's ``[(local_start, local_stop, payload)]``: each
        segment clipped to ``[start, stop)`` and shifted by ``-start``; segments outside are dropped."""
        out = []
        for seg in segments:
            a, b = max(seg[0], self.start), min(seg[1], self.stop)
            if b > a:
                out.append((a - self.start, b - self.start, *seg[2:]))
        return out

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of global ``x [S, ...]`` this rank holds -> ``[real_rows, ...]`` (a new tensor)."""
        if x.shape[0] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} rows (the packed sequence); found {x.shape[0]}")
        return x[self.start:self.stop].clone()

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's RoPE rows ``[real_rows, rope_dim]``."""
        return self.take(cos), self.take(sin)

    def gather(self, x_local: torch.Tensor, group=None) -> torch.Tensor:
        """All ranks' ``[real_rows, ...]`` rows -> the global ``[S, ...]`` on every rank (one all-gather; a
        short last share is padded to ``chunk`` rows for it)."""
        if x_local.shape[0] != self.real_rows:
            raise ValueError(f"expected {self.real_rows} local rows; found {x_local.shape[0]}")
        if self.world_size == 1:
            return x_local
        if self.real_rows != self.chunk:
            x_local = torch.cat([x_local, x_local.new_zeros((self.chunk - self.real_rows, *x_local.shape[1:]))])
        full = x_local.new_empty((self.padded_len, *x_local.shape[1:]))
        _all_gather_single(full, x_local.contiguous(), group=group)
        return full[: self.seq_len]
