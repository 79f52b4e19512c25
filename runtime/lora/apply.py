"""LoRA on the resident H3 model: merged (re-quantized NVFP4 or dense) or a bf16 low-rank side path.

``apply_loras(rt, [(path, strength, mode), ...])`` makes the resident model carry exactly that stack
(replacing whatever was applied before; ``[]`` removes everything) and returns a report. Files are read
and validated first (``lora_keys``: every key form, one LoraError per bad stack); the model changes only
when all of them fit. Several LoRAs stack in list order, each with its own strength and mode.

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
then. Side paths are unhooked. ``remove_loras(rt)`` = ``apply_loras(rt, [])``; ``sync_loras`` applies
only when the stack differs; a ``LoraView`` (what the "H3 LoRA" node outputs) syncs its stack whenever
its ``.model`` is used.

Where the side path is added:

- layers called as modules (dense linears of the reference blocks, the refiner, AdaLN, condition_proj,
  and out_proj in the NVFP4 stack): a per-instance ``forward`` hook; names, types and state-dict keys
  stay as they are;
- qkv_proj, fc1, fc2 in the NVFP4 block stack (``runtime.stack.Nvfp4Stack``), which feeds them bytes
  from its fused producers: the stack's block adds their side terms itself (``Nvfp4Stack._sides``) on the
  reference block's activations (``modulate(norm(x))``, ``silu(gate) * up`` at the compute dtype).

FC2 guard: the stack's ``lora_on_fc2`` callable is pointed at ``side_active(blocks[i].mlp.fc2)``, so
with a side path on a block's fc2 the guarded dispatcher refuses its pinned cuBLASLt path on every call
of that block (reason ``lora: LoRA side-path active on fc2; the pinned GEMM has no LoRA term``), falls
back on the same activation bytes and the run's FC2 counters record it.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from ..ops import nvfp4
from .keys import LOWRANK, LoraError, LoraMatch, LoraUpdate, match_lora, read_lora_file

__all__ = ["MODES", "LoraError", "LoraSpec", "LoraSide", "LoraView", "parse_lora_arg", "apply_loras",
           "remove_loras", "sync_loras", "with_lora", "lora_side", "side_active", "lora_report"]

MODES = ("merge", "side")
_STATE = "_h3_lora_state"
_SIDE = "_h3_lora_side"
_FC2 = re.compile(r"^blocks\.\d+\.mlp\.fc2$")
_ROW_CHUNK = 2048  # rows merged per float64 step (bounds the temporaries whatever the layer size)


# ---------------------------------------------------------------------------------------------
# the stack
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoraSpec:
    """One entry of a LoRA stack: a ``.safetensors`` file, its strength, ``merge`` or ``side``."""

    path: str
    strength: float = 1.0
    mode: str = "merge"

    def __post_init__(self):
        if self.mode not in MODES:
            raise LoraError(f"LoRA mode {self.mode!r}: expected one of {', '.join(MODES)}")
        s = float(self.strength)
        if not math.isfinite(s):
            raise LoraError(f"LoRA strength {self.strength!r} is not a finite number")
        object.__setattr__(self, "strength", s)
        object.__setattr__(self, "path", str(self.path))

    def signature(self) -> tuple:
        """Identifies this entry and the file's bytes (size, mtime) for ``sync_loras``."""
        p = Path(self.path)
        try:
            st = p.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None
        return (str(p.resolve()), stamp, self.strength, self.mode)


def _as_spec(s) -> LoraSpec:
    if isinstance(s, LoraSpec):
        return s
    if isinstance(s, (str, os.PathLike)):
        return LoraSpec(str(s))
    if isinstance(s, (tuple, list)) and 1 <= len(s) <= 3:
        return LoraSpec(*s)
    raise LoraError(f"a LoRA entry must be (path, strength, mode) or a LoraSpec; found {s!r}")


