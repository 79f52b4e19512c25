"""What a job loads, checked once: :class:`ModelSpec` and :func:`open_model`.

A spec holds the opened checkpoint (its headers read once, every tensor name and shape checked once by
``io.verify``), its config, the options resolved for this machine and the LoRAs to apply; ``spec.load()``
plans and loads from that opened checkpoint (``plan.make_plan`` takes it as it is), so nothing is read or
checked twice. The generate and forward jobs (``runtime.job``, ``runtime.forward``) carry one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .budget import DeviceMemory, MemoryAsk, MemoryPlan, ModelMemory, Workload, check_request, host_budget_bytes
from .io.checkpoint import Checkpoint, open_checkpoint
from .io.verify import check_checkpoint
from .load import H3Runtime, load_model
from .lora.apply import apply_loras
from .lora.spec import as_spec, parse_lora_arg
from .model.config import TINY, H3Config
from .options import RuntimeOptions
from .plan import memory_choices, resolve_device, resolve_dtype
from .sampling.request import SEED_RANGE, RequestError, approx_param_bytes, check_int



@dataclass
class ModelSpec:
    """What to load, checked. source: the opened checkpoint (headers read once, every name and shape checked),
    an in-memory tensor source (``plan.make_plan``: the benches' random weights), or None for the embedded tiny
    model; device / dtype: what the options resolve to here; weight_bytes: the weights' size as stored
    (the files' bytes, or an estimate from the config); loras: LoraSpecs applied after the load."""

    source: object | None
    config: H3Config
    options: RuntimeOptions
    device: torch.device
    dtype: torch.dtype
    tiny_seed: int = 0
    loras: tuple = ()
    weight_bytes: int = 0

    def check_memory(self, wl: Workload, ask: MemoryAsk, dev: DeviceMemory | None = None,
                     host_free: int | None = None) -> MemoryPlan:
        """The request-time memory check of ``wl`` before the load (``budget.check_request``; the model's memory
        from the options, ``ModelMemory.for_options``); dev / host_free: simulated (tests), default measured."""
        choices = memory_choices(self.options, self.config, self.device)
        mm = ModelMemory.for_options(self.config, choices, self.dtype).with_source(self.source)
        host_free = host_budget_bytes(choices["host_budget"]) if host_free is None else host_free
        return check_request(mm, wl, dev or DeviceMemory.probe(self.device), choices["vram_budget"], ask,
                             host_free=host_free)

    def load(self, progress: Callable[[int, int, str], None] | None = None, device: str | None = None,
             workload: Workload | None = None) -> H3Runtime:
        """plan -> streaming load -> LoRAs (``device``: another device of the same kind, a rank's). The plan and
        the load reuse the opened checkpoint; nothing is read or checked twice. progress(done, total, name) per
        tensor; workload: the run the device-memory budget is planned for (``runtime.budget``)."""
        opts = self.options if device is None else dataclasses.replace(self.options, device=device)
        rt = load_model(self.source, opts, tiny_seed=self.tiny_seed, progress=progress, workload=workload,
                        for_sampling=True)
        if self.loras:
            apply_loras(rt, self.loras)
        return rt


def runtime_options(options: RuntimeOptions | Mapping[str, Any] | None = None) -> RuntimeOptions:
    """``options`` as RuntimeOptions: as given, or the keyword overrides (flags, widgets; None values ignored)
    over the ``H3_*`` environment. A bad value is a RequestError naming it."""
    if isinstance(options, RuntimeOptions):
        return options
    try:
        return RuntimeOptions.from_env(**dict(options or {}))
    except ValueError as e:
        raise RequestError(f"{e}; fix the flag or the H3_* environment variable") from None


def open_source(model) -> tuple[object | None, H3Config, int]:
    """(source, config, weight bytes) of a checkpoint path (headers only), an in-memory source, or None."""
    if model is None:
        return None, TINY, approx_param_bytes(TINY)
    if hasattr(model, "tensor"):  # an opened Checkpoint or an in-memory source
        heads = getattr(model, "headers", ())
        size = sum(Path(h.path).stat().st_size for h in heads) if heads else approx_param_bytes(model.config, 2)
        return model, model.config, size
    if not Path(model).exists():
        raise RequestError(f"model file not found: {model}")
    ck = open_checkpoint(model)
    return ck, ck.config, sum(Path(h.path).stat().st_size for h in ck.headers)


def source_files(source) -> list[str]:
    """The files a checkpoint source is read from (the path it was opened with, and every shard); [] for an
    in-memory source or the embedded tiny model."""
    if not isinstance(source, Checkpoint):
        return []
    return [source.name, *(str(h.path) for h in source.headers)]


def verify_source(source) -> None:
    """Every tensor name and shape of a checkpoint from its headers, once (an in-memory source is the caller's)."""
    if isinstance(source, Checkpoint) and not source.verified:
        check_checkpoint(source)


def open_model(model=None, options: RuntimeOptions | Mapping[str, Any] | None = None, tiny_seed: int = 0,
               loras=()) -> ModelSpec:
    """What to load, checked before any weight is read: ``model`` a checkpoint path (its headers read once,
    every name and shape checked), an opened Checkpoint, an in-memory tensor source, or None (the embedded tiny
    model); the options resolved for this machine; ``loras`` as LoraSpecs or ``FILE:STRENGTH[:MODE]``."""
    source, cfg, weight_bytes = open_source(model)
    check_int("tiny_seed", tiny_seed, *SEED_RANGE)
    opts = runtime_options(options)
    device = resolve_device(opts)
    verify_source(source)
    loras = lora_specs(loras)
    dtype = resolve_dtype(opts, device)
    return ModelSpec(source, cfg, opts, device, dtype, tiny_seed, loras, weight_bytes)


def lora_specs(loras) -> tuple:
    """LoraSpecs from LoraSpecs or ``FILE:STRENGTH[:MODE]`` strings (the CLI's ``--lora``; the file must exist)."""
    return tuple(parse_lora_arg(s) if isinstance(s, str) else as_spec(s) for s in loras)
