"""FlashAttention-3 (Hopper, sm_90): the ``fa3`` (bf16/fp16) and ``fa3_fp8`` (e4m3) attention backends, bound over
``[1, S, H, D]`` NHD views (``ops.attention`` hands them strided views of the qkv buffer).

The kernels come from an installed ``flash_attn_interface`` module (Dao-AILab's ``hopper/`` build, or a wheel
that ships it, e.g. ``tokenspeed-fa3``). Nothing is downloaded; without it both backends say why and are skipped.

fa3       ``flash_attn_func(q, k, v)`` on the strided views as they are (unit stride in D is all it needs): exact
          softmax in fp32, P rounded to bf16 before PV, bf16 output.
fa3_fp8   The same kernel on e4m3 operands built here, one fp32 descale per head (FA3 takes ``(batch, heads)``
          descales), with two exact rewrites that shrink what the e4m3 rounding acts on:

          * K smoothing: ``k' = k - mean_t(k)`` per channel. Each query's scores shift by the constant
            ``q . mean(k)``, which softmax removes, so the result is unchanged in exact arithmetic.
          * V smoothing: ``v' = v - mean_t(v)`` per channel and ``o = attention(q, k', v') + mean_t(v)``: the
            softmax weights of a row sum to 1, so this too is exact in exact arithmetic.

          e4m3 is a float format (3 mantissa bits, relative error <= 2^-4 per element), so the error of a rounded
          element scales with its magnitude; removing a channel's common offset leaves only its spread to round.
          Q cannot be smoothed this way (``mean(q) . k`` varies with the key). Scales: per head,
          ``scale = amax / 448`` over the smoothed rows (1 where zero or subnormal); codes
          ``e4m3_rne(clamp(x' * (1 / scale), +-448))``. :func:`fa3_fp8_operands_reference` defines the bytes;
          :func:`fa3_fp8_operands` writes the same bytes in two Triton launches (statistics, then codes) reading
          the strided views directly. Inside the kernel FA3 rounds P to e4m3 for the PV product (its own
          numerics); :func:`fa3_fp8_dequantized` gives our operands back for an exact-attention emulation.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

from .fp8_producers import e4m3_scales
from .nvfp4_producers import DTYPE_CODE, cdiv, hw_cvt, pick_backend
from .triton import MISSING as TRITON_MISSING

if TRITON_MISSING is None:
    from .triton import fa3_kernels

__all__ = ["FA3_ARCH", "fa3_module", "fa3_check", "bind_fa3", "fa3_fp8_operands", "fa3_fp8_operands_reference",
           "fa3_fp8_dequantized"]

FA3_ARCH = (9, 0)  # FA3's kernels are Hopper's (wgmma, TMA); other architectures are refused
_HEAD_DIMS = (64, 96, 128, 192, 256)
_STATS_ROWS = 512  # rows per program of the statistics pass (its partials: cdiv(S, 512) x H x D)

# q, k, v [1, S, H, D] NHD views (unit stride in D) -> o [1, S, H, D] in q's dtype
NhdAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.lru_cache(maxsize=None)
def fa3_module() -> tuple[Any, str]:
    """(flash_attn_interface module, its distribution and version) or (None, the reason it cannot be used)."""
    try:
        mod = importlib.import_module("flash_attn_interface")
    except Exception as e:  # ImportError, or its compiled extension failing to load against this torch
        return None, (f"FlashAttention-3 not installed ({type(e).__name__}: {e}); install a build of "
                      "Dao-AILab/flash-attention's hopper/ package (module flash_attn_interface) for this torch")
    if not hasattr(mod, "flash_attn_func"):
        return None, f"flash_attn_interface at {getattr(mod, '__file__', '?')} has no flash_attn_func"
    return mod, _dist_version()


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    for name in ("flash_attn_3", "flash-attn-3", "tokenspeed-fa3", "flashattn-hopper"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "version unknown"


def _disabled_head_dims() -> set[int]:
    """Head dims the installed build left out (its flash_attn_config build flags, where it ships them)."""
    try:
        flags = importlib.import_module("flash_attn_config").CONFIG.get("build_flags", {})
    except Exception:
        return set()
    return {d for d in _HEAD_DIMS if flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}")}


def fa3_check(backend: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """(available, reason) for ``fa3`` / ``fa3_fp8`` on ``device``; never raises. The architecture is judged
    before anything is imported."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{backend} needs a CUDA device (found {device})"
    try:
        cc = tuple(torch.cuda.get_device_capability(device))
    except Exception as e:  # no driver, a bad index: refused, never raised
        return False, f"{backend}: the capability of {device} is unknown ({type(e).__name__}: {e})"
    if cc != FA3_ARCH:
        return False, (f"{backend}: FlashAttention-3's kernels are Hopper's (sm_90); this device is "
                       f"sm_{cc[0]}{cc[1]}")
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"{backend} needs fp16/bf16 activations (compute dtype is {dtype})"
    mod, version = fa3_module()
    if mod is None:
        return False, version
    ok = [d for d in _HEAD_DIMS if d not in _disabled_head_dims()]
    if head_dim not in ok:
        return False, f"{backend}: this FlashAttention-3 build runs head_dim {ok} (found {head_dim})"
    what = "e4m3 q/k/v, per-head descales, K and V smoothed" if backend == "fa3_fp8" else "bf16/fp16 q/k/v"
    return True, f"sm_90: FlashAttention-3 {version}, {what}"


