"""The FC2 dispatcher: runs FC2 through an accepted, pinned cuBLASLt plan, or falls back on the same bytes.

Contract: ``Fc2Dispatcher.__call__`` gets the FC2 activation exactly as the SwiGLU producer wrote it
(NVFP4 bytes + swizzled block scales on Blackwell; fp8 or bf16 on Hopper) and a ``fallback`` callable. It
returns the bf16 ``[m_padded, n]`` output of the pinned plan only when the guard (:mod:`.guard`) accepts the
call, the device and the plan; otherwise it returns ``fallback(ops)`` called with the very same
``Fc2Operands`` object (no second quantization) and records the guard's reason (``code: detail``).
``prepare`` (at load, before any CUDA-graph capture) builds the plans and self-tests them against the
reference GEMM (:mod:`.operands`); its results are cached per device and versions (:mod:`.lt_plans`).

The entry is bound per run: the first call of a kind (its ``Fc2Call``: shape, dtypes, producer, LoRA) in a
sampling run matches the table and the device once and keeps the entry's plan (or the refusal); the run's
other calls of that kind check only their operands (``describe_call``) and run it. ``begin_run`` starts the
next run's binding. A dispatcher exists only where the load plan applies the guarded path (``runtime.load``);
it takes the plan's settings (cache directory, strict), never the options.

Counters: every call is an attempt; it ends as a success or a fallback (or, in strict mode, an
error raised as :class:`Fc2LtError`). ``begin_run()``/``end_run()`` bracket one sampling run;
``report(required_per_run)`` gives ``{required_per_run, runs, all_passed}`` where required_per_run is
blocks x steps.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .table import Fc2Entry, Fc2LtError, Fc2Table, PLAN_STAGES, ROLE_FC2, Refusal
from .guard import (Fc2Call, Fc2Environment, Fc2Operands, describe_call, env_checks, first_failure, match_call,
                    match_env)
from .lt_plans import CompatCache, LtPlanLayer, PlanError, PlanLayer
from .operands import compare_bytes, reference_gemm, synthetic_operands

log = logging.getLogger("h3_blackwell.fc2_lt")


def _new_counts() -> dict[str, Any]:
    return {"attempts": 0, "successes": 0, "fallbacks": 0, "errors": 0, "reasons": Counter()}


def _freeze_counts(c: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: c[k] for k in ("attempts", "successes", "fallbacks", "errors")}
    out["reasons"] = dict(c["reasons"])
    return out


class Fc2Dispatcher:
    """Runs FC2 through an accepted pinned cuBLASLt plan, or falls back on the same bytes.

    Usage (at load, before any CUDA-graph capture)::

        fc2 = Fc2Dispatcher(plan.cache_dir, strict=plan.fc2_strict)  # table: builtin + cache_dir/fc2_lt/table/*.json
        fc2.prepare(torch.device("cuda"))       # build plans, cached compatibility, self-test
        fc2.begin_run()
        y = fc2(Fc2Operands(x_q, w_q, x_scale=xs, w_scale=ws, alpha=gs, m_logical=rows),
                lambda ops: slow_path(ops), producer=PRODUCER_SWIGLU_NVFP4)
        counts = fc2.end_run()                  # {"attempts", "successes", "fallbacks", ...}
    """

    def __init__(self, cache_dir: str | Path, *, strict: bool = False, table: Fc2Table | None = None,
                 plan_layer: PlanLayer | None = None, compat: CompatCache | None | bool = True):
        """cache_dir: where the extension builds, tuned entries and compatibility results live (the plan's
        ``cache_dir``); strict: a refusal raises Fc2LtError instead of falling back (the plan's ``fc2_strict``)."""
        self.strict = bool(strict)
        self.table = table if table is not None else Fc2Table.default(cache_dir)
        self.layer: PlanLayer = plan_layer if plan_layer is not None else LtPlanLayer(cache_dir)
        if compat is True:
            compat = CompatCache(Path(cache_dir).expanduser() / "fc2_lt" / "compat")
        self.compat: CompatCache | None = compat or None
        self._plans: dict[tuple[str, str], Any] = {}  # (entry fingerprint, device) -> plan | Refusal
        self._bound: dict[tuple[Fc2Call, str], Any] = {}  # this run: (call, device) -> (entry, plan) | Refusal
        self._current: dict[str, Any] | None = None
        self.total = _new_counts()
        self.runs: list[dict[str, Any]] = []
        self._warned: set[str] = set()
        self.prepared: dict[str, Any] = {}

    # -- runs and reports ------------------------------------------------------------------------

    def begin_run(self) -> None:
        self._current = _new_counts()
        self._bound = {}

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
            "enabled": True,  # a dispatcher exists only where the plan applies the guarded path
            "strict": self.strict,
            "layer": getattr(self.layer, "name", type(self.layer).__name__),
            # asked only once the layer was needed: for the real layer the first ask may build the extension
            "layer_unavailable": self.layer.unavailable_reason()
            if (self.prepared or self.total["attempts"]) else None,
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
        out: dict[str, Any] = {"enabled": True, "entries": {}}
        self.prepared = out
        try:
            self._prepare(out, device, self_test, reference)
        except Exception as e:  # noqa: BLE001 - preparing an optional fast path must not fail a model load
            out["reason"] = f"internal: {type(e).__name__}: {e}"
            log.warning("FC2 cuBLASLt prepare failed: %s", out["reason"])
        return out

    def _prepare(self, out: dict[str, Any], device: torch.device | str | None, self_test: bool,
                 reference: Callable[[Fc2Operands, Fc2Entry], torch.Tensor] | None) -> None:
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
            depth, refusal = first_failure(env_checks(entry, env))
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

    def __call__(self, ops: Fc2Operands, fallback: Callable[[Fc2Operands], torch.Tensor], *, role: str = ROLE_FC2,
                 lora_active: bool = False, producer: str | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """y[ops.m_logical, N] = x . w^T (+ nothing): the pinned plan when accepted, else ``fallback(ops)``.

        ``fallback`` receives the same :class:`Fc2Operands` (the same tensor objects) and must return
        ``[m_logical, N]`` in ``out_dtype``. ``out`` (optional) is a [m_padded, N] bf16 buffer for the
        pinned path; the result is then a view of it.
        """
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
        if self.strict:
            self._count("errors", result)
            raise Fc2LtError(result)
        self._count("fallbacks", result)
        return fallback(ops)

    def _try(self, ops: Fc2Operands, *, role: str, out_dtype: torch.dtype, lora_active: bool,
             producer: str | None, out: torch.Tensor | None) -> torch.Tensor | Refusal:
        call = describe_call(ops, role=role, out_dtype=out_dtype, lora_active=lora_active, producer=producer)
        if isinstance(call, Refusal):
            return call
        device = ops.x.device
        key = (call, str(device))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bind(call, device)
            if not (isinstance(bound, Refusal) and bound.code == "capture"):  # capture: may be prepared later
                self._bound[key] = bound
        if isinstance(bound, Refusal):
            return bound
        entry, plan = bound
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
                gone = Refusal("execute", f"{e.message} (failed earlier in this process; plan disabled) "
                                          f"[entry {entry.name}]")
                self._plans[(entry.fingerprint(), str(device))] = gone
                self._bound[key] = gone
            return r
        return out[: call.m_logical]

    def _bind(self, call: Fc2Call, device: torch.device) -> tuple[Fc2Entry, Any] | Refusal:
        """The entry and plan for ``call`` on ``device`` (the guard against the table, the extension, the device
        and the plan), or the first refusal: made once per call kind and run (``_try``)."""
        hits, refusal = match_call(self.table, call)
        if refusal is not None:
            return refusal
        why = self.layer.unavailable_reason()
        if why is not None:
            return Refusal("extension", why)
        env = self.layer.environment(device)
        entry, refusal = match_env(hits, env)
        if refusal is not None:
            return refusal
        assert entry is not None
        plan = self._plan(entry, env, device)
        if isinstance(plan, Refusal):
            return plan
        return entry, plan