def parse_lora_arg(text: str) -> LoraSpec:
    """``FILE:STRENGTH[:MODE]`` (the CLI's ``--lora``) -> LoraSpec. FILE may itself contain ':' (``C:\\...``);
    the fields are taken from the right. The file must exist."""
    parts = text.split(":")
    mode = "merge"
    if len(parts) >= 3 and parts[-1] in MODES:
        mode = parts.pop()
    if len(parts) < 2:
        raise LoraError(f"--lora {text!r}: expected FILE:STRENGTH[:MODE], e.g. turbo.safetensors:1.0:merge "
                        f"(MODE one of {', '.join(MODES)})")
    try:
        strength = float(parts[-1])
    except ValueError:
        raise LoraError(f"--lora {text!r}: strength {parts[-1]!r} is not a number (expected FILE:STRENGTH[:MODE], "
                        f"MODE one of {', '.join(MODES)})") from None
    path = ":".join(parts[:-1])
    if not Path(path).is_file():
        raise LoraError(f"--lora {text!r}: LoRA file not found: {path}")
    return LoraSpec(path, strength, mode)


# ---------------------------------------------------------------------------------------------
# the side path
# ---------------------------------------------------------------------------------------------

@dataclass
class _SideTerm:
    down: torch.Tensor  # [r, K] at the side dtype
    up: torch.Tensor  # [b - a, r]
    scale: float  # strength * alpha / r
    rows: tuple[int, int]
    source: str


