"""The guarded cuBLASLt FC2 path: accepted-configuration table, guard, dispatch, counters.

Where it sits: after the SwiGLU producer has written the FC2 activation (NVFP4 bytes + swizzled block
scales on Blackwell; fp8 or bf16 on Hopper), ``Fc2Dispatcher.__call__`` gets those exact bytes plus a
``fallback`` callable. It runs a *pinned* cuBLASLt configuration only when every condition of an
accepted table entry holds; otherwise it calls ``fallback(ops)`` with the very same ``Fc2Operands``
object (no second quantization) and records why.

Accepted entries come from evidence, never from inference:

- ``GB10_CANONICAL`` is the study in ``shared/seeds/003_7ef155e2299f514b.txt``: FC2, K=14,336,
  N=5,376, logical M=37,810, packed M=37,824, NVFP4 x NVFP4 -> BF16, no bias, no LoRA, after the
  SwiGLU NVFP4 producer, GB10 (sm_121), CUDA 13.0 runtime and headers, cuBLAS 13.1 headers,
  cuBLASLt 13.0 runtime; algo 70 / tile 20 / stages 37 / split-K 1 / reduction 0 / swizzle 0 /
  custom 0, zero workspace. Nearby M values were *not* all exact there, so nothing generalises.
- JSON files written by ``h3-blackwell tune-fc2`` (schema ``ENTRY_SCHEMA``) under
  ``RuntimeOptions.cache_dir/fc2_lt/table/`` or loaded explicitly.

Guard order (the first failing condition is the recorded reason, ``code: detail``):

- switch: ``disabled``;
- operands: ``contract`` (malformed), ``dtype`` (no plan kind for it);
- the call vs each entry: ``role`` ``lora`` ``bias`` ``out_dtype`` ``dtype`` ``producer`` ``k`` ``n``
  ``m_logical`` ``m_padded`` (``empty_table`` when nothing is loaded);
- the device vs the entries left: ``extension`` ``no_device`` ``cc`` ``sm_count`` ``cuda_header``
  ``cublas_header`` ``cuda_runtime`` ``cublaslt_runtime``;
- the plan: ``capture`` (not prepared before graph capture), ``policy`` ``init`` ``config`` ``check``
  ``workspace`` ``readback`` (the extension's stages), ``descriptors``, ``plan`` (anything else),
  ``self_test``;
- the run: ``contract`` (the extension refused a tensor), ``execute``; ``internal`` for a bug.

With several entries the reason comes from the entry that got furthest through these checks.

Counters: every call is an attempt; it ends as a success or a fallback (or, in strict mode, an
error raised as :class:`Fc2LtError`). ``begin_run()``/``end_run()`` bracket one sampling run;
``report(required_per_run)`` gives ``{required_per_run, runs, all_passed}`` where required_per_run is
blocks x steps.

The plan layer is pluggable (``PlanLayer``): :class:`LtPlanLayer` drives the real extension; tests
pass a fake. Measured compatibility (plan checks, self-tests) is cached on disk under
``cache_dir/fc2_lt/compat/`` keyed by the device model and every version involved.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from .options import RuntimeOptions

log = logging.getLogger("h3_blackwell.fc2_lt")

ENTRY_SCHEMA = "h3-blackwell/fc2-lt-entry/1"
COMPAT_SCHEMA = "h3-blackwell/fc2-lt-compat/1"
ROLE_FC2 = "fc2"
# The producer that writes FC2's input in one pass: silu(gate) * up -> NVFP4 bytes + swizzled scales
# (the seed's `vortex_native_quantize_swiglu_nvfp4`). Callers pass it as ``producer=``.
PRODUCER_SWIGLU_NVFP4 = "swiglu_nvfp4"
KINDS = ("nvfp4", "fp8_e4m3", "bf16")
# The extension's plan stages: a refusal at one of them is a property of (device, versions, algo, shape),
# so it is remembered on disk. "descriptors" (handle or scratch allocation failed) is not.
PLAN_STAGES = ("policy", "init", "config", "check", "workspace", "readback", "heuristic")

_FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)
_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class Fc2LtError(RuntimeError):
    """Strict mode: the pinned path could not run. ``.reason`` is the recorded ``code: detail``."""

    def __init__(self, reason: "Refusal"):
        super().__init__(
            f"FC2 cuBLASLt path refused ({reason}); strict mode is on (H3_NVFP4_FC2_LT_STRICT=1 / "
            "RuntimeOptions.fc2_lt_strict) so there is no fallback. Turn strict off to fall back, or fix the cause."
        )
        self.reason = reason


@dataclass(frozen=True)
class Refusal:
    """Why the pinned path did not run: a stable ``code`` and a human ``detail``."""

    code: str
    detail: str

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


# ----------------------------------------------------------------------------------------------
# table entries


@dataclass(frozen=True)
class AlgoSpec:
    """Every cuBLASLt algorithm configuration attribute (see kernels-facts.md 1.1)."""

    id: int
    tile: int
    stages: int
    splitk: int = 1
    reduction: int = 0
    swizzle: int = 0
    custom: int = 0
    cluster: int = 0
    inner_shape: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AlgoSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"algo config has unknown keys {sorted(extra)}; expected {sorted(known)}")
        return cls(**{k: int(v) for k, v in d.items()})


def _ver_pair(v: Sequence[int]) -> tuple[int, int]:
    if len(v) != 2:
        raise ValueError(f"expected [major, minor], found {v!r}")
    return int(v[0]), int(v[1])


@dataclass(frozen=True)
class Fc2Entry:
    """One accepted configuration: the exact conditions under which a pinned algo may run.

    Shapes are row-major: x [m_padded, K] (NVFP4: [m_padded, K/2] bytes), w [N, K], y [m_padded, N];
    the caller keeps the first ``m_logical`` rows. Versions: ``cuda_runtime`` is
    cudaRuntimeGetVersion (13000 = 13.0), ``cublaslt_runtime`` is cublasLtGetVersion (130000 = 13.0.0),
    both exact; header versions are (major, minor) of CUDART_VERSION / CUBLAS_VERSION at build time.
    """

    name: str
    role: str
    cc: tuple[int, int]
    sm_count: int
    cuda_header: tuple[int, int]
    cublas_header: tuple[int, int]
    cuda_runtime: int
    cublaslt_runtime: int
    dtype: str
    out_dtype: str
    m_logical: int
    m_padded: int
    n: int
    k: int
    algo: AlgoSpec
    workspace_bytes: int = 0
    pointer_mode: str = "host"
    scale_mode: str = "none"
    producer: str | None = None
    device_name: str = field(default="", compare=False)
    source: str = field(default="", compare=False)  # provenance: "builtin: ..." or the file it came from
    evidence: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.dtype not in KINDS:
            raise ValueError(f"entry {self.name}: dtype {self.dtype!r}; expected one of {KINDS}")
        if self.algo.splitk != 1 or self.algo.reduction != 0:
            raise ValueError(
                f"entry {self.name}: split-K {self.algo.splitk} / reduction {self.algo.reduction}; accepted entries "
                "need split-K 1 and reduction NONE (0) so the fp32 reduction order is fixed"
            )
        if self.m_padded < self.m_logical:
            raise ValueError(f"entry {self.name}: m_padded {self.m_padded} < m_logical {self.m_logical}")
        if self.pointer_mode not in ("host", "device"):
            raise ValueError(f"entry {self.name}: pointer_mode {self.pointer_mode!r}; expected host or device")

    @property
    def key(self) -> tuple:
        """(role, cc, SM count, cuBLASLt runtime, dtypes, logical M, padded M, N, K)."""
        return (self.role, self.cc, self.sm_count, self.cublaslt_runtime, self.dtype, self.out_dtype,
                self.m_logical, self.m_padded, self.n, self.k)

    @functools.cached_property
    def _fingerprint(self) -> str:
        body = json.dumps({k: v for k, v in self.to_json().items() if k not in ("evidence", "source")}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def fingerprint(self) -> str:
        """Identifies the conditions and the algo (not the evidence): keys the plan and compat caches."""
        return self._fingerprint

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": ENTRY_SCHEMA,
            "name": self.name,
            "role": self.role,
            "device": {"cc": list(self.cc), "sm_count": self.sm_count, "name": self.device_name},
            "versions": {
                "cuda_header": list(self.cuda_header),
                "cublas_header": list(self.cublas_header),
                "cuda_runtime": self.cuda_runtime,
                "cublaslt_runtime": self.cublaslt_runtime,
            },
            "gemm": {
                "dtype": self.dtype,
                "out_dtype": self.out_dtype,
                "m_logical": self.m_logical,
                "m_padded": self.m_padded,
                "n": self.n,
                "k": self.k,
                "bias": False,
                "lora": False,
                "producer": self.producer,
                "pointer_mode": self.pointer_mode,
                "scale_mode": self.scale_mode,
            },
            "algo": self.algo.as_dict(),
            "workspace_bytes": self.workspace_bytes,
            "source": self.source,
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str = "") -> "Fc2Entry":
        if d.get("schema") != ENTRY_SCHEMA:
            raise ValueError(f"schema is {d.get('schema')!r}; expected {ENTRY_SCHEMA!r}")
        try:
            dev, ver, g = d["device"], d["versions"], d["gemm"]
            if g.get("bias") or g.get("lora"):
                raise ValueError("entries cover only the GEMM without bias and without an active LoRA")
            return cls(
                name=str(d["name"]),
                role=str(d["role"]),
                cc=_ver_pair(dev["cc"]),
                sm_count=int(dev["sm_count"]),
                device_name=str(dev.get("name", "")),
                cuda_header=_ver_pair(ver["cuda_header"]),
                cublas_header=_ver_pair(ver["cublas_header"]),
                cuda_runtime=int(ver["cuda_runtime"]),
                cublaslt_runtime=int(ver["cublaslt_runtime"]),
                dtype=str(g["dtype"]),
                out_dtype=str(g["out_dtype"]),
                m_logical=int(g["m_logical"]),
                m_padded=int(g["m_padded"]),
                n=int(g["n"]),
                k=int(g["k"]),
                producer=g.get("producer"),
                pointer_mode=str(g.get("pointer_mode", "host")),
                scale_mode=str(g.get("scale_mode", "none")),
                algo=AlgoSpec.from_dict(d["algo"]),
                workspace_bytes=int(d.get("workspace_bytes", 0)),
                source=source or str(d.get("source", "")),
                evidence=d.get("evidence", {}),
            )
        except KeyError as e:
            raise ValueError(f"missing field {e}") from None


GB10_CANONICAL = Fc2Entry(
    name="gb10-fc2-nvfp4-canonical",
    role=ROLE_FC2,
    cc=(12, 1),
    # GB10 has 6,144 CUDA cores = 48 SMs; the seed does not print the SM count, and GB10 exists in one
    # configuration only, so this adds no condition beyond sm_121 on real hardware.
    sm_count=48,
    device_name="NVIDIA GB10",
    cuda_header=(13, 0),
    cublas_header=(13, 1),
    cuda_runtime=13000,
    cublaslt_runtime=130000,
    dtype="nvfp4",
    out_dtype="bf16",
    m_logical=37810,
    m_padded=37824,
    n=5376,
    k=14336,
    algo=AlgoSpec(id=70, tile=20, stages=37, splitk=1, reduction=0, swizzle=0, custom=0),
    workspace_bytes=0,
    # alpha = gsA * gsB lives on the device (dynamic activation scale); the seed does not record the
    # pointer mode, AlgoCheck verifies the algo supports it.
    pointer_mode="device",
    scale_mode="vec16_ue4m3",
    producer=PRODUCER_SWIGLU_NVFP4,
    source="builtin: seed 003 (fc2_nvfp4_scheduling/RESULTS.md, 2025-08-25)",
    evidence={
        "fc2_p50_ms": {"baseline_stream_k": 53.618, "pinned_splitk1": 15.636},
        "block_gate_p50_ms": {"0": [464.153, 420.714], "24": [460.184, 422.656], "49": [456.183, 420.335]},
        "trajectory_12step_s": [286.431, 262.979],
        "dispatch_12step": "600/600, zero fallback",
        "exact": "block outputs and 2/12-step video/audio BF16 byte-exact vs baseline",
        "not_exact_rows": [37711, 37725, 37742],
    },
)

BUILTIN_ENTRIES: tuple[Fc2Entry, ...] = (GB10_CANONICAL,)


class Fc2Table:
    """The accepted entries, in priority order. A later entry with the same key replaces an earlier one."""

    def __init__(self, entries: Iterable[Fc2Entry] = ()):
        self.entries: list[Fc2Entry] = []
        self.problems: list[str] = []  # files that could not be loaded, and why
        for e in entries:
            self.add(e)

    def add(self, entry: Fc2Entry) -> None:
        for i, old in enumerate(self.entries):
            if old.key == entry.key:
                log.info("fc2 table: %s replaces %s (same key)", entry.name, old.name)
                self.entries[i] = entry
                return
        self.entries.append(entry)

    def load_file(self, path: str | Path) -> Fc2Entry:
        path = Path(path)
        entry = Fc2Entry.from_json(json.loads(path.read_text()), source=str(path))
        self.add(entry)
        return entry

    def load_dir(self, directory: str | Path) -> None:
        """Load every ``*.json`` entry in ``directory``; a bad file is recorded in ``problems``, not raised."""
        d = Path(directory)
        if not d.is_dir():
            return
        for p in sorted(d.glob("*.json")):
            try:
                self.load_file(p)
            except (OSError, ValueError, TypeError) as e:
                self.problems.append(f"{p}: {e}")
                log.warning("fc2 table: ignoring %s: %s", p, e)

    @classmethod
    def default(cls, options: RuntimeOptions) -> "Fc2Table":
        t = cls(BUILTIN_ENTRIES)
        t.load_dir(table_dir(options))
        return t


def table_dir(options: RuntimeOptions) -> Path:
    """Where tuned entries are picked up automatically."""
    return Path(options.cache_dir).expanduser() / "fc2_lt" / "table"


# ----------------------------------------------------------------------------------------------
# the guard


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


def _first_failure(checks: list[tuple[str, bool, str]]) -> tuple[int, Refusal | None]:
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
        depth, refusal = _first_failure(call_checks(e, call))
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
        depth, refusal = _first_failure(env_checks(e, env))
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


@dataclass(frozen=True)
class Fc2Operands:
    """The bytes the producer made, handed unchanged to either path.

    x:       activation, [m_padded, K/2] uint8 / float4_e2m1fn_x2 (nvfp4), [m_padded, K] float8_e4m3fn or bf16
    w:       weight, [N, K/2] / [N, K], same kind as x
    x_scale: nvfp4: swizzled UE4M3 block scales of x (>= roundup(m_padded,128)*roundup(K/16,4) bytes);
             fp8: fp32, 1 value (tensor) or m_padded values (outer); bf16: None
    w_scale: the same for w (rows N)
    alpha:   nvfp4: decode-direction gsA*gsB, a 1-element fp32 CUDA tensor or a float; else 1.0/None
    m_logical: rows of the result the caller keeps (<= m_padded)
    """

    x: torch.Tensor
    w: torch.Tensor
    x_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None
    alpha: torch.Tensor | float | None = None
    m_logical: int = 0
    bias: torch.Tensor | None = None


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


class PlanError(Exception):
    """A plan could not be built or run. ``stage``: one of PLAN_STAGES, ``descriptors``, ``contract``, ``execute``."""

    def __init__(self, stage: str, message: str, info: Mapping[str, Any] | None = None):
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.message = message
        self.info = dict(info or {})


class PlanLayer(Protocol):
    """What the dispatcher needs from a cuBLASLt binding (the real extension or a test fake)."""

    name: str

    def unavailable_reason(self) -> str | None:
        """None when usable; else why not (e.g. the extension failed to build)."""

    def environment(self, device: torch.device) -> Fc2Environment:
        """Versions and the device that a plan for operands on ``device`` would use."""

    def build(self, entry: Fc2Entry, device: torch.device) -> Any:
        """A checked, pinned plan for ``entry``; raises PlanError(stage, message)."""

    def plan_info(self, plan: Any) -> dict[str, Any]:
        """Read-back configuration, workspace and waves of a built plan (JSON-safe)."""

    def run(self, plan: Any, ops: Fc2Operands, out: torch.Tensor) -> None:
        """Enqueue the GEMM into ``out`` [m_padded, N] bf16 on the current stream; raises PlanError."""

    def build_info(self) -> dict[str, Any]:
        """The extension's build_info() plus anything the layer knows (JSON-safe)."""

    def compat_tag(self) -> str:
        """Identifies the binding's build, for the compatibility cache key."""


