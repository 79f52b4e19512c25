"""Merging LoRA updates into the weights, and restoring the originals.

Contract (``merged_weight``): ``W = fp32(W0 + sum_i s_i * (alpha_i / r_i) * B_i @ A_i [+ s_j * diff_j])`` in
float64, rounded once; an NVFP4 layer then holds the reference quantizer's bytes of W (``merge_nvfp4``), a
dense parameter ``W.to(its dtype)`` (``merge_dense``). Before a tensor is first patched its ``Original`` is
recorded in the model's ``LoraState``; ``restore_all`` puts every patched tensor back bit for bit, unhooks
every side path and puts the runtime's base BlockOps back (``rt.ops``, kept in ``base_ops`` while a
``LoraOps`` carries the block linears' side paths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from ..ops import nvfp4
from .key_forms import LOWRANK, LoraUpdate
from .pdd import restore_bank
from .side import SIDE_ATTR, uninstall_side
from .source import Original, SourceWeights, nvfp4_equal, quantize_like

STATE_ATTR = "_h3_lora_state"


_ROW_CHUNK = 2048  # rows merged per float64 step (bounds the temporaries whatever the layer size)
_UPLOAD_STREAMS: dict = {}  # CUDA device index -> the stream LoRA factors cross to the device on


def _upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` (as stored) on ``dev``, without making the host wait for the work already queued there.

    A copy from pageable host memory on the current stream first waits for every kernel queued on that stream; a
    merge run at a block's gate in the middle of a step (``runtime.lora.apply._apply_behind``), or a merge each run
    applies to the AdaLN weights it brings over (``merge_on_transfer``), then held the host until the step's queued
    blocks had run, and the GPU idled while the host caught up. Here the copy runs on a stream of its own, which
    waits for nothing; the current stream waits for the copy on the device (an event, no host sync), and the
    device tensor is marked in use by the current stream, so its memory is not reused before the merge has read it.
    The same bytes as ``t.to(dev)``."""
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    side = _UPLOAD_STREAMS.get(index)
    if side is None:
        side = _UPLOAD_STREAMS.setdefault(index, torch.cuda.Stream(index))
    current = torch.cuda.current_stream(index)
    with torch.cuda.stream(side):
        out = t.to(torch.device("cuda", index))  # waits for this copy only (the side stream holds nothing else)
    current.wait_stream(side)
    out.record_stream(current)
    return out


