"""load_model: plan, stream, bind. A resident H3 model with its BlockOps, ready for ``sample``.

1. ``plan.make_plan``: every backend choice from the device, the options and the checkpoint header (no
   tensor read yet); printed by the callers and copied into every report.
2. ``stream_load``: one pass over a checkpoint (or the embedded tiny state dict) into a model built on the
   meta device, converting or adopting each block linear as it arrives.
3. FC2's guarded dispatcher is prepared (its extension built) only where the plan says FC2 takes NVFP4 bytes;
   the plan's attention is bound once (``ops.registry.bind``: the dense function, and the sparse backend around
   it where chosen), then ``ops.block_ops.build_ops`` binds the block operations the plan chose.

Every choice comes from the plan (its choices and settings, never its options): each block linear is built with
``plan.linear_choices()`` (the GEMM bound in the layer), the producers' tiles are the plan's ``tiles``.

The streaming load. For every tensor, in the model's order: read it (plain reads, never mmap, never unpickle),
check it is finite, then

- a block linear (``blocks.N.{attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2}``) with ``quantize`` on: its
  stored NVFP4 tensors are adopted as they are, or its dense weight (dequantized when stored as fp8/int8)
  is cast to the compute dtype on the device and quantized there (``_nvfp4_linear``, the same quantizer
  ``quantize`` uses); the dense copy is dropped before the next tensor is read;
- a full-form AdaLN projection when the plan keeps AdaLN rows per run: straight into pinned host memory (the plan
  keeps them on the device instead where every block fits beside them: ``budget.adaln_on_device``);
- anything else: onto the device at the parameter's dtype.

Read-ahead (a Checkpoint source; the embedded tiny model is read in place): the pass first lists every source tensor
it will read, in order, and a ``runtime.io.prefetch.ReadAhead`` reads them on worker threads
(``READ_AHEAD_THREADS``) while this thread moves, checks and quantizes the current one. The worker reads the same
bytes ``Checkpoint.tensor`` gives (shards concatenated, layouts changed); for a CUDA device into pinned host memory
(straight into it where the file holds the tensor whole, ``Checkpoint.read_into``), which this thread copies to the
device asynchronously (torch's pinned-memory cache reuses a buffer once its copy is done, and gives the cached pages
back when the pass ends), elsewhere into pageable memory; a full-form AdaLN projection kept in host memory gets its
pinned buffer allocated and read into on the worker, so pinning runs in parallel too. Reads ahead of this thread
hold at most ``READ_AHEAD_BYTES`` of host memory and at most an eighth of the host memory available when the load
starts (one read always runs, whatever its size), beside the tensor in hand. The device sees one tensor at a time,
as without it; the results, the order in which the model's entries are set, the progress callbacks and the errors
are the same: a read's error is raised when the loop reaches that tensor.

Peak device memory during a load is therefore the resident result plus about one source tensor (and the
quantizer's temporaries for it). Errors name the tensor: missing keys, wrong shapes, non-finite values.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from .budget import (DeviceMemory, Held, MemoryAsk, MemoryPlan, ModelMemory, Outside, TowerSize, Workload,
                     BudgetError, adaln_on_device, check_request, decide, gb, host_budget_bytes,
                     parse_vram_budget, plan_memory, streamed_linear_bytes)
from .errors import CheckpointError
from .io.adaln_file import ADALN_KEY, AdalnFromFile
from .io import prefetch
from .io.checkpoint import Checkpoint, dequantize_layer, dequantize_reads
from .io.comfy_quant import from_comfy_quant_tensors
from .io.header import ST_DTYPES
from .io.finite import FiniteChecks
from .io.prefetch import ReadAhead
from .io.verify import check_names_and_shapes, quant_layers
from .lora.merge import side_device_bytes
from .lora.source import checkpoint_stamp
from .model.config import QUANT_LINEARS, H3Config
from .model.h3 import H3Model
from .model.tiny import tiny_state_dict
from .offload import Parked, park, unpark, why_not_offload
from .ops import registry
from .ops.attention import AttentionFn, bind_attention_qkv
from .ops.interface import BlockOps
from .ops.block_ops import build_ops
from .ops.gemm_backends import Scratch
from .ops.linear import Nvfp4Linear, StoredParts
from .ops.sage import bind_sage_kv
from .ops.sparse_attention import SparseStepAttention
from .ops.stream_ops import StreamOps
from .ops.streaming import BlockStreamer, module_device_bytes
from .options import RuntimeOptions
from .pending_load import PRELUDE, PendingLoad, part_of
from .plan import ADALN_ON_DEVICE, Choice, LoadPlan, make_plan
from .sampling.request import host_available_bytes

log = logging.getLogger("h3_blackwell")

Progress = Callable[[int, int, str], None]


class StateDictSource:
    """A ComfyUI-named state dict (the embedded tiny model) behind the checkpoint reading interface."""

    def __init__(self, sd: dict[str, torch.Tensor], name: str, config=None):
        self._sd = sd
        self.name = name
        self.config = config

    def keys(self) -> list[str]:
        return list(self._sd)

    def shape(self, k: str) -> tuple:
        return tuple(self._sd[k].shape)

    def quant_format(self, layer: str) -> dict | None:
        return None

    def tensor(self, k: str, device="cpu") -> torch.Tensor:
        return self._sd[k].to(device)


def _set(model, name: str, value, as_parameter: bool = True) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Module):
        mod._modules[leaf] = value
    elif isinstance(getattr(mod, leaf), torch.nn.Parameter) and as_parameter:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def _nvfp4_linear(layer: str, weight: torch.Tensor | None, shape: tuple[int, int], *, stored: dict | None,
                  kw: dict, metadata: dict | None = None) -> Nvfp4Linear:
    """One block linear as an Nvfp4Linear built with ``kw`` (the plan's linear_choices and the shared scratch):
    adopted from its stored comfy_quant NVFP4 tensors (their format from the layer's marker or the file's
    ``metadata``), or quantized from ``weight`` [N, K] (on its device; the Triton quantizer on CUDA, the reference
    elsewhere: same bytes)."""
    if stored is not None:
        q = from_comfy_quant_tensors(stored, layer, shape=shape, metadata=metadata)
        return Nvfp4Linear(q.weight, stored=StoredParts(stored.get(f"{layer}.bias"), q.input_scale,
                                                        q.pre_quant_scale), **kw)
    return Nvfp4Linear.from_float(weight.detach(), **kw)


# the ``adaln`` choice once a run without room moved the AdaLN weights the plan kept on the device to host memory
ADALN_MOVED_OFF = Choice("rows per run", "modulation rows precomputed per run; full-form AdaLN weights in pinned host "
                                         "memory, moved off the device for a run that needed the room")


# the parts of a load pass's own thread that ``_Loader.phases`` times
LOAD_PARTS = ("waits_for_reads", "reads_here", "copies_issued", "finite_checks", "linears", "adopt",
              "release_staging")


class _Loader:
    """One streaming pass (module docstring). Its reads come from a ``ReadAhead`` where the source is a Checkpoint
    (``_reading``), else straight from the source; ``tensor`` is the reader interface ``dequantize_layer`` takes."""

    def __init__(self, model, src, plan, progress: Progress | None, streamer=None):
        self.model, self.src, self.plan, self.progress = model, src, plan, progress
        self.streamer = streamer  # BlockStreamer: a streamed block's linear moves to host memory once loaded
        self.device, self.dtype = plan.device, plan.dtype
        self.quant = quant_layers(src)
        if plan.scratch is None:
            plan.scratch = Scratch()
        self.linear_kw = dict(plan.linear_choices(), scratch=plan.scratch)
        self.stored = set(plan.stored_nvfp4)
        self.have = set(src.keys())
        self.formats: dict[str, dict] = {}  # a quantized layer's comfy_quant descriptor, read once
        self.host_like: dict[str, torch.Tensor] = {}  # the entries read into host memory: their meta parameters
        self.ahead: ReadAhead | None = None
        # a streamed block's stored linears of each shape: built in host memory (True) or on the device (False), by
        # the canary of ``_host_linear``
        self.host_built: dict[tuple, bool] = {}
        self.built_on_host = False  # the last block linear was built in host memory (its checks are the host's)
        # seconds of this thread per part of the pass (``phases``); the read-ahead threads' own time is its
        # ``read_seconds``. Host clocks: a CUDA copy is asynchronous, and its time lands on the next call that waits
        # for it (the finite check's one boolean, a layer's construction)
        self.seconds = dict.fromkeys(LOAD_PARTS, 0.0)
        self.read_seconds = self.read_bytes = 0
        # finite checks read back once per flush, not once per tensor: flushed before a streamed block's linear
        # leaves the device (adopt; a resident block's linear stays, so nothing waits there), every 32 tensors or
        # 64 MiB (what a queued temporary may keep alive beyond the plan's one source tensor), and at the end of
        # the pass
        self.checks = FiniteChecks()

    @contextmanager
    def _part(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t

    def _finite(self, name: str, t: torch.Tensor) -> torch.Tensor:
        with self._part("finite_checks"):
            return self.checks.add(name, t)

    def _flush_checks(self) -> None:
        with self._part("finite_checks"):
            self.checks.flush()

    def phases(self) -> dict:
        """Where the pass's time went: this thread's seconds per part (``LOAD_PARTS``), and the read-ahead threads'
        summed seconds and bytes (0 where none ran)."""
        return {**{k: round(v, 4) for k, v in self.seconds.items()},
                "read_ahead_thread_seconds": round(self.read_seconds, 4), "read_ahead_bytes": self.read_bytes,
                "streamed_linears_built_in_host_memory": {"x".join(map(str, k)): v for k, v in self.host_built.items()}}

    # -- what each entry reads -------------------------------------------------------------------
    def _format(self, layer: str) -> dict:
        if layer not in self.formats:
            self.formats[layer] = self.src.quant_format(layer) or {"format": "int8_tensorwise"}
        return self.formats[layer]

    def _weight_reads(self, layer: str) -> list[str]:
        return dequantize_reads(layer, self._format(layer)) if layer in self.quant else [layer + ".weight"]

    def _step(self, k: str) -> tuple[str, list[str]]:
        """What the load does with model entry ``k`` -> (step, the source tensors it reads, in its order): "stored"
        (a block linear adopted from its stored NVFP4 parts), "linear" (a block linear quantized from its weight),
        "file" (left in the checkpoint file: each run reads it, ``runtime.io.adaln_file``), "host" (into pinned host
        memory), "tensor" (onto the device), "none" (the source has no tensor for it)."""
        layer = k[:-7] if k.endswith(".weight") else None
        if self.plan.quantize and layer is not None and QUANT_LINEARS.match(layer):
            if layer in self.stored:
                return "stored", [x for x in self.src.keys()
                                  if x.startswith(layer + ".") and x.count(".") == layer.count(".") + 1]
            return "linear", self._weight_reads(layer)
        if self.plan.adaln_from_file and ADALN_KEY.match(k):
            return "file", []
        if self.plan.adaln_on_host and k.startswith("blocks.") and ".adaln_proj." in k:
            return "host", [k]
        if layer is not None and layer in self.quant:
            return "tensor", self._weight_reads(layer)
        return ("tensor", [k]) if k in self.have or k == "rope.inv_freq" else ("none", [])

    # -- reads -----------------------------------------------------------------------------------
    def tensor(self, name: str, device="cpu") -> torch.Tensor:
        """Source tensor ``name`` on ``device`` at its stored dtype: the read-ahead's next read (copied to the device
        asynchronously from pinned memory, ``_read``), or read now where none runs."""
        if self.ahead is None:
            with self._part("reads_here"):
                return self.src.tensor(name, device)
        with self._part("waits_for_reads"):
            t = self.ahead.get(name)
        with self._part("copies_issued"):
            return t.to(device, non_blocking=t.is_pinned())

    def _read(self, name: str) -> torch.Tensor:
        """One read on a read-ahead thread: into new pinned host memory for a "host" entry, and for a tensor bound
        for a CUDA device (its copy then runs asynchronously, and torch's pinned-memory cache hands the buffer to
        a later read once the copy is done), else ``src.tensor``."""
        like = self.host_like.get(name)
        if like is not None:
            return self._read_host(name, like)
        if self.device.type != "cuda":
            return self.src.tensor(name, "cpu")
        dt = ST_DTYPES.get(self.src.dtype_name(name))
        if dt is not None:
            host = torch.empty(self.src.shape(name), dtype=dt, pin_memory=True)
            if self.src.read_into(name, host):
                return host
        return self.src.tensor(name, "cpu").pin_memory()  # shards or a layout change: pinned as read

    def _read_host(self, k: str, like: torch.Tensor) -> torch.Tensor:
        """Tensor ``k`` in new host memory of ``like``'s shape and dtype, pinned where CUDA is available: a
        Checkpoint's ``read_host`` (straight there where the file holds it at that dtype), else read and cast in (an
        in-memory source)."""
        pin = torch.cuda.is_available()
        read_host = getattr(self.src, "read_host", None)
        if read_host is not None:
            return read_host(k, like.dtype, pin)
        return torch.empty(tuple(like.shape), dtype=like.dtype, pin_memory=pin).copy_(self.src.tensor(k, "cpu"))

    def _nbytes(self, name: str) -> int:
        like = self.host_like.get(name)
        if like is not None:
            return like.numel() * like.element_size()
        try:
            return self.src.nbytes(name)
        except CheckpointError:
            return 0  # not in the file: its read raises that error when the loop asks for it

    @contextmanager
    def _reading(self, reads: list[str]):
        """Within: ``tensor`` and ``_to_host`` take ``reads`` (every read of the pass, in order) from a ReadAhead
        over a Checkpoint, bounded by ``READ_AHEAD_BYTES`` and an eighth of the host memory available now. The
        in-memory tiny model (StateDictSource) is read in place."""
        if not isinstance(self.src, Checkpoint) or prefetch.READ_AHEAD_THREADS < 1:
            yield
            return
        cap = min(prefetch.READ_AHEAD_BYTES, host_available_bytes() // 8)
        with ReadAhead(reads, self._read, self._nbytes, cap, prefetch.READ_AHEAD_THREADS) as self.ahead:
            try:
                yield
            finally:
                self.read_seconds, self.read_bytes = self.ahead.read_seconds, self.ahead.read_bytes
                self.ahead = None
                if self.device.type == "cuda":  # the staging buffers' copies are done: give their pages back
                    with self._part("release_staging"):  # this thread's stream: a load behind the first
                        torch.cuda.current_stream(self.device).synchronize()  # step leaves the step's alone
                        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)  # torch >= 2.5; else they
                        if empty_host_cache is not None:                                 # stay cached for later
                            empty_host_cache()                                           # copies

    # -- the steps -------------------------------------------------------------------------------
    def _weight(self, layer: str) -> torch.Tensor:
        """A layer's weight on the device at its stored dtype, dequantized to fp32 where stored quantized; finite."""
        if layer in self.quant:
            w = dequantize_layer(self, layer, self._format(layer), self.device)
        else:
            w = self.tensor(layer + ".weight", self.device)
        return self._finite(layer + ".weight", w)

    def _linear(self, layer: str, shape: tuple, parts: list[str] | None) -> None:
        """A block linear from its stored NVFP4 ``parts``, or (None) quantized from its weight at the compute dtype;
        the dense copy is dropped before the next tensor is read. A stored linear of a streamed block is built in
        host memory (``_host_linear``): its bytes go to their host buffer without a trip to the device."""
        self.built_on_host = False
        if parts is not None and self._on_host_path(layer, shape):
            lin = self._host_linear(layer, shape, parts)
            self.built_on_host = self.host_built[shape]  # else the canary sent it down the device path
            _set(self.model, layer, lin)
            return
        if parts is not None:
            tensors = {x: self.tensor(x, self.device) for x in parts}
            for x, t in tensors.items():
                self._finite(x, t)
            with self._part("linears"):
                lin = _nvfp4_linear(layer, None, shape, stored=tensors, kw=self.linear_kw, metadata=self.src.metadata)
        else:
            w = self._weight(layer).to(self.dtype)
            with self._part("linears"):
                lin = _nvfp4_linear(layer, w, shape, stored=None, kw=self.linear_kw)
            del w
        _set(self.model, layer, lin)

    def _host_linear(self, layer: str, shape: tuple, parts: list[str]) -> Nvfp4Linear:
        """A streamed block's stored NVFP4 linear, built from host tensors (the read-ahead's staging) and
        checked finite there; the tensors that do not stream (global scale, bias, input and pre-quant scales) then
        moved to the device. ``adopt`` copies the streamed bytes into the linear's host buffer: no trip to the
        device and back. The first of each shape is also built on the device and compared byte for byte (the
        canary); a difference sends that shape's linears down the device path (``phases`` says which)."""
        tensors = {x: self.tensor(x, "cpu") for x in parts}
        for x, t in tensors.items():
            self._finite(x, t)
        with self._part("linears"):
            lin = _nvfp4_linear(layer, None, shape, stored=tensors, kw=self.linear_kw, metadata=self.src.metadata)
            for name in ("global_scale", "bias", "input_scale", "pre_quant_scale"):
                t = lin._buffers.get(name)
                if t is not None:
                    lin._buffers[name] = t.to(self.device)
            if shape in self.host_built:  # this shape's canary agreed (``_on_host_path`` sends no other here)
                return lin
            dev = self._device_linear(layer, shape, tensors)
            self.host_built[shape] = all(torch.equal(getattr(lin, n).cpu().reshape(-1).view(torch.uint8),
                                                     getattr(dev, n).cpu().reshape(-1).view(torch.uint8))
                                         for n in ("packed", "scales", "global_scale"))
            if not self.host_built[shape]:
                log.warning("[h3-blackwell] %s: the stored NVFP4 linear built in host memory differs from the "
                            "device's build; streamed linears of shape %s take the device path", layer, shape)
            return lin if self.host_built[shape] else dev

    def _device_linear(self, layer: str, shape: tuple, tensors: dict) -> Nvfp4Linear:
        return _nvfp4_linear(layer, None, shape, stored={x: t.to(self.device) for x, t in tensors.items()},
                             kw=self.linear_kw, metadata=self.src.metadata)

    def _on_host_path(self, layer: str, shape: tuple) -> bool:
        """Whether a stored block linear is built in host memory (``_host_linear``): of a streamed block, and its
        shape not refused by the canary (on the CPU both builds are the host's: the same path, tested)."""
        return self.streamer is not None and self.streamer.streams(layer) and self.host_built.get(shape, True)

    def _to_host(self, k: str, p) -> None:
        """Into pinned host memory (``_read_host``; on a read-ahead thread where one runs, so pinning runs in
        parallel too)."""
        with self._part("waits_for_reads" if self.ahead is not None else "reads_here"):
            host = self.ahead.get(k) if self.ahead is not None else self._read_host(k, p)
        self._finite(k, host)
        _set(self.model, k, host)

    def _tensor(self, k: str, p) -> None:
        layer = k[:-7] if k.endswith(".weight") else None
        t = self._weight(layer) if layer is not None and layer in self.quant else self._finite(
            k, self.tensor(k, self.device))
        _set(self.model, k, t.to(device=self.device, dtype=p.dtype))

    def run(self, pending: PendingLoad | None = None, on_part=None) -> None:
        """The pass. pending: the gates of a load behind the first step (``runtime.pending_load``): the entries are
        taken part by part (the prelude, then each block in order), and each part opens once its tensors are set,
        checked finite and adopted, after ``on_part(part)`` (the caller's per-part work, on this thread)."""
        want = dict(self.model.state_dict(keep_vars=True))
        label = getattr(self.src, "name", None) or self.src.headers[0].path.name
        if not getattr(self.src, "verified", False):  # a checkpoint checked before the load is not checked again
            check_names_and_shapes(want, self.src, self.quant, label, self.plan.config.num_layers)
        steps = [(k, *self._step(k)) for k in want]
        if pending is not None:  # stable: the prelude's entries in the model's order, then block 0, 1, ...
            steps.sort(key=lambda s: part_of(s[0]))
        self.host_like = {k: want[k] for k, step, _ in steps if step == "host"}
        with self._reading([x for _, _, reads in steps for x in reads]):
            for i, (k, step, reads) in enumerate(steps):
                if self.progress:
                    self.progress(i, len(steps), k)
                p = want[k]
                layer = k[:-7] if k.endswith(".weight") else None
                if step in ("stored", "linear"):
                    self._linear(layer, tuple(p.shape), reads if step == "stored" else None)
                elif step == "host":
                    self._to_host(k, p)
                elif step == "tensor":
                    self._tensor(k, p)
                if self.streamer is not None and layer is not None and self.streamer.streams(layer):
                    if not self.built_on_host:  # its checked tensors leave the device: read their flags first
                        self._flush_checks()
                    with self._part("adopt"):
                        self.streamer.adopt(layer, self.model.get_submodule(layer))
                part = part_of(k)
                if pending is not None and (i + 1 == len(steps) or part_of(steps[i + 1][0]) != part):
                    self._flush_checks()
                    self._check_part_set(label, part)
                    if on_part is not None:
                        on_part(part)
                    pending.open(part)
            self._flush_checks()
        self._check_part_set(label, None)

    def _check_part_set(self, label: str, part: int | None) -> None:
        """Raise CheckpointError naming the entries of ``part`` (None: every part) the pass left unset."""
        mod = self.model if part is None else (self.model.blocks[part] if part >= 0 else self.model)
        prefix = "" if part is None or part < 0 else f"blocks.{part}."
        left = [prefix + n for n, t in list(mod.named_parameters()) + list(mod.named_buffers())
                if t.is_meta and not (self.plan.adaln_from_file and ADALN_KEY.match(prefix + n))
                and (part is None or part >= 0 or part_of(n) == PRELUDE)]
        if left:
            raise CheckpointError(f"{label}: no tensor for {left[:5]}")