# ----------------------------------------------------------------------------------------------
# fp8 operands
# ----------------------------------------------------------------------------------------------


def _check_nhd(*xs: torch.Tensor) -> tuple[int, int, int]:
    q = xs[0]
    for x in xs:
        if x.dim() != 4 or x.shape[0] != 1 or x.shape != q.shape or x.stride(-1) != 1:
            raise ValueError(f"q, k, v must be NHD views [1, S, H, D] alike with unit stride in D; found "
                             f"{[tuple(t.shape) for t in xs]} strides {[t.stride() for t in xs]}")
        if x.dtype not in DTYPE_CODE or x.dtype != q.dtype:
            raise TypeError(f"q, k, v must share one float dtype; found {[t.dtype for t in xs]}")
    return tuple(q.shape[1:])  # type: ignore[return-value]


def _scales_from(q_amax, k_max, k_min, k_mean, v_max, v_min, v_mean):
    """Per-head descales [3, 1, H] and reciprocals [3, H] from the statistics (module docstring)."""
    amax = torch.stack([q_amax,
                        torch.maximum(k_max - k_mean, k_mean - k_min).amax(-1),
                        torch.maximum(v_max - v_mean, v_mean - v_min).amax(-1)])
    sc, inv = e4m3_scales(amax)
    return sc.unsqueeze(1).contiguous(), inv.contiguous()


