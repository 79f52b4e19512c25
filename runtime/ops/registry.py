"""The backend registry: for each op, its backends in preference order, each with a capability check, the
reference it is tested against and the binder that turns its name into the callable that runs.

Shape (after comfy-kitchen's registry): ``Backend(op, name, check, reference, bind)``. ``check(device, **kw)`` ->
``(available, reason)`` never raises. ``resolve(op, device, requested)`` picks the backend once, at load (the
load plan calls it): ``auto`` takes the first available one in preference order; an explicit request that
cannot run falls back to ``auto`` with ``"requested <name> unavailable: <why>"`` (never a silent swap).
``bind(op, name, **kw)`` turns the plan's choice into its callable, once: the attention function
``fn(qkv [S, 3*H*D]) -> [S, H*D]`` the block ops, sequence parallelism, the load-time probe, the tests and the
benches all call; the GEMM product ``fn(a, w, out_dtype, scratch)`` each NVFP4 layer keeps. Nothing is resolved
per call. ``capability_table`` is what the load plan records (every report's ``capabilities``) and what the
tests loop over.

The checks, choosers and binders live beside their kernels (``ops.attention``, ``ops.sage``,
``ops.sparse_attention``, ``ops.flash_attention``, ``ops.gemm_backends``); this module is the one table that names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import attention, gemm_backends, sage, sparse_attention


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    check: Callable[..., tuple[bool, str]]
    reference: str  # the backend this one is tested against ("" for the reference itself)
    bind: Callable[..., Callable]  # keyword arguments of the op (see bind) -> the callable that runs


def _attention_check(name: str):
    def check(device: torch.device, *, head_dim: int = 128, probe: bool = True, **_):
        if name == "reference":
            return True, "reference: fp32 math, the oracle"
        if torch.device(device).type != "cuda" and name != "sdpa":
            return False, f"{name}: needs a CUDA device"
        return attention._available(name, torch.device(device), head_dim, torch.bfloat16, probe)
    return check


def _attention_bind(name: str):
    def bind(*, head_dim: int, device=None, v_handling: str = "none", **_):
        return attention.bind_attention(name, head_dim, device=device, v_handling=v_handling)
    return bind


def _sparse_bind(*, head_dim: int, device, dtype, heads: int, dense, dense_name: str, settings, **_):
    """The sparse backend: its kernel plus the bound ``dense`` function for the dense steps; ``settings``:
    the plan's ``sparse_settings`` (a SparseSettings)."""
    return sparse_attention.bind_sparse(device, dtype, heads, head_dim, dense, dense_name, settings)


def _gemm_check(name: str):
    def check(device: torch.device, **_):
        for c in gemm_backends.gemm_capability_table(device):
            if c.backend == name:
                return c.available, c.reason
        return False, f"{name}: unknown"
    return check


def _gemm_bind(name: str):
    def bind(*, fp8_tiles: tuple | None = None, **_):
        return gemm_backends.bind_gemm(name, fp8_tiles=fp8_tiles)
    return bind


REGISTRY: dict[str, list[Backend]] = {
    "attention": [Backend("attention", n, _attention_check(n), "" if n == "reference" else "reference",
                          _attention_bind(n))
                  for n in ("sage2", "fa3_fp8", "fa3", "sage3", "fa4", "sdpa_cudnn", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_math", "sage1",
                            "reference")]
                 # LOSSY, never picked by auto; tested against the fp32 reference of the same sparse algorithm
                 + [Backend("attention", "sparse", sparse_attention.sparse_check, "sol_attention_reference",
                            _sparse_bind)],
    "gemm": [Backend("gemm", n, _gemm_check(n), "" if n == "reference" else "reference", _gemm_bind(n))
             for n in ("native", "fp8", "bf16", "emulated", "reference")],
}
_BY_NAME = {(b.op, b.name): b for backends in REGISTRY.values() for b in backends}


def _choose_attention(device, requested, head_dim=128, dtype=torch.bfloat16, **_):
    if requested == "sparse":  # lossy: refused with the reason where it cannot run, never swapped for another
        return sparse_attention.choose_sparse(device, head_dim=head_dim, dtype=dtype)
    return attention.choose_attention_backend(device, requested, head_dim=head_dim, dtype=dtype)


def _choose_gemm(device, requested, k_dims=(), **_):
    return gemm_backends.choose_gemm_backend(device, requested, k_dims=k_dims)


def _choose_v_handling(device, attention_backend, head_dim=128, **_):
    """V's handling for Sage2's sm_90 kernel: fused fp8 operands where its stages exist, else the library
    wrapper; nothing to choose for other attention backends."""
    if attention_backend != "sage2":
        return "none", f"no effect: attention runs {attention_backend} (it acts on Sage2's sm_90 kernel)"
    return sage.v_handling_status("fused", device, head_dim)


_CHOOSERS = {"attention": _choose_attention, "gemm": _choose_gemm, "v_handling": _choose_v_handling}


def resolve(op: str, device: torch.device | str, requested: str = "auto", **kw) -> tuple[str, str]:
    """(backend, reason) for ``op`` on ``device`` (module docstring). Made once per load, by the plan."""
    if op not in _CHOOSERS:
        raise ValueError(f"op {op!r}: expected one of {', '.join(_CHOOSERS)}")
    return _CHOOSERS[op](torch.device(device), requested, **kw)


def bind(op: str, name: str, **kw) -> Callable:
    """The callable of backend ``name`` of ``op`` (a name the plan resolved; module docstring). attention:
    ``head_dim``, ``device``, ``v_handling`` (sparse: also ``dtype``, ``heads``, ``dense``, ``dense_name``,
    ``settings``); gemm: ``fp8_tiles``."""
    b = _BY_NAME.get((op, name))
    if b is None:
        names = [x.name for x in REGISTRY.get(op, [])]
        raise ValueError(f"{op} backend {name!r}: expected one of {', '.join(names) or '(no such op)'}")
    return b.bind(**kw)


def capability_table(device: torch.device | str, *, probe: bool = False, head_dim: int = 128) -> dict:
    """{op: [{"backend", "available", "reason", "reference"}]} for every registered backend on ``device``."""
    device = torch.device(device)
    out = {}
    for op, backends in REGISTRY.items():
        rows = []
        for b in backends:
            ok, why = b.check(device, head_dim=head_dim, probe=probe)
            rows.append({"backend": b.name, "available": bool(ok), "reason": why, "reference": b.reference})
        out[op] = rows
    return out
