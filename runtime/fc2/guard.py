"""The FC2 guard: a call (shape, dtypes, producer, LoRA) and the device environment checked against the
table's entries; the first failing condition is the recorded reason (``code: detail``).

Contract: ``describe_call`` turns the producer's ``Fc2Operands`` into an :class:`Fc2Call` (or a
``contract`` / ``dtype`` refusal); ``match_call`` keeps the entries the call satisfies, ``match_env`` the one
the device satisfies; ``match`` is both. Nothing here touches the GPU.

Guard order (the first failing condition is the recorded reason):

- switch: ``disabled``;
- operands: ``contract`` (malformed), ``dtype`` (no plan kind for it);
- the call vs each entry: ``role`` ``lora`` ``bias`` ``out_dtype`` ``dtype`` ``producer`` ``k`` ``n``
  ``m_logical`` ``m_padded`` (``empty_table`` when nothing is loaded);
- the device vs the entries left: ``extension`` ``no_device`` ``cc`` ``sm_count`` ``cuda_header``
  ``cublas_header`` ``cuda_runtime`` ``cublaslt_runtime``;
- the plan (checked by the dispatcher): ``capture`` (not prepared before graph capture), ``policy`` ``init``
  ``config`` ``check`` ``workspace`` ``readback`` (the extension's stages), ``descriptors``, ``plan``
  (anything else), ``self_test``;
- the run: ``contract`` (the extension refused a tensor), ``execute``; ``internal`` for a bug.

With several entries the reason comes from the entry that got furthest through these checks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..ops.fc2_operands import Fc2Operands
from .table import Fc2Entry, Fc2Table, Refusal

log = logging.getLogger("h3_blackwell.fc2_lt")

_FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)
_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Fc2Call:
    """What one FC2 call asks for, derived from its operands and the caller's flags."""

    role: str
    dtype: str
    out_dtype: str
    m_logical: int
    m_padded: int
    n: int
    k: int
    bias: bool = False
    lora: bool = False
    producer: str | None = None


@dataclass(frozen=True)
class Fc2Environment:
    """The device and library versions a plan would run with (from the extension's build_info())."""

    cc: tuple[int, int] | None
    sm_count: int | None
    cuda_header: int | None
    cublas_header: int | None
    cuda_runtime: int | None
    cublaslt_runtime: int | None
    device_name: str = ""
    device_index: int | None = None
    device_error: str | None = None
    cuda_driver: int | None = None  # not a guard condition; part of the compatibility-cache key

    @classmethod
    def from_build_info(cls, info: Mapping[str, Any]) -> "Fc2Environment":
        dev = info.get("device") or {}
        cc = tuple(dev["cc"]) if dev.get("cc") is not None else None
        return cls(
            cc=cc,  # type: ignore[arg-type]
            sm_count=dev.get("sm_count"),
            cuda_header=info.get("cuda_header"),
            cublas_header=info.get("cublas_header"),
            cuda_runtime=info.get("cuda_runtime"),
            cublaslt_runtime=info.get("cublaslt_runtime"),
            device_name=dev.get("name", ""),
            device_index=dev.get("index"),
            device_error=info.get("device_error"),
            cuda_driver=info.get("cuda_driver"),
        )

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cc"] = list(self.cc) if self.cc else None
        return d


