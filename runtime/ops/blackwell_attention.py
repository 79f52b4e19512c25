"""Blackwell attention backends ``sage3`` (SageAttention3, FP4, sm_120/sm_121) and ``fa4`` (FlashAttention-4, CuTe
DSL, sm_100/sm_103), each guarded by compute capability, plus a plain-PyTorch emulation of each kernel's numerics
that runs anywhere (the CPU tests validate the emulations against the fp32 reference; the GPU tests compare the
real kernels with both where the architecture and the package are present).

Contract (as ``ops.sage`` and ``ops.flash_attention``):

* ``sage3_check`` / ``fa4_check(device, head_dim, dtype) -> (available, reason)`` never raise. Order: a CUDA
  device of the target architecture (decided from the capability alone, before anything is imported), then the
  package import (the reason says how to get it), then head_dim and dtype.
* ``bind_sage3`` / ``bind_fa4(device, head_dim, scale=None) -> fn(q, k, v)``: q, k, v ``[1, S, H, D]`` NHD views
  (any strides, unit stride in D; e.g. the thirds of the fused qkv buffer) -> o ``[1, S, H, D]`` in q's dtype.
  The caller's buffers are never written. RuntimeError with the check's reason where it cannot run.

sage3  ``sageattn3.sageattn3_blackwell(q, k, v, attn_mask=None, is_causal=False, per_block_mean=True)``, built from
       SageAttention's ``sageattention3_blackwell/`` (modules ``sageattn3``, ``fp4attn_cuda``, ``fp4quant_cuda``).
       HND ``[B, H, S, D]``, fp16/bf16, head_dim 64 or 128, H_q == H_kv; its kernel refuses anything but
       CC 12.0/12.1. No scale argument: softmax scale is ``D**-0.5``, so another scale is folded into q (one
       rounding of q). It subtracts K's token mean IN PLACE, so it gets a private copy of K; q and v go as HND
       views (it pads them to a multiple of 128 rows itself, a copy). Returns a contiguous HND tensor.
fa4    ``flash_attn.cute.flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...) -> (out, lse)`` from the
       ``flash-attn-4`` wheel. NHD, fp16/bf16 (fp8 only with descales), head_dim 8..128 in steps of 8 or 256 on its
       SM100 path (CC 10.x); views pass as they are when 16-byte aligned (else it copies them). Its package also
       has sm_80/sm_90/sm_120 paths; this backend is its Blackwell datacenter entry only.

Numerics emulated (what the tolerances below rest on; read from the sources, not measured on a Blackwell GPU):

sage3  K -= its token mean (in the inputs' dtype); rows padded with zeros to a multiple of 128; Q -= its mean per
       block of 128 rows, added back exactly as ``delta_s = mean_q k^T`` (rounded to q's dtype) on the scores. Q and K:
       NVFP4-like microscaling per 16 channels of a row, V per 16 tokens of a channel: ``scale = e4m3(amax / 6)``,
       ``code = e2m1_rne(clamp(x / scale, +-6))``, no global scale. QK^T in fp32. Online softmax over key tiles of
       128 (last tile first, padded keys masked): ``P~ = 2688 exp(s - m)`` with the running row max m; per 16 keys
       ``sf = 448 exp(bm - m)`` (bm the block max), P's codes ``e2m1(P~ / sf)`` and its scale ``e4m3(sf)``; the row
       sum adds the unquantized ``P~``; PV in fp32; o divided by the row sum, rounded to q's dtype. Not modelled:
       the kernel's fast-math reciprocals and ``ex2.approx`` (they can move a value across an FP4 rounding tie).
fa4    Scores and softmax in fp32, P rounded to q's dtype before PV, fp32 accumulation, the row sum from the
       unrounded P, output rounded to q's dtype (the kernel's lagging running max and polynomial exp2 change
       which values P rounds from, not how coarsely).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .blackwell_table import BY_NAME as _TABLE

__all__ = [
    "SAGE3_ARCHS", "FA4_ARCHS", "TOLERANCE", "NhdAttention",
    "capability", "sage3_check", "fa4_check", "bind_sage3", "bind_fa4",
    "e2m1_codes", "e2m1_values", "e4m3_round", "fp4_block_quantize", "fp4_block_dequantize",
    "sage3_emulated", "fa4_emulated", "BLACKWELL_BACKENDS",
]

# architectures and head dims: the Blackwell table's (ops.blackwell_table; tests/test_blackwell_table.py)
SAGE3_ARCHS = _TABLE["sage3"].archs  # sageattn3's kernel: TORCH_CHECK(sm120 || sm121)
FA4_ARCHS = _TABLE["fa4"].archs  # flash_attn.cute: CC 10.x runs its SM100 kernels (sm_103: native exp2)
SAGE3_MODULE, FA4_MODULE = "sageattn3", "flash_attn.cute"
_SAGE3_BLOCK = 128  # rows per Q-mean block, key tile and padding unit (QBLKSIZE = KBLKSIZE = 128)
_FP4_BLOCK = 16  # elements per e4m3 scale
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# rel-L2 of the real kernel's output against the fp32 reference on random N(0,1) q, k, v (bf16), as the emulation
# predicts it, with margin (the emulation's values on S = 300..1024, H = 2..4, D = 64/128 are in the reasons). As
# for sage2, random inputs are the hard case: the softmax is nearly flat, so per-element quantization noise of V
# and P does not average away relative to the output, and the error hardly depends on S.
TOLERANCE: dict[str, tuple[float, str]] = {
    "sage3": (0.25, "FP4 e2m1 (1 mantissa bit) q, k, P, V with e4m3 scales per 16: emulation 0.19 (V alone "
                    "0.10, q and k alone 0.14)"),
    "fa4": (1e-2, "as sdpa_flash: P rounded to bf16 before PV and bf16 output: emulation 2.3e-3"),
}

# q, k, v [1, S, H, D] NHD views (unit stride in D) -> o [1, S, H, D] in q's dtype
NhdAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# guards
# ----------------------------------------------------------------------------------------------


def capability(device: "torch.device | str") -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA ``device``; None for any other device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def _import(name: str):
    """The package module (only called once the architecture passed: these imports are heavy)."""
    return importlib.import_module(name)


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "version unknown"


def _arch_gate(backend: str, device, archs, what: str) -> Optional[str]:
    """The refusal reason when ``device`` is not one of ``archs``, else None."""
    names = "/".join(f"sm_{a}{b}" for a, b in archs)
    try:
        cc = capability(device)
    except Exception as e:  # no driver, bad index: a refusal, never an exception
        return f"{backend}: needs {names} ({what}); the capability of {device} is unknown ({type(e).__name__}: {e})"
    if cc is None:
        return f"{backend}: needs a CUDA device of {names} ({what}); found {torch.device(device)}"
    if cc not in archs:
        return f"{backend}: needs {names} ({what}); this device is sm_{cc[0]}{cc[1]}"
    return None


def sage3_check(device: "torch.device | str", head_dim: int = 128,
                dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """(available, reason) for SageAttention3 on ``device`` (module docstring); never raises."""
    why = _arch_gate("sage3", device, SAGE3_ARCHS, "SageAttention3 FP4 kernels")
    if why:
        return False, why
    try:
        mod = _import(SAGE3_MODULE)
    except Exception as e:  # ImportError, or its compiled extensions failing to load against this torch
        return False, (f"sage3: SageAttention3 not installed ({type(e).__name__}: {e}); build it on this GPU from "
                       "SageAttention's sageattention3_blackwell/ folder (python setup.py install: CUDA >= 12.8, "
                       "torch >= 2.8; its setup.py clones CUTLASS, so the build needs network access)")
    if not hasattr(mod, "sageattn3_blackwell"):
        return False, f"sage3: {SAGE3_MODULE} at {getattr(mod, '__file__', '?')} has no sageattn3_blackwell"
    if not _TABLE["sage3"].head_dim_ok(head_dim):
        return False, f"sage3: SageAttention3 runs head_dim 64 or 128 (found {head_dim})"
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"sage3: needs fp16/bf16 q, k, v (compute dtype is {dtype})"
    cc = capability(device)
    return True, (f"sm_{cc[0]}{cc[1]}: SageAttention3 sageattn3_blackwell ({_dist_version('sageattn3')}): FP4 q, "
                  f"k, P, v with e4m3 scales per 16, lossy (rel-L2 <= {TOLERANCE['sage3'][0]:g} on random data)")


def fa4_check(device: "torch.device | str", head_dim: int = 128,
              dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """(available, reason) for FlashAttention-4 on ``device`` (module docstring); never raises."""
    why = _arch_gate("fa4", device, FA4_ARCHS, "FlashAttention-4 SM100 kernels")
    if why:
        return False, why
    try:
        mod = _import(FA4_MODULE)
    except Exception as e:  # ImportError, or the CuTe DSL failing to initialise
        return False, (f"fa4: FlashAttention-4 not installed ({type(e).__name__}: {e}); pip install flash-attn-4 "
                       "(CUDA 13: pip install 'flash-attn-4[cu13]'), which brings nvidia-cutlass-dsl")
    if not hasattr(mod, "flash_attn_func"):
        return False, f"fa4: {FA4_MODULE} at {getattr(mod, '__file__', '?')} has no flash_attn_func"
    if not _TABLE["fa4"].head_dim_ok(head_dim):
        return False, (f"fa4: FlashAttention-4's SM100 forward runs head_dim 8..128 (multiple of 8) or 256 "
                       f"(found {head_dim})")
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"fa4: needs fp16/bf16 q, k, v (compute dtype is {dtype})"
    cc = capability(device)
    return True, (f"sm_{cc[0]}{cc[1]}: FlashAttention-4 flash_attn.cute.flash_attn_func "
                  f"({_dist_version('flash-attn-4')}), bf16/fp16 q/k/v as strided views")


# ----------------------------------------------------------------------------------------------
# binding
# ----------------------------------------------------------------------------------------------


def _q_factor(head_dim: int, scale: Optional[float]) -> float:
    """What q is multiplied by so that a kernel with the fixed softmax scale ``D**-0.5`` computes ``scale``."""
    if scale is None or math.isclose(float(scale) * head_dim ** 0.5, 1.0, rel_tol=1e-9):
        return 1.0
    return float(scale) * head_dim ** 0.5


def bind_sage3(device: "torch.device | str", head_dim: int, scale: Optional[float] = None) -> NhdAttention:
    """SageAttention3 bound once (module docstring): HND views of q and v, a private HND copy of K (the library
    subtracts K's mean in place), q pre-scaled when ``scale`` is not ``D**-0.5``."""
    ok, why = sage3_check(device, head_dim)
    if not ok:
        raise RuntimeError(why)
    kernel = _import(SAGE3_MODULE).sageattn3_blackwell
    c = _q_factor(head_dim, scale)

    def sage3(q, k, v):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [1, H, S, D] views
        if c != 1.0:
            qh = (qh.float() * c).to(q.dtype)
        kh = kh.clone(memory_format=torch.contiguous_format)
        # its quantizer launches on the current device
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            o = kernel(qh, kh, vh, is_causal=False, per_block_mean=True)
        return o.transpose(1, 2)
    return sage3


def bind_fa4(device: "torch.device | str", head_dim: int, scale: Optional[float] = None) -> NhdAttention:
    """FlashAttention-4 bound once (module docstring): the NHD views go to ``flash_attn_func`` as they are."""
    ok, why = fa4_check(device, head_dim)
    if not ok:
        raise RuntimeError(why)
    fn = _import(FA4_MODULE).flash_attn_func
    sm_scale = head_dim ** -0.5 if scale is None else float(scale)

    def fa4(q, k, v):
        o = fn(q, k, v, softmax_scale=sm_scale, causal=False)
        return o[0] if isinstance(o, tuple) else o
    return fa4


# ----------------------------------------------------------------------------------------------
# FP4 / e4m3 formats (the quantizer the sage3 emulation uses)
# ----------------------------------------------------------------------------------------------


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """FP4 e2m1 codes (uint8 0..15; bit 3 the sign) of fp32 ``x``: round to nearest, ties to the even code, values
    beyond +-6 saturate (``cvt.rn.satfinite.e2m1x2.f32``). Grid of codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    a = x.abs().clamp(max=6.0)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, m in enumerate(_E2M1_MIDPOINTS):  # a tie goes up when the upper code (i + 1) is even
        code += ((a > m) | ((a == m) & (i % 2 == 1))).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 ``codes`` (negative zero reads as 0)."""
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x >= 0`` rounded to e4m3 (RNE, saturating at 448, subnormals down to 2^-9), returned as fp32."""
    return x.clamp(max=448.0).to(torch.float8_e4m3fn).float()


def fp4_block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SageAttention3's FP4 quantizer along the last dim of fp32 ``x [..., n]`` (n % 16 == 0): per 16 elements
    ``scale = e4m3(amax / 6)``, ``code = e2m1(x * (1 / scale))`` (scale 0: codes 0). Returns (codes uint8
    ``[..., n]``, scales fp32 ``[..., n / 16]``)."""
    xb = x.float().unflatten(-1, (-1, _FP4_BLOCK))
    sf = e4m3_round(xb.abs().amax(-1, keepdim=True) / 6.0)
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    return e2m1_codes(xb * inv).flatten(-2), sf.squeeze(-1)


def fp4_block_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``codes * scale`` (the inverse layout of :func:`fp4_block_quantize`)."""
    return (e2m1_values(codes).unflatten(-1, (-1, _FP4_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


def _fp4_fake(x: torch.Tensor) -> torch.Tensor:
    return fp4_block_dequantize(*fp4_block_quantize(x))


# ----------------------------------------------------------------------------------------------
# emulations
# ----------------------------------------------------------------------------------------------


def _hnd_fp32(*xs: torch.Tensor) -> list[torch.Tensor]:
    q = xs[0]
    for x in xs:
        if x.dim() != 4 or x.shape[0] != 1 or x.shape != q.shape:
            raise ValueError(f"q, k, v must be [1, S, H, D] alike; found {[tuple(t.shape) for t in xs]}")
    return [x[0].transpose(0, 1).float() for x in xs]  # [H, S, D] fp32


def sage3_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """SageAttention3's numerics (module docstring) in plain PyTorch: q, k, v ``[1, S, H, D]`` (fp16/bf16, any
    strides, D a multiple of 16) -> o ``[1, S, H, D]`` in q's dtype. Memory ~ H x S_pad^2 fp32 (small S only)."""
    dt = q.dtype
    qh, kh, vh = _hnd_fp32(q, k, v)
    h, s, d = qh.shape
    c = _q_factor(d, scale)
    if c != 1.0:
        qh = (qh * c).to(dt).float()
    ks = d ** -0.5  # the kernel's own softmax scale
    kh = (kh - kh.mean(1, keepdim=True).to(dt).float()).to(dt).float()  # K smoothing, in k's dtype
    sp = -(-s // _SAGE3_BLOCK) * _SAGE3_BLOCK
    qh, kh, vh = (F.pad(t, (0, 0, 0, sp - s)) for t in (qh, kh, vh))
    qg = qh.view(h, sp // _SAGE3_BLOCK, _SAGE3_BLOCK, d)
    qm = qg.mean(2, keepdim=True).to(dt).float()  # per-block Q mean (padding rows included)
    qs = (qg - qm).to(dt).float().view(h, sp, d)
    delta = (qm.squeeze(2) @ kh.transpose(1, 2)).to(dt).float()  # [H, G, Sp]: what the smoothing took out
    qd, kd = _fp4_fake(qs), _fp4_fake(kh)
    vd = _fp4_fake(vh.transpose(1, 2)).transpose(1, 2)  # V's blocks run along tokens
    scores = qd @ kd.transpose(1, 2) + delta.repeat_interleave(_SAGE3_BLOCK, dim=1)  # [H, Sp, Sp], unscaled
    scores[..., s:] = float("-inf")
    m = torch.full((h, sp, 1), float("-inf"), device=qh.device)
    row_sum = torch.zeros(h, sp, 1, device=qh.device)
    o = torch.zeros(h, sp, d, device=qh.device)
    for j in reversed(range(0, sp, _SAGE3_BLOCK)):  # the kernel walks key tiles from the last one
        st = scores[..., j:j + _SAGE3_BLOCK]
        bm = st.unflatten(-1, (-1, _FP4_BLOCK)).amax(-1)  # [H, Sp, 8]
        m_new = torch.maximum(m, bm.amax(-1, keepdim=True))
        alpha = torch.exp((m - m_new) * ks)
        p = torch.exp((st - m_new) * ks) * (448.0 * 6.0)
        sf = torch.exp((bm - m_new) * ks) * 448.0
        sf_e = sf.repeat_interleave(_FP4_BLOCK, -1)
        ratio = torch.where(sf_e > 0, p / sf_e, torch.zeros_like(p))
        pd = e2m1_values(e2m1_codes(ratio)) * e4m3_round(sf).repeat_interleave(_FP4_BLOCK, -1)
        row_sum = row_sum * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + pd @ vd[:, j:j + _SAGE3_BLOCK]
        m = m_new
    o = torch.where(row_sum > 0, o / row_sum, torch.zeros_like(o))
    return o[:, :s].to(dt).transpose(0, 1).unsqueeze(0)


def fa4_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """A flash kernel's numerics (module docstring): q, k, v ``[1, S, H, D]`` -> o ``[1, S, H, D]`` in q's dtype:
    fp32 scores and softmax, P rounded to q's dtype before PV, fp32 accumulation, row sum of the unrounded P."""
    dt = q.dtype
    qh, kh, vh = _hnd_fp32(q, k, v)
    sm_scale = qh.shape[-1] ** -0.5 if scale is None else float(scale)
    st = (qh @ kh.transpose(1, 2)) * sm_scale
    p = torch.exp(st - st.amax(-1, keepdim=True))
    o = (p.to(dt).float() @ vh) / p.sum(-1, keepdim=True)
    return o.to(dt).transpose(0, 1).unsqueeze(0)


# name -> (check, bind, emulation): what the registry wires
BLACKWELL_BACKENDS: dict[str, tuple[Callable, Callable, Callable]] = {
    "sage3": (sage3_check, bind_sage3, sage3_emulated),
    "fa4": (fa4_check, bind_fa4, fa4_emulated),
}
