"""The holder of K and V of every row for attention over query-row chunks (``DiTBlock._attend_in_row_chunks``).

Two forms, chosen by the memory plan (``MemoryPlan.attn_kv_form``) and bound on the ops
(``rows_kv``): ``bf16`` keeps K and V at the compute dtype ([S, 2*H*D]) and attends through the dense
backend's row form (row-exact where the backend is: ``ops.attention.row_exactness``); ``sage`` keeps them once
as SageAttention2's sm_90 operands (``ops.sage_kv.SageKV``: half the bytes, and no per-chunk copies).

A holder has ``passes`` (the block's passes over all rows before any chunk attends: ``observe`` then ``seal``,
and ``store``), ``store(a, k, v)`` for the rows from ``a`` (128-aligned), and ``attend(q) -> o``; k, v, q and o
are [m, H*D] at the compute dtype."""

from __future__ import annotations

from typing import Callable

import torch

from .interface import KV_FORMS, BlockOps
from .sage_kv import SageKV


class Bf16KV:
    """K and V of ``rows`` rows at their own dtype, in one [rows, 2*H*D] buffer (made at the first store);
    ``attention_rows(q, k, v)``: the dense backend's row form."""

    passes = ("store",)

    def __init__(self, rows: int, attention_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
        self.rows, self.attention_rows, self.kv = rows, attention_rows, None

    @staticmethod
    def nbytes(rows: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
        return rows * 2 * heads * head_dim * dtype_bytes

    def store(self, a: int, k: torch.Tensor, v: torch.Tensor) -> None:
        w = k.shape[1]
        if self.kv is None:
            self.kv = k.new_empty(self.rows, 2 * w)
        self.kv[a:a + k.shape[0], :w] = k
        self.kv[a:a + k.shape[0], w:] = v

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        w = q.shape[1]
        return self.attention_rows(q, self.kv[:, :w], self.kv[:, w:])


def rows_kv(ops: BlockOps, rows: int, heads: int, head_dim: int, dtype: torch.dtype, device):
    """The holder of K and V of ``rows`` rows for ``ops``' query-row chunks, in ``ops.attn_kv_form``."""
    if ops.attn_kv_form == "sage":
        return SageKV(rows, heads, head_dim, dtype, device, ops.sage_kv_kernels, head_dim ** -0.5)
    return Bf16KV(rows, ops.attention_rows)


__all__ = ["Bf16KV", "KV_FORMS", "rows_kv"]
