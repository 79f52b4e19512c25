"""Full-form AdaLN weights left in the checkpoint file (the memory plan's ``adaln_from_file``, issue 37).

The 50 blocks' ``adaln_proj.linear`` weights of a full-form H3 are 26 GB in bf16: more than a 32 GB machine can
keep beside the streamed blocks. When the plan's host figure does not fit (``runtime.budget._check_host``), the
load leaves them in the file (the modules keep meta tensors) and each sampling run computes its modulation rows
(``H3Model._block_mods``) from the weights read here block by block, the next block read ahead in a worker thread.
Host memory holds ``BLOCKS_IN_FLIGHT`` reusable buffers, each of one block's weight and bias (page-locked when the
blocks go to a CUDA device, made at the first read and kept while the model lives): a plain read straight into the
buffer (``Checkpoint.read_into``: no mmap, nothing else kept), or where the file stores another dtype or layout a
read converted to the model's AdaLN dtype exactly as the load converts it into host memory; checked finite; then
copied to the device without blocking the host, and a buffer is read into again only after the device copy out of
it has finished (a CUDA event per buffer). A LoRA merged into an AdaLN weight (merge mode) is
applied by the model to what this returns (``H3Model.adaln_merges``), as for AdaLN weights kept in host memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
import weakref

import torch

from ..model.config import ADALN_KEY
from ..ops.host_buffers import aligned, host_empty, host_free
from .finite import check_finite

BLOCKS_IN_FLIGHT = 2  # blocks a run holds in host memory at once: the one in use and the next being read
READ_THREADS = 8  # one weight is read as this many parts at once (the page cache copies in parallel)


class AdalnFromFile:
    """The AdaLN weights of ``model``'s blocks read from ``checkpoint`` (a ``runtime.io.checkpoint.Checkpoint``)."""

    def __init__(self, checkpoint, model):
        self.checkpoint = checkpoint
        self.dtypes = {j: (b.adaln_proj.linear.weight.dtype, b.adaln_proj.linear.bias.dtype)
                       for j, b in enumerate(model.blocks)}
        self.reads = 0  # tensors read (a test counts them)
        self._pool: ThreadPoolExecutor | None = None  # the read-ahead worker, made at the first read
        self._ahead: dict[int, Future] = {}  # block -> (slot, its host tensors) being read
        self._slots: list[torch.Tensor] = []  # BLOCKS_IN_FLIGHT host buffers (bytes), made at the first read
        self._copied: list = [None] * BLOCKS_IN_FLIGHT  # per slot: the CUDA event after the copy out of it
        self._next = 0  # the slot the next read takes

    def names(self, j: int) -> tuple[str, str]:
        return f"blocks.{j}.adaln_proj.linear.weight", f"blocks.{j}.adaln_proj.linear.bias"

    def holds(self, name: str) -> bool:
        """Whether ``name`` (a block AdaLN weight or bias) is read from the file rather than held by the model."""
        return ADALN_KEY.match(name) is not None

    def _layout(self, j: int) -> list[tuple[int, torch.Size, torch.dtype]]:
        """(byte offset, shape, dtype) of block j's weight and bias in a slot (offsets aligned as a streamed
        linear's host buffer aligns them, ``host_buffers.aligned``)."""
        out, off = [], 0
        for name, dtype in zip(self.names(j), self.dtypes[j]):
            shape = torch.Size(self.checkpoint.shape(name))
            out.append((off, shape, dtype))
            off += aligned(shape.numel() * dtype.itemsize)
        return out

    def _make_slots(self, device: torch.device) -> None:
        """The host buffers, each of the largest block's weight and bias at its exact size; page-locked for a CUDA
        device (``host_empty``: registered, never rounded up to a power of two), unregistered when this object
        goes."""
        size = max(off + s.numel() * d.itemsize for j in self.dtypes for off, s, d in self._layout(j))
        for _ in range(BLOCKS_IN_FLIGHT):
            buf, how = host_empty(size, device.type == "cuda")
            self._slots.append(buf)
            weakref.finalize(self, host_free, buf, how).atexit = False

    def _host(self, j: int, slot: int) -> tuple[int, list[torch.Tensor]]:
        """Block j's AdaLN weight and bias read from the file into ``slot`` at the model's AdaLN dtypes, checked
        finite (the exception names the tensor), once the device copy out of that slot has finished. A tensor
        stored whole at its model dtype is read in ``READ_THREADS`` parts at once, straight into the slot."""
        done = self._copied[slot]
        if done is not None:
            done.synchronize()
        buf, host = self._slots[slot], []
        for name, (off, shape, dtype) in zip(self.names(j), self._layout(j)):
            t = buf[off:off + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            if not self.checkpoint.read_into(name, t, READ_THREADS):
                t.copy_(self.checkpoint.tensor(name, "cpu"))
            host.append(check_finite(name, t))
        return slot, host

    def _take_slot(self) -> int:
        slot, self._next = self._next, (self._next + 1) % BLOCKS_IN_FLIGHT
        return slot

    def _drain(self) -> None:
        """Wait out read-aheads of blocks not asked for (a read out of order): their slots are then free."""
        for fut in self._ahead.values():
            fut.exception()
        self._ahead.clear()

    def read(self, j: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block j's AdaLN (weight [6*3*hidden, t_dim], bias) as stored, on ``device`` at the model's AdaLN dtypes
        (new tensors: the host buffers are never handed out). While block j is copied to the device and used,
        block j + 1 is read into the other buffer in a worker thread (the file read, the run's largest cost at this
        step, overlaps the copy and the rows' GEMMs). The bytes are the same as reading block j here."""
        device = torch.device(device)
        if not self._slots:
            self._make_slots(device)
        ahead = self._ahead.pop(j, None)
        if ahead is None:
            self._drain()
            slot, host = self._host(j, self._take_slot())
        else:
            slot, host = ahead.result()
        if device.type == "cuda":  # from page-locked memory, in stream order; the slot is reused after this event
            out = [torch.empty(h.shape, dtype=h.dtype, device=device).copy_(h, non_blocking=True) for h in host]
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record(torch.cuda.current_stream(device))
        else:
            out = [h.to(device, copy=True) for h in host]
        if j + 1 < len(self.dtypes) and j + 1 not in self._ahead:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="h3-adaln-read")
            self._ahead[j + 1] = self._pool.submit(self._host, j + 1, self._take_slot())
        self.reads += len(host)
        return out[0], out[1]
