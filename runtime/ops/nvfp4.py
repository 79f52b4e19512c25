"""NVFP4: the reference format (pure torch, any device), and its on-disk forms.

Format (NVIDIA NVFP4, as cuBLASLt, torch and comfy-kitchen define it):

* element: E2M1 code, 4 bits = sign (bit 3) + 2 exponent bits (bias 1) + 1 mantissa bit; codes 0..7 are
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}, 8..15 the same negated (8 is -0). No Inf/NaN; saturates at 6.
* block: 16 consecutive elements along K share one UE4M3 scale ``s`` (fp8 e4m3fn bits, always >= 0).
* tensor: one fp32 global scale ``g`` in the DECODE direction, ``g = amax(|x|) / (6 * 448)``
  (1.0 for an all-zero tensor). ``value = e2m1(code) * s * g``.
* quantization (bit-for-bit comfy-kitchen's eager ``quantize_nvfp4`` / torchao):
  ``s = e4m3_rne(min((amax_block / 6) / g, 448))``; ``q = x / (g * s)`` (0 where ``g * s == 0``);
  ``code = e2m1_rne(clamp(q, -6, 6))``; every step is one correctly rounded fp32 operation.
* packing: ONE internal nibble order, low nibble first: element ``2i`` in bits 0-3 and ``2i+1`` in bits
  4-7 of byte ``i`` (torch ``float4_e2m1fn_x2``, cuBLASLt, ModelOpt). comfy-kitchen's on-disk default is
  the opposite (``hi_first=True``: element ``2i`` in the HIGH nibble); the conversion happens only in
  ``to_comfy_quant`` / ``from_comfy_quant`` (``swap_nibbles``).
* scale layout: the cuBLAS 128x4 tiled ("swizzled") layout of the ``[rows, K/16]`` scale matrix,
  zero-padded to ``[roundup(rows, 128), roundup(K/16, 4)]``: scale ``(r, c)`` lives at flat offset
  ``((r//128) * (C/4) + c//4) * 512 + (r%32) * 16 + ((r%128)//32) * 4 + c%4``.

On disk (ComfyUI ``comfy_quant``, format ``nvfp4``), for a linear ``<layer>`` with weight ``[N, K]``:

======================== ======== ====================================================================
``<layer>.weight``        uint8    ``[roundup(N,16), roundup(K,16)/2]``, HIGH nibble first (comfy-kitchen)
``<layer>.weight_scale``  fp8 e4m3 ``[roundup(N,128), roundup(roundup(K,16)/16, 4)]`` swizzled, zero padded
``<layer>.weight_scale_2`` fp32    ``[]`` global scale (decode direction)
``<layer>.input_scale``   fp32     ``[]`` optional: calibrated activation global scale (decode direction)
``<layer>.pre_quant_scale`` float  ``[K]`` optional: AWQ smoothing, multiplied into the input first
``<layer>.comfy_quant``   uint8    UTF-8 JSON ``{"format": "nvfp4"}``; or instead the safetensors metadata
                                   ``_quantization_metadata = {"format_version": "1.0", "layers": {...}}``
======================== ======== ====================================================================

ModelOpt / diffusers ``BFLQuantizationConfig`` layers: ``weight`` uint8 ``[N, K/2]`` LOW nibble first,
``weight_scale`` e4m3 ``[N, K/16]`` linear (not swizzled), ``weight_scale_2``, ``input_scale`` (read only).

Precision notes: ``e2m1 * s`` has at most 6 significant bits and lies in [2^-10, 2688], so it is exact
in bf16 and fp32; the float64 dequantization is exact; the float32 one computes ``v * (g * s)`` like
comfy-kitchen (two roundings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

__all__ = [
    "BLOCK", "E2M1_MAX", "E4M3_MAX", "GLOBAL_SCALE_DIVISOR", "E2M1_VALUES",
    "NVFP4Tensor", "ComfyQuantLayer",
    "roundup", "packed_shape", "scale_shape", "swap_nibbles", "swizzle_scales", "unswizzle_scales",
    "swizzled_offset", "e2m1_encode", "e2m1_decode", "pack_codes", "unpack_codes",
    "global_scale_from_amax", "global_scale", "quantize", "quantize_into", "dequantize", "dequantize_blocks",
    "comfy_quant_marker", "parse_comfy_quant_marker", "quantization_metadata", "parse_quantization_metadata",
    "to_comfy_quant", "from_comfy_quant", "from_comfy_quant_tensors", "from_modelopt", "comfy_quant_shapes",
]

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rows quantized per step in quantize(): a multiple of 128 so each step owns whole swizzle tiles; it
# bounds the fp32 temporaries to ~ROW_CHUNK * K * 4 bytes each whatever the tensor size (on CUDA a larger
# step keeps the kernel launches few).
ROW_CHUNK = 256
ROW_CHUNK_CUDA = 8192


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def packed_shape(rows: int, k: int, pad_rows: int = 16) -> tuple[int, int]:
    """Shape of the packed uint8 data of a [rows, k] tensor: [roundup(rows, pad_rows), roundup(k, 16) / 2]."""
    return roundup(rows, pad_rows), roundup(k, BLOCK) // 2


def scale_shape(rows: int, k: int) -> tuple[int, int]:
    """Shape of the swizzled block scales of a [rows, k] tensor: [roundup(rows,128), roundup(ceil(k/16), 4)]."""
    return roundup(rows, 128), roundup(roundup(k, BLOCK) // BLOCK, 4)


# ----------------------------------------------------------------------------------------------
# nibbles, codes, swizzle
# ----------------------------------------------------------------------------------------------

def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> uint8 with the two nibbles of every byte exchanged (0xAB -> 0xBA): converts between
    low-nibble-first (ours, torch, cuBLASLt, ModelOpt) and high-nibble-first (comfy-kitchen default).
    Works in 16M-byte pieces, so a large weight needs no full-size temporaries."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"swap_nibbles needs uint8 packed NVFP4 data; found {packed.dtype}")
    src = packed.contiguous()
    out = torch.empty_like(src)
    fi, fo = src.view(-1), out.view(-1)
    step = 1 << 24
    for i in range(0, fi.numel(), step):
        torch.bitwise_left_shift(fi[i:i + step], 4, out=fo[i:i + step])
        fo[i:i + step] |= fi[i:i + step] >> 4
    return out


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2m] (values 0..15) -> uint8 [..., m], element 2i in the LOW nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_codes needs an even last dim; found shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] (low nibble first) -> uint8 codes [..., 2m]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# |q| is rounded to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to the even code: the code is
# the number of midpoints below |q|, where a midpoint whose upper neighbour has the even code counts when
# |q| equals it (>=) and the others only when |q| exceeds it (>). Beyond 5 everything saturates to 6.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """fp32 values -> uint8 E2M1 codes, round to nearest even, saturating at +-6; the sign bit follows
    the sign of ``q`` (``-0.0`` and tiny negatives give code 8, as comfy-kitchen and torchao do)."""
    if q.dtype != torch.float32:
        raise TypeError(f"e2m1_encode expects float32; found {q.dtype}")
    a = q.abs()
    mask = torch.empty(q.shape, dtype=torch.bool, device=q.device)
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for mid, inclusive in _MIDPOINTS:  # in place, one comparison pass per midpoint, no allocations
        (torch.ge if inclusive else torch.gt)(a, mid, out=mask)
        code += mask.view(torch.uint8)
    torch.signbit(q, out=mask)
    code |= mask.view(torch.uint8) << 3
    return code


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 E2M1 codes -> values (exact in any float dtype)."""
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return lut[codes.long()]


