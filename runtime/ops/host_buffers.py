"""Host copies of streamed block linears (``runtime.ops.streaming``): every tensor of one linear that streams (its
NVFP4 ``packed`` bytes and ``scales``, or the dense ``weight``) in one exact-size host buffer, page-locked on CUDA,
with the views the module holds between its block's computations."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .linear import Nvfp4Linear

ALIGN = 256  # each tensor's offset in the buffer


def _streamed_names(lin: nn.Module) -> list[tuple[str, str]]:
    """(table, name) of the tensors of a block linear that stream: NVFP4 bytes and scales, or the dense weight."""
    if isinstance(lin, Nvfp4Linear):
        return [("_buffers", "packed"), ("_buffers", "scales")]
    return [("_parameters", "weight")]


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def host_empty(nbytes: int, pin: bool) -> tuple[torch.Tensor, str]:
    """An exact-size host byte buffer, page-locked on CUDA (cudaHostRegister: torch's pinned allocator would
    round each buffer up to a power of two; that allocator where registering fails; pageable where neither can lock
    more memory) -> (buffer, how it is pinned: "registered", "pinned" or "none")."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return buf, "none"
    try:
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(rc) == 0 and buf.is_pinned():
            return buf, "registered"
        if int(rc) == 0:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except (AttributeError, RuntimeError, TypeError):
        pass
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pinned"
    except RuntimeError:  # no page-locked memory left (a locked-memory limit): pageable, its copies synchronous
        return buf, "none"


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_free(buf: torch.Tensor, how: str) -> None:
    if how == "registered" and buf.numel():
        _unregister(buf.data_ptr())


@dataclass
class _Entry:
    table: str
    name: str
    offset: int
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    param: bool  # bound as an nn.Parameter (dense weights)


class HostLinear:
    """One streamed block linear's tensors in one host buffer: ``views`` are what the module holds between
    its blocks' computations; ``version`` changes whenever any of them is written in place."""

    def __init__(self, module: nn.Module, pin: bool):
        self.entries: list[_Entry] = []
        off = 0
        srcs = []
        for table, name in _streamed_names(module):
            t = getattr(module, table)[name]
            n = t.numel() * t.element_size()
            self.entries.append(_Entry(table, name, off, tuple(t.shape), t.dtype, n, table == "_parameters"))
            srcs.append(t)
            off += aligned(n)
        self.nbytes = off
        self.buffer, self.pinned = host_empty(off, pin)
        # the registration ends when this object is released or dropped, before the buffer's memory can be freed
        # (the finalizer holds the buffer): a registration left on freed memory makes later copies from whatever
        # is allocated there fail with "invalid argument"
        self._unpin = weakref.finalize(self, host_free, self.buffer, self.pinned)
        self._unpin.atexit = False
        self.views = {}
        for e, t in zip(self.entries, srcs):
            v = self.view(self.buffer, e)
            v.copy_(t.detach())
            self.views[e.name] = nn.Parameter(v, requires_grad=False) if e.param else v

    @staticmethod
    def view(buf: torch.Tensor, e: _Entry) -> torch.Tensor:
        return buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    @property
    def version(self) -> int:
        return self.buffer._version

    def bind_host(self, module: nn.Module) -> None:
        for e in self.entries:
            getattr(module, e.table)[e.name] = self.views[e.name]

    def holds(self, module: nn.Module) -> bool:
        """True while ``module`` still holds this buffer's views (not replaced by another tensor)."""
        return all(getattr(module, e.table).get(e.name) is self.views[e.name] for e in self.entries)

    def release(self) -> None:
        self._unpin()  # once: a later drop of this object unregisters nothing again
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.views = {}
