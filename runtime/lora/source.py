"""Where the resident model's source weights can be read again (the checkpoint file or the embedded tiny
model's seed), and how one patched tensor is put back (``Original``: from the source when it reproduces the
resident bytes, else a host copy).

Contract: ``SourceWeights.dense`` gives a parameter as the loader assigned it; ``nvfp4_parts`` a block
linear's stored NVFP4 tensor or float source weight; ``quantize_like`` re-quantizes a merged weight into the
row padding of an NVFP4 layer's buffers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io.checkpoint import dequantize_layer, open_checkpoint
from ..model.config import TINY
from ..model.tiny import tiny_state_dict
from ..io.comfy_quant import from_comfy_quant
from ..ops import nvfp4, nvfp4_producers
from .key_forms import LoraError

_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # stored as such: read and cast, never dequantized
_TINY_SOURCE = re.compile(r"^embedded tiny \(seed (-?\d+)\)$")


class SourceWeights:
    """Where the resident model's source weights can be read again.

    - the checkpoint file ``rt.source`` (opened lazily, headers only; files stamped by size and mtime);
    - the embedded tiny model (``rt.source == "embedded tiny (seed N)"`` with the TINY config): its
      weights are a pure function of the seed (``tiny.tiny_state_dict``);
    - nothing (``available`` False): merges into NVFP4 layers start from the resident NVFP4 weights and
      originals are kept as host copies.
    """

    def __init__(self, rt, cache: dict | None = None):
        self.cache = cache if cache is not None else {}
        src = getattr(rt, "source", None)
        self.path = Path(src) if isinstance(src, (str, os.PathLike)) and Path(src).is_file() else None
        m = _TINY_SOURCE.match(src) if isinstance(src, str) and self.path is None else None
        self.tiny_seed = int(m.group(1)) if m and rt.config == TINY else None
        self.dtype = rt.dtype
        self.loaded_stamp = getattr(rt, "source_stamp", ())
        plan = getattr(rt, "plan", None)
        self.stored_nvfp4 = frozenset(getattr(plan, "stored_nvfp4", ()))
        self._ck = None
        self._stamp = None
        self._tiny = None

    @property
    def available(self) -> bool:
        return self.path is not None or self.tiny_seed is not None

    @property
    def label(self) -> str:
        return "checkpoint" if self.path is not None else "embedded tiny weights (from the seed)"

    def ck(self):
        if self._ck is None:
            self._ck = open_checkpoint(self.path)
            self._stamp = checkpoint_stamp(self._ck)
        return self._ck

    def adopted(self, name: str) -> bool:
        """Whether the resident bytes of ``name`` are its checkpoint's as the load assigned them, from files that
        have not changed since (``H3Runtime.source_stamp``: the files' sizes and mtimes at the load): a block
        linear whose stored NVFP4 tensors the load adopted as they are (``plan.stored_nvfp4``), or a dense parameter
        stored unquantized under its name (the load and ``dense`` read and cast it the same way). A merge then
        records the original without reading the file to compare, and an NVFP4 merge starts from the resident
        bytes."""
        if self.path is None or not self.loaded_stamp or self.stamp() != self.loaded_stamp:
            return False
        if name in self.stored_nvfp4:
            return True
        ck = self.ck()
        return name in ck.keys() and ck.dtype_name(name) in _FLOAT_DTYPES

    def tiny(self) -> dict:
        if self._tiny is None:
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
            q = from_comfy_quant(*(ck.tensor(layer + s, device) for s in (".weight", ".weight_scale",
                                                                                ".weight_scale_2")), shape=shape)
            return q, None
        if fmt is None and ck.dtype_name(layer + ".weight") in ("F8_E4M3", "F8_E5M2", "I8", "U8"):
            fmt = {"format": "int8_tensorwise"}
        t = dequantize_layer(ck, layer, fmt, device) if fmt is not None else ck.tensor(layer + ".weight", device)
        return None, (t if tuple(t.shape) == tuple(shape) else None)


def checkpoint_stamp(ck) -> tuple:
    """((path, size, mtime_ns), ...) of a Checkpoint's files: what says they are the files a load or merge read."""
    return tuple((str(h.path), h.path.stat().st_size, h.path.stat().st_mtime_ns) for h in ck.headers)


@dataclass
class Original:
    """How to put one patched tensor (a dense parameter, or an NVFP4 layer's three buffers) back."""

    kind: str  # "dense" | "nvfp4"
    backup: dict | None = None  # host copies when the checkpoint cannot reproduce the original
    stamp: tuple | None = None  # the checkpoint files' (path, size, mtime) when it can

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.backup or {}).values())


def nvfp4_equal(a, b) -> bool:
    return (a.shape == b.shape and torch.equal(a.packed, b.packed) and torch.equal(a.scales.view(torch.uint8),
            b.scales.view(torch.uint8)) and torch.equal(a.global_scale, b.global_scale))


def quantize_like(w: torch.Tensor, module, backend: str = "auto"):
    """nvfp4.quantize's bytes with the row padding of ``module``'s packed buffer: on CUDA from the Triton quantizer
    the load uses (the same bytes: tests/gpu/test_lora_merge_gpu.py), elsewhere from the reference. ``backend``:
    ``nvfp4_producers.pick_backend``'s ("triton" runs the kernel on the CPU under Triton's interpreter, for tests)."""
    n = module.out_features
    pad = 16 if module.packed.shape[0] == nvfp4.roundup(n, 16) else 1
    if nvfp4_producers.pick_backend(backend, w.device) == "triton":
        q = nvfp4_producers.quantize(w.contiguous())  # packed rows unpadded; the scales' rows padded to 128
        rows = nvfp4.roundup(n, pad)
        if q.packed.shape[0] != rows:
            packed = torch.zeros((rows, q.packed.shape[1]), dtype=q.packed.dtype, device=w.device)
            packed[:n] = q.packed
            q = nvfp4.NVFP4Tensor(packed, q.scales, q.global_scale, q.shape)
    else:
        q = nvfp4.quantize(w, pad_rows=pad)
    if q.packed.shape != module.packed.shape:
        raise LoraError(f"re-quantizing {n}x{module.in_features}: packed {list(q.packed.shape)} does not fit the "
                        f"layer's buffer {list(module.packed.shape)}")
    return q
