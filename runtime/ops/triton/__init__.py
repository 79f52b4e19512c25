"""The ops' Triton kernels, and whether they can run here.

Kernel modules (plain modules, kernels at module level under ``@triton.jit``; each imports triton):

- ``common``: device helpers shared by the NVFP4 and fp8 kernels (exact loads, IEEE rounding, exp, RMSNorm);
- ``nvfp4_kernels``: behind ``ops.nvfp4_producers`` (NVFP4 producers and consumers);
- ``fp8_kernels``: behind ``ops.fp8_producers`` (e4m3 rowwise producers, SageAttention V);
- ``elementwise_kernels``: behind ``ops.elementwise`` (q/k norm + RoPE, gate + residual add).

``aot`` (no kernels): every kernel above compiled ahead of time for a GPU target that is not here
(``bench/blackwell_build.py``).

Triton is optional where the kernels cannot run anyway (the CPU): this package imports without it, sets
``MISSING`` to the reason, and the ops modules then import no kernel module and run their torch
references. The ops modules load the kernel modules once, at their own import::

    from .triton import MISSING as TRITON_MISSING
    if TRITON_MISSING is None:
        from .triton import nvfp4_kernels

Triton decides at decoration (``@triton.jit``, i.e. at import) whether a kernel is compiled or interpreted:
``TRITON_INTERPRET=1`` must be set before ``h3_blackwell`` is imported for the kernels to run on the CPU
(the tests' conftest does that).
"""

from __future__ import annotations

import torch

try:
    import triton
except ImportError as e:  # the reason is what status() reports
    triton = None
    MISSING: str | None = f"triton is not installed ({e})"
else:
    MISSING = None

# Triton's own switch, read once: the kernel modules are decorated right after this package is imported.
_INTERPRET = bool(triton is not None and getattr(getattr(triton, "knobs", None), "runtime", None) is not None
                  and triton.knobs.runtime.interpret)


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRET


def status(device: torch.device | str) -> tuple[bool, str]:
    """(usable, reason): whether the Triton kernels can run on tensors of ``device``."""
    if triton is None:
        return False, MISSING
    dev = torch.device(device)
    if dev.type == "cuda":
        return True, f"triton {triton.__version__} on CUDA"
    if _INTERPRET:
        return True, f"triton {triton.__version__} interpreter (TRITON_INTERPRET=1)"
    return False, (f"Triton kernels need a CUDA device (found {dev}); set TRITON_INTERPRET=1 before importing "
                   "h3_blackwell to interpret them on the CPU")


def hw_cvt(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` use the hardware fp32 -> e4m3 conversion (CUDA, not interpreted)."""
    return torch.device(device).type == "cuda" and not _INTERPRET
