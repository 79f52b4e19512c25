"""cuBLASLt plans for accepted FC2 entries: the pluggable plan layer, its stage errors, and the on-disk
compatibility cache.

Contract: a :class:`PlanLayer` reports its environment, builds a plan for an entry on a device (raising
:class:`PlanError` with the extension's stage: ``policy`` ``init`` ``config`` ``check`` ``workspace``
``readback``), and runs it on ``Fc2Operands`` into a bf16 output. :class:`LtPlanLayer` drives the compiled
extension (:mod:`.ext`); tests pass a fake with the same methods. :class:`CompatCache` remembers plan
checks and self-test results under ``cache_dir/fc2_lt/compat/``, keyed by the device model and every
version involved, so a refusal that is a property of (device, versions, algo, shape) is paid once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from ..io.atomic import folder_lock, write_file
from ..io.strict_json import read_json
from . import ext
from .table import COMPAT_SCHEMA, Fc2Entry
from .guard import Fc2Environment, Fc2Operands

log = logging.getLogger("h3_blackwell.fc2_lt")

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

    def __init__(self, cache_dir: str | Path, status: Any = None):
        self.cache_dir = cache_dir
        self._status = status
        self._env: dict[int, Fc2Environment] = {}

    def _ext(self):
        if self._status is None:
            self._status = ext.load(self.cache_dir)
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
    rebuilding; a passed self-test is not repeated. Processes sharing the cache folder each add their
    entries: a store reads, merges and replaces the file under the folder's lock, so none is lost.
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
        """The record of this key, or an empty one when the file is missing, unreadable, not JSON, of another key
        or of the wrong shape (it is measured again); entries that are not objects are dropped."""
        key = self.key_fields(env, layer_tag)
        try:
            rec = read_json(self.path(env, layer_tag))
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict) and rec.get("schema") == COMPAT_SCHEMA and rec.get("key") == key \
                and isinstance(rec.get("entries"), dict):
            rec["entries"] = {fp: e for fp, e in rec["entries"].items() if isinstance(e, dict)}
            return rec
        return {"schema": COMPAT_SCHEMA, "key": key, "entries": {}}

    def store_entry(self, env: Fc2Environment, layer_tag: str, fingerprint: str, result: Mapping[str, Any]) -> None:
        p = self.path(env, layer_tag)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with folder_lock(p.parent):  # read-merge-replace as one step: another process's entry is kept
                rec = self.load(env, layer_tag)
                cur = dict(rec["entries"].get(fingerprint, {}))
                cur.update(result)
                cur["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                rec["entries"][fingerprint] = cur
                text = json.dumps(rec, indent=1, sort_keys=True, default=str)
                write_file(p, lambda tmp: tmp.write_text(text), output=False)  # never a half-written file
        except OSError as e:  # a read-only cache must not break inference
            log.warning("fc2 compat cache not written (%s): %s", p, e)