def fa3_fp8_operands_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[1, S, H, D]`` (bf16/fp16/fp32 views) -> (codes ``float8_e4m3fn [3, 1, S, H, D]`` (q, k', v'),
    descales ``fp32 [3, 1, H]``, means ``fp32 [2, H, D]`` (k, v)). The definition (module docstring): means
    are the fp64 sums over tokens divided by S, rounded to fp32; ``x' = fp32(x) - mean`` (q: no mean);
    per-head ``scale = amax|x'| / 448`` (1 if zero or subnormal), ``code = e4m3_rne(clamp(x' * (1/scale)))``."""
    s, h, d = _check_nhd(q, k, v)
    xs = [t[0].float() for t in (q, k, v)]  # [S, H, D]
    means = torch.stack([(t[0].double().sum(0) / s).float() for t in (k, v)])
    sm = [xs[0], xs[1] - means[0], xs[2] - means[1]]
    sc, inv = e4m3_scales(torch.stack([x.abs().amax(dim=(0, 2)) for x in sm]))
    codes = torch.stack([torch.mul(x, inv[j].view(1, h, 1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                         for j, x in enumerate(sm)]).unsqueeze(1)
    return codes, sc.unsqueeze(1).contiguous(), means


def fa3_fp8_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fa3_fp8_operands_reference`'s bytes in two Triton launches over the strided views of one qkv
    buffer (q, k, v must be its thirds: same row stride, k at q + H*D, v at q + 2*H*D elements); any other
    views, and ``backend="reference"``, take the reference."""
    s, h, d = _check_nhd(q, k, v)
    row = q.stride(1)
    packed = (k.stride(1) == row and v.stride(1) == row and q.stride(2) == d and k.stride(2) == d
              and v.stride(2) == d and k.data_ptr() - q.data_ptr() == h * d * q.element_size()
              and v.data_ptr() - q.data_ptr() == 2 * h * d * q.element_size())
    if pick_backend(backend, q.device) == "reference" or not packed:
        return fa3_fp8_operands_reference(q, k, v)
    dev = q.device
    bt = 64 if dev.type == "cuda" else 32
    nt = max(1, _STATS_ROWS // bt)
    nb = cdiv(s, bt * nt)
    p32 = torch.empty(nb, 5, h, d, dtype=torch.float32, device=dev)
    p64 = torch.empty(nb, 2, h, d, dtype=torch.float64, device=dev)
    kind = DTYPE_CODE[q.dtype]
    fa3_kernels.qkv_stats_kernel[(nb, h)](q, p32, p64, s, row, h, KIND=kind, D=d, BT=bt, NT=nt, num_warps=4,
                                          enable_fp_fusion=False)
    means = (p64.sum(0) / s).float()  # [2, H, D]
    sc, inv = _scales_from(p32[:, 0].amax(dim=(0, 2)), p32[:, 1].amax(0), p32[:, 2].amin(0), means[0],
                           p32[:, 3].amax(0), p32[:, 4].amin(0), means[1])
    codes = torch.empty(3, 1, s, h, d, dtype=torch.float8_e4m3fn, device=dev)
    fa3_kernels.qkv_fp8_kernel[(cdiv(s, bt), h)](q, means, inv, codes.view(torch.uint8), s, row, h, s * h * d,
                                                 KIND=kind, D=d, BT=bt, HW=hw_cvt(dev), num_warps=4,
                                                 enable_fp_fusion=False)
    return codes, sc, means


def fa3_fp8_dequantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fa3_fp8_operands_reference`'s operands dequantized, fp32 ``[S, H, D]`` each (q, k', v'), and V's
    mean as ``[H*D]``: exact attention on the three plus the mean is what ``fa3_fp8`` computes, less the
    kernel's own roundings (P in e4m3, bf16 output) -- the part of its error that our operands decide."""
    codes, sc, means = fa3_fp8_operands_reference(q, k, v)
    deq = [codes[j, 0].float() * sc[j, 0].view(1, -1, 1) for j in range(3)]
    return deq[0], deq[1], deq[2], means[1].reshape(-1)


# ----------------------------------------------------------------------------------------------
# binding
# ----------------------------------------------------------------------------------------------


def bind_fa3(backend: str, scale: float) -> NhdAttention:
    """FlashAttention-3 bound once for ``backend`` (``fa3`` or ``fa3_fp8``); RuntimeError with the reason where
    the module is missing (the load plan checked the device with :func:`fa3_check`). Never writes to q, k or v."""
    if backend not in ("fa3", "fa3_fp8"):
        raise ValueError(f"backend {backend!r}: expected fa3 or fa3_fp8")
    mod, why = fa3_module()
    if mod is None:
        raise RuntimeError(why)
    fn = mod.flash_attn_func

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    if backend == "fa3":
        return lambda q, k, v: first(fn(q, k, v, softmax_scale=scale, causal=False))

    producer = "triton" if TRITON_MISSING is None else "reference"  # FA3 runs on CUDA: chosen once, here

    def fa3_fp8(q, k, v):
        codes, sc, means = fa3_fp8_operands(q, k, v, backend=producer)
        o = first(fn(codes[0], codes[1], codes[2], softmax_scale=scale, causal=False,
                     q_descale=sc[0], k_descale=sc[1], v_descale=sc[2]))
        o = o.to(q.dtype)  # FA3 writes bf16 for e4m3 inputs; q may be fp16
        return o.add_(means[1].to(o.dtype))  # V's mean back: [1, S, H, D] + [H, D]
    return fa3_fp8
