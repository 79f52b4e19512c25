"""NVFP4 Triton kernels: the producers (the seed's "vortex" family) and the consumers the GEMM backends use.

Producers (each writes EXACTLY the bytes of the reference quantizer ``nvfp4.quantize`` applied to its
fp32 reference input; the tests compare bytes):

* ``quantize(x, g)``: x [S, K] -> NVFP4 (packed [S, Kp/2] low nibble first, swizzled e4m3 scales).
* ``rms_modulate_quantize(x, weight, scale_rows, shift_rows, segments, eps, g)``: RMSNorm -> per-segment
  modulate ``h = n * (1 + scale[row]) + shift[row]`` -> quantize; input of the QKV and FC1 GEMMs.
* ``swiglu_quantize(h, g)``: h [S, 2F] = [gate | up] -> ``silu(gate) * up`` -> quantize; input of FC2.

Consumers: ``dequantize_bf16`` (NVFP4 -> bf16 scratch, optionally times a device scalar), ``to_fp8_rowwise``
(NVFP4 -> e4m3 with one fp32 scale per row) and ``nvfp4_gemm`` (the exact-product "emulated" GEMM).

Fused-op arithmetic: ``runtime.ops.reference`` (``rms_modulate_reference``, ``swiglu_reference``,
``dequantize_bf16_reference``, ``to_fp8_rowwise_reference``) is the definition; every step is one correctly
rounded IEEE operation, no FMA contraction, so the kernel and the torch reference agree bit for bit.

Activation global scale (the ``act_scale`` option): ``g=None`` -> dynamic, ``g = amax(|input|) / 2688``
computed on the device in an extra read pass (no host sync) so nothing saturates; a tensor ``g`` ->
calibrated (the checkpoint's ``input_scale``, decode direction): one pass less, values above
``2688 * g`` saturate to +-6 * 448 * g. With the dynamic scale, ``amax_reduce`` (optional, every producer)
maps the tensor's amax (fp32 ``[]`` on the device) to the amax the scale is taken from: sequence parallelism
binds an all-reduce MAX over the ranks (``runtime.parallel.amax``), so a rank's rows are quantized with the
scale of the whole sequence; None is the local amax (the single-process bytes).

The kernels are in ``ops.triton.nvfp4_kernels``, loaded at import when triton is installed. On CPU they run
under ``TRITON_INTERPRET=1`` set before import (tests); ``backend="auto"`` picks Triton for CUDA tensors and the
torch reference otherwise.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import nvfp4
from .elementwise import segment_table
from .operand_checks import FLOAT_DTYPES, Modulation, check_2d, check_norm_inputs
from .reference import (const_like, dequantize_bf16_reference, rms_modulate_reference, swiglu_reference,
                        to_fp8_rowwise_reference)
from .triton import MISSING as TRITON_MISSING, hw_cvt, status as triton_status

if TRITON_MISSING is None:  # the kernels, loaded once; without triton the references run (triton_status says why)
    from .triton import nvfp4_kernels

__all__ = [
    "triton_status", "hw_cvt", "activation_global_scale", "AmaxReduce", "dynamic_global_scale",
    "Modulation", "quantize", "rms_modulate_quantize", "swiglu_quantize",
    "dequantize_bf16", "to_fp8_rowwise", "nvfp4_gemm",
]


# swiglu_quantize's name where other code must know which producer wrote FC2's input: silu(gate) * up -> NVFP4
# bytes + swizzled scales in one pass (the seed's `vortex_native_quantize_swiglu_nvfp4`); FC2 table entries name it
SWIGLU_PRODUCER = "swiglu_nvfp4"
# amax_reduce(amax fp32 [], this tensor's) -> fp32 [], the amax the dynamic scale is taken from (see the docstring)
AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
assert tuple(DTYPE_CODE) == FLOAT_DTYPES


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


def _tiles(device: torch.device, fp8: tuple | None = None) -> dict:
    """Tile sizes (any BM dividing 128 and BK a multiple of 64 give the same bytes); ``fp8``: to_fp8_rowwise's
    (BM, BK, num_warps) from a measured table (ops.producer_tiles), else the built-in ones."""
    if device.type == "cuda":
        return dict(q=(32, 256, 4), norm=(16, 256, 8), glu=(32, 256, 4), deq=(32, 256, 4),
                    fp8=fp8 or (32, 256, 8),  # the four weights: least total time
                    gemm=(128, 128, 64, 8, 8, 3))
    return dict(q=(32, 64, 1), norm=(32, 64, 1), glu=(32, 64, 1), deq=(32, 64, 1), fp8=(32, 64, 1),
                gemm=(16, 16, 32, 4, 1, 1))


def padded_segment_table(segs: list, nseg: int, device: torch.device) -> torch.Tensor:
    """(start, stop, row) triples padded with empty entries to ``nseg`` -> int32 [3*nseg] on the device,
    cached per layout (elementwise.segment_table): no host->device copy, so no host sync, per call."""
    return segment_table([tuple(sg) for sg in segs] + [(0, 0, 0)] * (nseg - len(segs)), device)


# ----------------------------------------------------------------------------------------------
# policy
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


def dynamic_global_scale(x: torch.Tensor, amax_reduce: AmaxReduce | None = None) -> torch.Tensor:
    """The dynamic global scale of ``x`` (fp32 ``[]``): ``nvfp4.global_scale(x)``, its amax first passed
    through ``amax_reduce`` when given."""
    if amax_reduce is None:
        return nvfp4.global_scale(x)
    return _from_amax(nvfp4.amax(x), amax_reduce)


def _from_amax(amax: torch.Tensor, amax_reduce: AmaxReduce | None) -> torch.Tensor:
    a = amax.reshape(()).float()
    return nvfp4.global_scale_from_amax(a if amax_reduce is None else amax_reduce(a))


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

def quantize(x: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, backend: str = "auto",
             amax_reduce: AmaxReduce | None = None) -> nvfp4.NVFP4Tensor:
    """x [S, K] float -> NVFP4 (packed [S, roundup(K,16)/2], swizzled scales [roundup(S,128), ...]).
    global_scale None: dynamic amax (through ``amax_reduce`` when given); else the calibrated decode-direction
    scale."""
    check_2d(x, "x")
    g = dynamic_global_scale(x, amax_reduce) if global_scale is None else _global(global_scale, x)
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


def rms_modulate_quantize(x: torch.Tensor, weight: torch.Tensor | None, mod: Modulation, eps: float,
                          global_scale: torch.Tensor | float | None = None, *, backend: str = "auto",
                          pad_rows: int = 1, amax_reduce: AmaxReduce | None = None) -> nvfp4.NVFP4Tensor:
    """RMSNorm(x) * weight -> per-segment modulate -> NVFP4, in one kernel (two with dynamic scale).

    x [S, K] float; weight [K] or None; mod: ``Modulation`` (scale_rows / shift_rows [rows, K], e.g. the
    block's scale_msa / shift_msa rows for every (t, modality) row; segments: (start, stop, row) triples that
    tile [0, S) in order). Output bytes equal ``nvfp4.quantize(rms_modulate_reference(...), g, pad_rows=pad_rows)``:
    ``pad_rows=128`` gives packed ``[roundup(S, 128), K/2]`` with zero rows, so a GEMM on it writes zero rows
    past S.
    """
    scale_rows, shift_rows = mod.scale_rows, mod.shift_rows
    segs = check_norm_inputs(x, weight, scale_rows, shift_rows, mod.segments)
    if pick_backend(backend, x.device) == "reference":
        h = rms_modulate_reference(x, weight, scale_rows, shift_rows, segs, eps)
        g = dynamic_global_scale(h, amax_reduce) if global_scale is None else _global(global_scale, x)
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
        g = _from_amax(row_amax.amax(), amax_reduce)
    else:
        g = _global(global_scale, x)
    _launch(nvfp4_kernels.rms_modulate_kernel, (cdiv(rs, bm),), x, w, scale_rows, shift_rows, seg, eps_t, g,
            packed, scales, g, s, k, x.stride(0), scale_rows.stride(0), shift_rows.stride(0), packed.stride(0),
            rp, rs, kp, cp, MODE=1, NKT_OUT=cdiv(cp * 16, bk), **common)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), g, (s, k))


def swiglu_quantize(h: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, backend: str = "auto",
                    pad_rows: int = 1, amax_reduce: AmaxReduce | None = None) -> nvfp4.NVFP4Tensor:
    """h [S, 2F] = [gate | up] (fc1's output) -> NVFP4 of silu(gate) * up, [S, F]. Output bytes equal
    ``nvfp4.quantize(swiglu_reference(h), g, pad_rows=pad_rows)``: ``pad_rows=16`` gives the packed
    ``[roundup(S, 16), F/2]`` (zero rows) that the pinned FC2 configurations of the seed require."""
    check_2d(h, "h")
    if h.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F] = [gate | up]; found an odd width {h.shape[1]}")
    if pick_backend(backend, h.device) == "reference":
        y = swiglu_reference(h)
        g = dynamic_global_scale(y, amax_reduce) if global_scale is None else _global(global_scale, h)
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
        g = _from_amax(part.amax(), amax_reduce)
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


def to_fp8_rowwise(t: nvfp4.NVFP4Tensor, *, out: torch.Tensor | None = None, backend: str = "auto",
                   tiles: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 [N, K] -> (float8_e4m3fn [N, K] in ``out`` (reusable scratch), fp32 row scales [N]); see
    ``to_fp8_rowwise_reference`` for the arithmetic. ``tiles``: (BM, BK, num_warps) from a measured table
    (``ProducerTiles.to_fp8_rowwise``), None for the built-in ones."""
    n, k = t.shape
    view = _scratch_view(out, n, k, torch.float8_e4m3fn, t.device)
    if pick_backend(backend, t.device) == "reference":
        q, ra = to_fp8_rowwise_reference(t)
        view.copy_(q)
        return view, ra
    ra = torch.empty(n, dtype=torch.float32, device=t.device)
    bm, bk, nw = _tiles(t.device, tiles)["fp8"]
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
