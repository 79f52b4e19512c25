"""The real guard of each Blackwell entry of ``ops.blackwell_table``, asked one question: may this entry run on
``device`` for ``head_dim`` and ``dtype``? Each answer is the guard's own ``(ok, reason)``; nothing is re-decided
here. ``bench/blackwell_first_run.py`` prints them; ``tests/test_blackwell_table.py`` checks them against the
table at every capability (with ``torch.cuda.get_device_capability`` answering it).

native     ``ops.gemm_backends`` capability table, row ``native`` (on CUDA: its load-time probe GEMM too)
sage2      ``ops.sage.sage2_plan`` must name the non-sm_90 kernel, then ``ops.attention``'s sage2 check
           (package, built extension, head dim, dtype)
sage3/fa4  ``ops.blackwell_attention.sage3_check`` / ``fa4_check``
fc2_gb10   ``fc2.guard.env_checks`` of the seed's entry with the device's capability and SM count; the header
           and library versions come from the built extension (``fc2_environment``), else they are unknown and
           that is the reason.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .fc2 import guard as fc2_guard
from .fc2.table import GB10_CANONICAL
from .ops import attention, blackwell_attention, gemm_backends, sage
from .ops.blackwell_table import BY_NAME, ENTRIES

__all__ = ["verdict", "verdicts", "fc2_environment"]


def _native(device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    for row in gemm_backends.gemm_capability_table(device):
        if row.backend == "native":
            return row.available, row.reason
    return False, "native: not in the GEMM capability table"


def _sage2(device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    cc = sage.capability(device)
    try:
        fn = sage.sage2_plan(cc)[0]
    except RuntimeError as e:
        return False, f"sage2: {e}"
    if fn == sage.SAGE2_SM90_FN:
        return False, f"sage2: sm_{cc[0]}{cc[1]} runs {fn}, not the non-sm_90 kernel of this entry"
    return attention._available("sage2", device, head_dim, dtype, probe=device.type == "cuda")


def fc2_environment(device: torch.device, build_info: Optional[dict[str, Any]] = None) -> fc2_guard.Fc2Environment:
    """The FC2 guard's environment: the extension's ``build_info()`` where given, else the device alone (its
    capability and SM count from torch; header and library versions unknown)."""
    if build_info is not None:
        return fc2_guard.Fc2Environment.from_build_info(build_info)
    if device.type != "cuda":
        return fc2_guard.Fc2Environment(None, None, None, None, None, None, device_error=f"device is {device}")
    props = torch.cuda.get_device_properties(device)
    return fc2_guard.Fc2Environment(tuple(torch.cuda.get_device_capability(device)), props.multi_processor_count,
                                    None, None, None, None, device_name=props.name)


def _fc2(device: torch.device, head_dim: int, dtype: torch.dtype,
         build_info: Optional[dict[str, Any]] = None) -> tuple[bool, str]:
    env = fc2_environment(device, build_info)
    _, refusal = fc2_guard.first_failure(fc2_guard.env_checks(GB10_CANONICAL, env))
    if refusal is None:
        return True, f"fc2_gb10: {GB10_CANONICAL.name} matches {env.device_name or 'this device'}"
    return False, f"fc2_gb10: {refusal.code}: {refusal.detail}"


_GUARDS: dict[str, Callable[..., tuple[bool, str]]] = {
    "native": _native,
    "sage2": _sage2,
    "sage3": lambda device, head_dim, dtype: blackwell_attention.sage3_check(device, head_dim, dtype),
    "fa4": lambda device, head_dim, dtype: blackwell_attention.fa4_check(device, head_dim, dtype),
    "fc2_gb10": _fc2,
}
assert set(_GUARDS) == set(BY_NAME), "every Blackwell table entry needs its guard here"


def verdict(name: str, device: "torch.device | str", head_dim: int = 128,
            dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """``(ok, reason)`` of entry ``name``'s guard on ``device`` (never raises: an exception is the reason)."""
    if name not in _GUARDS:
        raise ValueError(f"Blackwell entry {name!r}: expected one of {', '.join(_GUARDS)}")
    try:
        return _GUARDS[name](torch.device(device), head_dim, dtype)
    except Exception as e:  # noqa: BLE001 - a guard that raises is reported, not propagated
        return False, f"{name}: the guard raised {type(e).__name__}: {e}"


def verdicts(device: "torch.device | str", head_dim: int = 128) -> dict[str, tuple[bool, str]]:
    """Every entry's verdict on ``device``, in table order."""
    return {e.name: verdict(e.name, device, head_dim) for e in ENTRIES}
