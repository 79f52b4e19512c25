"""NVFP4: the reference format (pure torch, any device). Its on-disk forms are ``runtime.io.comfy_quant``.

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
  the opposite (``hi_first=True``: element ``2i`` in the HIGH nibble); the conversion happens only at the
  on-disk edge (``runtime.io.comfy_quant``, with ``swap_nibbles``).
* scale layout: the cuBLAS 128x4 tiled ("swizzled") layout of the ``[rows, K/16]`` scale matrix,
  zero-padded to ``[roundup(rows, 128), roundup(K/16, 4)]``: scale ``(r, c)`` lives at flat offset
  ``((r//128) * (C/4) + c//4) * 512 + (r%32) * 16 + ((r%128)//32) * 4 + c%4``.

Precision notes: ``e2m1 * s`` has at most 6 significant bits and lies in [2^-10, 2688], so it is exact
in bf16 and fp32; the float64 dequantization is exact; the float32 one computes ``v * (g * s)`` like
comfy-kitchen (two roundings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "BLOCK", "E2M1_MAX", "E4M3_MAX", "GLOBAL_SCALE_DIVISOR", "E2M1_VALUES",
    "NVFP4Tensor",
    "roundup", "packed_shape", "scale_shape", "swap_nibbles", "swizzle_scales", "unswizzle_scales",
    "swizzled_offset", "e2m1_encode", "e2m1_decode", "pack_codes", "unpack_codes",
    "amax", "global_scale_from_amax", "global_scale", "quantize", "quantize_into", "dequantize", "dequantize_blocks",
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


def amax(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) as a ``[]`` tensor on x's device (x's dtype; fp32 0 for an empty ``x``), from one min/max pass
    (no |x| temporary the size of x)."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg()).abs()


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor NVFP4 global scale of ``x`` (fp32 ``[]``, decode direction, on x's device):
    ``global_scale_from_amax(amax(x))``."""
    return global_scale_from_amax(amax(x))


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