def stream_load(model, src, plan, progress: Progress | None = None, streamer=None,
                pending: PendingLoad | None = None, on_part=None) -> dict:
    """Fill ``model`` (built on the meta device) from ``src`` (a Checkpoint or StateDictSource) as the load
    plan says (module docstring). ``streamer`` (a BlockStreamer): after each block linear it ``streams``, its
    ``adopt(layer, module)`` moves the linear's bytes to host memory, so the device never holds more than the
    resident blocks plus one layer. pending / on_part: run part by part behind the first step (``_Loader.run``).
    Raises CheckpointError naming the tensor for bad input (the streamer's host buffers made ahead are dropped
    first). -> where its time went (``_Loader.phases``)."""
    loader = _Loader(model, src, plan, progress, streamer)
    try:
        loader.run(pending, on_part)
    except BaseException:
        if streamer is not None:
            streamer.drop_ahead()
        raise
    return loader.phases()


@dataclass
class H3Runtime:
    """A loaded model that stays resident across runs.

    plan: the LoadPlan it was loaded with; ops: the BlockOps every evaluation runs; backends: {op: {"choice",
    "reason"}} (the plan's choices plus what prepare found), copied into every report; attention: the plan's
    dense attention bound once (``qkv [S, 3*H*D] -> [S, H*D]`` for any head count: sequence parallelism runs it
    on a rank's heads), None where the block ops attend exactly (the dense reference).
    """

    model: H3Model
    plan: LoadPlan
    ops: BlockOps
    backends: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    # where load_model's time went: seconds per step ("plan": the plan and its probes; "pass": the streaming pass,
    # with its own parts in "pass_parts"; ...), host clocks (``_Loader.phases``)
    load_phases: dict = field(default_factory=dict)
    fc2: object | None = None  # the guarded FC2 dispatcher, where FC2 takes NVFP4 bytes on CUDA
    sparse: SparseStepAttention | None = None  # the sparse attention bound in ops (attention=sparse): the sampler
    #                                            sets its per-run routing and per-step schedule switch
    streamer: BlockStreamer | None = None  # the streamed blocks of the memory plan (plan.memory); ops binds them
    attention: AttentionFn | None = None
    parked: Parked | None = None  # set while offload() holds the device tensors in host memory
    lora_stack: tuple = ()  # the LoRA stack last applied to this runtime (apply_loras; sync_loras restores it)
    source_stamp: tuple = ()  # the checkpoint files' (path, size, mtime_ns) when the load read them (() for none)
    pending: PendingLoad | None = None  # the pass while it runs behind the first step (``finish_load`` ends it)
    planned_for: Workload | None = None  # the run the load's memory plan was made for
    loaded_behind: bool = False  # the pass ran behind the first step (its tensors were allocated on its stream)

    def finish_load(self) -> None:
        """Wait for a pass running behind the first step (``runtime.pending_load``) and everything queued on its
        blocks (deferred LoRA merges), then drop the gates; nothing when the load ran before. Raises the pass's
        error (the runtime stays unusable: every later call raises it again)."""
        p = self.pending
        if p is None:
            return
        passed = p.finish()
        self.load_phases["pass_parts"] = passed
        self.load_phases["behind_first_step"] = p.summary()
        self.load_phases["streamed_host_buffers_made_ahead"] = self.streamer.made_ahead_report()
        self.model.pending = None
        self.streamer.gate = None
        self.pending = None

    @property
    def config(self) -> H3Config:
        return self.plan.config

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def source(self) -> str:
        return self.plan.source

    @source.setter
    def source(self, value: str) -> None:  # where LoRA merges read source weights from (runtime.lora)
        self.plan.source = value

    def device_bytes(self) -> int:
        """Bytes this runtime holds on its device: the model's parameters and buffers there (a streamed block's
        linears sit in host memory between blocks), the streamer's block buffers, the GEMM scratch as the runs so
        far have grown it, and the LoRA side paths. A Fun ControlNet tower counts its own
        (``FunControl.device_bytes``)."""
        scratch = self.plan.scratch.nbytes() if self.plan.scratch is not None else 0
        streams = 0 if self.streamer is None else self.streamer.device_bytes
        m, dev = self.model, self.device
        if self.pending is not None and self.pending.error is not None:
            raise self.pending.error  # the pass failed: this runtime is unusable
        if self.pending is not None and self.plan.memory is not None:
            # the pass runs behind the first step: what it leaves on the device, by the plan's count (as
            # ``fit_memory`` counts what a loaded model holds), without waiting for it (ComfyUI's model management
            # asks when the loader returns)
            mp = self.plan.memory
            return _weight_device_bytes(ModelMemory.from_plan(self.plan), len(mp.resident), mp.refiner_on_host) \
                + streams + scratch
        return module_device_bytes(m, dev) + streams + scratch + side_device_bytes(m, dev)

    def offload(self) -> int:
        """Hand the device memory back without dropping the runtime (``runtime.offload``) -> the bytes the allocator
        freed: 0 off CUDA, when already offloaded, on an integrated GPU, or when the host cannot spare the memory
        (``offload.why_not_offload``; then nothing moved). Every use that plans a run (``fit_memory``) or calls
        :meth:`onload` puts the weights back first, so a holder of this runtime never sees it half there."""
        self.finish_load()
        if self.parked is not None or self.device.type != "cuda":
            return 0
        why = why_not_offload("cuda", bool(getattr(torch.cuda.get_device_properties(self.device), "is_integrated",
                                                   False)), self.device_bytes(), host_available_bytes())
        if why is not None:
            log.warning("[h3-blackwell] the model stays on the device (not offloaded): %s", why)
            return 0
        try:
            self.parked = park(self)
        except (MemoryError, RuntimeError) as e:  # host memory ran out: park put everything back
            log.warning("[h3-blackwell] offload to host memory failed (%s: %s); the model stays on the device",
                        type(e).__name__, e)
            return 0
        return self.parked.freed_bytes

    def onload(self) -> None:
        """Undo :meth:`offload` (nothing when the runtime was not offloaded): the weights back, placed as before.
        Raises the device's out-of-memory error with the runtime still offloaded (a later call tries again)."""
        self.finish_load()
        if self.parked is not None:
            unpark(self, self.parked)
            self.parked = None

    def check_memory(self, wl: Workload, ask: MemoryAsk, dev: DeviceMemory | None = None,
                     host_free: int | None = None) -> MemoryPlan:
        """The request-time memory check of ``wl`` on this loaded model (``budget.check_request`` with its plan;
        what it holds on the device and in host memory counts as available to it). AdaLN weights the plan keeps on
        the device are checked as ``fit_memory`` would place them for a run without room for them: in host memory.
        While the pass runs behind the first step, the run the load planned for is accepted as the load checked it
        (probing now would count the bytes the pass has yet to allocate as free); any other waits for the pass."""
        if self._load_plan_stands(wl, dev):
            return self.plan.memory
        held = Held(self.device_bytes() if self.parked is None else 0,
                    0 if self.streamer is None else self.streamer.host_bytes)
        host_free = host_budget_bytes(self.plan.host_budget) if host_free is None else host_free
        return check_request(ModelMemory.from_plan(self.plan, placed=False), wl,
                             dev or DeviceMemory.probe(self.device), self.plan.vram_budget, ask, held, host_free)

    def _load_plan_stands(self, wl: Workload, dev: DeviceMemory | None, same_extras: bool = True) -> bool:
        """While the pass runs behind the first step: whether the load's memory decision stands for ``wl``, the very
        run the load planned (no simulated device, nothing beside it the load did not plan: ``same_extras``); probing
        now would count the bytes the pass has yet to allocate as free. Any other request waits for the pass
        (False). False where no pass runs."""
        if self.pending is None:
            return False
        if same_extras and wl == self.planned_for and dev is None and self.pending.error is None:
            return True
        self.finish_load()
        return False

    def describe(self) -> str:
        lines = self.plan.describe().splitlines()
        extra = {k: v for k, v in self.backends.items() if k not in self.plan.report()}
        lines += [f"  {op:<12} {b['choice']:<14} {b['reason']}" for op, b in extra.items()]
        return "\n".join(lines)

    def fit_memory(self, video_shape, audio_shape, text_tokens: int, steps: int, cond=None,
                   device_memory: DeviceMemory | None = None, control=None, sparse=None) -> dict:
        """Plan the device-memory budget again for a sampling run of these latent shapes (``sample`` calls it when
        sampling starts, so ``auto`` sees the memory ComfyUI's text encoder and VAE hold then), move blocks
        between the device and host memory if the decision changed, and return the ``memory`` choice.
        control: the run's loaded Fun ControlNet tower (``FunControl``) or None: its device bytes are already
        held (``auto`` counts them as available again) and are planned like the load's. A tower loaded onto this
        plan that the run leaves out keeps its device bytes, and LoRA side paths hold theirs: both come off a given
        budget. An offloaded runtime (``offload``) is planned as holding nothing and comes back as planned. sparse:
        the run's own SparseSettings (a sampler's or core's node's method; None: the load's), whose sparse path is
        counted. Raises BudgetError (nothing moved) when the budget cannot run this request."""
        plan, st = self.plan, self.streamer
        if plan.memory is None or st is None:
            self.onload()
            return {}
        wl = Workload.from_shapes(video_shape, audio_shape, text_tokens, steps, cond, TowerSize.of(control))
        if self._load_plan_stands(wl, device_memory, control is None and not plan.towers
                                  and (sparse is None or sparse == plan.sparse_settings())):
            self.backends["memory"] = plan.choices["memory"].as_dict()
            return self.backends["memory"]
        dev = device_memory or DeviceMemory.probe(self.device)
        mm = ModelMemory.from_plan(plan)
        if sparse is not None and mm.sparse:
            mm = replace(mm, sparse_method=sparse.method, sparse_token_aug=sparse.token_aug)
        old = plan.memory
        # a loaded tower (FunControl) holds device bytes and, streamed, host bytes; a tower's source none yet
        tower_st = getattr(control, "streamer", None)
        # an offloaded runtime holds nothing on the device: it is planned from there and comes back as planned
        adaln_moved = False
        held = (0 if self.parked is not None else _weight_device_bytes(mm, len(old.resident), self.model.refiner_on_host)
                + st.device_bytes) + (control.device_bytes(self.device) if hasattr(control, "device_bytes") else 0)
        idle = sum(t.device_bytes(self.device) for t in list(getattr(plan, "towers", ())) if t is not control)
        outside = (Outside(idle, "a loaded Fun ControlNet tower this run does not use holds",
                           "or drop that tower (its memory goes once nothing refers to it)"),
                   Outside(side_device_bytes(self.model, self.device), "the LoRA side paths hold",
                           "or apply the LoRAs in merge mode (no device bytes beside the weights)"))
        host_held = st.host_bytes + (0 if tower_st is None else tower_st.host_bytes)
        args = (wl, dev, parse_vram_budget(plan.vram_budget), host_budget_bytes(plan.host_budget))
        if plan.choices["adaln"].choice == ADALN_ON_DEVICE:  # kept there while every block fits beside them
            host_mm = ModelMemory.from_plan(plan, placed=False)
            new = adaln_on_device(host_mm, *args, held=Held(held, host_held), outside=outside)
            if new is None:  # this run needs the room: plan it with AdaLN in pinned host memory, then move them
                new = decide(host_mm, *args, held=Held(held, host_held), outside=outside,
                             unchanged="nothing moved: the model stays loaded as it was")
                if new.adaln_from_file:
                    raise BudgetError(f"this run needs the device memory the {gb(host_mm.adaln_host_bytes)} of AdaLN "
                                      "weights hold, and the host memory cannot hold them; reload the model so that "
                                      "its load plans them in the checkpoint file (nothing moved: the model stays "
                                      "loaded as it was)")
                if self.parked is not None:  # offloaded: their host copies stay when the rest comes back
                    lins = {id(b.adaln_proj.linear) for b in self.model.blocks}
                    self.parked.tensors = [e for e in self.parked.tensors if id(e[0]) not in lins]
                place_adaln(self.model.blocks, self.device, on_host=True)
                for tower in [t for t in plan.towers if not t.curve_form]:  # loaded as the base keeps its AdaLN
                    place_adaln(tower.control_blocks, self.device, on_host=True)
                plan.choices["adaln"], adaln_moved = ADALN_MOVED_OFF, True
        else:
            new = decide(mm, *args, held=Held(held, host_held), outside=outside,
                         unchanged="nothing moved: the model stays loaded as it was")
        if tower_st is not None and new.tower_streams:  # the tower's blocks move too: device -> host first,
            tower_st.restream(range(len(control.places)))  # so that the base's moves find the room
        if self.parked is not None:
            self.parked.streamed = frozenset(new.streamed)
            self.onload()
        moved = (adaln_moved or set(new.streamed) != set(st.streamed)
                 or new.refiner_on_host != self.model.refiner_on_host)
        st.restream(new.streamed)
        place_refiner(self.model, new.refiner_on_host)
        self._give_back_pass_blocks(moved)
        if tower_st is not None and not new.tower_streams:
            tower_st.restream(())
        new.adaln_from_file = new.adaln_from_file or plan.adaln_from_file  # decided at load: the weights stay there
        self.ops.set_ffn_chunk_rows(new.ffn_chunk_rows)
        self.ops.set_attn_chunk_rows(new.attn_chunk_rows, new.attn_kv_form)
        plan.memory = new
        plan.choices["memory"] = new.choice()
        self.backends["memory"] = plan.choices["memory"].as_dict()
        return self.backends["memory"]

    def _give_back_pass_blocks(self, moved: bool) -> None:
        """After weights ``moved`` off the device: a pass behind the first step allocated them on its own stream, and
        the blocks they freed are reused only by that stream's allocations, so give them back for the run's."""
        if moved and self.loaded_behind and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_report(self, peak_allocated_bytes: int | None = None) -> dict | None:
        """The report's ``memory`` block: the budget, resident and streamed blocks, the estimate and the measured
        peak, bytes copied and copy time hidden / exposed per step (since the last call), host bytes."""
        mp = self.plan.memory
        if mp is None:
            return None
        self.finish_load()
        out = mp.report()
        out["peak_allocated_bytes"] = peak_allocated_bytes
        if peak_allocated_bytes:
            out["estimate_over_peak"] = mp.estimate.total / peak_allocated_bytes
        st = self.streamer
        if st is not None and st.order:
            out.update(st.summary())
            out["pinned_host_bytes"] = st.pinned_bytes
            out["stream_buffer_bytes"] = st.device_bytes
        else:
            out.update({"bytes_copied_per_step": 0, "copy_ms_per_step": 0.0, "copy_exposed_ms_per_step": 0.0,
                        "copy_hidden_ms_per_step": 0.0})
        return out