class LoraSide:
    """The low-rank terms added to one layer's output: ``y[..., a:b] += scale * (x @ A^T) @ B^T``.

    dtype: the layer's compute dtype (A, B and the [S, r] intermediate); x [..., K] any float dtype,
    y [..., N] the layer's output, updated in place (the fp32-accumulating GEMM writes ``y + scale * t @ B^T``
    with one rounding when y has the side dtype).
    """

    def __init__(self, module_name: str, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device):
        self.module_name, self.in_features, self.out_features = module_name, in_features, out_features
        self.dtype, self.device = dtype, device
        self.terms: list[_SideTerm] = []

    def add_term(self, u: LoraUpdate, strength: float, source: str) -> None:
        self.terms.append(_SideTerm(u.down.to(self.device, self.dtype).contiguous(),
                                    u.up.to(self.device, self.dtype).contiguous(),
                                    strength * u.unit_scale, u.rows, source))

    @property
    def active(self) -> bool:
        return bool(self.terms)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += the side path of x (in place; returns y)."""
        if x.shape[-1] != self.in_features or y.shape[-1] != self.out_features:
            raise ValueError(f"LoRA side path of {self.module_name}: x [..., {x.shape[-1]}] / y [..., {y.shape[-1]}]; "
                             f"expected [..., {self.in_features}] / [..., {self.out_features}]")
        xs = x.reshape(-1, self.in_features).to(self.dtype)
        y2 = y if y.dim() == 2 else y.reshape(-1, self.out_features)
        for t in self.terms:
            h = xs @ t.down.t()  # [S, r]
            ys = y2[:, t.rows[0]:t.rows[1]]
            if ys.dtype == h.dtype:
                ys.addmm_(h, t.up.t(), alpha=t.scale)
            else:
                ys.add_((h @ t.up.t()).to(ys.dtype), alpha=t.scale)
        if y2.data_ptr() != y.data_ptr():  # reshape had to copy (a non-viewable y): write back
            y.copy_(y2.view(y.shape))
        return y

    def nbytes(self) -> int:
        return sum(t.down.numel() * t.down.element_size() + t.up.numel() * t.up.element_size() for t in self.terms)


def lora_side(module: nn.Module) -> LoraSide | None:
    """The side path active on ``module`` (None when there is none)."""
    s = getattr(module, _SIDE, None)
    return s if isinstance(s, LoraSide) and s.active else None


def side_active(module: nn.Module) -> bool:
    """True while a side-path LoRA is active on ``module`` (the FC2 guard's ``lora_active``)."""
    return lora_side(module) is not None


def _nvfp4_linear_cls():
    from ..ops.linear import Nvfp4Linear

    return Nvfp4Linear


def _module_device(module: nn.Module) -> torch.device:
    t = getattr(module, "packed", None)
    t = t if isinstance(t, torch.Tensor) else getattr(module, "weight", None)
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


def _install_side(name: str, module: nn.Module, side: LoraSide) -> dict:
    """Hook ``module``'s forward to add ``side`` (per instance; returns what ``_uninstall_side`` needs)."""
    prev = {"forward": module.__dict__.get("forward")}
    cls = type(module)

    def forward(x):
        f = prev["forward"]
        y = f(x) if f is not None else cls.forward(module, x)
        side.add_(x, y)
        return y

    module.forward = forward
    setattr(module, _SIDE, side)
    return prev


def _uninstall_side(module: nn.Module, prev: dict) -> None:
    for k, f in prev.items():
        module.__dict__.pop(k, None)
        if f is not None:
            module.__dict__[k] = f
    module.__dict__.pop(_SIDE, None)


# ---------------------------------------------------------------------------------------------
# the NVFP4 block stack with side paths
# ---------------------------------------------------------------------------------------------

def _install_stack(model, st: "_State") -> None:
    """Tell the NVFP4 stack's FC2 guard which blocks carry a side path on fc2 (the stack adds the side terms
    of qkv/fc1/fc2 itself: ``Nvfp4Stack._sides``)."""
    stack = getattr(model, "stack", None)
    if stack is None or st.stack is not None:
        return
    blocks = model.blocks
    st.stack = (stack, stack.__dict__.get("lora_on_fc2"))
    stack.lora_on_fc2 = lambda i: side_active(blocks[i].mlp.fc2)


def _uninstall_stack(model, st: "_State") -> None:
    if st.stack is None:
        return
    stack, prev = st.stack
    if prev is not None:
        stack.lora_on_fc2 = prev
    st.stack = None


# ---------------------------------------------------------------------------------------------
# source weights and originals
# ---------------------------------------------------------------------------------------------

_TINY_SOURCE = re.compile(r"^embedded tiny \(seed (-?\d+)\)$")


class _Source:
    """Where the resident model's source weights can be read again.

    - the checkpoint file ``rt.source`` (opened lazily, headers only; files stamped by size and mtime);
    - the embedded tiny model (``rt.source == "embedded tiny (seed N)"`` with the TINY config): its
      weights are a pure function of the seed (``tiny.tiny_state_dict``);
    - nothing (``available`` False): merges into NVFP4 layers start from the resident NVFP4 weights and
      originals are kept as host copies.
    """

    def __init__(self, rt, cache: dict | None = None):
        from ..model.config import TINY

        self.cache = cache if cache is not None else {}
        src = getattr(rt, "source", None)
        self.path = Path(src) if isinstance(src, (str, os.PathLike)) and Path(src).is_file() else None
        m = _TINY_SOURCE.match(src) if isinstance(src, str) and self.path is None else None
        self.tiny_seed = int(m.group(1)) if m and rt.config == TINY else None
        self.dtype = rt.dtype
        self._ck = None
        self._stamp = None
        self._tiny = None

    @property
    def available(self) -> bool:
        return self.path is not None or self.tiny_seed is not None

    @property
    def label(self) -> str:
        return "checkpoint" if self.path is not None else "embedded tiny weights (from the seed)"

    @staticmethod
    def _stamps(ck) -> tuple:
        return tuple((str(h.path), h.path.stat().st_size, h.path.stat().st_mtime_ns) for h in ck.headers)

    def ck(self):
        if self._ck is None:
            from ..io.checkpoint import open_checkpoint

            self._ck = open_checkpoint(self.path)
            self._stamp = self._stamps(self._ck)
        return self._ck

    def tiny(self) -> dict:
        if self._tiny is None:
            from ..model.config import TINY
            from ..model.tiny import tiny_state_dict

            key = ("tiny", self.tiny_seed, self.dtype)
            if key not in self.cache:
                self.cache.clear()
                self.cache[key] = tiny_state_dict(TINY, self.tiny_seed, self.dtype)
            self._tiny = self.cache[key]
        return self._tiny

    def stamp(self) -> tuple:
        if self.path is None:
            return ("tiny", self.tiny_seed)
        self.ck()
        return self._stamp

    def check_unchanged(self, stamp: tuple) -> None:
        if self.stamp() != stamp:
            raise LoraError(f"the checkpoint {self.path} changed on disk since its layers were patched, so the "
                            "original weights cannot be restored from it; reload the model")

    def dense(self, param: str, like: torch.Tensor) -> torch.Tensor | None:
        """The parameter as the loader assigned it (dtype and device of ``like``), or None."""
        from ..io.checkpoint import dequantize_layer

        if not self.available:
            return None
        if self.path is None:
            t = self.tiny().get(param)
        else:
            ck = self.ck()
            layer = param[: -len(".weight")] if param.endswith(".weight") else None
            fmt = ck.quant_format(layer) if layer and param in ck.keys() else None
            if fmt is None and layer and param in ck.keys() and ck.dtype_name(param) in ("F8_E4M3", "F8_E5M2", "I8",
                                                                                           "U8"):
                fmt = {"format": "int8_tensorwise"}
            if fmt is not None:
                t = dequantize_layer(ck, layer, fmt, like.device)
            elif param in ck.keys():
                t = ck.tensor(param, like.device)
            else:
                t = None
        if t is None or tuple(t.shape) != tuple(like.shape):
            return None
        return t.to(device=like.device, dtype=like.dtype)

    def nvfp4_parts(self, layer: str, shape: tuple[int, int], device):
        """(stored NVFP4Tensor or None, float source W0 or None) of a block linear."""
        from ..io.checkpoint import dequantize_layer
        if not self.available:
            return None, None
        if self.path is None:
            t = self.tiny().get(layer + ".weight")
            return None, (t.to(device) if t is not None and tuple(t.shape) == tuple(shape) else None)
        ck = self.ck()
        if layer + ".weight" not in ck.keys():
            return None, None
        fmt = ck.quant_format(layer)
        if fmt is not None and fmt.get("format") == "nvfp4":
            q = nvfp4.from_comfy_quant(*(ck.tensor(layer + s, device) for s in (".weight", ".weight_scale",
                                                                                ".weight_scale_2")), shape=shape)
            return q, None
        if fmt is None and ck.dtype_name(layer + ".weight") in ("F8_E4M3", "F8_E5M2", "I8", "U8"):
            fmt = {"format": "int8_tensorwise"}
        t = dequantize_layer(ck, layer, fmt, device) if fmt is not None else ck.tensor(layer + ".weight", device)
        return None, (t if tuple(t.shape) == tuple(shape) else None)


@dataclass
class _Original:
    """How to put one patched tensor (a dense parameter, or an NVFP4 layer's three buffers) back."""

    kind: str  # "dense" | "nvfp4"
    backup: dict | None = None  # host copies when the checkpoint cannot reproduce the original
    stamp: tuple | None = None  # the checkpoint files' (path, size, mtime) when it can

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.backup or {}).values())


