"""The ComfyUI ``comfy_quant`` on-disk codec for NVFP4 layers (and the ModelOpt layout, read only).

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import torch

from ..ops.nvfp4 import BLOCK, NVFP4Tensor, packed_shape, roundup, scale_shape, swap_nibbles, swizzle_scales

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
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"comfy_quant marker is not UTF-8 JSON ({type(e).__name__}); found bytes {raw[:40]!r}"
                         ) from None
    if not isinstance(d, dict):
        raise ValueError(f"comfy_quant marker must be a JSON object; found {d!r}")
    params = d.get("params") if isinstance(d.get("params"), dict) else {}
    return _checked_conf({**params, **{k: v for k, v in d.items() if k != "params"}}, "comfy_quant marker")


def _checked_conf(conf: dict, where: str) -> dict:
    """A layer's quantization descriptor whose ``format`` (when present) is a string; ValueError otherwise."""
    fmt = conf.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise ValueError(f"{where}: 'format' is {json.dumps(fmt)[:80]}; expected a string such as \"nvfp4\"")
    return conf


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
        if not isinstance(layers, dict):
            raise TypeError(f"'layers' is {type(layers).__name__}, expected an object")
    except (json.JSONDecodeError, AttributeError, RecursionError, TypeError) as e:
        raise ValueError(f"_quantization_metadata is not a JSON object with 'layers' ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None
    return {k: _checked_conf(dict(v), f"_quantization_metadata layer {k!r}") for k, v in layers.items()
            if isinstance(v, dict)}


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