def _weight_device_bytes(mm: ModelMemory, resident_blocks: int, refiner_on_host: bool) -> int:
    """The device bytes of a loaded model's weights by the plan's count: every other tensor and the resident blocks,
    less the token refiner where it waits in host memory (counted in ``other_bytes``)."""
    return mm.other_bytes + resident_blocks * mm.block_bytes - (mm.refiner_bytes if refiner_on_host else 0)


def _prepare_fc2(plan: LoadPlan) -> tuple[object | None, dict | None]:
    """The guarded FC2 dispatcher, prepared before any capture, only where the plan applies it."""
    if not plan.fc2_lt:
        return None, None
    from .fc2.dispatcher import Fc2Dispatcher  # builds/loads the C++ extension: only where FC2 applies

    fc2 = Fc2Dispatcher(plan.cache_dir, strict=plan.fc2_strict)
    prep = fc2.prepare(plan.device)
    reason = prep.get("reason") or "prepared: " + ", ".join(
        f"{k}: {v.get('status', v) if isinstance(v, dict) else v}" for k, v in prep.get("entries", {}).items())
    return fc2, {"choice": plan.choices["fc2_lt"].choice, "reason": reason}


def _place(modules, device: torch.device, on_host: bool) -> None:
    """Move every parameter and buffer of ``modules`` (their own, not their children's) to host memory (``on_host``:
    pinned for a CUDA ``device``, a separate copy on the CPU, so the emulation runs the same path) or to ``device``."""
    for mod in modules:
        for table in ("_parameters", "_buffers"):
            for name, t in list(getattr(mod, table).items()):
                if t is None or t.is_meta:
                    continue
                if on_host:
                    moved = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=device.type == "cuda")
                    moved.copy_(t)
                else:
                    moved = t.to(device)
                getattr(mod, table)[name] = nn.Parameter(moved, requires_grad=False) if table == "_parameters" \
                    else moved


