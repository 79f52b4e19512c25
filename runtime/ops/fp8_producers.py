"""Hopper W4A8 activation producers: e4m3 with ONE fp32 scale per row, written directly by the fused ops.

The NVFP4 producers of ``nvfp4_producers`` write NVFP4 with a global scale (an extra amax pass over the
whole tensor), and on Hopper the fp8 GEMM backend then re-expresses those bytes as rowwise e4m3
(``to_fp8_rowwise``). The producers here skip both: each is ONE kernel launch that reads its input and
writes ``float8_e4m3fn [S, K]`` plus ``row_scale fp32 [S]`` with ``value ~= e4m3 * row_scale[row]``.
Weights stay NVFP4 (``Nvfp4Linear.forward_fp8`` expands them per layer, as the fp8 backend does).

* ``quantize_fp8(x)``: x [S, K] -> e4m3 rowwise; the out_proj input.
* ``rms_modulate_fp8(x, weight, scale_rows, shift_rows, segments, eps)``: RMSNorm -> per-segment modulate
  (the exact arithmetic of ``reference.rms_modulate_reference``) -> e4m3 rowwise; QKV and FC1 inputs.
* ``swiglu_fp8(h)``: h [S, 2F] = [gate | up] -> ``silu(gate) * up`` (``reference.swiglu_reference``'s
  arithmetic) -> e4m3 rowwise; the FC2 input.

Numerics: ``runtime.ops.reference.fp8_rowwise_reference`` is the definition (its docstring gives the steps) and
the kernels write its bytes exactly, for the fp32 row y of the fused op (never rounded to bf16 first): a row
scale ``amax / 448`` (1 where that is 0 or subnormal), the product ``y * (1 / row_scale)`` in fp32, then ONE
rounding to e4m3. On CUDA that rounding is the hardware conversion (cvt.rn.satfinite), elsewhere integer
arithmetic; the bytes are the same.

So every activation is rounded once to e4m3: relative error <= 2^-4 per element (absolute <= 2^-10 *
row_scale in e4m3's subnormal range, i.e. for |y| < amax / 28672). As a per-element worst-case bound that is
more accurate than NVFP4 activations, whose elements get E2M1 (one mantissa bit: relative error up to
1/5..1/3, and values under a quarter of their block's scale unit flushed to 0) under an e4m3 block scale, and
which the fp8 GEMM backend on Hopper rounds AGAIN to rowwise e4m3 (a second 2^-4). Finite inputs only (an
inf/NaN row is not defined). The GEMM side is ``torch._scaled_mm`` rowwise (``Nvfp4Linear.forward_fp8``).

Scheme (one launch, input read once from HBM): a program owns BM whole rows.

* ``loop``: the program walks the row in BK-wide tiles twice -- pass 1 computes the fused op and the row
  amax (RMSNorm has one more pass before it, for the sum of squares), pass 2 recomputes the op and writes
  the codes. The row block is re-read (from L2 when it is still there, else HBM) and the fused op is
  evaluated twice, but registers stay bounded for any width, and no temporary leaves the program.
* ``row``: BK = next_pow2(K), one tile per row: the fused op is evaluated once and kept in registers
  between the amax and the write (no recompute, no re-read); costs lanes on padding (14336 -> 16384 is
  12.5 %, 5376 -> 8192 is 34 %) and registers (BM=1 row spread over 16 warps: 32 fp32 per thread).

``auto`` picks ``row`` on CUDA for row widths up to 16384 (every canonical width) and ``loop`` elsewhere and
on the CPU (the choice and its measurements: bench/NOTES.md, ``bench/producers_h200.py``). A tile table
(``tiles``: a ``ProducerTiles`` the load plan read from ``producer_tiles``) overrides the built-in choice. Every
scheme and tiling writes identical bytes (tests check several).

Every step is one correctly rounded IEEE operation (``tl.div_rn`` where it divides, no FMA contraction: launches pass
``enable_fp_fusion=False``), so kernel, interpreter and torch reference agree bit for bit. The kernels
are in ``ops.triton.fp8_kernels``, loaded at import when triton is installed; on CPU they run under
``TRITON_INTERPRET=1`` set before import (tests), ``backend="auto"`` picks Triton for CUDA tensors and the torch
reference otherwise.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .nvfp4_producers import DTYPE_CODE, cdiv, hw_cvt, padded_segment_table, pick_backend
from .operand_checks import Modulation, check_2d, check_norm_inputs
from .nvfp4 import E4M3_MAX
from .reference import (FP32_MIN_NORMAL, const_like, quantize_fp8_reference, rms_modulate_fp8_reference,
                        swiglu_fp8_reference)
from .producer_tiles import ProducerTiles
from .triton import MISSING as TRITON_MISSING

if TRITON_MISSING is None:  # the kernels, loaded once; without triton the references run
    from .triton import fp8_kernels

__all__ = ["E4M3_MAX", "SCHEMES", "Modulation", "quantize_fp8", "rms_modulate_fp8", "swiglu_fp8", "sage_v_fp8",
           "sage_v_fp8_reference",
           "SAGE_V_PERM", "e4m3_scales"]

SCHEMES = ("auto", "loop", "row")


def _launch(kernel, grid, device, *args, **kw):
    # fp fusion off: the references round every multiply and add separately (no FMA), and so must we.
    kernel[grid](*args, HW=hw_cvt(device), enable_fp_fusion=False, **kw)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}: expected one of {', '.join(SCHEMES)}")


# A tile table (ops.producer_tiles.ProducerTiles, read by the load plan and passed as ``tiles``): consulted for
# scheme="auto" on CUDA, for the ops in producer_tiles.FP8_OPS. Tiles change speed only: every configuration writes
# the same bytes (the tests run both schemes, the bench checks each configuration it times against the reference).


def _tiles(op: str, k: int, device: torch.device, scheme: str, tiles: ProducerTiles | None
           ) -> tuple[str, int, int, int, int]:
    """-> (scheme, BM, BK, NKT, num_warps) for op in FP8_OPS and row width k (``tiles``: a measured table)."""
    _check_scheme(scheme)
    cuda = device.type == "cuda"
    if scheme == "auto" and cuda and tiles is not None and op in tiles.fp8:
        sch, bm, bk, nw = tiles.fp8[op]
        if sch == "row":
            bk = max(bk, _pow2(k))  # a row tile holds the whole row
        return sch, bm, bk, 1 if sch == "row" else cdiv(k, bk), nw
    if scheme == "auto":
        # one row per program, the row kept in registers, on CUDA up to 16384 wide; why: bench/NOTES.md
        scheme = "row" if cuda and k <= 16384 else "loop"
    if scheme == "row":
        bk = max(16, _pow2(k))
        if cuda:
            return scheme, 1, bk, 1, {"quantize": 8, "rms": 4}.get(op, 16) if bk >= 8192 else \
                min(16, max(4, bk // 1024))
        return scheme, 4, bk, 1, 1
    if cuda:
        bm, bk, nw = {"quantize": (16, 256, 4), "rms": (16, 256, 8)}.get(op, (16, 256, 4))
    else:
        bm, bk, nw = 8, 64, 1
    return scheme, bm, bk, cdiv(k, bk), nw


# ----------------------------------------------------------------------------------------------
# producers
# ----------------------------------------------------------------------------------------------

def _outputs(s: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((s, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty(s, dtype=torch.float32, device=device))


def quantize_fp8(x: torch.Tensor, *, backend: str = "auto", scheme: str = "auto", tiles: ProducerTiles | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, K] float -> (float8_e4m3fn [S, K], fp32 row_scale [S]), one launch (``tiles``: a measured table)."""
    _check_scheme(scheme)
    check_2d(x, "x")
    s, k = x.shape
    if k == 0:
        raise ValueError("quantize_fp8 needs K >= 1")
    if pick_backend(backend, x.device) == "reference":
        return quantize_fp8_reference(x)
    out, rs = _outputs(s, k, x.device)
    if s == 0:
        return out, rs
    _, bm, bk, nkt, nw = _tiles("quantize", k, x.device, scheme, tiles)
    _launch(fp8_kernels.quantize_fp8_kernel, (cdiv(s, bm),), x.device, x, out.view(torch.uint8), rs, s, k, x.stride(0),
            out.stride(0), X_KIND=DTYPE_CODE[x.dtype], BM=bm, BK=bk, NKT=nkt, num_warps=nw)
    return out, rs