def swizzle_scales(linear: torch.Tensor) -> torch.Tensor:
    """Block scales [R, C] (one byte each: fp8 e4m3fn or uint8) -> the cuBLAS 128x4 tiled layout
    [roundup(R,128), roundup(C,4)], zero padded; same dtype."""
    if linear.dim() != 2 or linear.element_size() != 1:
        raise ValueError(f"swizzle_scales needs a 2-D one-byte tensor [rows, K/16]; found {linear.dtype} "
                         f"{tuple(linear.shape)}")
    r, c = linear.shape
    rp, cp = roundup(r, 128), roundup(c, 4)
    buf = torch.zeros((rp, cp), dtype=torch.uint8, device=linear.device)
    buf[:r, :c] = linear.view(torch.uint8)
    out = buf.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return out.view(linear.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: [roundup(rows,128), roundup(cols,4)] tiled -> [rows, cols] linear."""
    rp, cp = roundup(rows, 128), roundup(cols, 4)
    if swizzled.numel() != rp * cp or swizzled.element_size() != 1:
        raise ValueError(f"swizzled scales for [{rows}, {cols}] must hold {rp}x{cp} one-byte values; found "
                         f"{swizzled.dtype} {tuple(swizzled.shape)}")
    u = swizzled.reshape(rp, cp).view(torch.uint8)
    lin = u.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return lin[:rows, :cols].contiguous().view(swizzled.dtype)


def swizzled_offset(r: torch.Tensor, c: torch.Tensor, cols_padded: int) -> torch.Tensor:
    """Flat offset of scale (r, c) in the tiled layout whose padded width is ``cols_padded``."""
    return ((r // 128) * (cols_padded // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


# ----------------------------------------------------------------------------------------------
# the tensor
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """A quantized 2-D tensor of logical shape ``shape = (N, K)``.

    packed:       uint8 ``[R, roundup(K,16)/2]``, R >= N (weights pad R to 16, activations keep R = N);
                  LOW nibble first (element 2i in bits 0-3).
    scales:       float8_e4m3fn ``[roundup(R,128), roundup(roundup(K,16)/16, 4)]``, 128x4 swizzled,
                  zero padded.
    global_scale: float32 ``[]`` on the same device, decode direction (amax / 2688).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self):
        n, k = (int(v) for v in self.shape)
        object.__setattr__(self, "shape", (n, k))
        p, s, g = self.packed, self.scales, self.global_scale
        if p.dtype != torch.uint8 or p.dim() != 2:
            raise ValueError(f"NVFP4 packed data must be 2-D uint8; found {p.dtype} {tuple(p.shape)}")
        if p.shape[0] < n or p.shape[1] != roundup(k, BLOCK) // 2:
            raise ValueError(f"NVFP4 packed data for shape ({n}, {k}) must be [>= {n}, {roundup(k, BLOCK) // 2}]; "
                             f"found {tuple(p.shape)}")
        want = scale_shape(p.shape[0], k)
        if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != want:
            raise ValueError(f"NVFP4 block scales for packed rows {p.shape[0]}, K={k} must be float8_e4m3fn "
                             f"{list(want)} (128x4 swizzled); found {s.dtype} {list(s.shape)}")
        if g.dtype != torch.float32 or g.numel() != 1:
            raise ValueError(f"NVFP4 global scale must be one float32; found {g.dtype} {tuple(g.shape)}")
        if g.dim() != 0:
            object.__setattr__(self, "global_scale", g.reshape(()))
        if not (p.device == s.device == g.device):
            raise ValueError(f"NVFP4 parts are on different devices: packed {p.device}, scales {s.device}, "
                             f"global scale {g.device}")

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def k_padded(self) -> int:
        return self.packed.shape[1] * 2

    def to(self, device) -> "NVFP4Tensor":
        return NVFP4Tensor(self.packed.to(device), self.scales.to(device), self.global_scale.to(device), self.shape)

    def linear_scales(self) -> torch.Tensor:
        """float8_e4m3fn [N, roundup(K,16)/16]: the block scales unswizzled."""
        return unswizzle_scales(self.scales, self.shape[0], self.k_padded // BLOCK)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() + 4


# ----------------------------------------------------------------------------------------------
# quantize / dequantize
# ----------------------------------------------------------------------------------------------

def _const(v: float, device) -> torch.Tensor:
    # Scalars go in as 0-dim tensors on the data's device: CUDA's `tensor / python_float` multiplies by
    # the reciprocal (one extra rounding), which would break bit equality with the CPU reference.
    return torch.tensor(v, dtype=torch.float32, device=device)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``[]``: ``amax / 2688``, or 1.0 when amax is 0 (an all-zero tensor). No host sync."""
    a = amax.reshape(()).float()
    return torch.where(a > 0, a / _const(GLOBAL_SCALE_DIVISOR, a.device), _const(1.0, a.device))


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor NVFP4 global scale of ``x`` (fp32 ``[]``, decode direction, on x's device).
    amax(|x|) comes from one min/max pass (no |x| temporary the size of x)."""
    if x.numel() == 0:
        return global_scale_from_amax(torch.zeros((), device=x.device))
    lo, hi = torch.aminmax(x)
    return global_scale_from_amax(torch.maximum(hi, lo.neg()).abs())


def _quantize_rows(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [r, Kp] float (Kp % 16 == 0) -> (packed uint8 [r, Kp/2], linear e4m3 scales [r, Kp/16])."""
    r, kp = x.shape
    xb = x.reshape(r, kp // BLOCK, BLOCK)
    lo, hi = torch.aminmax(xb, dim=-1)
    # max(|x|) without an |x| temporary; exact in the source dtype; abs() makes an all-zero block +0, not -0
    amax = torch.maximum(hi, lo.neg()).abs().float()
    s = amax / _const(E2M1_MAX, x.device)
    s = torch.clamp(s / g, max=E4M3_MAX)
    s8 = s.to(torch.float8_e4m3fn)  # round to nearest even
    total = g * s8.float()
    zero = total == 0
    q = xb.to(torch.float32, copy=True)
    q.div_(total.masked_fill(zero, 1.0).unsqueeze(-1))
    if bool(zero.any()):  # blocks whose scale rounds to 0 encode as +0 (not -0), like comfy-kitchen
        q.masked_fill_(zero.unsqueeze(-1), 0.0)
    # no clamp to +-6 needed: e2m1_encode saturates everything above 5 to code 7
    return pack_codes(e2m1_encode(q).reshape(r, kp)), s8


def quantize_into(x: torch.Tensor, g: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``x`` [N, K] with global scale ``g`` into preallocated ``packed`` [R >= N, Kp/2] (rows
    >= N must already be zero) and ``scales`` (e4m3, swizzled, zero-filled). Works ROW_CHUNK rows at a
    time (ROW_CHUNK_CUDA on CUDA) so temporaries stay small whatever N is."""
    n, k = x.shape
    kp = roundup(k, BLOCK)
    cp = scales.shape[1]
    su = scales.view(torch.uint8)
    step = ROW_CHUNK_CUDA if x.device.type == "cuda" else ROW_CHUNK
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        xc = x[r0:r1]
        if kp != k:
            xc = F.pad(xc, (0, kp - k))
        p, s8 = _quantize_rows(xc, g)
        packed[r0:r1] = p
        tiles = swizzle_scales(s8.view(torch.uint8))
        if tiles.shape[1] != cp:
            raise AssertionError("scale width mismatch")  # unreachable: both come from scale_shape()
        su[r0:r0 + tiles.shape[0]] = tiles


def quantize(x: torch.Tensor, global_scale_: torch.Tensor | float | None = None, *, pad_rows: int = 16
             ) -> NVFP4Tensor:
    """Reference NVFP4 quantizer (bit-for-bit comfy-kitchen's eager ``quantize_nvfp4``).

    x: [N, K] float16/bfloat16/float32, finite, any device. global_scale_: decode-direction fp32 (None:
    ``amax(|x|) / 2688``; a calibrated ``input_scale`` saturates values above ``2688 * g``).
    pad_rows: packed rows are padded with zeros to a multiple of this (16 for checkpoint weights as
    ComfyUI stores them, 1 for activations). Returns an NVFP4Tensor (low nibble first, swizzled scales).
    """
    if x.dim() != 2:
        raise ValueError(f"NVFP4 quantizes 2-D tensors [N, K]; found shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"NVFP4 quantizes float16/bfloat16/float32; found {x.dtype} (dequantize it first)")
    n, k = x.shape
    if global_scale_ is None:
        g = global_scale(x)
    else:
        g = torch.as_tensor(global_scale_, dtype=torch.float32, device=x.device).reshape(())
    pshape = packed_shape(n, k, pad_rows)
    packed = torch.zeros(pshape, dtype=torch.uint8, device=x.device)
    scales = torch.zeros(scale_shape(pshape[0], k), dtype=torch.uint8, device=x.device).view(torch.float8_e4m3fn)
    quantize_into(x, g, packed, scales)
    return NVFP4Tensor(packed, scales, g, (n, k))


def dequantize_blocks(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1 * block_scale`` WITHOUT the global scale, [N, K] in ``dtype``: exact in bf16, fp32, fp64."""
    n, k = t.shape
    kp = t.k_padded
    v = e2m1_decode(unpack_codes(t.packed[:n]), dtype).reshape(n, kp // BLOCK, BLOCK)
    s = t.linear_scales().to(dtype)
    return (v * s.unsqueeze(-1)).reshape(n, kp)[:, :k]


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 -> [N, K] values. float64: exact ``v * s * g``. float32: ``v * (g * s)`` exactly as
    comfy-kitchen's eager ``dequantize_nvfp4(..., output_type=float32)``. bf16/fp16: the fp32 result rounded."""
    n, k = t.shape
    kp = t.k_padded
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    v = e2m1_decode(unpack_codes(t.packed[:n]), cdt).reshape(n, kp // BLOCK, BLOCK)
    total = t.global_scale.to(cdt) * t.linear_scales().to(cdt)
    return (v * total.unsqueeze(-1)).reshape(n, kp)[:, :k].to(dtype)


# ----------------------------------------------------------------------------------------------
# comfy_quant markers and metadata
# ----------------------------------------------------------------------------------------------

def comfy_quant_marker(conf: Mapping | None = None) -> torch.Tensor:
    """The ``<layer>.comfy_quant`` tensor: uint8 [n] of UTF-8 JSON (ComfyUI writes ``json.dumps(conf)``)."""
    conf = dict(conf or {"format": "nvfp4"})
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def parse_comfy_quant_marker(marker: torch.Tensor) -> dict:
    """uint8 JSON marker -> dict, with keys nested under ``params`` merged in (ComfyUI accepts both)."""
    raw = bytes(marker.cpu().reshape(-1).to(torch.uint8).tolist()).rstrip(b"\x00")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"comfy_quant marker is not UTF-8 JSON ({e}); found bytes {raw[:40]!r}") from None
    if not isinstance(d, dict):
        raise ValueError(f"comfy_quant marker must be a JSON object; found {d!r}")
    params = d.get("params") if isinstance(d.get("params"), dict) else {}
    return {**params, **{k: v for k, v in d.items() if k != "params"}}


def quantization_metadata(layers: Mapping[str, Mapping]) -> str:
    """The safetensors metadata value ``_quantization_metadata`` for these layers (name -> conf)."""
    return json.dumps({"format_version": "1.0", "layers": {k: dict(v) for k, v in layers.items()}})


def parse_quantization_metadata(metadata: Mapping[str, str] | None) -> dict[str, dict]:
    """safetensors metadata -> {layer: conf} from ``_quantization_metadata`` ({} when absent)."""
    raw = (metadata or {}).get("_quantization_metadata")
    if not raw:
        return {}
    try:
        layers = json.loads(raw).get("layers", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"_quantization_metadata is not a JSON object with 'layers' ({e})") from None
    return {k: dict(v) for k, v in layers.items() if isinstance(v, dict)}


# ----------------------------------------------------------------------------------------------
# comfy_quant tensors <-> NVFP4Tensor (the nibble-order edge)
# ----------------------------------------------------------------------------------------------

def comfy_quant_shapes(n: int, k: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """suffix -> (safetensors dtype, shape) of the tensors ``to_comfy_quant`` writes for a [N, K] weight
    (without optional input_scale / pre_quant_scale): lets a writer lay out a header before quantizing."""
    marker = comfy_quant_marker().numel()
    return {
        ".weight": ("U8", packed_shape(n, k, 16)),
        ".weight_scale": ("F8_E4M3", scale_shape(roundup(n, 16), k)),
        ".weight_scale_2": ("F32", ()),
        ".comfy_quant": ("U8", (marker,)),
    }


@dataclass
class ComfyQuantLayer:
    """One nvfp4 ``comfy_quant`` layer: the weight plus the optional activation-side tensors."""

    weight: NVFP4Tensor
    input_scale: torch.Tensor | None = None  # fp32 [], decode direction
    pre_quant_scale: torch.Tensor | None = None  # [K]
    conf: dict | None = None


def to_comfy_quant(t: NVFP4Tensor, layer: str, *, input_scale: torch.Tensor | None = None,
                   pre_quant_scale: torch.Tensor | None = None, marker: bool = True,
                   hi_first: bool = True) -> dict[str, torch.Tensor]:
    """NVFP4Tensor -> ComfyUI state-dict entries ``{layer + suffix: tensor}``.

    The packed data gets comfy-kitchen's default HIGH-nibble-first order (``hi_first=False`` keeps ours)
    and is padded to 16 rows, as ComfyUI's loader expects ``[roundup(N,16), roundup(K,16)/2]``.
    """
    n, k = t.shape
    rows = roundup(n, 16)
    packed, scales = t.packed, t.scales
    if packed.shape[0] != rows:
        p = torch.zeros((rows, packed.shape[1]), dtype=torch.uint8, device=packed.device)
        p[:min(rows, packed.shape[0])] = packed[:rows]
        packed = p
        want = scale_shape(rows, k)
        if tuple(scales.shape) != want:
            s = torch.zeros(want, dtype=torch.uint8, device=scales.device)
            m = min(want[0], scales.shape[0])
            s[:m] = scales.view(torch.uint8)[:m]
            scales = s.view(torch.float8_e4m3fn)
    out = {
        f"{layer}.weight": swap_nibbles(packed) if hi_first else packed.clone(),
        f"{layer}.weight_scale": scales.clone(),
        f"{layer}.weight_scale_2": t.global_scale.reshape(()).float().clone(),
    }
    if input_scale is not None:
        out[f"{layer}.input_scale"] = torch.as_tensor(input_scale, dtype=torch.float32).reshape(()).clone()
    if pre_quant_scale is not None:
        out[f"{layer}.pre_quant_scale"] = pre_quant_scale.clone()
    if marker:
        out[f"{layer}.comfy_quant"] = comfy_quant_marker({"format": "nvfp4"})
    return out


def from_comfy_quant(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
                     shape: tuple[int, int] | None = None, hi_first: bool = True) -> NVFP4Tensor:
    """ComfyUI nvfp4 tensors -> NVFP4Tensor (our low-nibble-first order).

    weight: uint8 [roundup(N,16), roundup(K,16)/2] (``hi_first`` = comfy-kitchen's default order);
    weight_scale: fp8 e4m3 (or its uint8 bytes) swizzled, [roundup(N,128), roundup(Kp/16,4)] (a flat
    tensor of that many bytes is accepted); weight_scale_2: fp32 scalar. shape: the logical (N, K)
    (ComfyUI takes it from the module; default: the padded storage shape).
    """
    if weight.dtype not in (torch.uint8, torch.int8) or weight.dim() != 2:
        raise ValueError(f"nvfp4 weight must be 2-D uint8 packed E2M1; found {weight.dtype} {tuple(weight.shape)}")
    weight = weight.view(torch.uint8)
    rows, half = weight.shape
    n, k = shape if shape is not None else (rows, half * 2)
    if rows < n or half * 2 != roundup(k, BLOCK):
        raise ValueError(f"nvfp4 weight for logical shape ({n}, {k}) must be [{roundup(n, 16)}, "
                         f"{roundup(k, BLOCK) // 2}]; found {list(weight.shape)}")
    want = scale_shape(rows, k)
    if weight_scale.element_size() != 1 or weight_scale.numel() != want[0] * want[1]:
        raise ValueError(f"nvfp4 weight_scale must hold {want[0]}x{want[1]} fp8 e4m3 values (128x4 swizzled) "
                         f"for weight {list(weight.shape)}; found {weight_scale.dtype} {list(weight_scale.shape)}. "
                         "A linear [N, K/16] scale is the ModelOpt layout: use from_modelopt")
    scales = weight_scale.reshape(want).view(torch.uint8).view(torch.float8_e4m3fn)
    if weight_scale_2.numel() != 1:
        raise ValueError(f"nvfp4 weight_scale_2 must be one fp32 value; found shape {list(weight_scale_2.shape)}")
    g = weight_scale_2.reshape(()).to(device=weight.device, dtype=torch.float32)
    packed = swap_nibbles(weight) if hi_first else weight.contiguous()
    return NVFP4Tensor(packed, scales.to(weight.device).contiguous(), g, (n, k))


def from_comfy_quant_tensors(tensors: Mapping[str, torch.Tensor], layer: str, *,
                             shape: tuple[int, int] | None = None,
                             metadata: Mapping[str, str] | None = None) -> ComfyQuantLayer:
    """Read one nvfp4 layer from a state dict (``<layer>.weight`` etc.). The format comes from the
    ``<layer>.comfy_quant`` marker or, failing that, the safetensors ``_quantization_metadata``."""
    marker = tensors.get(f"{layer}.comfy_quant")
    if marker is not None:
        conf = parse_comfy_quant_marker(marker)
    else:
        conf = parse_quantization_metadata(metadata).get(layer)
        if conf is None:
            raise ValueError(f"{layer}: no {layer}.comfy_quant marker and no _quantization_metadata entry; "
                             "cannot tell its format")
    if conf.get("format") != "nvfp4":
        raise ValueError(f"{layer}: comfy_quant format is {conf.get('format')!r}; expected 'nvfp4'")
    missing = [s for s in (".weight", ".weight_scale", ".weight_scale_2") if f"{layer}{s}" not in tensors]
    if missing:
        raise ValueError(f"{layer}: nvfp4 layer lacks {', '.join(layer + s for s in missing)}")
    w = from_comfy_quant(tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"],
                         tensors[f"{layer}.weight_scale_2"], shape=shape)
    ins = tensors.get(f"{layer}.input_scale")
    pqs = tensors.get(f"{layer}.pre_quant_scale")
    return ComfyQuantLayer(w, None if ins is None else ins.reshape(()).float(), pqs, conf)


def from_modelopt(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> NVFP4Tensor:
    """ModelOpt / diffusers-BFL nvfp4 layer -> NVFP4Tensor.

    weight: uint8 [N, K/2] LOW nibble first; weight_scale: e4m3 (or uint8 bytes) [N, K/16] LINEAR
    (not swizzled); weight_scale_2: fp32 scalar (amax / 2688). K must be a multiple of 16.
    """
    if weight.dtype not in (torch.uint8, torch.int8) or weight.dim() != 2:
        raise ValueError(f"ModelOpt nvfp4 weight must be 2-D uint8; found {weight.dtype} {tuple(weight.shape)}")
    n, half = weight.shape
    k = half * 2
    if k % BLOCK:
        raise ValueError(f"ModelOpt nvfp4 weight has K = {k}, not a multiple of 16")
    if tuple(weight_scale.shape) != (n, k // BLOCK) or weight_scale.element_size() != 1:
        raise ValueError(f"ModelOpt nvfp4 weight_scale must be linear e4m3 [{n}, {k // BLOCK}]; found "
                         f"{weight_scale.dtype} {list(weight_scale.shape)}")
    scales = swizzle_scales(weight_scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    g = weight_scale_2.reshape(()).to(device=weight.device, dtype=torch.float32)
    return NVFP4Tensor(weight.view(torch.uint8).contiguous(), scales, g, (n, k))