def _cuda_pair(v: int | None) -> tuple[int, int] | None:
    return None if v is None else (v // 1000, (v % 1000) // 10)


def _cublas_pair(v: int | None) -> tuple[int, int] | None:
    return None if v is None else (v // 10000, (v % 10000) // 100)


def _fmt_pair(p: tuple[int, int] | None) -> str:
    return "unknown" if p is None else f"{p[0]}.{p[1]}"


def call_checks(entry: Fc2Entry, call: Fc2Call) -> list[tuple[str, bool, str]]:
    """The per-call conditions of ``entry``, in guard order: (code, holds, detail if it does not)."""
    return [
        ("role", call.role == entry.role, f"role {call.role!r}, the entry covers {entry.role!r}"),
        ("lora", not call.lora, "LoRA side-path active on fc2; the pinned GEMM has no LoRA term"),
        ("bias", not call.bias, "a bias is present; accepted entries cover the GEMM without bias"),
        ("out_dtype", call.out_dtype == entry.out_dtype,
         f"output {call.out_dtype}, the entry writes {entry.out_dtype}"),
        ("dtype", call.dtype == entry.dtype, f"operands are {call.dtype}, the entry is {entry.dtype}"),
        ("producer", entry.producer is None or call.producer == entry.producer,
         f"activation producer {call.producer!r}, the entry was validated after {entry.producer!r}"),
        ("k", call.k == entry.k, f"K={call.k}, the entry needs K={entry.k} (unsharded)"),
        ("n", call.n == entry.n, f"N={call.n}, the entry needs N={entry.n} (unsharded)"),
        ("m_logical", call.m_logical == entry.m_logical,
         f"logical M={call.m_logical}, the entry needs exactly {entry.m_logical} (nearby M were not all exact)"),
        ("m_padded", call.m_padded == entry.m_padded,
         f"packed M={call.m_padded}, the entry needs exactly {entry.m_padded}"),
    ]


def env_checks(entry: Fc2Entry, env: Fc2Environment) -> list[tuple[str, bool, str]]:
    """The device/version conditions of ``entry``, in guard order."""
    cuda_hdr, blas_hdr = _cuda_pair(env.cuda_header), _cublas_pair(env.cublas_header)
    cc = env.cc
    have = f"sm_{cc[0]}{cc[1]}" if cc else "no device"
    return [
        ("no_device", cc is not None, f"no CUDA device for the plan ({env.device_error or 'operands not on CUDA'})"),
        ("cc", cc == entry.cc, f"device is {have}, the entry needs sm_{entry.cc[0]}{entry.cc[1]}"),
        ("sm_count", env.sm_count == entry.sm_count,
         f"device has {env.sm_count} SMs, the entry needs {entry.sm_count}"),
        ("cuda_header", cuda_hdr == entry.cuda_header,
         f"extension built against CUDA {_fmt_pair(cuda_hdr)} headers, the entry needs {_fmt_pair(entry.cuda_header)}"),
        ("cublas_header", blas_hdr == entry.cublas_header,
         f"extension built against cuBLAS {_fmt_pair(blas_hdr)} headers, "
         f"the entry needs {_fmt_pair(entry.cublas_header)}"),
        ("cuda_runtime", env.cuda_runtime == entry.cuda_runtime,
         f"CUDA runtime {env.cuda_runtime}, the entry needs {entry.cuda_runtime}"),
        ("cublaslt_runtime", env.cublaslt_runtime == entry.cublaslt_runtime,
         f"cuBLASLt runtime {env.cublaslt_runtime}, the entry needs {entry.cublaslt_runtime}"),
    ]


def first_failure(checks: list[tuple[str, bool, str]]) -> tuple[int, Refusal | None]:
    """(how many checks passed, the first failing check as a Refusal or None) for ``(code, ok, detail)``
    checks in guard order."""
    for i, (code, ok, detail) in enumerate(checks):
        if not ok:
            return i, Refusal(code, detail)
    return len(checks), None


def _best(results: list[tuple[int, Fc2Entry, Refusal | None]], table_len: int) -> tuple[Fc2Entry | None, Refusal]:
    # the entry that got furthest names the reason; ties go to the earlier (higher-priority) entry
    depth, entry, refusal = max(results, key=lambda r: r[0])
    assert refusal is not None
    suffix = f" [closest entry {entry.name}]" if table_len > 1 else f" [entry {entry.name}]"
    return None, Refusal(refusal.code, refusal.detail + suffix)


def match_call(table: Fc2Table, call: Fc2Call) -> tuple[list[Fc2Entry], Refusal | None]:
    """Entries whose per-call conditions all hold, or the reason none does."""
    if not table.entries:
        return [], Refusal("empty_table", "no accepted FC2 configuration is loaded")
    results = []
    hits = []
    for e in table.entries:
        depth, refusal = first_failure(call_checks(e, call))
        if refusal is None:
            hits.append(e)
        results.append((depth, e, refusal))
    if hits:
        return hits, None
    return [], _best(results, len(table.entries))[1]


def match_env(entries: Sequence[Fc2Entry], env: Fc2Environment) -> tuple[Fc2Entry | None, Refusal | None]:
    """The first entry whose device/version conditions hold, or the reason none does."""
    results = []
    for e in entries:
        depth, refusal = first_failure(env_checks(e, env))
        if refusal is None:
            return e, None
        results.append((depth, e, refusal))
    return _best(results, len(entries))


def match(table: Fc2Table, call: Fc2Call, env: Fc2Environment) -> tuple[Fc2Entry | None, Refusal | None]:
    """The whole guard without tensors: the accepted entry, or the first failing condition."""
    hits, refusal = match_call(table, call)
    if refusal is not None:
        return None, refusal
    return match_env(hits, env)


# ----------------------------------------------------------------------------------------------
# operands and plan layers


def operand_kind(x: torch.Tensor) -> str | None:
    if x.dtype == torch.uint8 or (_FLOAT4 is not None and x.dtype == _FLOAT4):
        return "nvfp4"
    if x.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if x.dtype == torch.bfloat16:
        return "bf16"
    return None


def describe_call(ops: Fc2Operands, *, role: str, out_dtype: torch.dtype, lora_active: bool,
                  producer: str | None) -> Fc2Call | Refusal:
    """Derive the guard's view of a call from its operands, or refuse a malformed one."""
    x, w = ops.x, ops.w
    if x.dim() != 2 or w.dim() != 2:
        return Refusal("contract", f"x {tuple(x.shape)} and w {tuple(w.shape)} must both be 2-D")
    kind = operand_kind(x)
    if kind is None:
        return Refusal("dtype", f"x is {x.dtype}; the pinned path takes nvfp4 bytes, float8_e4m3fn or bfloat16")
    if operand_kind(w) != kind:
        return Refusal("dtype", f"x is {x.dtype} ({kind}) but w is {w.dtype}")
    if x.shape[1] != w.shape[1]:
        return Refusal("contract", f"x {tuple(x.shape)} and w {tuple(w.shape)} disagree on K")
    if not 0 < ops.m_logical <= x.shape[0]:
        return Refusal("contract", f"m_logical={ops.m_logical} must be in 1..{x.shape[0]} (rows of x)")
    k = x.shape[1] * (2 if kind == "nvfp4" else 1)
    return Fc2Call(
        role=role,
        dtype=kind,
        out_dtype=_OUT_DTYPES.get(out_dtype, str(out_dtype).replace("torch.", "")),
        m_logical=int(ops.m_logical),
        m_padded=int(x.shape[0]),
        n=int(w.shape[0]),
        k=int(k),
        bias=ops.bias is not None,
        lora=bool(lora_active),
        producer=producer,
    )