def _nv_equal(a, b) -> bool:
    return (a.shape == b.shape and torch.equal(a.packed, b.packed) and torch.equal(a.scales.view(torch.uint8),
            b.scales.view(torch.uint8)) and torch.equal(a.global_scale, b.global_scale))


def _quantize_like(w: torch.Tensor, module):
    """nvfp4.quantize with the row padding of ``module``'s packed buffer."""
    n = module.out_features
    pad = 16 if module.packed.shape[0] == nvfp4.roundup(n, 16) else 1
    q = nvfp4.quantize(w, pad_rows=pad)
    if q.packed.shape != module.packed.shape:
        raise LoraError(f"re-quantizing {n}x{module.in_features}: packed {list(q.packed.shape)} does not fit the "
                        f"layer's buffer {list(module.packed.shape)}")
    return q


# ---------------------------------------------------------------------------------------------
# merging
# ---------------------------------------------------------------------------------------------

def merged_weight(w0: torch.Tensor, entries: Sequence[tuple[float, LoraUpdate]],
                  device: torch.device | None = None) -> torch.Tensor:
    """The merge contract: fp32(W0 + sum s*(alpha/r)*B@A (+ s*diff)) in float64, rounded once.

    w0 [N, K] or [N] any float dtype; entries: (strength, update) in stack order; device: where the
    float64 math runs (default w0's; the result is on w0's device). Row-chunked so the float64 temporaries
    stay ~_ROW_CHUNK rows whatever N is.
    """
    n = w0.shape[0]
    out = torch.empty(w0.shape, dtype=torch.float32, device=w0.device)
    dev = torch.device(device) if device is not None else w0.device
    ups = [(s, u, (u.down.to(dev, torch.float64) if u.kind == LOWRANK else None)) for s, u in entries]
    for r0 in range(0, n, _ROW_CHUNK):
        r1 = min(n, r0 + _ROW_CHUNK)
        acc = w0[r0:r1].to(dev, torch.float64, copy=True)
        for s, u, down in ups:
            a, b = u.rows
            i0, i1 = max(r0, a), min(r1, b)
            if i0 >= i1:
                continue
            if u.kind == LOWRANK:
                acc[i0 - r0:i1 - r0] += (u.up[i0 - a:i1 - a].to(dev, torch.float64) @ down) * (s * u.unit_scale)
            else:
                acc[i0 - r0:i1 - r0] += u.delta[i0 - a:i1 - a].to(dev, torch.float64) * s
        out[r0:r1] = acc.to(torch.float32).to(out.device)
    return out


