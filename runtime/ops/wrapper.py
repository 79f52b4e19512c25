"""OpsWrapper: the base of the BlockOps wrappers (``runtime.lora.ops.LoraOps``, ``runtime.ops.stream_ops.StreamOps``).

A wrapper holds ``inner`` (any BlockOps) and a few attributes of its own, listed in the subclass's ``OWN``. Every
member of the ``BlockOps`` interface (runtime.ops.interface) is delegated to ``inner`` by name (``DELEGATED``)
or by a declared setter; a subclass overrides the ones it changes and defines ``with_attention``. Nothing else is delegated, and a wrapper refuses to have any other attribute set
on it: state belongs to the ops that declare it (``ops.base`` for the plain ops' state,
``set_ffn_chunk_rows`` / ``set_amax_reduce`` for the declared setters), so wrappers stack in any order and never
shadow or silently pass on what they wrap."""

from __future__ import annotations

from typing import Callable

import torch

from .interface import BlockOps


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

    def set_ffn_chunk_rows(self, rows: int | None) -> None:
        self.inner.set_ffn_chunk_rows(rows)

    def set_attn_chunk_rows(self, rows: int | None, kv_form: str = "bf16") -> None:
        self.inner.set_attn_chunk_rows(rows, kv_form)

    def set_amax_reduce(self, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.inner.set_amax_reduce(fn)


class _FromInner:
    """A BlockOps member of a wrapper that is the wrapped ops' own (read on each access, never copied)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.inner, self.name)


# The BlockOps members (runtime.ops.interface) a wrapper takes from the ops it wraps unless its class overrides them:
# the declared state and the block's operations. Everything else is neither read nor written through a wrapper.
DELEGATED = ("name", "attends_exactly", "base", "ffn_chunk_rows", "attn_chunk_rows", "attn_kv_form", "attention_rows",
             "sage_kv_kernels", "fc2_dispatcher",
             "fc2_direct_calls", "act_scale", "takes_amax_reduce", "sparse", "status", "qkv", "norm_rope_", "attention",
             "out_proj", "gate_add_", "fc1", "fc2")
for _member in DELEGATED:
    setattr(OpsWrapper, _member, _FromInner(_member))
del _member
