"""NVFP4 Triton kernels: the producers (the seed's "vortex" family) and the consumers the GEMM backends use.

Producers (each writes EXACTLY the bytes of the reference quantizer ``nvfp4.quantize`` applied to its
fp32 reference input; the tests compare bytes):

* ``quantize(x, g)``: x [S, K] -> NVFP4 (packed [S, Kp/2] low nibble first, swizzled e4m3 scales).
* ``rms_modulate_quantize(x, weight, scale_rows, shift_rows, segments, eps, g)``: RMSNorm -> per-segment
  modulate ``h = n * (1 + scale[row]) + shift[row]`` -> quantize; input of the QKV and FC1 GEMMs.
* ``swiglu_quantize(h, g)``: h [S, 2F] = [gate | up] -> ``silu(gate) * up`` -> quantize; input of FC2.

Consumers: ``dequantize_bf16`` (NVFP4 -> bf16 scratch, optionally times a device scalar), ``to_fp8_rowwise``
(NVFP4 -> e4m3 with one fp32 scale per row) and ``nvfp4_gemm`` (the exact-product "emulated" GEMM).

Fused-op arithmetic (the ``*_reference`` functions are the definition; every step is one correctly
rounded IEEE operation, no FMA contraction, so the kernel and the torch reference agree bit for bit):

* RMSNorm: ``ss = sum(fp64(x)^2)`` (fp64, so the summation order cannot change the fp32 result except
  in ~1e-16-relative ties), ``rstd = fp32(1 / sqrt(ss / K + eps))`` in fp64, ``n = fp32(x) * rstd``,
  then ``n = n * weight`` when there is a weight, then ``h = n * (1 + scale) + shift`` in fp32. h is
  quantized from fp32 (never rounded to bf16 first).
* SwiGLU: ``silu(a) = a / (1 + exp(-a))`` with ``exp`` our own fp32 routine (Cody-Waite reduction,
  degree-7 polynomial, argument clamped to [-80, 80]; a few ulp from the true exp) so GPU, CPU and
  interpreter compute the same bits; ``y = silu(gate) * up``; |y| < 2^-126 is flushed to a signed zero.

Activation global scale (the ``act_scale`` option): ``g=None`` -> dynamic, ``g = amax(|input|) / 2688``
computed on the device in an extra read pass (no host sync) so nothing saturates; a tensor ``g`` ->
calibrated (the checkpoint's ``input_scale``, decode direction): one pass less, values above
``2688 * g`` saturate to +-6 * 448 * g.

The kernels are in ``ops.triton.nvfp4_kernels``, loaded at import when triton is installed. On CPU they run
under ``TRITON_INTERPRET=1`` set before import (tests); ``backend="auto"`` picks Triton for CUDA tensors and the
torch reference otherwise.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import nvfp4
from .elementwise import check_segments, segment_table
from .triton import MISSING as TRITON_MISSING, hw_cvt, status as triton_status

if TRITON_MISSING is None:  # the kernels, loaded once; without triton the references run (triton_status says why)
    from .triton import nvfp4_kernels

__all__ = [
    "triton_status", "hw_cvt", "activation_global_scale",
    "quantize", "rms_modulate_quantize", "swiglu_quantize",
    "rms_modulate_reference", "swiglu_reference", "exp_reference", "silu_reference",
    "dequantize_bf16", "dequantize_bf16_reference", "to_fp8_rowwise", "to_fp8_rowwise_reference",
    "nvfp4_gemm",
]


DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FLOATS = tuple(DTYPE_CODE)


def pick_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend={backend!r}: expected auto, triton or reference")
    if backend == "reference":
        return backend
    ok, why = triton_status(device)
    if backend == "triton" and not ok:
        raise RuntimeError(f"backend='triton' is not usable: {why}")
    return "triton" if ok and (backend == "triton" or device.type == "cuda") else "reference"


def _launch(kernel, grid, *args, **kw):
    # fp fusion off: the references round every multiply and add separately (no FMA), and so must we.
    kernel[grid](*args, enable_fp_fusion=False, **kw)


_FP8_TILES: list = []  # [(BM, BK, num_warps)] from a tile table entry (set_fp8_tiles), else empty


def set_fp8_tiles(entry) -> tuple | None:
    """``to_fp8_rowwise``'s CUDA tiles from a tile table entry [BM, BK, num_warps] (powers of two, BK >= 64);
    None restores the built-in ones. Tiles change speed only, never the bytes."""
    _FP8_TILES.clear()
    if entry is None:
        return None
    ok = (isinstance(entry, (list, tuple)) and len(entry) == 3
          and all(isinstance(n, int) and n > 0 and n & (n - 1) == 0 for n in entry) and entry[1] >= 64)
    if not ok:
        raise ValueError(f"tile table entry to_fp8_rowwise={entry!r}: expected [BM, BK, num_warps], powers of "
                         "two, BK >= 64")
    _FP8_TILES.append(tuple(entry))
    return tuple(entry)


def _tiles(device: torch.device) -> dict:
    """Tile sizes (any BM dividing 128 and BK a multiple of 64 give the same bytes)."""
    if device.type == "cuda":
        return dict(q=(32, 256, 4), norm=(16, 256, 8), glu=(32, 256, 4), deq=(32, 256, 4),
                    fp8=_FP8_TILES[0] if _FP8_TILES else (32, 256, 8),  # the four weights: least total time
                    gemm=(128, 128, 64, 8, 8, 3))
    return dict(q=(32, 64, 1), norm=(32, 64, 1), glu=(32, 64, 1), deq=(32, 64, 1), fp8=(32, 64, 1),
                gemm=(16, 16, 32, 4, 1, 1))


# ----------------------------------------------------------------------------------------------
# references (pure torch; the definition the kernels are tested against)
# ----------------------------------------------------------------------------------------------

_CONSTS: dict = {}


def const_like(v: float, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    # 0-dim tensor on the data's device: CUDA turns `tensor / python_scalar` into a multiply by the
    # reciprocal, which is not the correctly rounded quotient the kernels compute. On CUDA it is cached:
    # building it is a host->device copy from pageable memory, which makes the host wait for the GPU to
    # drain its queue (and the GPU then idle while the host launches the next kernels).
    if like.device.type != "cuda":
        return torch.tensor(v, dtype=dtype, device=like.device)
    key = (float(v), dtype, like.device)
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) > 256:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.tensor(v, dtype=dtype, device=like.device)
    return t


def padded_segment_table(segs: list, nseg: int, device: torch.device) -> torch.Tensor:
    """(start, stop, row) triples padded with empty entries to ``nseg`` -> int32 [3*nseg] on the device,
    cached per layout (elementwise.segment_table): no host->device copy, so no host sync, per call."""
    return segment_table([tuple(sg) for sg in segs] + [(0, 0, 0)] * (nseg - len(segs)), device)


def exp_reference(t: torch.Tensor) -> torch.Tensor:
    """fp32 exp by the fixed operation sequence the kernels use (see module docstring)."""
    t = torch.clamp(t.float(), -80.0, 80.0)
    n = torch.round(t * 1.4426950408889634)
    r = t - n * 0.693145751953125
    r = r - n * 1.428606765330187e-06
    p = r * 1.984126984126984e-04 + 1.388888888888889e-03
    for c in (8.333333333333333e-03, 4.166666666666667e-02, 1.666666666666667e-01, 0.5, 1.0, 1.0):
        p = p * r + c
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def silu_reference(a: torch.Tensor) -> torch.Tensor:
    a = a.float()
    return a / (exp_reference(-a) + 1.0)


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """h [S, 2F] = [gate | up] (any float dtype) -> fp32 [S, F] = silu(gate) * up, as the kernel computes it."""
    f = h.shape[1] // 2
    y = silu_reference(h[:, :f]) * h[:, f:].float()
    return torch.where(y.abs() < 1.1754943508222875e-38, y * 0.0, y)


def rms_modulate_reference(x: torch.Tensor, weight: torch.Tensor | None, scale_rows: torch.Tensor,
                           shift_rows: torch.Tensor, segments: Sequence[Sequence[int]], eps: float) -> torch.Tensor:
    """x [S, K] -> fp32 h [S, K]: RMSNorm (fp64 sum of squares) * weight, then per segment (a, b, row)
    ``h[a:b] = n[a:b] * (1 + scale_rows[row]) + shift_rows[row]`` (module docstring has the exact steps)."""
    segs = check_norm_inputs(x, weight, scale_rows, shift_rows, segments)
    k = x.shape[1]
    xf = x.float()
    ss = xf.double().pow(2).sum(-1)
    rstd = torch.div(const_like(1.0, x, torch.float64),
                     torch.sqrt(ss / const_like(k, x, torch.float64) + const_like(eps, x, torch.float64))).float()
    n = xf * rstd.unsqueeze(1)
    if weight is not None:
        n = n * weight.float()
    h = torch.empty_like(n)
    for a, b, r in segs:
        h[a:b] = n[a:b] * (scale_rows[r].float() + 1.0) + shift_rows[r].float()
    return h


def dequantize_bf16_reference(t: nvfp4.NVFP4Tensor, multiplier: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] bf16 = bf16(v * s [* multiplier]) (fp32 product, one rounding); exact without multiplier."""
    v = nvfp4.dequantize_blocks(t, torch.float32)
    if multiplier is not None:
        v = v * multiplier.float()
    return v.to(torch.bfloat16)


