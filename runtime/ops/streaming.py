"""Block streaming: DiT blocks whose weights live in pinned host memory and are copied to the device just before they
compute (the memory plan of ``runtime.budget`` says which).

- ``BlockStreamer`` holds every streamed block's bytes as stored (the NVFP4 ``packed`` bytes and ``scales`` of each
  ``Nvfp4Linear``; the dense ``weight`` of the reference stack) in one host buffer per linear, pinned on CUDA.
  ``SLOTS`` device buffers (slots) of one block each take turns: a dedicated copy stream fills the slot of the next
  streamed block while the current one computes. Order is kept with CUDA events only: the copy into a slot waits for
  the event recorded after the last block that used it (``free``), the compute stream waits for the event recorded
  after the copy (``ready``). Nothing synchronizes the host per block.
- ``StreamOps`` (runtime.ops.stream_ops) is a BlockOps wrapper (like ``runtime.lora.ops.LoraOps``): the first op of
  block i that reads a weight (qkv, out_proj, fc1 or fc2) binds block i's linears to its slot (``enter``), FC2's
  return unbinds them (``leave``) and records the slot free. Between blocks a streamed linear holds its host tensors,
  so a LoRA merge (which writes the layer's tensors in place) writes the host bytes that stream next; each slot
  remembers the version counters of the host bytes it holds and copies again when they changed. The wrapper also
  carries the plan's FFN row chunking (``ffn_chunk_rows``, read by ``DiTBlock.forward``).
- CPU: the same loop with host-to-host copies into separate slot tensors (an emulation for tests: the copies are
  synchronous, so all of their time counts as exposed).

Prefetch is cyclic: entering streamed block j issues the copies of the next ``SLOTS - 1`` streamed blocks in stack
order, wrapping to the first streamed blocks of the next evaluation, so a skipped tail (First-Block Cache) or the end
of a step costs nothing. Copy time and exposed (stalled) time are measured per evaluation with CUDA events and read
once, after the run's final synchronization (``summary``).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from .host_buffers import BuffersAhead, HostLinear
from .stream_stats import StepStats, summarize

SLOTS = 2
LINEAR_NAMES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def module_device_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes of ``module``'s parameters and buffers on ``device`` (its type, and its index where both name one);
    a streamed block's linears, in host memory between blocks, are not among them."""
    dev = torch.device(device)
    return sum(t.nbytes for t in list(module.parameters()) + list(module.buffers())
               if t.device.type == dev.type and (dev.index is None or t.device.index in (None, dev.index)))


