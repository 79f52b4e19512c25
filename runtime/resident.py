"""The resident model: one owner of a loaded ``H3Runtime`` and of its lifecycle (load, release, reload, offload).

A host that keeps a model loaded across requests (the ComfyUI loader and the ``MODEL`` it hands to core's
samplers) holds one :class:`ResidentModel`; everything that evaluates the model asks it for the runtime
(:meth:`ResidentModel.runtime`), which reads the file again after a release and moves offloaded weights back.
The handle also holds the model's per-call evaluator (``call``, a ``ModelCall``) and the Fun ControlNet towers
loaded beside the runtime on its device, so that a release drops all of them at once.

Release (:meth:`ResidentModel.release`) drops the handle's reference. When that was the last one, the runtime's
device memory goes and the next use reads the file again. When something else still holds the runtime (a host's
cache of its own outputs), dropping it would free nothing: the runtime then stays this handle's and is offloaded
in place to host memory (``H3Runtime.offload``) until its next use.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Callable

import torch

from .errors import H3Error
from .load import H3Runtime
from .sampling.model_call import ModelCall

log = logging.getLogger("h3_blackwell")


class ResidentModel:
    """The one owner of a resident H3 runtime.

    rt: the loaded runtime (None: read it at the first :meth:`runtime`); open: ``() -> H3Runtime`` that reads it
    (again), None where the model cannot be read again once released. ``size`` is the bytes the model holds on its
    device when it is there (``H3Runtime.device_bytes`` plus the towers in ``towers``), measured by :meth:`measure`
    and kept while released or offloaded (what it will hold once back). ``towers``: key -> an object with
    ``device_bytes(device)`` (a Fun ControlNet tower and what it was loaded for) held beside the runtime; dropped
    on release.
    """

    def __init__(self, rt: H3Runtime | None = None, open: Callable[[], H3Runtime] | None = None):
        if rt is None and open is None:
            raise H3Error("ResidentModel needs a loaded runtime or a way to open one (open=...); got neither")
        self._rt, self._open = (rt if rt is not None else open()), open
        self.towers: dict = {}
        self.call = ModelCall(self._rt)
        rt = self._rt
        # an offloaded runtime counts what it held on the device: what it holds once back
        self.size = rt.parked.held_bytes if rt.parked is not None else rt.device_bytes()
        self.config, self.dtype, self.device = rt.config, rt.dtype, rt.device

    @property
    def loaded(self) -> H3Runtime | None:
        """The runtime this handle holds now (on the device or offloaded), None once released; never loads."""
        return self._rt

    @property
    def resident(self) -> bool:
        return self._rt is not None

    @property
    def offloaded(self) -> bool:
        """The runtime is this handle's but its weights are in host memory (``H3Runtime.offload``)."""
        return self._rt is not None and self._rt.parked is not None

    def runtime(self) -> H3Runtime:
        """The runtime on its device: read again when it was released, moved back when it was offloaded."""
        if self._rt is None:
            if self._open is None:
                raise H3Error("the H3 model was released and this handle cannot read it again (it was made over a "
                              "loaded runtime, without a file to open); load the model again")
            self._rt = self._open()
            self.call = ModelCall(self._rt)
            log.info("[h3-blackwell] H3 model read again after its release")
        elif self._rt.parked is not None:
            self._rt.onload()
            log.info("[h3-blackwell] H3 model back on the device")
        return self._rt

    def measure(self) -> None:
        """``size`` from the runtime and the towers it holds now (kept while released or offloaded)."""
        rt = self._rt
        if rt is not None and rt.parked is None:
            self.size = rt.device_bytes() + sum(t.device_bytes(rt.device) for t in self.towers.values())

    def release(self) -> int:
        """Drop the runtime -> the bytes that freed: ``size`` when this handle held the last reference. When
        something else still holds it, the runtime stays this handle's and is offloaded in place (its weights to
        host memory until the next use); the bytes the allocator freed are returned (0 where it cannot offload).
        The last run's record (``call.last_run``) stays readable while the runtime stays."""
        if self._rt is None:
            return 0
        self.call.end_run()
        last = self.call.last_run
        ref = weakref.ref(self._rt)
        self._rt, self.call, self.towers = None, ModelCall(None), {}
        gc.collect()
        held = ref()
        if held is None:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log.info("[h3-blackwell] H3 model released")
            return self.size
        self._rt, self.call = held, ModelCall(held)
        self.call.last_run = last
        freed = held.offload()
        if self.offloaded:
            log.info("[h3-blackwell] H3 model offloaded to host memory (%.2f GB of device memory freed): another "
                     "holder keeps it (the loader's H3_MODEL output or an H3 LoRA output, cached by ComfyUI); its "
                     "next use moves it back", freed / 1e9)
        else:
            log.info("[h3-blackwell] H3 model not released: another holder keeps it and it was not offloaded; its "
                     "device memory stays in use")
        return freed
