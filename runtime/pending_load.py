"""A load that runs behind the first step: the streaming pass on a worker thread, the blocks opened one by one.

ComfyUI core's dynamic VRAM moves each weight to the device when a forward first needs it, so its load lands
inside its first step. ``load_model(options.load_behind)`` does the same with the whole pass (``runtime.load``):
the plan is made and the model built on the meta device first (nothing is read yet); then the pass runs on a
worker thread, on a CUDA stream of its own, in parts: the prelude (every entry outside ``blocks.N``: embeddings,
token refiner, final layer, RoPE), then block 0, 1, ... A part opens when its tensors are set, checked finite, and
(a streamed block's linears) moved to host memory: a host flag, and on CUDA an event recorded on the pass's stream.

- ``prelude()`` / ``block(j)`` return once that part is open; on CUDA the calling thread's current stream then waits
  for the part's copies (an event wait: no host sync). The sampler asks for the prelude before its run plan and for
  block j before block j's modulation rows, before its streamed bytes are copied, and before it computes
  (``H3Model.pending``). Each caller may also run what it has queued for an opened part (``then``: the LoRA
  merges ``runtime.lora.apply`` defers until a block is there), once, on the caller's thread.
- ``finish()`` joins the pass and returns its phases (``_Loader.phases``); every other use of the runtime that
  needs the whole model calls it first (``H3Runtime.finish_load``).
- An error of the pass (a non-finite tensor, a short file) is kept and raised by every later wait and by
  ``finish``: a part opens only once its own tensors are checked, so nothing computed before the error used a bad
  tensor. The runtime is then unusable, as ``load_model`` would have raised in the foreground.

``waited_seconds`` is the time callers spent waiting for parts (the load not hidden behind the step), reported with
the pass's own seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

import torch

PRELUDE = -1  # the part of every entry outside ``blocks.N``

# Python's thread switch interval while a pass runs behind the first step. The pass's thread is busy in Python
# between its torch calls, and every torch call of another thread (the sampler's launches, a LoRA file read) gives
# up the GIL and must win it back: at the default 5 ms each such handoff can cost a whole interval. A LoRA read beside
# the pass took as long as the pass on an H100 host at 0.5 ms; on the CPU it took 3.7x its time alone at 5 ms, 1.8x
# at 0.5 ms and 1.0x at 0.1 ms, and the pass itself was faster too (bench/NOTES.md). 0.1 ms while any pass runs.
SWITCH_INTERVAL = 0.0001
_switch = {"active": 0, "saved": None}
_switch_lock = threading.Lock()


def _switch_begin() -> None:
    with _switch_lock:
        if _switch["active"] == 0:
            _switch["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_INTERVAL, _switch["saved"]))
        _switch["active"] += 1


def _switch_end() -> None:
    with _switch_lock:
        _switch["active"] -= 1
        if _switch["active"] == 0 and _switch["saved"] is not None:
            sys.setswitchinterval(_switch["saved"])


def part_of(name: str) -> int:
    """The part an entry belongs to: its block index for ``blocks.N....``, else PRELUDE."""
    if name.startswith("blocks."):
        return int(name.split(".", 2)[1])
    return PRELUDE


class PendingLoad:
    """The gates of one pass run behind the first step (module docstring). ``blocks``: the model's block count."""

    def __init__(self, blocks: int, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # the pass's thread sets this device as its current one ("cuda" names the current device of this thread)
        self.index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None
        self.blocks = blocks
        self._open = {p: threading.Event() for p in [PRELUDE, *range(blocks)]}
        self._ok: dict[int, bool] = {}
        self._events: dict[int, object] = {}
        self._waited: set = set()  # (stream, part) pairs already ordered after the part's copies
        self._then: dict[int, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.result: dict = {}
        self.pass_seconds = 0.0
        self.waited_seconds = 0.0

    # -- the pass's side ------------------------------------------------------------------------
    def start(self, fn: Callable[["PendingLoad"], dict]) -> None:
        """Run ``fn(self)`` (the pass; it calls ``open`` per part and returns its phases) on a worker thread."""
        def body():
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    if self.cuda:
                        torch.cuda.set_device(self.index)
                        with torch.cuda.stream(self.stream):
                            self.result = fn(self) or {}
                            self.stream.synchronize()
                    else:
                        self.result = fn(self) or {}
                missing = [p for p, ev in self._open.items() if not ev.is_set()]
                if missing:
                    raise RuntimeError(f"the load behind the first step ended without opening parts {missing[:5]}")
            except BaseException as e:  # kept: every later wait raises it
                self.error = e
            finally:
                self.pass_seconds = time.perf_counter() - t0
                for ev in self._open.values():  # wake every waiter; a part not opened by ``open`` is not ok
                    ev.set()
                self.done.set()
                _switch_end()

        _switch_begin()
        self.thread = threading.Thread(target=body, name="h3-load-behind", daemon=True)
        self.thread.start()

    def open(self, part: int) -> None:
        """Part ``part`` is loaded and checked (called on the pass's thread, its stream current)."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._events[part] = ev
        self._ok[part] = True
        self._open[part].set()

    # -- the callers' side ----------------------------------------------------------------------
    def then(self, part: int, fn: Callable[[], None]) -> None:
        """Queue ``fn`` to run on the caller's thread once ``part`` is open (by the first ``wait`` of that part)."""
        with self._lock:
            self._then.setdefault(part, []).append(fn)

    def wait(self, part: int) -> None:
        """Return once ``part`` is open (raising the pass's error if it failed first), the current stream ordered
        after its copies; then run what ``then`` queued for it."""
        if threading.current_thread() is self.thread:  # the pass itself never waits on its own parts
            return
        ev = self._open[part]
        if not ev.is_set():
            t0 = time.perf_counter()
            ev.wait()
            self.waited_seconds += time.perf_counter() - t0
        if not self._ok.get(part):
            raise self.error if self.error is not None else RuntimeError(f"load part {part} never opened")
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            key = (stream.cuda_stream, part)
            if key not in self._waited:
                stream.wait_event(self._events[part])
                self._waited.add(key)
        with self._lock:
            todo = self._then.pop(part, [])
        for fn in todo:
            fn()

    def prelude(self) -> None:
        self.wait(PRELUDE)

    def block(self, j: int) -> None:
        self.wait(int(j))

    def finish(self) -> dict:
        """Join the pass (raising its error), order the current stream after all of it, run every queued ``then`` in
        part order -> the pass's result."""
        t0 = time.perf_counter()
        self.done.wait()
        if self.thread is not None:
            self.thread.join()
        self.waited_seconds += time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for part in [PRELUDE, *range(self.blocks)]:
            self.wait(part)
        return self.result

    def summary(self) -> dict:
        """What the report says of it: the pass's seconds, and how long callers waited for it."""
        return {"pass_seconds": round(self.pass_seconds, 4), "waited_seconds": round(self.waited_seconds, 4),
                "done": self.done.is_set(), "failed": None if self.error is None else type(self.error).__name__}