def place_adaln(blocks, device: torch.device, on_host: bool) -> None:
    """Move ``blocks``' full-form AdaLN weights and biases (DiT or control blocks) to pinned host memory
    (``on_host``; a separate copy on the CPU) or to ``device``. A run then computes its modulation rows from the
    copy it brings over (``H3Model._block_mods``, ``model.control._adaln_rows``): the same rows."""
    _place([blk.adaln_proj.linear for blk in blocks], torch.device(device), on_host)


def place_refiner(model: H3Model, on_host: bool) -> None:
    """Keep the token refiner's weights in host memory (pinned on CUDA; a separate copy on the CPU, so the emulation
    runs the same path) or on the model's device, as the memory plan says (``MemoryPlan.refiner_on_host``): it runs
    once per sampling run (``H3Model.refine_text`` brings its weights over for that call)."""
    if model.refiner_on_host == on_host:
        return
    _place(model.token_refiner.modules(), model.device, on_host)
    model.refiner_on_host = on_host


def bind_attention(plan: LoadPlan) -> tuple[AttentionFn, SparseStepAttention | None]:
    """The plan's attention bound once (``ops.registry.bind``) -> (the dense function, the sparse backend around
    it or None). attention=sparse: the kernel plus the dense function for its dense steps."""
    cfg = plan.config
    dense = registry.bind("attention", plan.dense_attention, head_dim=cfg.head_dim, device=plan.device,
                          v_handling=plan.v_handling)
    if plan.attention != "sparse":
        return dense, None
    sparse = registry.bind("attention", "sparse", head_dim=cfg.head_dim, device=plan.device, dtype=plan.dtype,
                           heads=cfg.num_heads, dense=dense, dense_name=plan.dense_attention,
                           settings=plan.sparse_settings())
    return dense, sparse