@dataclass
class _State:
    originals: dict = field(default_factory=dict)  # tensor name -> _Original
    sides: dict = field(default_factory=dict)  # module name -> (module, prev hooks)
    stack: tuple | None = None  # (the model's Nvfp4Stack, its previous lora_on_fc2) while wrapped
    verified: dict = field(default_factory=dict)  # tensor name -> source stamp that reproduces it exactly
    source_cache: dict = field(default_factory=dict)  # the embedded tiny model's source weights
    signature: tuple = ()
    report: dict | None = None


def _state(model: nn.Module) -> _State:
    st = model.__dict__.get(_STATE)
    if st is None:
        st = _State()
        model.__dict__[_STATE] = st
    return st


def _base(rt):
    return rt._base if isinstance(rt, LoraView) else rt


def _restore_all(rt, st: _State, source: _Source) -> None:
    model = rt.model
    mods = dict(model.named_modules())
    _uninstall_stack(model, st)
    for name, (module, prev) in list(st.sides.items()):
        _uninstall_side(module, prev)
        del st.sides[name]
    for tname, rec in list(st.originals.items()):
        if rec.kind == "nvfp4":
            module = mods[tname]
            if rec.backup is not None:
                parts = rec.backup
            else:
                source.check_unchanged(rec.stamp)
                stored, w = source.nvfp4_parts(tname, (module.out_features, module.in_features), module.packed.device)
                q = stored if stored is not None else _quantize_like(w, module)
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


def _record_dense(st: _State, tname: str, p: torch.Tensor, source: _Source) -> _Original:
    rec = st.originals.get(tname)
    if rec is None:
        stamp = source.stamp() if source.available else None
        if stamp is not None and st.verified.get(tname) != stamp:
            ref = source.dense(tname, p.data)
            if ref is not None and torch.equal(ref, p.data):
                st.verified[tname] = stamp
        if stamp is not None and st.verified.get(tname) == stamp:
            rec = _Original("dense", stamp=stamp)
        else:
            rec = _Original("dense", backup={"t": p.detach().to("cpu", copy=True)})
        st.originals[tname] = rec
    return rec


def _merge_nvfp4(st: _State, name: str, module, entries, source: _Source, report: dict) -> None:
    shape = (module.out_features, module.in_features)
    stored, w0 = source.nvfp4_parts(name, shape, module.packed.device)
    resident = module.weight
    if name not in st.originals:
        stamp = source.stamp() if source.available else None
        if stamp is not None and st.verified.get(name) != stamp:
            exact = stored if stored is not None else (_quantize_like(w0, module) if w0 is not None else None)
            if exact is not None and _nv_equal(exact, resident):
                st.verified[name] = stamp
        if stamp is not None and st.verified.get(name) == stamp:
            st.originals[name] = _Original("nvfp4", stamp=stamp)
        else:
            st.originals[name] = _Original("nvfp4", backup={k: getattr(module, k).detach().to("cpu", copy=True)
                                                             for k in ("packed", "scales", "global_scale")})
    if stored is not None:
        base, origin = nvfp4.dequantize(stored, torch.float64), "checkpoint NVFP4 (dequantized exactly)"
    elif w0 is not None:
        base, origin = w0, f"{source.label} ({str(w0.dtype).replace('torch.', '')})"
    else:
        base, origin = nvfp4.dequantize(resident, torch.float64), "resident NVFP4 (no source weights to read)"
    q = _quantize_like(merged_weight(base, entries), module)
    module.packed.copy_(q.packed)
    module.scales.copy_(q.scales)
    module.global_scale.copy_(q.global_scale)
    report["merged_nvfp4"].append(name)
    report["base_weights"][origin] = report["base_weights"].get(origin, 0) + 1


