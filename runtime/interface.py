"""The runtime object ``nodes/`` and ``cli/`` hold: an ``H3Runtime`` (``load_model``) or a ``LoraView`` of one
(the "H3 LoRA" node's output). ``Runtime`` is its typing.Protocol: what a node pack or script may read and call;
everything else of ``H3Runtime`` is the runtime's own (the sampler and the memory plan use it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .model.config import H3Config
from .ops.interface import BlockOps


@runtime_checkable
class Runtime(Protocol):
    """config: the model's H3Config; device / dtype: where and at what compute dtype it runs; plan: the
    ``LoadPlan`` it was loaded with; model: the resident ``H3Model``; ops: its bound ``BlockOps``; backends:
    {op: {"choice", "reason"}} as every report carries them; lora_stack: the LoRA stack this object wants the
    shared model to carry (``sync_loras`` makes it so: an explicit call, never a side effect of reading);
    check_memory: the request-time memory check (``runtime.budget.check_request``) on this loaded model."""

    @property
    def config(self) -> H3Config: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def plan(self) -> Any: ...
    @property
    def model(self) -> Any: ...
    @property
    def ops(self) -> BlockOps: ...
    @property
    def backends(self) -> dict: ...
    @property
    def lora_stack(self) -> tuple: ...

    def describe(self) -> str: ...
    def device_bytes(self) -> int: ...
    def fit_memory(self, video_shape, audio_shape, text_tokens: int, steps: int, cond=None, device_memory=None,
                   control=None, sparse=None) -> dict: ...
    def offload(self) -> int: ...
    def onload(self) -> None: ...
    def check_memory(self, wl, ask, dev=None, host_free=None) -> Any: ...


__all__ = ["Runtime"]