class BlockStreamer:
    """The streamed blocks of one model on one device (module docstring). ``streamed``: block indices."""

    def __init__(self, blocks: nn.ModuleList, streamed, device: torch.device, slots: int = SLOTS):
        self.blocks = blocks
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.nslots = max(2, int(slots))
        self.host: dict[int, dict[str, HostLinear]] = {}
        self._set_streamed(streamed)
        self.slots: list[dict[str, torch.Tensor]] = []
        self.slot_bytes = 0
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.bound: int | None = None
        self.bound_slot: int | None = None
        self.last: int | None = None
        self.steps: list[StepStats] = []
        self.bytes_total = 0
        self.versioned = True
        self.ahead: BuffersAhead | None = None
        self.made_ahead = (0, 0)  # the last load's streamed host buffers: (made ahead and taken, planned)
        # a load behind the first step (runtime.pending_load): gate(j) returns once block j's linears are adopted
        self.gate = None
        self._reset_slots()

    def _set_streamed(self, streamed) -> None:
        self.streamed = frozenset(int(j) for j in streamed)
        self.order = sorted(self.streamed)

    def _reset_slots(self) -> None:
        self.slot_block: list[int | None] = [None] * self.nslots
        self.slot_version: list[tuple | None] = [None] * self.nslots
        self.ready: list[object | None] = [None] * self.nslots
        self.free: list[object | None] = [None] * self.nslots
        self.slot_used = [0] * self.nslots

    # -- load ---------------------------------------------------------------------------------------
    def _streamed_linear(self, layer: str) -> tuple[int, str] | None:
        """(block, linear name) where ``layer`` is a linear of a streamed block, else None."""
        parts = layer.split(".", 2)
        if len(parts) < 3 or parts[0] != "blocks" or parts[2] not in LINEAR_NAMES or int(parts[1]) not in self.streamed:
            return None
        return int(parts[1]), parts[2]

    def streams(self, layer: str) -> bool:
        """Whether ``adopt`` moves ``layer`` to host memory (a linear of a streamed block)."""
        return self._streamed_linear(layer) is not None

    def adopt(self, layer: str, module: nn.Module) -> bool:
        """The loader's hook after each block linear: a streamed block's linear moves its streamed tensors to
        host memory (the device copies are then freed). Returns True when it did."""
        where = self._streamed_linear(layer)
        if where is None:
            return False
        j, name = where
        hl = HostLinear(module, pin=self.cuda, ahead=self.ahead, key=(j, name))
        hl.bind_host(module)
        self.host.setdefault(j, {})[name] = hl
        return True

    def expect_host_buffers(self, nbytes) -> None:
        """Before the load: make the streamed linears' host buffers ahead on a worker thread (``BuffersAhead``), in
        load order, at ``nbytes(out_features, in_features)`` each (the size ``HostLinear`` will give that linear).
        ``adopt`` takes them; a linear whose size differs makes its own, as without this. ``finish`` (or
        ``drop_ahead`` where the load fails) frees what is left."""
        if not self.order:
            return
        sizes = [((j, name), nbytes(lin.out_features, lin.in_features)) for j in self.order for name in LINEAR_NAMES
                 for lin in (self.blocks[j].get_submodule(name),)]
        self.ahead = BuffersAhead(sizes, pin=self.cuda)

    def made_ahead_report(self) -> dict:
        """The last load's streamed host buffers made ahead: {"taken", "planned"} (``load_phases``)."""
        return dict(zip(("taken", "planned"), self.made_ahead))

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            self.made_ahead = (self.ahead.taken, len(self.ahead.sizes))
            self.ahead.close()
            self.ahead = None

    def alloc_slots_for(self, nbytes) -> None:
        """Before a load behind the first step (which may reach a streamed block before the pass ends): the slots,
        each linear's region ``nbytes(out_features, in_features)`` at its largest (``HostLinear``'s NVFP4 size)."""
        if self.order:
            self._make_slots({name: max(nbytes(b.get_submodule(name).out_features, b.get_submodule(name).in_features)
                                        for b in (self.blocks[j] for j in self.order)) for name in LINEAR_NAMES})

    def finish(self, behind: bool = False) -> None:
        """After the load: every streamed block is in host memory; allocate the slots, copy the first blocks.
        behind: the slots were made before the pass (``alloc_slots_for``): check each linear fits its region."""
        self.drop_ahead()
        missing = [j for j in self.order if set(self.host.get(j, {})) != set(LINEAR_NAMES)]
        big = [f"blocks.{j}.{n}" for j in self.order if behind and self.slots for n, hl in self.host.get(j, {}).items()
               if hl.nbytes > self.slots[0][n].numel()]
        if missing or big:
            raise RuntimeError(f"block streaming: blocks {missing[:5]} were planned to stream but their linears were "
                               "not adopted (the loader's hook did not run for them)" if missing else
                               f"block streaming: {big[0]} holds more bytes than its slot; load with load_behind=off")
        if not behind:
            self._alloc_slots()
        # dense weights are nn.Parameters, written through ``.data`` by LoRA merges (not counted in the version
        # counter): their slots are copied again in every evaluation
        self.versioned = all(not e.param for parts in self.host.values() for hl in parts.values() for e in hl.entries)
        if not behind:
            if self.order:
                self._prefetch_after(self.order[-1])
            self.steps = []  # the copies issued at load belong to no evaluation

    def _alloc_slots(self) -> None:
        self._make_slots({name: max(self.host[j][name].nbytes for j in self.order) for name in LINEAR_NAMES}
                         if self.order else {})

    def _make_slots(self, sizes: dict[str, int]) -> None:
        self.slots = []
        self.slot_bytes = sum(sizes.values())
        for _ in range(self.nslots if sizes else 0):
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            regions, off = {}, 0
            for name in LINEAR_NAMES:
                regions[name] = buf[off:off + sizes[name]]
                off += sizes[name]
            self.slots.append(regions)
        self._reset_slots()

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        return sum(hl.nbytes for parts in self.host.values() for hl in parts.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(hl.nbytes for parts in self.host.values() for hl in parts.values() if hl.pinned != "none")

    @property
    def device_bytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    def block_bytes(self, j: int) -> int:
        return sum(hl.nbytes for hl in self.host[j].values())

    def _versions(self, j: int) -> tuple:
        return tuple(hl.version for hl in self.host[j].values())

    # -- the loop ------------------------------------------------------------------------------------
    def _sync_host(self, j: int) -> None:
        """A streamed linear whose module was given other tensors (not our host views) is adopted again."""
        blk = self.blocks[j]
        for name, hl in self.host[j].items():
            mod = blk.get_submodule(name)
            if hl.holds(mod):
                continue
            new = HostLinear(mod, pin=self.cuda)
            if new.nbytes > self.slot_bytes and len(self.slots):
                new.release()
                raise RuntimeError(f"block streaming: blocks.{j}.{name} was replaced by a larger tensor set than its "
                                   "device buffer holds")
            hl.release()
            new.bind_host(mod)
            self.host[j][name] = new
            self._invalidate(j)

    def _invalidate(self, j: int) -> None:
        for s, b in enumerate(self.slot_block):
            if b == j:
                self.slot_block[s] = None

    def _upcoming(self, j: int) -> list[int]:
        """The next SLOTS - 1 streamed blocks after j in stack order, wrapping around."""
        if not self.order:
            return []
        k = next((n for n, b in enumerate(self.order) if b > j), len(self.order))
        out = []
        # wrap to the next evaluation's first blocks only where a slot stays valid across evaluations
        for n in range(len(self.order) if self.versioned else len(self.order) - k):
            b = self.order[(k + n) % len(self.order)]
            if b == j or b in out:
                continue
            out.append(b)
            if len(out) == self.nslots - 1:
                break
        return out

    def _slot_of(self, j: int) -> int | None:
        for s, b in enumerate(self.slot_block):
            if b == j and self.slot_version[s] == self._versions(j):
                return s
        return None

    def _victim(self, keep: set) -> int:
        cands = [s for s in range(self.nslots) if s != self.bound_slot and self.slot_block[s] not in keep]
        return min(cands, key=lambda s: self.slot_used[s])

    def _stats(self) -> StepStats:
        if not self.steps:
            self.steps.append(StepStats())
        return self.steps[-1]

    def _copy(self, j: int, s: int) -> None:
        """Block j's host bytes -> slot s (on the copy stream after the slot's last user finished)."""
        if self.gate is not None:
            self.gate(j)
        nbytes = self.block_bytes(j)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                if self.free[s] is not None:
                    self.copy_stream.wait_event(self.free[s])
                start.record(self.copy_stream)
                for name, hl in self.host[j].items():
                    self.slots[s][name][:hl.nbytes].copy_(hl.buffer, non_blocking=True)
                end.record(self.copy_stream)
            self.ready[s] = end
            self._stats().copies.append((start, end, nbytes))
        else:
            t0 = time.perf_counter()
            for name, hl in self.host[j].items():
                self.slots[s][name][:hl.nbytes].copy_(hl.buffer)
            self._stats().copies.append((time.perf_counter() - t0, nbytes))
        self.slot_block[s], self.slot_version[s] = j, self._versions(j)
        self.bytes_total += nbytes

    def _prefetch_after(self, j: int) -> None:
        ahead = self._upcoming(j)
        for u in ahead:  # (``_copy`` waits for a load behind the first step to open u)
            if self._slot_of(u) is None:
                self._copy(u, self._victim(set(ahead) | ({self.bound} if self.bound is not None else set())))

    def enter(self, j: int, starts_block: bool = True) -> None:
        """Bind block j's streamed linears to the slot holding its bytes (copying them first if they are not
        there), then prefetch the next streamed blocks. Idempotent while j is bound. starts_block: the block's
        first op (qkv); False for a later op that binds it again (the next FFN row chunk after fc2 unbound it)."""
        if j not in self.streamed or self.bound == j:
            return
        if self.bound is not None:
            self.leave(self.bound)
        if self.gate is not None:
            self.gate(j)
        if self.last is None or (starts_block and j <= self.last):
            self.steps.append(StepStats())  # a new evaluation: block indices started over
            if not self.versioned:
                self.slot_block = [None] * self.nslots
        self.last = j
        self._sync_host(j)
        s = self._slot_of(j)
        if s is None:
            s = self._victim(set(self._upcoming(j)))
            self._copy(j, s)
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            stream.wait_event(self.ready[s])
            b.record(stream)
            self._stats().stalls.append((a, b))
        blk = self.blocks[j]
        for name, hl in self.host[j].items():
            mod = blk.get_submodule(name)
            region = self.slots[s][name]
            for e in hl.entries:
                getattr(mod, e.table)[e.name] = HostLinear.view(region, e)
        self.bound, self.bound_slot = j, s
        self.slot_used[s] = max(self.slot_used) + 1
        self._prefetch_after(j)

    def leave(self, j: int) -> None:
        """Block j computed: its slot may be refilled once the compute stream passes this point."""
        if self.bound != j:
            return
        s = self.bound_slot
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.free[s] = ev
        blk = self.blocks[j]
        for name, hl in self.host[j].items():
            hl.bind_host(blk.get_submodule(name))
        self.bound, self.bound_slot = None, None

    def release(self) -> None:
        """Unbind whatever block is bound (after an error inside a block)."""
        if self.bound is not None:
            self.leave(self.bound)

    # -- re-planning -------------------------------------------------------------------------------
    def restream(self, streamed) -> None:
        """Change which blocks stream (``runtime.budget`` re-planned for a sampling run): blocks that now stream
        move to host memory first (freeing device memory), then blocks that become resident move to the device.
        Synchronizes the device once."""
        new = frozenset(int(j) for j in streamed)
        if new == self.streamed:
            return
        self.release()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.slots = []
        self._reset_slots()
        gone = self.streamed - new
        self._set_streamed(new)
        for j in sorted(new - set(self.host)):
            for name in LINEAR_NAMES:
                self.adopt(f"blocks.{j}.{name}", self.blocks[j].get_submodule(name))
        for j in sorted(gone):
            for name, hl in self.host.pop(j, {}).items():  # ({}: a failed park left it unadopted)
                mod = self.blocks[j].get_submodule(name)
                for e in hl.entries:
                    t = torch.empty(e.shape, dtype=e.dtype, device=self.device)
                    t.copy_(HostLinear.view(hl.buffer, e))
                    getattr(mod, e.table)[e.name] = nn.Parameter(t, requires_grad=False) if e.param else t
                hl.release()
        self.last = None
        self.finish()

    # -- offload ------------------------------------------------------------------------------------
    def park(self) -> frozenset:
        """All block linears to host memory, slots freed (``runtime.offload``) -> the streamed set, for unpark."""
        before = self.streamed
        self.release()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._set_streamed(range(len(self.blocks)))
        for j, name in ((j, n) for j in self.order if j not in self.host for n in LINEAR_NAMES):
            self.adopt(f"blocks.{j}.{name}", self.blocks[j].get_submodule(name))
        self.slots, self.slot_bytes, self.last = [], 0, None
        self._reset_slots()
        return before

    def unpark(self, streamed) -> None:
        if frozenset(int(j) for j in streamed) != self.streamed:
            return self.restream(streamed)  # ends in finish()
        self.finish()

    # -- measurement -------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Copies and stalls of the evaluations since the last summary (read after the run's final
        synchronization: CUDA events only), then cleared (``stream_stats.summarize``)."""
        self.release()
        out, self.steps = summarize(self.steps, self.cuda), []
        return out
