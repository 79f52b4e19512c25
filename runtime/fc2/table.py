"""FC2 accepted-configuration entries and the table that holds them.

An entry (:class:`Fc2Entry`, JSON schema ``ENTRY_SCHEMA``) pins one cuBLASLt configuration for one role,
shape (K, N, logical and padded M), operand dtype, producer and device environment (compute capability,
SM count, CUDA / cuBLAS header and runtime versions). Entries come from evidence, never from inference:

- ``GB10_CANONICAL`` is the study in ``shared/seeds/003_7ef155e2299f514b.txt``: FC2, K=14,336,
  N=5,376, logical M=37,810, packed M=37,824, NVFP4 x NVFP4 -> BF16, no bias, no LoRA, after the
  SwiGLU NVFP4 producer, GB10 (sm_121), CUDA 13.0 runtime and headers, cuBLAS 13.1 headers,
  cuBLASLt 13.0 runtime; algo 70 / tile 20 / stages 37 / split-K 1 / reduction 0 / swizzle 0 /
  custom 0, zero workspace; for this exact shape only (its evidence: bench/NOTES.md).
- JSON files written by ``h3-blackwell tune-fc2`` (:mod:`.tune`) under
  ``cache_dir/fc2_lt/table/`` (``table_dir``; the cache directory of ``RuntimeOptions``) or loaded explicitly.

:class:`Fc2Table` holds them in priority order (``Fc2Table.default``: the built-in entry, then the cache
directory's files). :class:`Refusal` is the ``code: detail`` reason every refusal in the package carries.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..io.strict_json import read_json
from ..ops.nvfp4_producers import SWIGLU_PRODUCER


log = logging.getLogger("h3_blackwell.fc2_lt")

ENTRY_SCHEMA = "h3-blackwell/fc2-lt-entry/1"
COMPAT_SCHEMA = "h3-blackwell/fc2-lt-compat/1"
ROLE_FC2 = "fc2"
# The producer that writes FC2's input in one pass (ops.nvfp4_producers.swiglu_quantize, named there); entries
# require it and callers pass it as ``producer=``.
PRODUCER_SWIGLU_NVFP4 = SWIGLU_PRODUCER
KINDS = ("nvfp4", "fp8_e4m3", "bf16")
# The extension's plan stages: a refusal at one of them is a property of (device, versions, algo, shape),
# so it is remembered on disk. "descriptors" (handle or scratch allocation failed) is not.
PLAN_STAGES = ("policy", "init", "config", "check", "workspace", "readback", "heuristic")


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


def _section(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``d[key]``, which must be a JSON object (KeyError when absent)."""
    v = d[key]
    if not isinstance(v, Mapping):
        raise ValueError(f"'{key}' is a JSON {type(v).__name__}; expected an object")
    return v


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
        if not isinstance(d, Mapping):
            raise ValueError(f"the entry is a JSON {type(d).__name__}; expected an object")
        if d.get("schema") != ENTRY_SCHEMA:
            raise ValueError(f"schema is {d.get('schema')!r}; expected {ENTRY_SCHEMA!r}")
        try:
            dev, ver, g = (_section(d, k) for k in ("device", "versions", "gemm"))
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
                algo=AlgoSpec.from_dict(_section(d, "algo")),
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
    evidence={"notes": "bench/NOTES.md, 'The seed's GB10 FC2 entry': its timings, exactness and the logical M "
                        "values that were not exact"},
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
        entry = Fc2Entry.from_json(read_json(path), source=str(path))
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
    def default(cls, cache_dir: str | Path) -> "Fc2Table":
        """The built-in entries, then the tuned files under ``table_dir(cache_dir)``."""
        t = cls(BUILTIN_ENTRIES)
        t.load_dir(table_dir(cache_dir))
        return t


def table_dir(cache_dir: str | Path) -> Path:
    """Where tuned entries are picked up automatically (``cache_dir``: the plan's ``cache_dir``)."""
    return Path(cache_dir).expanduser() / "fc2_lt" / "table"


# ----------------------------------------------------------------------------------------------
# the guard
