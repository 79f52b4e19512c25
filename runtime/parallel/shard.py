"""Row sharding of the packed sequence: each rank holds one contiguous share.

The S packed rows are padded at the END to ``S_pad = N * ceil(S / N)``; rank r holds global rows
``[r*c, (r+1)*c)`` with ``c = S_pad / N``. Real rows stop at S, so the padding (fewer than N rows) sits at
the tail of the last rank(s): after the all-to-all the sequence is back in global order with the padding
last, and attention excludes it exactly by attending the first S rows only. Padding rows belong to no
segment, so modulation and gating never touch them; they stay zero through the blocks.

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

    def take(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Rows of global ``x [S, ...]`` this rank holds -> ``[chunk, ...]`` (a new tensor; padding = ``fill``)."""
        if x.shape[0] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} rows (the packed sequence); found {x.shape[0]}")
        out = x.new_full((self.chunk, *x.shape[1:]), fill)
        out[: self.real_rows] = x[self.start:self.stop]
        return out

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's RoPE rows ``[chunk, rope_dim]``; padding rows get cos 1, sin 0 (the identity rotation)."""
        return self.take(cos, 1.0), self.take(sin, 0.0)

    def gather(self, x_local: torch.Tensor, group=None) -> torch.Tensor:
        """All ranks' ``[chunk, ...]`` rows -> the global ``[S, ...]`` on every rank (one all-gather)."""
        if x_local.shape[0] != self.chunk:
            raise ValueError(f"expected {self.chunk} local rows; found {x_local.shape[0]}")
        if self.world_size == 1:
            return x_local[: self.seq_len]
        full = x_local.new_empty((self.padded_len, *x_local.shape[1:]))
        _all_gather_single(full, x_local.contiguous(), group=group)
        return full[: self.seq_len]