@dataclass
class _LtPlan:
    ext_plan: Any
    entry: Fc2Entry
    device: torch.device
    workspace: torch.Tensor | None
    alpha_cache: dict = field(default_factory=dict)


class LtPlanLayer:
    """The real plan layer: the ``csrc/fc2_nvfp4_lt.cpp`` extension loaded through ``ext.load``."""

    name = "cublaslt"

    def __init__(self, options: RuntimeOptions, status: Any = None):
        self.options = options
        self._status = status
        self._env: dict[int, Fc2Environment] = {}

    def _ext(self):
        if self._status is None:
            from . import ext

            self._status = ext.load(self.options)
        return self._status

    def unavailable_reason(self) -> str | None:
        st = self._ext()
        return None if st.ok else st.reason

    def build_info(self) -> dict[str, Any]:
        st = self._ext()
        return dict(st.build_info or {}) if st.ok else {"error": st.reason}

    def compat_tag(self) -> str:
        return str(self._ext().tag)

    def environment(self, device: torch.device) -> Fc2Environment:
        st = self._ext()
        info = dict(st.build_info or {})
        if device.type != "cuda":
            info["device"] = None
            info["device_error"] = f"operands are on {device}, not a CUDA device"
            return Fc2Environment.from_build_info(info)
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._env:
            with torch.cuda.device(idx):
                self._env[idx] = Fc2Environment.from_build_info(st.module.build_info())
        return self._env[idx]

    def build(self, entry: Fc2Entry, device: torch.device) -> _LtPlan:
        mod = self._ext().module
        idx = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(idx):
            try:
                prob = mod.Problem(entry.dtype, entry.m_padded, entry.n, entry.k, entry.pointer_mode, entry.scale_mode)
            except (RuntimeError, ValueError) as e:
                raise PlanError("descriptors", f"cuBLASLt handle/descriptors: {e}") from None
            plan = prob.pinned_plan(entry.algo.as_dict(), entry.workspace_bytes)
            info = dict(plan.info())
            if not plan.ok:
                raise PlanError(info["stage"], info["message"], info)
            ws = None
            if plan.workspace_required > 0:
                ws = torch.empty(int(plan.workspace_required), dtype=torch.uint8, device=torch.device("cuda", idx))
        return _LtPlan(plan, entry, torch.device("cuda", idx), ws)

    def plan_info(self, plan: _LtPlan) -> dict[str, Any]:
        return dict(plan.ext_plan.info())

    def run(self, plan: _LtPlan, ops: Fc2Operands, out: torch.Tensor) -> None:
        alpha_t, alpha_h = None, 1.0
        a = ops.alpha
        if isinstance(a, torch.Tensor):
            if plan.entry.pointer_mode != "device":
                raise PlanError("contract", "this entry uses host pointer mode; pass alpha as a Python float")
            alpha_t = a
        elif a is not None:
            alpha_h = float(a)
            if plan.entry.pointer_mode == "device":
                alpha_t = plan.alpha_cache.get(alpha_h)
                if alpha_t is None:  # prefer a device tensor: a float costs a small upload per new value
                    if len(plan.alpha_cache) > 16:
                        plan.alpha_cache.clear()
                    alpha_t = torch.full((1,), alpha_h, dtype=torch.float32, device=plan.device)
                    plan.alpha_cache[alpha_h] = alpha_t
        stream = torch.cuda.current_stream(plan.device).cuda_stream
        with torch.cuda.device(plan.device):
            try:
                st = plan.ext_plan.run(ops.x, ops.w, out, ops.x_scale, ops.w_scale, alpha_t, alpha_h,
                                       plan.workspace, stream)
            except ValueError as e:
                raise PlanError("contract", str(e)) from None
            except RuntimeError as e:
                raise PlanError("execute", str(e)) from None
        if st != 0:
            raise PlanError("execute", f"cublasLtMatmul returned {self._ext().module.status_name(st)} ({st})")


