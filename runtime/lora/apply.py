"""LoRA on the resident H3 model: merged (re-quantized NVFP4 or dense) or a bf16 low-rank side path.

``apply_loras(rt, [(path, strength, mode), ...])`` makes the resident model carry exactly that stack
(replacing whatever was applied before; ``[]`` removes everything) and returns a report. Files are read
and validated first (``key_forms``: every key form, one LoraError per bad stack); the model changes only
when all of them fit. Several LoRAs stack in list order, each with its own strength and mode. This module
groups the updates and drives ``merge`` (weights), ``side`` (the side path) and ``source`` (originals).

Modes, per LoRA:

- ``merge``: the update goes into the weights. For every targeted weight W0 (the layer's source
  weight, see below) the merged weight is

      W = fp32( W0 + sum_i s_i * (alpha_i / r_i) * B_i @ A_i  [+ s_j * diff_j] )

  evaluated in float64 (W0, A, B as stored, exact products; terms added in stack order, then in
  (module, rows) order) and rounded ONCE to fp32. An NVFP4 layer (``Nvfp4Linear``) then holds
  ``nvfp4.quantize(W)``, the reference quantizer's bytes, written in place over its buffers. When the
  dense reference stack is active (no NVFP4 layers) the update is merged into the dense weights:
  the parameter holds ``W.to(its dtype)``. No run-time cost either way.
- ``side``: the layer keeps its weights; its output gets ``y[:, a:b] += s * (alpha/r) * (x @ A^T) @ B^T``
  computed with A and B at the layer's compute dtype (bf16 in production: tensor-core GEMMs with fp32
  accumulation, the [S, r] intermediate rounded to bf16, the sum written with one rounding), on top of
  the NVFP4 or dense GEMM output. Exact LoRA math, no re-quantization. ``.diff``/``.diff_b`` tensors have
  no low-rank form and are always merged (the report says so).

The source weight W0 of an NVFP4 layer is read again from where the model came from: the checkpoint
file ``rt.source`` (bf16/fp16/fp32 as stored, NVFP4 dequantized exactly in float64, fp8/int8
dequantized as the loader does), or for the embedded tiny model its seed. Without a source it is the
resident NVFP4 weight dequantized exactly; the report says which (``base_weights``).

Removal restores every patched tensor bit for bit: from the source when it reproduces the resident
original exactly (checked when the layer is first patched; no memory held), else from a host copy taken
then. Side paths are unhooked and the runtime's base BlockOps object is put back as ``rt.ops``.
``remove_loras(rt)`` = ``apply_loras(rt, [])``; ``sync_loras`` applies only when the stack differs; a
``LoraView`` (what the "H3 LoRA" node outputs) carries its stack and applies it only when asked:
``view.sync()`` / ``sync_loras(view)`` (``sample`` and ``run`` call it; reading ``.model`` changes nothing).

Where the side path is added:

- the DiT block linears (``blocks.N.attn.qkv_proj``, ``attn.out_proj``, ``mlp.fc1``, ``mlp.fc2``), whatever the
  stack (reference, NVFP4, W4A8): a BlockOps wrapper, ``rt.ops = LoraOps(base_ops, sides)``
  (``runtime.lora.ops``): the side terms on the reference block's activations (``modulate(norm(x))``, o,
  ``silu(gate) * up`` at the compute dtype). The modules get no hook and no attribute; the base ops object is
  kept on the model's LoraState and put back when the side paths go. ``model(...)`` / ``model.evaluate``
  without ``ops`` run the bare reference, so evaluate with ``rt.ops`` to see block side paths.
- layers outside BlockOps (the token refiner, AdaLN, condition_proj, the final layer): a per-instance
  ``forward`` hook (``runtime.lora.side``); names, types and state-dict keys stay as they are.

PDD head banks (``runtime.lora.pdd``): ``final_layer.{video,audio}_out.set_weight`` / ``set_bias`` in a LoRA file
replace both output heads with an n-head bank (the model's ``head_bank`` becomes n, the sampler blends the heads
along its schedule); removal puts the heads and config back. The file's other tensors are an ordinary LoRA.

FC2 guard: ``LoraOps.fc2`` calls the inner fc2 with ``lora_active=True`` on a block whose fc2 has a side path,
so the guarded dispatcher refuses its pinned cuBLASLt path on every call of that block (reason ``lora: LoRA
side-path active on fc2; the pinned GEMM has no LoRA term``), falls back on the same activation bytes and
the run's FC2 counters record it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..ops.linear import Nvfp4Linear
from ..pending_load import PRELUDE, part_of
from .key_forms import LOWRANK, LoraError, LoraMatch, match_lora, read_lora_file
from .merge import (STATE_ATTR, LoraState, lora_state, merge_dense, merge_nvfp4, merge_on_transfer, merged_weight,
                    restore_all)
from .ops import BLOCK_LINEAR, LoraOps
from .pdd import PddBank, install_bank, split_bank
from .side import LoraSide, install_side, lora_side, module_device, side_active
from .source import SourceWeights
from .spec import MODES, LoraSpec, as_spec, parse_lora_arg

__all__ = ["MODES", "LoraError", "LoraSpec", "LoraSide", "LoraView", "parse_lora_arg", "apply_loras",
           "remove_loras", "sync_loras", "with_lora", "lora_side", "lora_sides", "side_active", "lora_report",
           "merged_weight"]


_FC2 = re.compile(r"^blocks\.\d+\.mlp\.fc2$")


def _base(rt):
    return rt._base if isinstance(rt, LoraView) else rt


def _read_all(rt, specs: list[LoraSpec]) -> tuple[list[LoraMatch], list[PddBank | None]]:
    """Every file read and matched (its PDD head bank, if any, split off first: ``runtime.lora.pdd``)."""
    errors, matches, banks = [], [], []
    for sp in specs:
        try:
            bank, lf = split_bank(read_lora_file(sp.path), rt.config)
            if bank is not None and not lf.tensors:  # a bank alone: no trunk LoRA to match
                matches.append(LoraMatch(lf, [], [], [], "none (a PDD head bank only)"))
            else:
                matches.append(match_lora(lf, rt.model, rt.config))
            banks.append(bank)
        except LoraError as e:
            errors.append(str(e))
    if errors:
        raise LoraError(" | ".join(errors) if len(errors) > 1 else errors[0])
    return matches, banks


def _stack_bank(specs: list[LoraSpec], banks: list, merges: dict, sides: dict) -> PddBank | None:
    """The stack's PDD bank (strength 0 leaves it out), refused when two files bring one or when the stack also
    updates the heads it replaces."""
    active = [b for sp, b in zip(specs, banks) if b is not None and sp.strength != 0.0]
    if len(active) > 1:
        raise LoraError(f"one PDD head bank per LoRA stack; {', '.join(Path(b.file).name for b in active)} each "
                        "bring one. Nothing was changed")
    heads = ("final_layer.video_out", "final_layer.audio_out")
    if active and (any(m in heads for m, _ in merges) or any(m in heads for m in sides)):
        raise LoraError(f"{Path(active[0].file).name} installs a PDD head bank, and the stack also updates the output "
                        "heads (the bank would overwrite that update). Nothing was changed")
    return active[0] if active else None


def apply_loras(rt, specs: Iterable) -> dict:
    """Make the resident model of ``rt`` carry exactly ``specs`` and return the report.

    rt: an H3Runtime or a LoraView; specs: ``[(path, strength, mode)]`` or LoraSpec, stacked in order;
    ``[]`` removes every LoRA. The stack is recorded as ``rt.lora_stack`` (what ``sync_loras(rt)`` restores
    later; a view records it on itself, not on the runtime it shares). Every file is read and validated
    before the model changes: a bad stack raises ONE LoraError and leaves the model as it was. The report
    is also put in ``rt.backends["lora"]`` (so every run report carries it).
    """
    specs = [as_spec(s) for s in specs]
    rep = _apply(_base(rt), specs)
    rt.lora_stack = tuple(specs)
    return rep


def _new_report() -> dict:
    return {"loras": [], "merged_nvfp4": [], "merged_dense": [], "side": [], "skipped": [], "base_weights": {},
            "notes": [], "fc2_side": []}


def _group_updates(specs: list[LoraSpec], matches: list[LoraMatch], mods: dict, model_device: torch.device,
                   report: dict) -> tuple[dict[tuple[str, str], list], dict[str, list]]:
    """The updates of the stack grouped, in stack order: merges per (module, param) as (strength, update),
    side terms per module as (strength, update, file name). Side-mode low-rank updates of modules off the
    model's device, and every diff, are merged (the report's notes say so)."""
    merges: dict[tuple[str, str], list] = {}
    sides: dict[str, list] = {}
    for sp, m in zip(specs, matches):
        entry = {"file": m.file.name, "path": m.file.path, "strength": sp.strength, "mode": sp.mode,
                 "naming": m.forms, "alpha": m.alpha_source, "targets": len(m.targets), "updates": len(m.updates),
                 "skipped": len(m.skipped)}
        report["loras"].append(entry)
        report["skipped"].extend(dict(s, lora=m.file.name) for s in m.skipped)
        if sp.strength == 0.0:
            entry["applied"] = "no (strength 0)"
            continue
        diffs_merged, off_device = 0, set()
        for u in m.updates:
            if sp.mode == "side" and u.kind == LOWRANK and ".adaln_proj." in u.module \
                    and module_device(mods[u.module]) != model_device:
                off_device.add(u.module)  # computed outside its module (offloaded AdaLN): no hook would run
            if sp.mode == "side" and u.kind == LOWRANK and u.module not in off_device:
                sides.setdefault(u.module, []).append((sp.strength, u, m.file.name))
            else:
                merges.setdefault((u.module, u.param), []).append((sp.strength, u))
                diffs_merged += sp.mode == "side" and u.kind != LOWRANK
        if diffs_merged:
            report["notes"].append(f"{m.file.name}: {diffs_merged} full-weight diff tensors have no low-rank form "
                                   "and were merged although the mode is 'side'")
        if off_device:
            report["notes"].append(f"{m.file.name}: {len(off_device)} layers live off the device (AdaLN kept in host "
                                   "memory, computed once per run outside the module), so their side-mode updates "
                                   "were merged: " + ", ".join(sorted(off_device)[:3])
                                   + (" ..." if len(off_device) > 3 else ""))
    return merges, sides


def _refuse_awq_merges(merges: dict[tuple[str, str], list], mods: dict, nv_cls: type) -> None:
    """Raise (before anything changes) when a weight merge targets an AWQ-smoothed NVFP4 layer."""
    for (mname, pname) in merges:
        pqs = getattr(mods[mname], "pre_quant_scale", None) if isinstance(mods[mname], nv_cls) else None
        if pname == "weight" and pqs is not None:
            raise LoraError(f"{mname} is an AWQ-smoothed NVFP4 layer (pre_quant_scale); merging a LoRA into it is not "
                            "supported. Nothing was changed; use mode 'side' for this LoRA")


def _install_sides(rt, st: LoraState, sides: dict[str, list], mods: dict, nv_cls: type, report: dict) -> None:
    """One LoraSide per module (at the layer's compute dtype, on its device) with its terms: the block linears'
    in a LoraOps around the runtime's ops (``rt.ops``; the base kept in ``st.base_ops``), the others hooked in."""
    block: dict[str, LoraSide] = {}
    for mname, terms in sides.items():
        module = mods[mname]
        side_dtype = (module.out_dtype or rt.dtype) if isinstance(module, nv_cls) else module.weight.dtype
        dev = rt.device  # where the layer computes: a streamed block linear (runtime.ops.streaming) and an offloaded
        #                  AdaLN hold host tensors between uses
        side = LoraSide(mname, module.in_features, module.out_features, side_dtype, dev)
        for s, u, fname in terms:
            side.add_term(u, s, fname)
        if BLOCK_LINEAR.match(mname):
            block[mname] = side
        else:
            st.sides[mname] = (module, install_side(mname, module, side))
        report["side"].append(mname)
        if _FC2.match(mname):
            report["fc2_side"].append(mname)
    if block:
        st.base_ops, st.block_sides = rt.ops, block
        rt.ops = LoraOps(rt.ops, block)


def _finish_report(rt, st: LoraState, mods: dict, nv_cls: type, report: dict) -> None:
    """What the model now holds: originals kept, side bytes, which stack merged, the FC2 guard's refusal."""
    report["originals"] = {"from_source": sum(r.backup is None for r in st.originals.values()),
                           "host_copies": sum(r.backup is not None for r in st.originals.values()),
                           "host_copy_bytes": sum(r.nbytes() for r in st.originals.values())}
    report["side_bytes"] = sum(s.nbytes() for s in lora_sides(rt).values())
    report["stack"] = "dense reference stack (merge = into the dense weights)" if not any(
        isinstance(m, nv_cls) for m in mods.values()) else "NVFP4 stack (merge = re-quantized NVFP4)"
    if report["fc2_side"]:
        disp = rt.ops.fc2_dispatcher is not None
        report["fc2_guard"] = ("refused on every FC2 call of " + ", ".join(report["fc2_side"])
                               + ": reason 'lora: LoRA side-path active on fc2' (the pinned GEMM has no LoRA term)"
                               + ("" if disp else "; no FC2 dispatcher is active on this stack"))


@dataclass
class _Merging:
    """What every merge of one stack writes to: the LoRA state, the source weights, the report, the phases' host
    seconds, the model's device."""

    st: LoraState
    source: SourceWeights
    report: dict
    phases: dict
    device: torch.device

    def one(self, model, mname: str, pname: str, entries: list) -> None:
        """One merge of the stack into ``mname.pname`` as the module is now: re-quantized NVFP4, applied to each copy
        a run brings over (AdaLN off the device), or into the dense tensor."""
        module, t = model.get_submodule(mname), time.perf_counter()
        if pname == "weight" and isinstance(module, Nvfp4Linear):
            merge_nvfp4(self.st, mname, module, entries, self.source, self.report, self.device)
            kind = "merge_nvfp4"
        elif model.adaln_off_device(f"{mname}.{pname}"):  # in host memory or the file: merged as each run
            merge_on_transfer(model, f"{mname}.{pname}", entries, self.device, self.report)  # brings it over
            kind = "merge_on_transfer"
        else:
            merge_dense(self.st, f"{mname}.{pname}", getattr(module, pname), entries, self.source, self.report,
                        self.device)
            kind = "merge_dense"
        self.phases[kind] += time.perf_counter() - t  # host clocks: a merge's GPU work lands on its next wait


def _behind(rt, specs: list[LoraSpec]) -> bool:
    """Whether this stack is merged block by block behind a load still running (``_apply_behind``): the load runs
    behind the first step, the model carries no LoRA yet, and every LoRA of the stack merges."""
    if getattr(rt, "pending", None) is None:
        return False
    st = rt.model.__dict__.get(STATE_ATTR)
    fresh = st is None or (not st.originals and not st.sides and st.bank is None and not st.signature)
    return fresh and all(sp.mode == "merge" or sp.strength == 0.0 for sp in specs)


class _BlockMerges:
    """The merges ``_apply_behind`` left to the blocks: run by ``PendingLoad.wait`` on the sampler's thread when
    block j opens (``run``), the report finished after the last. A failure restores every original, drops the
    stack (the model carries no LoRA) and propagates from the wait; the blocks still queued then merge nothing."""

    def __init__(self, rt, merging: _Merging, specs, seconds: float, parts: set):
        self.rt, self.merging, self.specs = rt, merging, specs
        self.seconds, self.left, self.failed = seconds, set(parts), False

    def run(self, part: int, items: list) -> None:
        if self.failed:
            return
        t0 = time.perf_counter()
        model = self.rt.model
        try:
            with torch.no_grad():
                self._merge(model, items)
        except BaseException:
            self.failed = True
            m = self.merging
            restore_all(self.rt, m.st, m.source)
            m.st.signature, m.st.report = (), None
            self.rt.lora_stack = ()
            self.rt.backends.pop("lora", None)
            raise
        self.seconds += time.perf_counter() - t0
        self.left.discard(part)
        if not self.left:
            self.finish()

    def _merge(self, model, items: list) -> None:
        for (mname, pname), entries in items:
            self.merging.one(model, mname, pname, entries)

    def finish(self) -> None:
        m = self.merging
        _finish_report(self.rt, m.st, dict(self.rt.model.named_modules()), Nvfp4Linear, m.report)
        m.report["seconds"] = round(self.seconds, 3)
        m.report["phase_seconds"] = {k: round(v, 4) for k, v in m.phases.items()}
        _publish(self.rt, m.report, self.specs)


def _refuse_awq_behind(rt, merges: dict) -> None:
    """``_refuse_awq_merges`` before the layers are loaded: from the checkpoint's keys (an AWQ-smoothed stored NVFP4
    layer has ``<layer>.pre_quant_scale``)."""
    ck = getattr(rt.plan, "checkpoint", None)
    keys = set(ck.keys()) if ck is not None else set()
    stored = set(rt.plan.stored_nvfp4)
    for (mname, pname) in merges:
        if pname == "weight" and mname in stored and f"{mname}.pre_quant_scale" in keys:
            raise LoraError(f"{mname} is an AWQ-smoothed NVFP4 layer (pre_quant_scale); merging a LoRA into it is not "
                            "supported. Nothing was changed; use mode 'side' for this LoRA")


def _apply_behind(rt, specs: list[LoraSpec], matches: list, t0: float) -> dict:
    """``_apply`` while the load runs behind the first step: the files are read and checked now, the merges into the
    model's entries outside the blocks run now (after the load's prelude), and each block's merges are queued on
    its part of the load (``PendingLoad.then``): the sampler runs them when the first step reaches the block, after
    its tensors are checked and before its modulation rows or its compute. The bytes are ``_apply``'s (the same
    merges of the same loaded tensors); only when they run differs. The report is finished by the last block's."""
    pending = rt.pending
    pending.prelude()
    t = time.perf_counter()
    phases = {"read_files": t - t0, "merge_nvfp4": 0.0, "merge_dense": 0.0, "merge_on_transfer": 0.0}
    model = rt.model
    st = lora_state(model)
    source = SourceWeights(rt, st.source_cache)
    model_device = model.device
    report = _new_report()
    merges, sides = _group_updates(specs, matches, dict(model.named_modules()), model_device, report)
    if sides:  # _behind admits merge stacks only
        raise AssertionError("side paths in a stack merged behind the load")
    _refuse_awq_behind(rt, merges)
    phases["group"] = time.perf_counter() - t
    by_part: dict[int, list] = {}
    for key, entries in merges.items():
        by_part.setdefault(part_of(key[0]), []).append((key, entries))
    merging = _Merging(st, source, report, phases, model_device)
    try:
        for (mname, pname), entries in by_part.pop(PRELUDE, []):
            merging.one(model, mname, pname, entries)
    except BaseException:
        restore_all(rt, st, source)
        raise
    report["notes"].append(f"merged into each block when the first step reached it ({len(by_part)} blocks): the "
                           "load ran behind the first step")
    deferred = _BlockMerges(rt, merging, specs, time.perf_counter() - t0, set(by_part))
    for part, items in sorted(by_part.items()):
        pending.then(part, lambda part=part, items=items: deferred.run(part, items))
    st.signature = tuple(sp.signature() for sp in specs)
    st.report = report
    if not by_part:
        deferred.finish()
    else:
        _publish(rt, report, specs)
    return report


@torch.no_grad()
def _apply(rt, specs: list[LoraSpec]) -> dict:
    """Validate every file, then restore the model's originals and apply ``specs`` (merges, then side paths);
    any failure restores the originals before it propagates. Returns the report. While the load runs behind the
    first step, a merge stack on a model without LoRA is merged block by block behind it (``_apply_behind``);
    anything else waits for the load first."""
    t0 = time.perf_counter()
    matches = None
    if _behind(rt, specs):
        matches, banks = _read_all(rt, specs)
        if not any(b is not None for b in banks):
            return _apply_behind(rt, specs, matches, t0)
    finish = getattr(rt, "finish_load", None)
    if finish is not None:
        finish()
    rt.onload()  # an offloaded runtime's weights come back before any is written
    if matches is None:
        matches, banks = _read_all(rt, specs)
    t = time.perf_counter()
    phases = {"read_files": t - t0, "merge_nvfp4": 0.0, "merge_dense": 0.0, "merge_on_transfer": 0.0}
    model = rt.model
    mods = dict(model.named_modules())
    nv_cls = Nvfp4Linear
    st = lora_state(model)
    source = SourceWeights(rt, st.source_cache)
    model_device = model.device
    report = _new_report()
    merges, sides = _group_updates(specs, matches, mods, model_device, report)
    _refuse_awq_merges(merges, mods, nv_cls)
    bank = _stack_bank(specs, banks, merges, sides)
    phases["group"] = time.perf_counter() - t
    try:
        t = time.perf_counter()
        restore_all(rt, st, source)
        phases["restore"] = time.perf_counter() - t
        merging = _Merging(st, source, report, phases, model_device)
        for (mname, pname), entries in merges.items():
            merging.one(model, mname, pname, entries)
        t = time.perf_counter()
        _install_sides(rt, st, sides, mods, nv_cls, report)
        phases["side_paths"] = time.perf_counter() - t
        if bank is not None:
            st.bank = install_bank(rt, bank)
            report["pdd_bank"] = bank.report()
    except BaseException:
        restore_all(rt, st, source)  # never leave a half-applied stack behind
        st.signature, st.report = (), None
        rt.backends.pop("lora", None)
        raise
    t = time.perf_counter()
    _finish_report(rt, st, mods, nv_cls, report)
    phases["finish_report"] = time.perf_counter() - t
    report["seconds"] = round(time.perf_counter() - t0, 3)
    report["phase_seconds"] = {k: round(v, 4) for k, v in phases.items()}  # where ``seconds`` went
    st.signature = tuple(sp.signature() for sp in specs)
    st.report = report
    _publish(rt, report, specs)
    return report


def _publish(rt, report: dict, specs: list[LoraSpec]) -> None:
    if not specs:
        rt.backends.pop("lora", None)
        return
    modes = sorted({sp.mode for sp in specs if sp.strength != 0.0})
    choice = "+".join(modes) or "none"
    parts = [f"{e['file']} x{e['strength']:g} {e['mode']}" for e in report["loras"]]
    why = f"{len(specs)} LoRA{'s' if len(specs) > 1 else ''}: {', '.join(parts)}"
    n_m = len(report["merged_nvfp4"]) + len(report["merged_dense"])
    why += f"; {n_m} tensors merged, {len(report['side'])} side paths"
    if report["skipped"]:
        why += f"; {len(report['skipped'])} tensors skipped ({report['skipped'][0]['reason']})"
    if report["fc2_side"]:
        why += "; FC2 cuBLASLt path refused (LoRA side path on fc2)"
    if report.get("pdd_bank"):
        why += f"; PDD head bank of {report['pdd_bank']['heads']} heads installed"
    rt.backends["lora"] = {"choice": choice, "reason": why, "report": report}


def remove_loras(rt) -> dict:
    """Remove every LoRA (``apply_loras(rt, [])``): patched tensors restored bit for bit, side paths unhooked."""
    return apply_loras(rt, [])


def lora_sides(rt) -> dict[str, LoraSide]:
    """Every active side path of the resident model by module name: the block linears' (in the LoraOps that
    is ``rt.ops``) and the hooked layers' (refiner, AdaLN, condition_proj, final layer)."""
    st = _base(rt).model.__dict__.get(STATE_ATTR)
    if st is None:
        return {}
    out = {n: s for n, s in st.block_sides.items() if s.active}
    for n, (m, _) in st.sides.items():
        side = lora_side(m)
        if side is not None:
            out[n] = side
    return out


def lora_report(rt) -> dict | None:
    """The report of the stack the resident model carries now (None when it carries none)."""
    st = _base(rt).model.__dict__.get(STATE_ATTR)
    return st.report if st is not None and st.signature else None


def sync_loras(rt, specs: Iterable | None = None) -> dict | None:
    """Make the shared resident model carry ``specs`` (default: ``rt.lora_stack``, i.e. the view's stack, or
    for a plain runtime the stack last applied to it, none by default), doing nothing when it already
    does (same files, sizes, mtimes, strengths, modes). Call it before sampling with ``rt``."""
    if specs is None:
        specs = rt.lora_stack
    specs = [as_spec(s) for s in specs]
    base = _base(rt)
    st = base.model.__dict__.get(STATE_ATTR)
    sig = tuple(sp.signature() for sp in specs)
    if (st.signature if st is not None else ()) == sig:
        return st.report if st is not None else None
    return _apply(base, specs)


class LoraView:
    """A resident runtime seen with a LoRA stack (what the "H3 LoRA" node outputs; a ``runtime.interface.Runtime``).

    It shares the resident model and wants it to carry exactly ``lora_stack``: ``sync()`` (= ``sync_loras(view)``)
    makes it so, with no work when it already does; ``sample`` and ``run`` call it before they evaluate. Reading
    an attribute never changes the model: ``.model`` and ``.ops`` are the shared ones as they are now (another
    view may have synced its own stack since). Every other attribute is the base runtime's.
    """

    def __init__(self, base, stack: Iterable):
        object.__setattr__(self, "_base", _base(base))
        self.lora_stack = tuple(as_spec(s) for s in stack)

    def sync(self) -> dict | None:
        """Make the shared model carry ``lora_stack``; returns the stack's report (None for an empty stack)."""
        return sync_loras(self._base, self.lora_stack)

    @property
    def model(self):
        return self._base.model

    @property
    def ops(self):
        return self._base.ops

    def __getattr__(self, name):
        if name.startswith("__") or name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)


# The rest of the ``runtime.interface.Runtime`` protocol, found on the class: isinstance(view, Runtime) looks each
# member up statically from Python 3.12 on (inspect.getattr_static), past ``__getattr__``.
RUNTIME_MEMBERS = ("config", "device", "dtype", "plan", "backends", "describe", "device_bytes", "fit_memory",
                   "offload", "onload", "check_memory")


def _delegated(name: str) -> property:
    return property(lambda self: getattr(self._base, name), doc=f"The base runtime's ``{name}``.")


for _name in RUNTIME_MEMBERS:
    setattr(LoraView, _name, _delegated(_name))


def with_lora(rt, path: str, strength: float = 1.0, mode: str = "merge") -> LoraView:
    """``rt`` plus one more LoRA on top of its stack (a LoraView; nothing is applied until ``sync``)."""
    return LoraView(rt, tuple(rt.lora_stack) + (LoraSpec(path, strength, mode),))
