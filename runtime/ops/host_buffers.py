"""Host copies of streamed block linears (``runtime.ops.streaming``): every tensor of one linear that streams (its
NVFP4 ``packed`` bytes and ``scales``, or the dense ``weight``) in one exact-size host buffer, page-locked on CUDA,
with the views the module holds between its block's computations."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Hashable, Iterable

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

    def __init__(self, module: nn.Module, pin: bool, ahead: "BuffersAhead | None" = None, key: Hashable = None):
        """``ahead``: where a buffer made earlier for ``key`` may wait (``BuffersAhead``); it is used where its size
        is this linear's, else a new one is made here."""
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
        made = ahead.take(key, off) if ahead is not None else None
        self.buffer, self.pinned = made if made is not None else host_empty(off, pin)
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


class BuffersAhead:
    """Exact-size host buffers (``host_empty``) made in a given order on one worker thread, before they are asked for.

    Page-locking is the costly part of a streamed block's host copy: ``cudaHostRegister`` faults in and locks every
    page of the new buffer. Made here, that runs beside the load's reads and copies instead of inside its main
    thread. ``sizes``: (key, bytes) in the order they will be asked for. ``take(key, nbytes)`` waits for that key's
    buffer and hands it over (the taker owns it: ``host_free`` when done), or returns None where none was planned
    for the key, its size differs (it is freed) or the worker failed; the caller then makes its own. ``close`` stops
    the worker and frees every buffer not taken. Buffers made and not yet taken are host memory the plan already
    counts (every streamed linear's)."""

    def __init__(self, sizes: Iterable[tuple[Hashable, int]], pin: bool):
        self.sizes = [(k, int(n)) for k, n in sizes]
        self.pin = pin
        self._planned = {k for k, _ in self.sizes}
        self._made: dict = {}
        self._done = False
        self._closed = False
        self.error: BaseException | None = None
        self.taken = 0  # buffers handed over (the rest were made by their takers, or freed unused)
        # registration happens in the worker's CUDA context: the caller's current device, as where it registers itself
        self._device = torch.cuda.current_device() if pin and torch.cuda.is_available() else None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="h3-host-buffers", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            for key, n in self.sizes:
                with self._cv:
                    if self._closed:
                        return
                made = host_empty(n, self.pin)
                with self._cv:
                    if self._closed:
                        host_free(*made)
                        return
                    self._made[key] = made
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - the takers make their own buffers instead
            self.error = e
        finally:
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def take(self, key: Hashable, nbytes: int) -> tuple[torch.Tensor, str] | None:
        if key not in self._planned:
            return None
        with self._cv:
            while key not in self._made and not self._done and not self._closed:
                self._cv.wait()
            made = self._made.pop(key, None)
            self._planned.discard(key)
        if made is not None and made[0].numel() != nbytes:
            host_free(*made)
            return None
        self.taken += made is not None
        return made

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        with self._cv:
            left, self._made = list(self._made.values()), {}
        for made in left:
            host_free(*made)