def _pad_outputs(out: torch.Tensor, rs: torch.Tensor, s: int, pad_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, K] e4m3 and [S] scales -> [roundup(S, pad_rows), K] / [roundup(S, pad_rows)]: zero codes and scale
    1.0 past S (the reference path; the kernel path allocates the padded outputs up front)."""
    rows = cdiv(s, pad_rows) * pad_rows
    if rows == s:
        return out, rs
    o2, r2 = _padded_outputs(s, out.shape[1], out.device, pad_rows)
    o2[:s].copy_(out)
    r2[:s].copy_(rs)
    return o2, r2


def _padded_outputs(s: int, k: int, device, pad_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = cdiv(s, pad_rows) * pad_rows
    out = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=device)
    rs = torch.empty(rows, dtype=torch.float32, device=device)
    if rows > s:
        out[s:].view(torch.uint8).zero_()  # zero codes: a GEMM on them writes zero rows (no bias)
        rs[s:].fill_(1.0)
    return out, rs


def rms_modulate_fp8(x: torch.Tensor, weight: torch.Tensor | None, mod: Modulation, eps: float, *,
                     backend: str = "auto", scheme: str = "auto", pad_rows: int = 1,
                     tiles: ProducerTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight -> per-segment modulate -> e4m3 rowwise, in one kernel launch.

    Arguments as ``nvfp4_producers.rms_modulate_quantize`` (``mod``: the scale/shift tables and the
    (start, stop, row) segments tiling [0, S) in order). Output equals
    ``fp8_rowwise_reference(rms_modulate_reference(...))`` bit for bit.
    ``pad_rows`` > 1: outputs of ``roundup(S, pad_rows)`` rows, zero codes and row scale 1.0 past S.
    """
    _check_scheme(scheme)
    scale_rows, shift_rows = mod.scale_rows, mod.shift_rows
    segs = check_norm_inputs(x, weight, scale_rows, shift_rows, mod.segments)
    if shift_rows.dtype != scale_rows.dtype:
        raise TypeError(f"scale_rows ({scale_rows.dtype}) and shift_rows ({shift_rows.dtype}) must share a dtype")
    s, k = x.shape
    if k == 0:
        raise ValueError("rms_modulate_fp8 needs K >= 1")
    if pick_backend(backend, x.device) == "reference":
        out, rs = rms_modulate_fp8_reference(x, weight, scale_rows, shift_rows, segs, eps)
        return _pad_outputs(out, rs, s, pad_rows) if pad_rows > 1 else (out, rs)
    out, rs = _outputs(s, k, x.device) if pad_rows <= 1 else _padded_outputs(s, k, x.device, pad_rows)
    if s == 0:
        return out, rs
    _, bm, bk, nkt, nw = _tiles("rms", k, x.device, scheme, tiles)
    nseg = 1 << (len(segs) - 1).bit_length()  # a power of two: few recompiles as layouts change
    seg = padded_segment_table(segs, nseg, x.device)
    eps_t = const_like(eps, x, torch.float64)
    w = weight if weight is not None else x  # unused pointer when HAS_W is False
    _launch(fp8_kernels.rms_fp8_kernel, (cdiv(s, bm),), x.device, x, w, scale_rows, shift_rows, seg, eps_t, out.view(torch.uint8),
            rs, s, k, x.stride(0), scale_rows.stride(0), shift_rows.stride(0), out.stride(0),
            HAS_W=weight is not None, X_KIND=DTYPE_CODE[x.dtype], W_KIND=DTYPE_CODE[w.dtype],
            T_KIND=DTYPE_CODE[scale_rows.dtype], BM=bm, BK=bk, NKT=nkt, NSEG=nseg, num_warps=nw)
    return out, rs


