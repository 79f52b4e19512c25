"""Read-ahead: worker threads read the next tensors of a known sequence while the caller works on the current one.

File reads release the GIL (``readinto``), so several threads read the page cache or the disk in parallel while the
caller's thread moves, checks and quantizes the tensor it was handed.

``ReadAhead(names, read, nbytes, max_bytes, threads)``, a context manager:

- ``names``: the reads the caller will ask for, in its order; a name may appear more than once (each occurrence is
  one read). ``read(name)`` -> a host tensor; it runs on a worker thread, so it must only read state that nobody
  changes meanwhile. ``nbytes(name)``: the bytes ``read(name)`` returns (a read's own temporaries, a concatenation of
  shards say, come on top while it runs).
- ``get(name)``: the result of the next read of the sequence, which must be ``name`` (ValueError otherwise: the
  caller asks in another order than it declared). Reads start in the sequence's order only.
- A read that raised re-raises from ``get`` of its name, and only there: the same exception object, its type and
  message unchanged, with a note naming the tensor.
- Bound: reads started and not yet claimed (running, or done and waiting) hold at most ``max_bytes``
  (``held_bytes``, its high-water mark ``peak_held_bytes``), except that one read is always under way while any is
  left, whatever its size. The tensor ``get`` hands back is the caller's from then on and no longer counted.
- ``close()`` (leaving the ``with`` block, an exception included): reads not started are cancelled, running ones
  finish, every worker thread is joined; nothing read is kept. ``get`` after ``close`` raises RuntimeError.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

# bytes of reads ahead of the caller, and the reading threads (more threads than this gain nothing on the page
# cache of one file and hold more buffers); READ_AHEAD_THREADS = 0: a caller reads on its own thread instead
READ_AHEAD_BYTES = 4 << 30
READ_AHEAD_THREADS = min(8, os.cpu_count() or 1)


class ReadAhead:
    """Reads of ``names`` in worker threads, handed out in order (module docstring)."""

    def __init__(self, names: Sequence[str], read: Callable[[str], torch.Tensor], nbytes: Callable[[str], int],
                 max_bytes: int | None = None, threads: int | None = None):
        threads = READ_AHEAD_THREADS if threads is None else threads
        if threads < 1:
            raise ValueError(f"ReadAhead needs at least one thread; found threads={threads}")
        self.max_bytes = READ_AHEAD_BYTES if max_bytes is None else max_bytes
        self._names, self._read, self._nbytes = list(names), read, nbytes
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(threads, thread_name_prefix="h3-read-ahead")
        self._queue: deque[tuple[str, int, Future]] = deque()  # started, not yet claimed, in order
        self._started = 0  # reads of self._names started so far
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.read_seconds = 0.0  # summed over the threads' reads (what overlapped the caller)
        self.read_bytes = 0
        self._lock = threading.Lock()
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def _fill(self) -> None:
        """Start the next reads in order while they fit in ``max_bytes`` (one always, when none is under way)."""
        while self._started < len(self._names):
            name = self._names[self._started]
            n = int(self._nbytes(name))
            if self._queue and self.held_bytes + n > self.max_bytes:
                return
            self._queue.append((name, n, self._pool.submit(self._timed_read, name, n)))
            self._started += 1
            self.held_bytes += n
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def _timed_read(self, name: str, n: int) -> torch.Tensor:
        t = time.perf_counter()
        out = self._read(name)
        with self._lock:
            self.read_seconds += time.perf_counter() - t
            self.read_bytes += n
        return out

    def get(self, name: str) -> torch.Tensor:
        """The next read's tensor, which must be ``name``; waits for it, re-raises its exception."""
        if self._pool is None:
            raise RuntimeError(f"ReadAhead.get({name!r}) after close")
        if not self._queue:
            raise ValueError(f"ReadAhead.get({name!r}): every declared read was handed out already; the caller asks "
                             "for more reads than it declared")
        want = self._queue[0][0]
        if want != name:
            raise ValueError(f"ReadAhead.get({name!r}): the next declared read is {want!r}; the caller asks in "
                             "another order than it declared")
        _, n, fut = self._queue.popleft()
        self.held_bytes -= n
        self._fill()  # the claimed tensor is the caller's: its bytes go to the next reads
        try:
            return fut.result()
        except Exception as e:
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"(read ahead on a worker thread: tensor {name!r})")
            raise

    def close(self) -> None:
        """Cancel the reads not started, wait for the running ones, join the threads. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._queue.clear()
        self.held_bytes = 0

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
