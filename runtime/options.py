"""RuntimeOptions: the one place that reads configuration.

Node widgets, CLI flags and the seed's ``H3_*`` environment variables all land here. Nothing else in
the runtime reads ``os.environ``. Precedence: explicit keyword > environment variable > default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

# name of the field -> (environment variable, parser)
_ENV = {
    "scale_backend": ("H3_NVFP4_SCALE_BACKEND", str),
    "scale_version": ("H3_NVFP4_SCALE_VERSION", str),
    "fused_elementwise": ("H3_FUSED_ELEMENTWISE", "bool"),
    "modulate_fusion": ("H3_NVFP4_MODULATE_FUSION", "bool"),
    "swiglu_fusion": ("H3_NVFP4_SWIGLU_FUSION", "bool"),
    "fc2_lt": ("H3_NVFP4_FC2_LT_SPLITK1", "bool"),
    "fc2_lt_strict": ("H3_NVFP4_FC2_LT_STRICT", "bool"),
    "qkv_layout": ("H3_SAGE_QKV_LAYOUT", str),
    "sage_v_pad": ("H3_SAGE_V_PAD", str),
    "attention": ("H3_ATTENTION", str),
    "gemm": ("H3_GEMM", str),
    "act_scale": ("H3_NVFP4_ACT_SCALE", str),
    "act_format": ("H3_ACT_FORMAT", str),
    "adaln_cache": ("H3_ADALN_CACHE", "bool"),
    "cache_dir": ("H3_CACHE_DIR", str),
    "quantize": ("H3_NVFP4", "bool"),
    "producer_tiles": ("H3_PRODUCER_TILES", str),
    "fp8_accum": ("H3_FP8_ACCUM", str),
    "silu": ("H3_SILU", str),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{name}={v!r}: expected 1/0, true/false, yes/no or on/off")


@dataclass
class RuntimeOptions:
    """Backend choices and switches for one loaded model.

    attention: auto | sage2 | sage1 | sdpa | reference
    gemm:      auto | native | emulated | fp8 | bf16 | reference   (NVFP4 linear backend)
    act_scale: dynamic (amax per call) | calibrated (checkpoint input_scale when present)
    act_format: auto (fp8 where every block linear runs the fp8 GEMM backend, i.e. Hopper/Ada; else nvfp4) |
               nvfp4 (W4A4: NVFP4 activations) | fp8 (W4A8, Hopper: e4m3 activations with one fp32 scale
               per row from the fused producers; used only with the fp8 GEMM backend, see runtime.stack)
    sage_v_pad: library (SageAttention2's sm90 wrapper pads V with torch.cat: one copy of V per call) |
               buffer (sm90 sage2 only: the QKV GEMM writes roundup(S, 128) rows, zero tail, and the
               wrapper calls Sage2's stages itself on that buffer: no copy; see ops.attention) |
               fused (the default; sm90 sage2 only, a no-op elsewhere: V's fp8 operands built by our Triton
               producer straight from the strided V view: no pad copy, no transpose copy)
    fp8_accum: fast (the default; Hopper's reduced-precision fp8 accumulation in the W4A8 GEMMs: ~7 % faster
               block GEMMs on the H200, per-GEMM rel-L2 0.0023-0.0033 instead of 0.0017 against fp64,
               bench/results/fp8-accum-h200.json) | fp32 (accumulate in fp32, as cuBLAS does without fast
               accumulation). The canonical forward's rel-L2 against bf16 is 0.0269 either way (0.0268 fp32):
               bench/results/canonical-h200.json and canonical-h200-fp32-exact.json.
    silu:      fast (the default; the W4A8 SwiGLU producer's silu with the hardware exp2 and an approximate
               division: a few fp32 ulp, so a code may move one e4m3 step) | exact (the reference's own exp and
               IEEE division: bit-exact against the torch reference)
    producer_tiles: path of a measured tile table for the producers (bench/producers_h200.py
               --tiles-out); speed only, the bytes are the same with any tiles
    fc2_lt:    the guarded cuBLASLt FC2 path (H3_NVFP4_FC2_LT_SPLITK1); strict raises instead of falling back
    dtype:     compute dtype of the block stack (bfloat16 on GPU, float32 on CPU by default)
    """

    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    gemm: str = "auto"
    quantize: bool = True  # quantize bf16/fp8 sources to NVFP4 at load (False = keep source precision)
    act_scale: str = "dynamic"
    act_format: str = "auto"
    scale_backend: str = "vortex"
    scale_version: str = "1"
    fused_elementwise: bool = True
    modulate_fusion: bool = True
    swiglu_fusion: bool = True
    fc2_lt: bool = True
    fc2_lt_strict: bool = False
    qkv_layout: str = "strided_nhd"
    sage_v_pad: str = "fused"
    adaln_cache: bool = True
    fp8_accum: str = "fast"
    silu: str = "fast"
    producer_tiles: str = ""  # a tile table JSON from bench/producers_h200.py --tiles-out ("" = built-in tiles)
    cache_dir: str = field(default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "h3_blackwell"))

    _CHOICES = {
        "attention": ("auto", "sage2", "sage1", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
                      "reference"),
        "gemm": ("auto", "native", "emulated", "fp8", "bf16", "reference"),
        "act_scale": ("dynamic", "calibrated"),
        "act_format": ("auto", "nvfp4", "fp8"),
        "qkv_layout": ("strided_nhd", "contiguous"),
        "sage_v_pad": ("library", "buffer", "fused"),
        "fp8_accum": ("fp32", "fast"),
        "silu": ("exact", "fast"),
        "dtype": ("auto", "float32", "bfloat16", "float16"),
    }

    def __post_init__(self):
        for name, choices in self._CHOICES.items():
            v = getattr(self, name)
            if v not in choices:
                raise ValueError(f"option {name}={v!r}: expected one of {', '.join(choices)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "RuntimeOptions":
        """Defaults <- ``H3_*`` environment variables <- explicit ``overrides`` (None values ignored)."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        for name, (var, kind) in _ENV.items():
            if var in env:
                kw[name] = _parse_bool(var, env[var]) if kind == "bool" else kind(env[var])
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def as_env(self) -> dict[str, str]:
        """The seed-profile ``configuration`` block: every H3_* option in force, as strings."""
        out = {}
        for name, (var, kind) in _ENV.items():
            v = getattr(self, name)
            out[var] = ("1" if v else "0") if kind == "bool" else str(v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
