"""OpsWrapper: the base of the BlockOps wrappers (``runtime.lora.ops.LoraOps``, ``runtime.ops.stream_ops.StreamOps``).

A wrapper holds ``inner`` (any BlockOps) and a few attributes of its own, listed in the subclass's ``OWN``. Every
member of the ``BlockOps`` interface (runtime.ops.interface) is delegated to ``inner`` explicitly; a subclass
overrides the ones it changes. Nothing else is delegated, and a wrapper refuses to have any other attribute set
on it: state belongs to the ops that declare it (``ops.base`` for the plain ops' state,
``set_ffn_chunk_rows`` / ``set_amax_reduce`` for the declared setters), so wrappers stack in any order and never
shadow or silently pass on what they wrap."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .interface import AttentionFn, BlockOps


class OpsWrapper:
    OWN: tuple[str, ...] = ("inner",)

    def __init__(self, inner: BlockOps, **own):
        object.__setattr__(self, "inner", inner)
        for name, value in own.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        if name not in type(self).OWN:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} of its own (its own: "
                                 f"{', '.join(type(self).OWN)}); a wrapper does not pass writes on: set it on "
                                 f"ops.base, or use the BlockOps setter")
        object.__setattr__(self, name, value)

    # -- the declared state, read from the wrapped ops ---------------------------------------------
    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def attends_exactly(self) -> bool:
        return self.inner.attends_exactly

    @property
    def base(self) -> BlockOps:
        return self.inner.base

    @property
    def ffn_chunk_rows(self) -> int | None:
        return self.inner.ffn_chunk_rows

    @property
    def fc2_dispatcher(self) -> Any:
        return self.inner.fc2_dispatcher

    @property
    def fc2_direct_calls(self) -> int:
        return self.inner.fc2_direct_calls

    @property
    def act_scale(self) -> str | None:
        return self.inner.act_scale

    @property
    def takes_amax_reduce(self) -> bool:
        return self.inner.takes_amax_reduce

    def set_ffn_chunk_rows(self, rows: int | None) -> None:
        self.inner.set_ffn_chunk_rows(rows)

    def set_amax_reduce(self, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.inner.set_amax_reduce(fn)

    def status(self) -> dict:
        return self.inner.status()

    # -- the block's operations, unchanged unless a subclass overrides them ------------------------
    def with_attention(self, fn: AttentionFn) -> BlockOps:  # a subclass re-wraps the copy
        raise NotImplementedError(f"{type(self).__name__}.with_attention")

    def qkv(self, i, blk, x, shift, scale, segs):
        return self.inner.qkv(i, blk, x, shift, scale, segs)

    def norm_rope_(self, blk, qkv, cos, sin):
        return self.inner.norm_rope_(blk, qkv, cos, sin)

    def attention(self, qkv):
        return self.inner.attention(qkv)

    def out_proj(self, i, blk, o):
        return self.inner.out_proj(i, blk, o)

    def gate_add_(self, x, y, gate, segs):
        return self.inner.gate_add_(x, y, gate, segs)

    def fc1(self, i, blk, x, shift, scale, segs):
        return self.inner.fc1(i, blk, x, shift, scale, segs)

    def fc2(self, i, blk, h, lora_active: bool = False):
        return self.inner.fc2(i, blk, h, lora_active=lora_active)
