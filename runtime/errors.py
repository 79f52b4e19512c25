"""Error types. Every message says what was expected, what was found and what to do."""

import errno


class H3Error(ValueError):
    """Base of the runtime's user-facing errors (bad input, bad checkpoint, bad geometry)."""


class CheckpointError(H3Error):
    """A checkpoint could not be read or does not describe an H3 DiT. The message says what to do."""


class Interrupted(RuntimeError):
    """A run was interrupted between steps (by the user or the host). The model stays usable."""


def describe(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters of it): how a probe or a bench records
    the error of a kernel that could not run."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:limit] if lines else ''}"


_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "defaultcpuallocator",
             "can't start new thread")


def is_out_of_memory(e: BaseException) -> bool:
    """True for an allocation failure on any device: MemoryError, torch's OutOfMemoryError (CUDA), the CPU
    allocator's RuntimeError (``DefaultCPUAllocator: can't allocate memory``), MPS / XPU out of memory, and an
    OSError ENOMEM."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    if isinstance(e, OSError):
        return e.errno == errno.ENOMEM
    return isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _OOM_TEXT)