def load_model(path: str | Path | None = None, options: RuntimeOptions | None = None, tiny_seed: int = 0,
               progress: Callable[[int, int, str], None] | None = None, workload: Workload | None = None,
               device_memory: DeviceMemory | None = None, for_sampling: bool = False) -> H3Runtime:
    """Load an H3 DiT (or the embedded tiny model when ``path`` is None, or an in-memory tensor source, see
    ``plan.make_plan``): plan, stream, bind (module docstring). workload: the run the memory budget is planned
    for (``runtime.budget.Workload``; default the model's default request); device_memory: a simulated device
    for the memory plan (tests); for_sampling: the caller only samples with the runtime, so ``load_behind`` auto may
    run the pass behind the first step (``load_behind_choice``; then ``finish_load`` before reading its tensors
    directly). Raises CheckpointError with the problem named for bad files, BudgetError
    (before any tensor is read) when the device-memory budget cannot run the workload."""
    options = options or RuntimeOptions.from_env()
    t0 = time.perf_counter()
    marks = [t0]
    plan = make_plan(path, options, tiny_seed)
    plan_memory(plan, workload, device_memory)
    marks.append(time.perf_counter())
    backends = plan.report()
    model = H3Model(plan.config, plan.dtype, device="meta")
    src = plan.checkpoint if path is not None else StateDictSource(
        tiny_state_dict(plan.config, tiny_seed, plan.dtype), plan.source, plan.config)
    streamer = BlockStreamer(model.blocks, plan.memory.streamed, plan.device, plan.memory.slots)
    stamp = checkpoint_stamp(src) if hasattr(src, "headers") else ()
    marks.append(time.perf_counter())
    if plan.quantize:  # the streamed NVFP4 linears' page-locked host buffers, made beside the reads
        streamer.expect_host_buffers(lambda n, k: streamed_linear_bytes(n, k, True, 0))
    if plan.adaln_from_file:
        model.adaln_source = AdalnFromFile(plan.checkpoint, model)
    behind, why_behind = load_behind_choice(plan.load_behind, plan.device, isinstance(src, Checkpoint), for_sampling)
    if behind and streamer.order and not plan.quantize:
        behind, why_behind = False, "the dense reference stack streams blocks: its slots are sized by the pass"
    backends["load"] = {"choice": "behind the first step" if behind else "before the first step",
                        "reason": why_behind}
    if behind:
        pending = _start_behind(model, src, plan, streamer, progress)
        marks.append(time.perf_counter())
        passed = {}
    else:
        pending = None
        passed = stream_load(model, src, plan, progress, streamer)
        marks.append(time.perf_counter())
        streamer.finish()
        place_refiner(model, plan.memory.refiner_on_host)
        model.eval().requires_grad_(False)
    marks.append(time.perf_counter())
    fc2, fc2_report = _prepare_fc2(plan)
    if fc2_report is not None:
        backends["fc2_lt"] = fc2_report
    dense, sparse = bind_attention(plan)
    base = build_ops(plan, sparse or dense, fc2)
    base.sparse = sparse  # the blocks ask it which of them run sparse now
    if sparse is None:  # the dense backend's row form, for the memory plan's query-row chunks
        base.attention_rows_fn = bind_attention_qkv(plan.dense_attention, plan.config.head_dim, device=plan.device,
                                                    v_handling=plan.v_handling)
        base.sage_kv_kernels = bind_sage_kv(plan.dense_attention, plan.v_handling)
    base.set_attn_chunk_rows(plan.memory.attn_chunk_rows, plan.memory.attn_kv_form)
    ops = StreamOps(base, streamer, plan.memory.ffn_chunk_rows)
    rt = H3Runtime(model, plan, ops, backends, fc2=fc2, sparse=sparse, streamer=streamer,
                   attention=None if base.attends_exactly else dense, source_stamp=stamp, pending=pending,
                   planned_for=workload or Workload.for_request(plan.config), loaded_behind=pending is not None)
    marks.append(time.perf_counter())
    rt.load_seconds = marks[-1] - t0
    steps = dict(zip(("plan", "model_and_source", "pass" if pending is None else "pass_started",
                      "streamer_and_placement", "fc2_and_ops"), (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
    rt.load_phases = {**steps, "pass_parts": passed,
                      "streamed_host_buffers_made_ahead": streamer.made_ahead_report()}
    return rt


def load_behind_choice(setting: str, device: torch.device, from_file: bool, for_sampling: bool
                       ) -> tuple[bool, str]:
    """Whether ``load_model`` runs its pass behind the first step (``runtime.pending_load``) -> (yes, why).
    auto: for a caller that only samples with the model (``for_sampling``: ``ModelSpec.load``, which the CLI, the job
    runner, the nodes and the benches use), on CUDA, from a checkpoint file (the pass's copies then run on a stream
    of their own beside the step's kernels). A direct ``load_model`` call gets the whole model before it returns
    (its caller may read the tensors at once); the embedded tiny model and the CPU have nothing to overlap."""
    if setting == "on":
        return True, "load_behind=on: the pass runs on a worker thread; each block opens when its tensors are checked"
    if setting == "off":
        return False, "load_behind=off"
    if not for_sampling:
        return False, ("auto: load_model called directly (its caller may read the tensors at once); ModelSpec.load "
                       "runs the pass behind the first step")
    if device.type != "cuda":
        return False, "auto: not CUDA (no copy stream to overlap the pass with the first step)"
    if not from_file:
        return False, "auto: not a checkpoint file (the embedded tiny model or tensors in memory: nothing to read)"
    return True, ("auto: CUDA and a checkpoint file: the pass runs on a worker thread and its own stream; the first "
                  "step waits for each block only where the pass has not reached it yet")


def _start_behind(model: H3Model, src, plan: LoadPlan, streamer: BlockStreamer, progress: Progress | None
                  ) -> PendingLoad:
    """Start the pass behind the first step (``runtime.pending_load``): the streamed blocks' device slots made now
    at the plan's sizes (the first step may reach one before the pass ends), the refiner placed once the prelude is
    set, the streamer finished at the end of the pass (on its thread). ``progress`` hears the start only: the pass's
    thread never calls into the caller's progress bar."""
    pending = PendingLoad(len(model.blocks), plan.device)
    if plan.quantize:
        streamer.alloc_slots_for(lambda n, k: streamed_linear_bytes(n, k, True, 0))

    def on_part(part: int) -> None:
        if part == PRELUDE:
            place_refiner(model, plan.memory.refiner_on_host)

    def run(p: PendingLoad) -> dict:
        passed = stream_load(model, src, plan, None, streamer, pending=p, on_part=on_part)
        streamer.finish(behind=True)
        model.eval().requires_grad_(False)
        if plan.device.type == "cuda":  # the pass's own temporaries, cached for its stream alone: given back
            torch.cuda.empty_cache()  # (after the pass's work: emptying the cache synchronizes the device)
        return passed

    model.eval().requires_grad_(False)
    model.pending = pending
    streamer.gate = pending.block
    if progress is not None:
        progress(0, 1, "the load runs behind the first step")
    pending.start(run)
    return pending
