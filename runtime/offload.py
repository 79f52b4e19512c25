"""Offload in place: a resident runtime's device memory handed back without dropping the runtime.

ComfyUI unloads a MODEL to make room (for a VAE, another model), but its output cache keeps the loader's outputs,
so the runtime object stays referenced and dropping it frees nothing. ``park(rt)`` moves what the runtime holds
on its CUDA device into host memory *in place* (whoever holds the runtime sees it parked); ``unpark`` puts it back
as it was. What moves:

- every block's linears: into the block streamer's exact-size page-locked host buffers (``BlockStreamer.park``),
  its device slots freed;
- every other parameter and buffer of the model on the device (norms, embeddings, the head, token refiners):
  a host copy replaces it in its module's table; one host copy per tensor shared by several modules;
- the LoRA side paths' down/up matrices;
- the GEMM scratch (it grows again on first use).

The bytes freed are measured by the allocator (``torch.cuda.memory_allocated`` before and after), never
computed from what moved: anything another object still holds on the device stays counted as held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .lora.merge import move_sides

HOST_LEFT_FREE = 2 * 2 ** 30  # page-locked memory cannot be swapped out: an offload leaves at least this much free


def why_not_offload(device_type: str, integrated: bool, need_bytes: int, host_free_bytes: int) -> str | None:
    """Why an offload of ``need_bytes`` would not help or not be safe (None: it would): off CUDA there is no device
    memory to give back; on an integrated GPU (GB10) the device memory is the host memory; and page-locking what the
    host cannot spare (less than HOST_LEFT_FREE left) would push the rest of the process out of memory."""
    if device_type != "cuda":
        return "the model is not on a CUDA device"
    if integrated:
        return "the GPU shares its memory with the host (integrated), so moving the weights frees nothing"
    if need_bytes + HOST_LEFT_FREE > host_free_bytes:
        return (f"it needs {need_bytes / 1e9:.2f} GB of host memory and {host_free_bytes / 1e9:.2f} GB is free "
                f"(at least {HOST_LEFT_FREE / 2 ** 30:.0f} GiB must stay free)")
    return None


@dataclass
class Parked:
    """What :func:`park` moved: the streamed block set to come back to, and (module, table, name, was a Parameter)
    of every other device tensor with its host copy (shared tensors share one copy)."""

    device: torch.device
    streamed: frozenset
    tensors: list = field(default_factory=list)  # (module, table, name, host tensor, param)
    freed_bytes: int = 0
    held_bytes: int = 0  # H3Runtime.device_bytes() before the park


def _host_copies(model: nn.Module, device: torch.device, skip: set) -> list:
    out, seen = [], {}
    for mod in model.modules():
        for table in ("_parameters", "_buffers"):
            for name, t in list(getattr(mod, table).items()):
                if t is None or id(t) in skip or t.device != device:
                    continue
                host = seen.get(id(t))
                if host is None:
                    host = seen[id(t)] = t.detach().to("cpu", copy=True)
                out.append((mod, table, name, host, isinstance(t, nn.Parameter)))
    return out


def _put(entries: list, device: torch.device | None) -> None:
    """Bind each entry's tensor in its module: its host copy (device None) or a device copy of it; an entry shared
    by several modules binds one object in all of them."""
    made = {}
    for mod, table, name, host, param in entries:
        t = made.get((id(host), param))
        if t is None:
            t = host if device is None else host.to(device)
            t = made[(id(host), param)] = nn.Parameter(t, requires_grad=False) if param else t
        getattr(mod, table)[name] = t


def park(rt) -> Parked:
    """Move ``rt``'s device memory to host memory in place (module docstring) -> what moved, with the bytes the
    CUDA allocator freed (0 on the CPU, where the same moves run as copies: nothing is on a device). The runtime
    must not be mid-evaluation; ``H3Runtime.offload`` calls this on CUDA only."""
    dev = torch.device(rt.device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if cuda:
        torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    st = rt.streamer
    parked = Parked(dev, st.streamed, held_bytes=rt.device_bytes())
    try:
        st.park()
        views = {id(v) for parts in st.host.values() for hl in parts.values() for v in hl.views.values()}
        parked.tensors = _host_copies(rt.model, dev, views)
        _put(parked.tensors, None)
        move_sides(rt.model, torch.device("cpu"))
    except BaseException:  # host memory ran out part way (or an interrupt): everything back as it was
        unpark(rt, parked)
        raise
    if rt.plan.scratch is not None:
        rt.plan.scratch.clear()
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        parked.freed_bytes = max(0, before - torch.cuda.memory_allocated(dev))
    return parked


def unpark(rt, parked: Parked) -> None:
    """Undo :func:`park` (or what a failed one did): the model's tensors back on the device, the blocks placed as
    before. Where the device runs out of memory part way, what had moved goes back to host memory (the runtime is
    left as park left it) and the error propagates."""
    try:
        _put(parked.tensors, parked.device)
        move_sides(rt.model, parked.device)
        rt.streamer.unpark(parked.streamed)
    except BaseException:
        _put(parked.tensors, None)
        move_sides(rt.model, torch.device("cpu"))
        rt.streamer.park()
        if parked.device.type == "cuda":
            torch.cuda.empty_cache()
        raise