def _merge_dense(st: _State, tname: str, p: torch.Tensor, entries, source: _Source, report: dict,
                 device: torch.device) -> None:
    """Merge into a dense tensor in place (it stays where it lives, e.g. offloaded AdaLN in pinned host
    memory); the float64 math runs on the model's device."""
    _record_dense(st, tname, p, source)
    p.data.copy_(merged_weight(p.data, entries, device).to(p.dtype))
    report["merged_dense"].append(tname)


# ---------------------------------------------------------------------------------------------
# the public entry points
# ---------------------------------------------------------------------------------------------

def _read_all(rt, specs: list[LoraSpec]) -> list[LoraMatch]:
    errors, matches = [], []
    for sp in specs:
        try:
            matches.append(match_lora(read_lora_file(sp.path), rt.model, rt.config))
        except LoraError as e:
            errors.append(str(e))
    if errors:
        raise LoraError(" | ".join(errors) if len(errors) > 1 else errors[0])
    return matches


def apply_loras(rt, specs: Iterable) -> dict:
    """Make the resident model of ``rt`` carry exactly ``specs`` and return the report.

    rt: an H3Runtime or a LoraView; specs: ``[(path, strength, mode)]`` or LoraSpec, stacked in order;
    ``[]`` removes every LoRA. The stack is recorded as ``rt.lora_stack`` (what ``sync_loras(rt)`` restores
    later; a view records it on itself, not on the runtime it shares). Every file is read and validated
    before the model changes: a bad stack raises ONE LoraError and leaves the model as it was. The report
    is also put in ``rt.backends["lora"]`` (so every run report carries it).
    """
    specs = [_as_spec(s) for s in specs]
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
            if sp.mode == "side" and u.kind == LOWRANK and _module_device(mods[u.module]) != model_device:
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


def _install_sides(rt, st: _State, sides: dict[str, list], mods: dict, nv_cls: type, report: dict) -> None:
    """One LoraSide per module (at the layer's compute dtype, on its device) with its terms, hooked in."""
    for mname, terms in sides.items():
        module = mods[mname]
        side_dtype = (module.out_dtype or rt.dtype) if isinstance(module, nv_cls) else module.weight.dtype
        dev = module.packed.device if isinstance(module, nv_cls) else module.weight.device
        side = LoraSide(mname, module.in_features, module.out_features, side_dtype, dev)
        for s, u, fname in terms:
            side.add_term(u, s, fname)
        st.sides[mname] = (module, _install_side(mname, module, side))
        report["side"].append(mname)
        if _FC2.match(mname):
            report["fc2_side"].append(mname)
    if st.sides:
        _install_stack(rt.model, st)


def _finish_report(rt, st: _State, mods: dict, nv_cls: type, report: dict) -> None:
    """What the model now holds: originals kept, side bytes, which stack merged, the FC2 guard's refusal."""
    report["originals"] = {"from_source": sum(r.backup is None for r in st.originals.values()),
                           "host_copies": sum(r.backup is not None for r in st.originals.values()),
                           "host_copy_bytes": sum(r.nbytes() for r in st.originals.values())}
    report["side_bytes"] = sum(m.__dict__[_SIDE].nbytes() for m, _ in st.sides.values())
    report["stack"] = "dense reference stack (merge = into the dense weights)" if not any(
        isinstance(m, nv_cls) for m in mods.values()) else "NVFP4 stack (merge = re-quantized NVFP4)"
    if report["fc2_side"]:
        stack = getattr(rt.model, "stack", None)
        disp = (getattr(rt, "fc2", None) or getattr(stack, "fc2", None)) is not None
        report["fc2_guard"] = ("refused on every FC2 call of " + ", ".join(report["fc2_side"])
                               + ": reason 'lora: LoRA side-path active on fc2' (the pinned GEMM has no LoRA term)"
                               + ("" if disp else "; no FC2 dispatcher is active on this stack"))