# ----------------------------------------------------------------------------------------------
# on-disk compatibility cache


class CompatCache:
    """Measured compatibility per (device model, versions, extension build), one JSON file per key.

    Records, per entry fingerprint: whether the plan was built (or the stage/reason it was refused),
    its read-back info, and the self-test result. A refusal at a plan stage is replayed without
    rebuilding; a passed self-test is not repeated.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @staticmethod
    def key_fields(env: Fc2Environment, layer_tag: str) -> dict[str, Any]:
        return {
            "device_name": env.device_name,
            "cc": list(env.cc) if env.cc else None,
            "sm_count": env.sm_count,
            "cuda_runtime": env.cuda_runtime,
            "cublaslt_runtime": env.cublaslt_runtime,
            "cuda_header": env.cuda_header,
            "cublas_header": env.cublas_header,
            "cuda_driver": env.cuda_driver,
            "torch": torch.__version__,
            "layer": layer_tag,
        }

    def path(self, env: Fc2Environment, layer_tag: str) -> Path:
        fields = self.key_fields(env, layer_tag)
        h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
        return self.root / f"{h}.json"

    def load(self, env: Fc2Environment, layer_tag: str) -> dict[str, Any]:
        p = self.path(env, layer_tag)
        try:
            rec = json.loads(p.read_text())
            if rec.get("schema") == COMPAT_SCHEMA and rec.get("key") == self.key_fields(env, layer_tag):
                return rec
        except (OSError, ValueError):
            pass
        return {"schema": COMPAT_SCHEMA, "key": self.key_fields(env, layer_tag), "entries": {}}

    def store_entry(self, env: Fc2Environment, layer_tag: str, fingerprint: str, result: Mapping[str, Any]) -> None:
        rec = self.load(env, layer_tag)
        cur = dict(rec["entries"].get(fingerprint, {}))
        cur.update(result)
        cur["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        rec["entries"][fingerprint] = cur
        p = self.path(env, layer_tag)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, default=str))
            tmp.replace(p)
        except OSError as e:  # a read-only cache must not break inference
            log.warning("fc2 compat cache not written (%s): %s", p, e)


# ----------------------------------------------------------------------------------------------
# the dispatcher


def _new_counts() -> dict[str, Any]:
    return {"attempts": 0, "successes": 0, "fallbacks": 0, "errors": 0, "reasons": Counter()}


def _freeze_counts(c: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: c[k] for k in ("attempts", "successes", "fallbacks", "errors")}
    out["reasons"] = dict(c["reasons"])
    return out


class Fc2Dispatcher:
    """Runs FC2 through an accepted pinned cuBLASLt plan, or falls back on the same bytes.

    Usage (at load, before any CUDA-graph capture)::

        fc2 = Fc2Dispatcher(options)            # table: builtin + cache_dir/fc2_lt/table/*.json
        fc2.prepare(torch.device("cuda"))       # build plans, cached compatibility, self-test
        fc2.begin_run()
        y = fc2(x_q, w_q, x_scale=xs, w_scale=ws, alpha=gs, m_logical=rows,
                producer=PRODUCER_SWIGLU_NVFP4, fallback=lambda ops: slow_path(ops))
        counts = fc2.end_run()                  # {"attempts", "successes", "fallbacks", ...}
    """

    def __init__(self, options: RuntimeOptions, *, table: Fc2Table | None = None,
                 plan_layer: PlanLayer | None = None, compat: CompatCache | None | bool = True):
        self.options = options
        self.table = table if table is not None else Fc2Table.default(options)
        self.layer: PlanLayer = plan_layer if plan_layer is not None else LtPlanLayer(options)
        if compat is True:
            compat = CompatCache(Path(options.cache_dir).expanduser() / "fc2_lt" / "compat")
        self.compat: CompatCache | None = compat or None
        self._plans: dict[tuple[str, str], Any] = {}  # (entry fingerprint, device) -> plan | Refusal
        self._current: dict[str, Any] | None = None
        self.total = _new_counts()
        self.runs: list[dict[str, Any]] = []
        self._warned: set[str] = set()
        self.prepared: dict[str, Any] = {}

    # -- runs and reports ------------------------------------------------------------------------

    def begin_run(self) -> None:
        self._current = _new_counts()

    def end_run(self) -> dict[str, Any]:
        cur = _freeze_counts(self._current or _new_counts())
        self.runs.append(cur)
        self._current = None
        return cur

    def report(self, required_per_run: int) -> dict[str, Any]:
        """``{required_per_run, runs:[{attempts, successes, fallbacks}], all_passed}`` over the finished runs.

        required_per_run = FC2 calls one sampling run makes (blocks x steps).
        """
        runs = [{k: r[k] for k in ("attempts", "successes", "fallbacks")} for r in self.runs]
        ok = bool(runs) and required_per_run > 0 and all(
            r["attempts"] == required_per_run and r["successes"] == required_per_run and r["fallbacks"] == 0
            for r in runs
        )
        return {"required_per_run": required_per_run, "runs": runs, "all_passed": ok}

    def status(self) -> dict[str, Any]:
        """A JSON-safe summary for the run report: switches, entries, prepare results, lifetime counts."""
        return {
            "enabled": self.options.fc2_lt,
            "strict": self.options.fc2_lt_strict,
            "layer": getattr(self.layer, "name", type(self.layer).__name__),
            # asked only once the layer was needed: for the real layer the first ask may build the extension
            "layer_unavailable": self.layer.unavailable_reason()
            if self.options.fc2_lt and (self.prepared or self.total["attempts"]) else None,
            "entries": [e.name for e in self.table.entries],
            "table_problems": list(self.table.problems),
            "prepared": self.prepared,
            "lifetime": _freeze_counts(self.total),
        }

    def build_info(self) -> dict[str, Any]:
        info = dict(self.layer.build_info())
        if "cublaslt_runtime" in info:
            info["cublaslt_runtime_version"] = info["cublaslt_runtime"]
        return info

    # -- counting --------------------------------------------------------------------------------

    def _count(self, key: str, reason: Refusal | None = None) -> None:
        for c in (self.total, self._current):
            if c is None:
                continue
            c[key] += 1
            if reason is not None:
                c["reasons"][str(reason)] += 1

    def _note(self, refusal: Refusal) -> None:
        s = str(refusal)
        if s not in self._warned:
            self._warned.add(s)
            log.warning("FC2 cuBLASLt path not used: %s", s)

    # -- plans -----------------------------------------------------------------------------------

    def _plan(self, entry: Fc2Entry, env: Fc2Environment, device: torch.device) -> Any:
        """The built plan for (entry, device), or the Refusal that stopped it (both cached)."""
        key = (entry.fingerprint(), str(device))
        if key in self._plans:
            return self._plans[key]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # no plan building inside capture: AlgoCheck/heuristics may allocate or sync
            return Refusal("capture", f"plan for {entry.name} was not prepared before CUDA-graph capture; "
                                      "call Fc2Dispatcher.prepare() at load")
        tag = self.layer.compat_tag()
        if self.compat is not None:
            rec = self.compat.load(env, tag)["entries"].get(entry.fingerprint())
            if rec and rec.get("status") == "refused":
                r = Refusal(rec["code"], f"{rec['detail']} (cached compatibility result; delete "
                                         f"{self.compat.path(env, tag)} to re-measure)")
                self._plans[key] = r
                return r
        try:
            plan = self.layer.build(entry, device)
        except PlanError as e:
            r = Refusal(e.stage, f"{e.message} [entry {entry.name}]")
            self._plans[key] = r
            if self.compat is not None and e.stage in PLAN_STAGES:  # deterministic refusals only
                self.compat.store_entry(env, tag, entry.fingerprint(),
                                        {"entry": entry.name, "status": "refused", "code": e.stage,
                                         "detail": e.message, "plan": e.info})
            return r
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the workspace: refuse, do not cache on disk
            r = Refusal("plan", f"building the plan raised {type(e).__name__}: {e} [entry {entry.name}]")
            self._plans[key] = r
            return r
        self._plans[key] = plan
        if self.compat is not None:
            self.compat.store_entry(env, tag, entry.fingerprint(),
                                    {"entry": entry.name, "status": "ready", "plan": self.layer.plan_info(plan)})
        return plan

    def prepare(self, device: torch.device | str | None = None, *, self_test: bool = True,
                reference: Callable[[Fc2Operands, Fc2Entry], torch.Tensor] | None = None) -> dict[str, Any]:
        """Load the layer and build every entry's plan that this device can take, before inference.

        With ``self_test`` each ready plan runs once on synthetic operands of its exact shape and its
        bytes are compared with ``reference`` (default: torch's own GEMM for the dtype, the path the
        tuner validated against); a mismatch or failure refuses the entry. Results are cached on disk,
        so a passed self-test is not repeated for the same device and versions.
        """
        out: dict[str, Any] = {"enabled": self.options.fc2_lt, "entries": {}}
        self.prepared = out
        try:
            self._prepare(out, device, self_test, reference)
        except Exception as e:  # noqa: BLE001 - preparing an optional fast path must not fail a model load
            out["reason"] = f"internal: {type(e).__name__}: {e}"
            log.warning("FC2 cuBLASLt prepare failed: %s", out["reason"])
        return out

    def _prepare(self, out: dict[str, Any], device: torch.device | str | None, self_test: bool,
                 reference: Callable[[Fc2Operands, Fc2Entry], torch.Tensor] | None) -> None:
        if not self.options.fc2_lt:
            out["reason"] = "disabled (H3_NVFP4_FC2_LT_SPLITK1=0)"
            return
        why = self.layer.unavailable_reason()
        if why is not None:
            out["reason"] = f"extension: {why}"
            log.warning("FC2 cuBLASLt path unavailable: %s", why)
            return
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        env = self.layer.environment(device)
        out["environment"] = env.as_dict()
        out["build_info"] = self.build_info()
        tag = self.layer.compat_tag()
        for entry in self.table.entries:
            depth, refusal = _first_failure(env_checks(entry, env))
            if refusal is not None:
                out["entries"][entry.name] = {"status": "not this device", "reason": str(refusal)}
                continue
            plan = self._plan(entry, env, device)
            if isinstance(plan, Refusal):
                out["entries"][entry.name] = {"status": "refused", "reason": str(plan)}
                continue
            res: dict[str, Any] = {"status": "ready", "plan": self.layer.plan_info(plan)}
            if self_test:
                st = res["self_test"] = self._self_test(entry, env, tag, plan, device, reference)
                if not st.get("passed"):
                    r = Refusal("self_test", f"{st.get('detail')} [entry {entry.name}]")
                    self._plans[(entry.fingerprint(), str(device))] = r
                    res["status"] = "refused"
                    res["reason"] = str(r)
                    if self.compat is not None and reference is None and "mismatched_elements" in st:
                        # different bytes from the reference are a property of (device, versions, algo): remember
                        self.compat.store_entry(env, tag, entry.fingerprint(),
                                                {"status": "refused", "code": "self_test", "detail": st["detail"]})
            out["entries"][entry.name] = res

    def _self_test(self, entry: Fc2Entry, env: Fc2Environment, tag: str, plan: Any, device: torch.device,
                   reference: Callable[[Fc2Operands, Fc2Entry], torch.Tensor] | None) -> dict[str, Any]:
        fp = entry.fingerprint()
        if self.compat is not None:
            prior = self.compat.load(env, tag)["entries"].get(fp, {}).get("self_test")
            if prior and prior.get("passed") and reference is None:
                return dict(prior, cached=True)
        from .tune_fc2 import compare_bytes, reference_gemm, synthetic_operands

        t0 = time.perf_counter()
        try:
            ops = synthetic_operands(entry.dtype, entry.m_logical, entry.m_padded, entry.n, entry.k, device,
                                     seed=1234, scale_mode=entry.scale_mode)
            out = torch.full((entry.m_padded, entry.n), float("nan"), dtype=torch.bfloat16, device=device)
            self.layer.run(plan, ops, out)
            ref = (reference(ops, entry) if reference is not None
                   else reference_gemm(ops, entry.dtype, entry.scale_mode))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            cmp = compare_bytes(out, ref)
            res = {"passed": cmp["equal"], "mismatched_elements": cmp["mismatched"],
                   "reference": "caller" if reference is not None else "torch",
                   "detail": "byte-identical to the reference GEMM" if cmp["equal"]
                   else f"{cmp['mismatched']} of {out.numel()} bf16 elements differ from the reference GEMM",
                   "seconds": round(time.perf_counter() - t0, 3)}
            del ops, out, ref
        except PlanError as e:
            res = {"passed": False, "detail": f"{e.stage}: {e.message}"}
        except Exception as e:  # noqa: BLE001 - e.g. the torch reference is unsupported here
            res = {"passed": False, "detail": f"self-test could not run: {type(e).__name__}: {e}"}
        if self.compat is not None:
            self.compat.store_entry(env, tag, fp, {"entry": entry.name, "self_test": res})
        return res

    # -- the call --------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *, m_logical: int,
                 fallback: Callable[[Fc2Operands], torch.Tensor], x_scale: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, alpha: torch.Tensor | float | None = None,
                 role: str = ROLE_FC2, bias: torch.Tensor | None = None, lora_active: bool = False,
                 producer: str | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """y[m_logical, N] = x . w^T (+ nothing): the pinned plan when accepted, else ``fallback(ops)``.

        ``fallback`` receives the same :class:`Fc2Operands` (the same tensor objects) and must return
        ``[m_logical, N]`` in ``out_dtype``. ``out`` (optional) is a [m_padded, N] bf16 buffer for the
        pinned path; the result is then a view of it.
        """
        ops = Fc2Operands(x=x, w=w, x_scale=x_scale, w_scale=w_scale, alpha=alpha, m_logical=m_logical, bias=bias)
        self._count("attempts")
        try:
            result = self._try(ops, role=role, out_dtype=out_dtype, lora_active=lora_active, producer=producer,
                               out=out)
        except Exception as e:  # noqa: BLE001 - never take a run down: record it, fall back (or raise if strict)
            result = Refusal("internal", f"{type(e).__name__}: {e}")
        if isinstance(result, torch.Tensor):
            self._count("successes")
            return result
        self._note(result)
        if self.options.fc2_lt_strict and result.code != "disabled":
            self._count("errors", result)
            raise Fc2LtError(result)
        self._count("fallbacks", result)
        return fallback(ops)

    def _try(self, ops: Fc2Operands, *, role: str, out_dtype: torch.dtype, lora_active: bool,
             producer: str | None, out: torch.Tensor | None) -> torch.Tensor | Refusal:
        if not self.options.fc2_lt:
            return Refusal("disabled", "the FC2 cuBLASLt path is off (H3_NVFP4_FC2_LT_SPLITK1=0)")
        call = describe_call(ops, role=role, out_dtype=out_dtype, lora_active=lora_active, producer=producer)
        if isinstance(call, Refusal):
            return call
        hits, refusal = match_call(self.table, call)
        if refusal is not None:
            return refusal
        why = self.layer.unavailable_reason()
        if why is not None:
            return Refusal("extension", why)
        device = ops.x.device
        env = self.layer.environment(device)
        entry, refusal = match_env(hits, env)
        if refusal is not None:
            return refusal
        assert entry is not None
        plan = self._plan(entry, env, device)
        if isinstance(plan, Refusal):
            return plan
        if out is None:
            out = torch.empty((call.m_padded, call.n), dtype=torch.bfloat16, device=device)
        elif tuple(out.shape) != (call.m_padded, call.n) or out.dtype != torch.bfloat16:
            return Refusal("contract",
                           f"out is {out.dtype} {tuple(out.shape)}; expected bf16 [{call.m_padded}, {call.n}]")
        try:
            self.layer.run(plan, ops, out)
        except PlanError as e:
            r = Refusal(e.stage, f"{e.message} [entry {entry.name}]")
            if e.stage == "execute":
                # a plan that failed to execute once is not retried in this process
                self._plans[(entry.fingerprint(), str(device))] = Refusal(
                    "execute", f"{e.message} (failed earlier in this process; plan disabled) [entry {entry.name}]")
            return r
        return out[: call.m_logical]