def to_fp8_rowwise_reference(t: nvfp4.NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 [N, K] -> (e4m3 [N, K], fp32 row scales [N]) with ``v*s ~= e4m3 * row_scale``:
    ``row_scale = 6 * max(block scales of the row) / 448`` (1 for an all-zero row), each element
    ``e4m3_rne(clamp(v * s * inv, +-448))`` with ``inv = 1 / row_scale`` correctly rounded in fp32 (a
    multiply, not a per-element division: cheaper on the GPU; the fp32 product is within 2 ulp of the
    quotient, and one rounding to 3 mantissa bits follows: relative error <= 2^-4)."""
    v = nvfp4.dequantize_blocks(t, torch.float32)
    smax = t.linear_scales().float().amax(1) if v.shape[1] else torch.zeros(v.shape[0], device=v.device)
    ra = torch.div(smax * 6.0, const_like(448.0, v))
    ra = torch.where(ra == 0, const_like(1.0, v), ra)
    inv = torch.div(const_like(1.0, v), ra)
    return torch.mul(v, inv.unsqueeze(1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), ra


# ----------------------------------------------------------------------------------------------
# policy and validation
# ----------------------------------------------------------------------------------------------

def activation_global_scale(policy: str, input_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
    """Resolve the ``act_scale`` option for one layer -> (g or None for dynamic, reason).

    "dynamic": amax per call. "calibrated": the layer's ``input_scale`` (decode direction); a layer
    without one falls back to dynamic and the reason says so.
    """
    if policy == "dynamic":
        return None, "dynamic: amax(|input|) / 2688 per call"
    if policy == "calibrated":
        if input_scale is None:
            return None, "dynamic: act_scale=calibrated but this layer has no input_scale"
        return input_scale.reshape(()).float(), "calibrated: the checkpoint's input_scale"
    raise ValueError(f"act_scale={policy!r}: expected dynamic or calibrated")


def check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [S, K]; found shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32/bfloat16/float16; found {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{name} needs unit column stride; found strides {x.stride()}")


def check_norm_inputs(x, weight, scale_rows, shift_rows, segments):
    check_2d(x, "x")
    k = x.shape[1]
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != k):
        raise ValueError(f"norm weight must be [K={k}]; found {tuple(weight.shape)}")
    for name, t in (("scale_rows", scale_rows), ("shift_rows", shift_rows)):
        if t.dim() != 2 or t.shape[1] != k:
            raise ValueError(f"{name} must be [rows, K={k}]; found {tuple(t.shape)}")
        if t.dtype not in _FLOATS or t.stride(1) != 1:
            raise ValueError(f"{name} must be a float table with unit column stride; found {t.dtype}, {t.stride()}")
    if scale_rows.shape[0] != shift_rows.shape[0]:
        raise ValueError(f"scale_rows has {scale_rows.shape[0]} rows, shift_rows {shift_rows.shape[0]}")
    for name, t in (("weight", weight), ("scale_rows", scale_rows), ("shift_rows", shift_rows)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return check_segments(segments, x.shape[0], scale_rows.shape[0])


def _global(g, x: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(g, dtype=torch.float32, device=x.device).reshape(())


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _outputs(s: int, k: int, device, pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.empty(nvfp4.packed_shape(s, k, pad_rows), dtype=torch.uint8, device=device)
    if packed.shape[0] > s:
        packed[s:].zero_()  # padding rows hold zero codes (the kernels write rows < s only)
    scales = torch.empty(nvfp4.scale_shape(s, k), dtype=torch.uint8, device=device)
    return packed, scales


def _geometry(s: int, k: int) -> tuple[int, int, int, int]:
    kp = nvfp4.roundup(k, nvfp4.BLOCK)
    rs, cp = nvfp4.scale_shape(s, k)
    return s, rs, kp, cp


# ----------------------------------------------------------------------------------------------
# producers
# ----------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, backend: str = "auto"
             ) -> nvfp4.NVFP4Tensor:
    """x [S, K] float -> NVFP4 (packed [S, roundup(K,16)/2], swizzled scales [roundup(S,128), ...]).
    global_scale None: dynamic amax; else the calibrated decode-direction scale."""
    check_2d(x, "x")
    g = nvfp4.global_scale(x) if global_scale is None else _global(global_scale, x)
    if pick_backend(backend, x.device) == "reference":
        return nvfp4.quantize(x, g, pad_rows=1)
    s, k = x.shape
    packed, scales = _outputs(s, k, x.device)
    rp, rs, kp, cp = _geometry(s, k)
    bm, bk, nw = _tiles(x.device)["q"]
    grid = (cdiv(rs, bm), cdiv(cp * 16, bk))
    _launch(nvfp4_kernels.quantize_kernel, grid, x, g, packed, scales, s, k, x.stride(0), packed.stride(0), rp, rs, kp, cp,
            X_KIND=DTYPE_CODE[x.dtype], BM=bm, BK=bk, num_warps=nw)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), g, (s, k))


def rms_modulate_quantize(x: torch.Tensor, weight: torch.Tensor | None, scale_rows: torch.Tensor,
                          shift_rows: torch.Tensor, segments: Sequence[Sequence[int]], eps: float,
                          global_scale: torch.Tensor | float | None = None, *, backend: str = "auto",
                          pad_rows: int = 1) -> nvfp4.NVFP4Tensor:
    """RMSNorm(x) * weight -> per-segment modulate -> NVFP4, in one kernel (two with dynamic scale).

    x [S, K] float; weight [K] or None; scale_rows / shift_rows [rows, K] (e.g. the block's
    scale_msa / shift_msa rows for every (t, modality) row); segments: (start, stop, row) triples that
    tile [0, S) in order. Output bytes equal ``nvfp4.quantize(rms_modulate_reference(...), g, pad_rows=pad_rows)``:
    ``pad_rows=128`` gives packed ``[roundup(S, 128), K/2]`` with zero rows, so a GEMM on it writes zero rows
    past S (the zero-tailed qkv buffer of ``RuntimeOptions.sage_v_pad="buffer"``).
    """
    segs = check_norm_inputs(x, weight, scale_rows, shift_rows, segments)
    if pick_backend(backend, x.device) == "reference":
        h = rms_modulate_reference(x, weight, scale_rows, shift_rows, segs, eps)
        g = nvfp4.global_scale(h) if global_scale is None else _global(global_scale, x)
        return nvfp4.quantize(h, g, pad_rows=pad_rows)
    s, k = x.shape
    rp, rs, kp, cp = _geometry(s, k)
    bm, bk, nw = _tiles(x.device)["norm"]
    nseg = 1 << (len(segs) - 1).bit_length()  # a power of two: few recompiles as layouts change
    seg = padded_segment_table(segs, nseg, x.device)
    nkt = cdiv(k, bk)
    eps_t = const_like(eps, x, torch.float64)
    w = weight if weight is not None else x  # unused pointer when HAS_W is False
    common = dict(HAS_W=weight is not None, X_KIND=DTYPE_CODE[x.dtype], W_KIND=DTYPE_CODE[w.dtype],
                  T_KIND=DTYPE_CODE[scale_rows.dtype], BM=bm, BK=bk, NKT=nkt, NSEG=nseg, num_warps=nw)
    if shift_rows.dtype != scale_rows.dtype:
        raise TypeError(f"scale_rows ({scale_rows.dtype}) and shift_rows ({shift_rows.dtype}) must share a dtype")
    packed, scales = _outputs(s, k, x.device, pad_rows)
    if global_scale is None:
        row_amax = torch.empty(s, dtype=torch.float32, device=x.device)
        _launch(nvfp4_kernels.rms_modulate_kernel, (cdiv(s, bm),), x, w, scale_rows, shift_rows, seg, eps_t,
                eps_t, packed, scales, row_amax, s, k, x.stride(0), scale_rows.stride(0), shift_rows.stride(0),
                packed.stride(0), rp, rs, kp, cp, MODE=0, NKT_OUT=nkt, **common)
        g = nvfp4.global_scale_from_amax(row_amax.amax())
    else:
        g = _global(global_scale, x)
    _launch(nvfp4_kernels.rms_modulate_kernel, (cdiv(rs, bm),), x, w, scale_rows, shift_rows, seg, eps_t, g,
            packed, scales, g, s, k, x.stride(0), scale_rows.stride(0), shift_rows.stride(0), packed.stride(0),
            rp, rs, kp, cp, MODE=1, NKT_OUT=cdiv(cp * 16, bk), **common)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), g, (s, k))


def swiglu_quantize(h: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, backend: str = "auto",
                    pad_rows: int = 1) -> nvfp4.NVFP4Tensor:
    """h [S, 2F] = [gate | up] (fc1's output) -> NVFP4 of silu(gate) * up, [S, F]. Output bytes equal
    ``nvfp4.quantize(swiglu_reference(h), g, pad_rows=pad_rows)``: ``pad_rows=16`` gives the packed
    ``[roundup(S, 16), F/2]`` (zero rows) that the pinned FC2 configurations of the seed require."""
    check_2d(h, "h")
    if h.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F] = [gate | up]; found an odd width {h.shape[1]}")
    if pick_backend(backend, h.device) == "reference":
        y = swiglu_reference(h)
        g = nvfp4.global_scale(y) if global_scale is None else _global(global_scale, h)
        return nvfp4.quantize(y, g, pad_rows=pad_rows)
    s, f = h.shape[0], h.shape[1] // 2
    rp, rs, kp, cp = _geometry(s, f)
    bm, bk, nw = _tiles(h.device)["glu"]
    packed, scales = _outputs(s, f, h.device, pad_rows)
    if global_scale is None:
        grid0 = (cdiv(s, bm), cdiv(f, bk))
        part = torch.empty(grid0[0] * grid0[1], dtype=torch.float32, device=h.device)
        _launch(nvfp4_kernels.swiglu_kernel, grid0, h, part, packed, scales, part, s, f, h.stride(0), packed.stride(0), rp, rs,
                kp, cp, MODE=0, H_KIND=DTYPE_CODE[h.dtype], BM=bm, BK=bk, num_warps=nw)
        g = nvfp4.global_scale_from_amax(part.amax())
    else:
        g = _global(global_scale, h)
    grid = (cdiv(rs, bm), cdiv(cp * 16, bk))
    _launch(nvfp4_kernels.swiglu_kernel, grid, h, g, packed, scales, g, s, f, h.stride(0), packed.stride(0), rp, rs, kp, cp,
            MODE=1, H_KIND=DTYPE_CODE[h.dtype], BM=bm, BK=bk, num_warps=nw)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), g, (s, f))


# ----------------------------------------------------------------------------------------------
# consumers (GEMM backends)
# ----------------------------------------------------------------------------------------------

def _scratch_view(out: torch.Tensor | None, n: int, k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The leading [n, k] view of a reusable scratch buffer (a new one when ``out`` is None)."""
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() < n * k:
        name = str(dtype).replace("torch.", "")
        raise ValueError(f"scratch must be {name} with >= {n}x{k} elements; found {out.dtype} {tuple(out.shape)}")
    return out.reshape(-1)[: n * k].view(n, k)


def dequantize_bf16(t: nvfp4.NVFP4Tensor, multiplier: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """NVFP4 [N, K] -> bf16 [N, K] = bf16(v * s [* multiplier]) written into ``out`` (a reusable scratch
    buffer, at least [N, K]; its leading [N, K] view is returned). multiplier: fp32 device scalar."""
    n, k = t.shape
    view = _scratch_view(out, n, k, torch.bfloat16, t.device)
    if pick_backend(backend, t.device) == "reference":
        view.copy_(dequantize_bf16_reference(t, multiplier))
        return view
    bm, bk, nw = _tiles(t.device)["deq"]
    gm = multiplier if multiplier is not None else t.global_scale
    _launch(nvfp4_kernels.dequant_kernel, (cdiv(n, bm), cdiv(k, bk)), t.packed, t.scales.view(torch.uint8), gm, view,
            n, k, t.k_padded, t.scales.shape[1], t.packed.stride(0), view.stride(0), HAS_G=multiplier is not None,
            OUT_KIND=1, BM=bm, BK=bk, num_warps=nw)
    return view


def to_fp8_rowwise(t: nvfp4.NVFP4Tensor, *, out: torch.Tensor | None = None, backend: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 [N, K] -> (float8_e4m3fn [N, K] in ``out`` (reusable scratch), fp32 row scales [N]); see
    ``to_fp8_rowwise_reference`` for the arithmetic."""
    n, k = t.shape
    view = _scratch_view(out, n, k, torch.float8_e4m3fn, t.device)
    if pick_backend(backend, t.device) == "reference":
        q, ra = to_fp8_rowwise_reference(t)
        view.copy_(q)
        return view, ra
    ra = torch.empty(n, dtype=torch.float32, device=t.device)
    bm, bk, nw = _tiles(t.device)["fp8"]
    _launch(nvfp4_kernels.fp8_rowwise_kernel, (cdiv(n, bm),), t.packed, t.scales.view(torch.uint8), view.view(torch.uint8),
            ra, n, k, t.k_padded, t.scales.shape[1], t.packed.stride(0), view.stride(0), BM=bm, BK=bk,
            NKT=cdiv(t.k_padded, bk), HW=hw_cvt(t.device), num_warps=nw)
    return view, ra


def nvfp4_gemm(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton: a [M, K] x b [N, K]^T -> [M, N] = ga * gb * sum_k (va*sa)(vb*sb): each product exact,
    fp32 accumulation (tensor-core bf16 MMA), one rounding to ``out_dtype`` (bf16 or fp32)."""
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"nvfp4_gemm: a is [M, {k}] but b is [N, {kb}]; K must match")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"nvfp4_gemm writes bfloat16 or float32; asked for {out_dtype}")
    ok, why = triton_status(a.device)
    if not ok:
        raise RuntimeError(f"nvfp4_gemm is a Triton kernel: {why}")
    bm, bn, bk, gm, nw, ns = _tiles(a.device)["gemm"]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _launch(nvfp4_kernels.gemm_kernel, grid, a.packed, a.scales.view(torch.uint8), b.packed, b.scales.view(torch.uint8),
            a.global_scale, b.global_scale, out, m, n, a.k_padded, a.scales.shape[1], b.scales.shape[1],
            a.packed.stride(0), b.packed.stride(0), out.stride(0), OUT_KIND=1 if out_dtype == torch.bfloat16 else 0,
            BM=bm, BN=bn, BK=bk, GROUP_M=gm, NKT=cdiv(a.k_padded, bk), DOT_BF16=a.device.type == "cuda",
            num_warps=nw, num_stages=ns)
    return out
