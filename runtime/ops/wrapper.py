"""OpsWrapper: the base of the BlockOps wrappers (``runtime.lora.ops.LoraOps``, ``runtime.ops.streaming.StreamOps``).

A wrapper holds ``inner`` (any BlockOps) and a few attributes of its own, listed in the subclass's ``OWN``. Reading
an attribute it does not define reads the inner ops' (``fc2_direct_calls``, ``act_scale``, ...); setting one that
is not its own sets the inner ops' (``fc2_dispatcher``, ``amax_reduce``), so a wrapper never shadows the state it
wraps and wrappers stack in any order."""

from __future__ import annotations


class OpsWrapper:
    OWN: tuple[str, ...] = ("inner",)

    def __init__(self, inner, **own):
        object.__setattr__(self, "inner", inner)
        for name, value in own.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name.startswith("__") or name in type(self).OWN:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in type(self).OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)