def merged_weight(w0: torch.Tensor, entries: Sequence[tuple[float, LoraUpdate]],
                  device: torch.device | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
    """The merge contract: fp32(W0 + sum s*(alpha/r)*B@A (+ s*diff)) in float64, rounded once.

    w0 [N, K] or [N] any float dtype; entries: (strength, update) in stack order; device: where the
    float64 math runs (default w0's). Row-chunked so the float64 temporaries stay ~_ROW_CHUNK rows whatever N
    is. Returns the fp32 result on w0's device, or, with ``into`` (w0's shape, on w0's device, any float dtype;
    w0 itself for an in-place merge: each chunk is read before it is written), that fp32 result cast to
    ``into``'s dtype chunk by chunk where the math runs, written there and returned: the bytes of
    ``merged_weight(w0, entries).to(into.dtype)`` without the full-size fp32 copy or its transfer.
    """
    n = w0.shape[0]
    out = torch.empty(w0.shape, dtype=torch.float32, device=w0.device) if into is None else into
    dev = torch.device(device) if device is not None else w0.device
    # a low-rank update's factors reach ``dev`` once per tensor ([rows, r] and [r, K] in float64: megabytes), not
    # once per row chunk, and on a stream of their own (``_upload``): the host never waits for the math queued
    # before them (the same values either way)
    ups = [(s, u, *((_upload(u.up, dev).to(torch.float64), _upload(u.down, dev).to(torch.float64))
                    if u.kind == LOWRANK else (None, None))) for s, u in entries]
    for r0 in range(0, n, _ROW_CHUNK):
        r1 = min(n, r0 + _ROW_CHUNK)
        acc = w0[r0:r1].to(dev, torch.float64, copy=True)
        for s, u, up, down in ups:
            a, b = u.rows
            i0, i1 = max(r0, a), min(r1, b)
            if i0 >= i1:
                continue
            if u.kind == LOWRANK:
                acc[i0 - r0:i1 - r0] += (up[i0 - a:i1 - a] @ down) * (s * u.unit_scale)
            else:
                acc[i0 - r0:i1 - r0] += _upload(u.delta[i0 - a:i1 - a], dev).to(torch.float64) * s
        out[r0:r1] = acc.to(torch.float32).to(out.dtype).to(out.device)
    return out


@dataclass
class LoraState:
    originals: dict = field(default_factory=dict)  # tensor name -> Original
    sides: dict = field(default_factory=dict)  # module name -> (module, prev hooks): layers outside BlockOps
    block_sides: dict = field(default_factory=dict)  # block linear name -> LoraSide (in the LoraOps that is rt.ops)
    base_ops: object | None = None  # rt.ops before the LoraOps wrapped it (None: not wrapped)
    verified: dict = field(default_factory=dict)  # tensor name -> source stamp that reproduces it exactly
    source_cache: dict = field(default_factory=dict)  # the embedded tiny model's source weights
    signature: tuple = ()
    report: dict | None = None
    bank: object | None = None  # runtime.lora.pdd.BankOriginal while a PDD head bank replaces the heads


def lora_state(model: nn.Module) -> LoraState:
    st = model.__dict__.get(STATE_ATTR)
    if st is None:
        st = LoraState()
        model.__dict__[STATE_ATTR] = st
    return st


def _side_paths(model: nn.Module) -> list:
    """Every LoRA side path on ``model``: the block linears' (in the LoraOps) and the hooked layers'."""
    st = model.__dict__.get(STATE_ATTR)
    if st is None:
        return []
    sides = list(st.block_sides.values()) + [getattr(m, SIDE_ATTR, None) for m, _ in st.sides.values()]
    return [side for side in sides if side is not None]


def side_device_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes the LoRA side paths on ``model`` hold on ``device``'s type (every term's A and B; 0 without any)."""
    kind = torch.device(device).type
    return sum(t.numel() * t.element_size() for side in _side_paths(model) for term in side.terms
               for t in (term.down, term.up) if t.device.type == kind)


def move_sides(model: nn.Module, device: torch.device) -> None:
    """Move every LoRA side path on ``model`` (its terms' A and B) to ``device`` (``runtime.offload``)."""
    dev = torch.device(device)
    for side in _side_paths(model):
        for term in side.terms:
            term.down, term.up = term.down.to(dev), term.up.to(dev)
        side.device = dev


def restore_all(rt, st: LoraState, source: SourceWeights) -> None:
    if st.bank is not None:  # the heads a PDD bank replaced, and the config's head_bank
        restore_bank(rt, st.bank)
        st.bank = None
    model = rt.model
    model.adaln_merges.clear()  # merges applied as AdaLN weights come to the device: nothing stored was written
    mods = dict(model.named_modules())
    for name, (module, prev) in list(st.sides.items()):
        uninstall_side(module, prev)
        del st.sides[name]
    if st.base_ops is not None:
        rt.ops = st.base_ops
    st.base_ops, st.block_sides = None, {}
    for tname, rec in list(st.originals.items()):
        if rec.kind == "nvfp4":
            module = mods[tname]
            if rec.backup is not None:
                parts = rec.backup
            else:
                source.check_unchanged(rec.stamp)
                stored, w = source.nvfp4_parts(tname, (module.out_features, module.in_features), model.device)
                q = stored if stored is not None else quantize_like(w, module)
                parts = {"packed": q.packed, "scales": q.scales, "global_scale": q.global_scale}
            for k in ("packed", "scales", "global_scale"):
                getattr(module, k).copy_(parts[k])
        else:
            mod_name, pname = tname.rsplit(".", 1)
            p = getattr(mods[mod_name], pname)
            if rec.backup is not None:
                p.data.copy_(rec.backup["t"])
            else:
                source.check_unchanged(rec.stamp)
                p.data.copy_(source.dense(tname, p.data))
        del st.originals[tname]


def record_dense(st: LoraState, tname: str, p: torch.Tensor, source: SourceWeights) -> Original:
    rec = st.originals.get(tname)
    if rec is None:
        stamp = source.stamp() if source.available else None
        if stamp is not None and source.adopted(tname):  # the load's bytes of the unchanged file: nothing to compare
            st.verified[tname] = stamp
        elif stamp is not None and st.verified.get(tname) != stamp:
            ref = source.dense(tname, p.data)
            if ref is not None and torch.equal(ref, p.data):
                st.verified[tname] = stamp
        if stamp is not None and st.verified.get(tname) == stamp:
            rec = Original("dense", stamp=stamp)
        else:
            rec = Original("dense", backup={"t": p.detach().to("cpu", copy=True)})
        st.originals[tname] = rec
    return rec


def merge_nvfp4(st: LoraState, name: str, module, entries, source: SourceWeights, report: dict,
                device: torch.device) -> None:
    """Merge into an NVFP4 block linear: the math on the model's ``device`` (a streamed block's packed bytes and
    scales live in host memory between uses, its global scale on the device), the result written back where each
    buffer lives."""
    shape = (module.out_features, module.in_features)
    resident = nvfp4.NVFP4Tensor(module.packed.to(device), module.scales.to(device), module.global_scale.to(device),
                                 shape)
    adopted = source.adopted(name)  # the resident bytes are the file's: nothing to read or compare
    stored, w0 = (resident, None) if adopted else source.nvfp4_parts(name, shape, device)
    if name not in st.originals:
        stamp = source.stamp() if source.available else None
        if adopted:
            st.verified[name] = stamp
        elif stamp is not None and st.verified.get(name) != stamp:
            exact = stored if stored is not None else (quantize_like(w0, module) if w0 is not None else None)
            if exact is not None and nvfp4_equal(exact, resident):
                st.verified[name] = stamp
        if stamp is not None and st.verified.get(name) == stamp:
            st.originals[name] = Original("nvfp4", stamp=stamp)
        else:
            st.originals[name] = Original("nvfp4", backup={k: getattr(module, k).detach().to("cpu", copy=True)
                                                             for k in ("packed", "scales", "global_scale")})
    if stored is not None:
        base, origin = nvfp4.dequantize(stored, torch.float64), "checkpoint NVFP4 (dequantized exactly)"
    elif w0 is not None:
        base, origin = w0, f"{source.label} ({str(w0.dtype).replace('torch.', '')})"
    else:
        base, origin = nvfp4.dequantize(resident, torch.float64), "resident NVFP4 (no source weights to read)"
    q = quantize_like(merged_weight(base, entries), module)
    module.packed.copy_(q.packed)
    module.scales.copy_(q.scales)
    module.global_scale.copy_(q.global_scale)
    report["merged_nvfp4"].append(name)
    report["base_weights"][origin] = report["base_weights"].get(origin, 0) + 1


def merge_on_transfer(model, tname: str, entries, device: torch.device, report: dict) -> None:
    """Merge into a block AdaLN weight or bias the model keeps off the device (pinned host memory, or left in the
    checkpoint file: ``runtime.io.adaln_file``): each run applies the merged weight ``merge_dense`` would write
    (float64 on the model's device, one rounding to the weight's dtype) to the copy it brings to the device
    (``H3Model._block_mods``). The stored weight is never written, so nothing is recorded to restore: removal
    forgets the merge."""
    model.adaln_merges[tname] = lambda w: merged_weight(w, entries, device, into=w)
    report["merged_dense"].append(tname)


def merge_dense(st: LoraState, tname: str, p: torch.Tensor, entries, source: SourceWeights, report: dict,
                 device: torch.device) -> None:
    """Merge into a dense tensor in place (it stays where it lives, e.g. offloaded AdaLN in pinned host
    memory); the float64 math runs on the model's device."""
    record_dense(st, tname, p, source)
    merged_weight(p.data, entries, device, into=p.data)
    report["merged_dense"].append(tname)