SILU = ("exact", "fast")


def swiglu_fp8(h: torch.Tensor, *, backend: str = "auto", scheme: str = "auto", silu: str = "exact",
               tiles: ProducerTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h [S, 2F] = [gate | up] (fc1's output) -> e4m3 rowwise of silu(gate) * up, [S, F], one launch.
    Output equals ``fp8_rowwise_reference(swiglu_reference(h))`` bit for bit. ``silu="fast"`` (Triton only;
    RuntimeOptions.silu): silu with the hardware exp2 and an approximate division, a few fp32 ulp from the
    reference's value, so a code can land one e4m3 step away where the value sits at a rounding midpoint
    (the tests bound how many); the reference path ignores it."""
    _check_scheme(scheme)
    if silu not in SILU:
        raise ValueError(f"silu={silu!r}: expected one of {', '.join(SILU)}")
    check_2d(h, "h")
    if h.shape[1] % 2 or h.shape[1] == 0:
        raise ValueError(f"h must be [S, 2F] = [gate | up] with F >= 1; found width {h.shape[1]}")
    s, f = h.shape[0], h.shape[1] // 2
    if pick_backend(backend, h.device) == "reference":
        return swiglu_fp8_reference(h)
    out, rs = _outputs(s, f, h.device)
    if s == 0:
        return out, rs
    fast_entry = silu == "fast" and tiles is not None and "swiglu_fast" in tiles.fp8
    _, bm, bk, nkt, nw = _tiles("swiglu_fast" if fast_entry else "swiglu", f, h.device, scheme, tiles)
    _launch(fp8_kernels.swiglu_fp8_kernel, (cdiv(s, bm),), h.device, h, out.view(torch.uint8), rs, s, f, h.stride(0),
            out.stride(0), H_KIND=DTYPE_CODE[h.dtype], BM=bm, BK=bk, NKT=nkt, FAST=silu == "fast", num_warps=nw)
    return out, rs


# ----------------------------------------------------------------------------------------------
# V for SageAttention2's sm_90 kernel (the fused V handling, ops.sage)
# ----------------------------------------------------------------------------------------------

SAGE_V_PERM = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)  # token order within each 16 (fp8 PV MMA)
SAGE_V_ROWS = 128


def _sage_v_check(v: torch.Tensor) -> tuple[int, int, int]:
    if v.dim() != 4 or v.shape[0] != 1 or v.stride(-1) != 1:
        raise ValueError(f"v must be an NHD view [1, S, H, D] with unit stride in D; found {tuple(v.shape)} "
                         f"strides {v.stride()}")
    s, h, d = v.shape[1:]
    if d not in (64, 128) or s < 1:
        raise ValueError(f"v: head_dim must be 64 or 128 and S >= 1; found S={s}, D={d}")
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"v must be bf16 or fp16; found {v.dtype}")
    return s, h, d


def e4m3_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax (any shape: per channel, per head) -> (scale = amax / 448, 1 where that is 0 or subnormal;
    inv = 1 / scale)."""
    sc = torch.div(amax, const_like(E4M3_MAX, amax))
    sc = torch.where(sc < FP32_MIN_NORMAL, const_like(1.0, amax), sc)
    return sc, torch.div(const_like(1.0, amax), sc)


def sage_v_token_order(rows: int, device) -> torch.Tensor:
    """Position i of the sm_90 kernel's V holds token ``order[i]`` (each 16 tokens in ``SAGE_V_PERM`` order); rows:
    a multiple of 16."""
    return (torch.arange(rows, device=device) // 16) * 16 + torch.tensor(SAGE_V_PERM, device=device).repeat(rows // 16)


def sage_v_codes(v: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """V rows [m, H, D] (from a 16-aligned start) and the reciprocal scales [H, D] -> e4m3 codes
    [D, H, roundup(m, 16)] in the kernel's token order: ``code = e4m3_rne(clamp(v * inv, +-448))``, zero past m.
    One fp32 copy of the rows (quantized in place)."""
    m, h, d = v.shape
    mp = -(-m // 16) * 16
    x = torch.zeros(mp, h, d, dtype=torch.float32, device=v.device)
    x[:m].copy_(v)
    q = x.mul_(inv).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    del x
    return q[sage_v_token_order(mp, v.device)].permute(2, 1, 0)


def sage_v_fp8_reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V ``[1, S, H, D]`` -> (``float8_e4m3fn [1, D, H, roundup(S, 128)]``, ``fp32 [1, H, D]``): the operands
    SageAttention2's sm_90 kernel takes for V (what its ``per_channel_fp8(v, "NHD", smooth_v=False)`` builds
    from V zero-padded to 128 rows), with this module's rounding rules: per channel (h, d)
    ``scale = amax_t |v| / 448`` (1 when zero or subnormal), ``code = e4m3_rne(clamp(v * (1/scale), +-448))``,
    tokens past S zero, each 16 tokens stored in the order ``SAGE_V_PERM`` (``sage_v_codes``)."""
    s, h, d = _sage_v_check(v)
    sc, inv = e4m3_scales(v[0].float().abs().amax(0))
    out = torch.zeros(1, d, h, -(-s // SAGE_V_ROWS) * SAGE_V_ROWS, dtype=torch.float8_e4m3fn, device=v.device)
    codes = sage_v_codes(v[0], inv)
    out[0, :, :, :codes.shape[2]] = codes
    return out, sc.unsqueeze(0)


def sage_v_fp8(v: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``sage_v_fp8_reference`` in two launches reading the strided V view directly (one amax pass, one
    quantize + transpose + permute pass; no padded copy of V). Bytes equal the reference's."""
    s, h, d = _sage_v_check(v)
    if pick_backend(backend, v.device) == "reference":
        return sage_v_fp8_reference(v)
    rows = -(-s // SAGE_V_ROWS) * SAGE_V_ROWS
    bt = 64 if v.device.type == "cuda" else 32
    nb = rows // bt
    part = torch.empty(nb, h, d, dtype=torch.float32, device=v.device)
    kind = DTYPE_CODE[v.dtype]
    _launch(fp8_kernels.v_amax_kernel, (nb, h), v.device, v, part, s, v.stride(1), v.stride(2), h, V_KIND=kind, D=d,
            BT=bt, num_warps=4)
    sc, inv = e4m3_scales(part.amax(0))
    out = torch.empty(1, d, h, rows, dtype=torch.float8_e4m3fn, device=v.device)
    _launch(fp8_kernels.v_quant_kernel, (nb, h), v.device, v, inv, out.view(torch.uint8), s, v.stride(1), v.stride(2), h,
            rows, V_KIND=kind, D=d, BT=bt, num_warps=4)
    return out, sc.unsqueeze(0)