@torch.no_grad()
def _apply(rt, specs: list[LoraSpec]) -> dict:
    """Validate every file, then restore the model's originals and apply ``specs`` (merges, then side paths);
    any failure restores the originals before it propagates. Returns the report."""
    t0 = time.perf_counter()
    matches = _read_all(rt, specs)
    model = rt.model
    mods = dict(model.named_modules())
    nv_cls = _nvfp4_linear_cls()
    st = _state(model)
    source = _Source(rt, st.source_cache)
    model_device = model.device
    report = _new_report()
    merges, sides = _group_updates(specs, matches, mods, model_device, report)
    _refuse_awq_merges(merges, mods, nv_cls)
    try:
        _restore_all(rt, st, source)
        for (mname, pname), entries in merges.items():
            module = mods[mname]
            if pname == "weight" and isinstance(module, nv_cls):
                _merge_nvfp4(st, mname, module, entries, source, report)
            else:
                _merge_dense(st, f"{mname}.{pname}", getattr(module, pname), entries, source, report, model_device)
        _install_sides(rt, st, sides, mods, nv_cls, report)
    except BaseException:
        _restore_all(rt, st, source)  # never leave a half-applied stack behind
        st.signature, st.report = (), None
        rt.backends.pop("lora", None)
        raise
    _finish_report(rt, st, mods, nv_cls, report)
    report["seconds"] = round(time.perf_counter() - t0, 3)
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
    rt.backends["lora"] = {"choice": choice, "reason": why, "report": report}


def remove_loras(rt) -> dict:
    """Remove every LoRA (``apply_loras(rt, [])``): patched tensors restored bit for bit, side paths unhooked."""
    return apply_loras(rt, [])


def lora_report(rt) -> dict | None:
    """The report of the stack the resident model carries now (None when it carries none)."""
    st = _base(rt).model.__dict__.get(_STATE)
    return st.report if st is not None and st.signature else None


def sync_loras(rt, specs: Iterable | None = None) -> dict | None:
    """Make the shared resident model carry ``specs`` (default: ``rt.lora_stack``, i.e. the view's stack, or
    for a plain runtime the stack last applied to it, none by default), doing nothing when it already
    does (same files, sizes, mtimes, strengths, modes). Call it before sampling with ``rt``."""
    if specs is None:
        specs = getattr(rt, "lora_stack", ())
    specs = [_as_spec(s) for s in specs]
    base = _base(rt)
    st = base.model.__dict__.get(_STATE)
    sig = tuple(sp.signature() for sp in specs)
    if (st.signature if st is not None else ()) == sig:
        return st.report if st is not None else None
    return _apply(base, specs)


class LoraView:
    """A resident runtime seen with a LoRA stack (what the "H3 LoRA" node outputs).

    It shares the resident model; every access to ``.model`` first makes that model carry exactly
    ``lora_stack`` (``sync_loras``: no work when it already does). Everything else is the base runtime's.
    """

    def __init__(self, base, stack: Iterable):
        object.__setattr__(self, "_base", _base(base))
        self.lora_stack = tuple(_as_spec(s) for s in stack)

    @property
    def model(self):
        sync_loras(self._base, self.lora_stack)
        return self._base.model

    def __getattr__(self, name):
        if name.startswith("__") or name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)

    def describe(self) -> str:
        sync_loras(self._base, self.lora_stack)
        return self._base.describe()


def with_lora(rt, path: str, strength: float = 1.0, mode: str = "merge") -> LoraView:
    """``rt`` plus one more LoRA on top of its stack (a LoraView; nothing is applied until ``.model``)."""
    return LoraView(rt, tuple(getattr(rt, "lora_stack", ())) + (LoraSpec(path, strength, mode),))
