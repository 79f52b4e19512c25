"""A checkpoint checked against its detected config from the headers alone: every tensor present, every
shape and dtype right, quantized layers included (an NVFP4 layer's packed weight and scales by the layout of
its [N, K] weight, each with its stored dtype), and every layer the file's ``_quantization_metadata`` claims is
quantized really stored that way. Reads no tensor data except the few-byte ``comfy_quant`` markers.

``generate`` and ``forward`` call it before the model loads, ``quantize`` before it writes anything.
"""

from __future__ import annotations

import math

from ..errors import CheckpointError
from .comfy_quant import comfy_quant_shapes, parse_quantization_metadata
from .checkpoint import Checkpoint, expected_keys

_QUANT_DTYPES = ("F8_E4M3", "F8_E5M2", "I8", "U8")
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# stored dtypes each NVFP4 tensor may have: packed E2M1 bytes, e4m3 scales (or their raw bytes), a float scalar
_NVFP4_DTYPES = {".weight": ("U8", "I8"), ".weight_scale": ("F8_E4M3", "U8"), ".weight_scale_2": _FLOAT_DTYPES}
# the stored weight dtype of the other formats ``dequantize_layer`` reads
_WEIGHT_DTYPES = {"float8_e4m3fn": ("F8_E4M3", "U8"), "float8_e5m2": ("F8_E5M2", "U8"), "int8_tensorwise": ("I8", "U8")}


def quant_layers(src) -> set[str]:
    """Layers stored quantized (a ``comfy_quant`` marker, an fp8/int8/uint8 weight, or an entry of the file's
    ``_quantization_metadata`` naming a stored weight); none for an in-memory source that is not a Checkpoint."""
    if not isinstance(src, Checkpoint):
        return set()
    have = src.keys()
    layers = {k[: -len(".comfy_quant")] for k in have if k.endswith(".comfy_quant")}
    layers |= {k[: -len(".weight")] for k in have if k.endswith(".weight") and src.dtype_name(k) in _QUANT_DTYPES}
    try:
        claimed = parse_quantization_metadata(src.metadata)
    except ValueError as e:
        raise CheckpointError(f"{src.headers[0].path.name}: {e}; re-export the file") from None
    layers |= {layer for layer in claimed if layer + ".weight" in have}
    return layers


def _dtype_problem(ck, name: str, allowed, what: str) -> list[str]:
    dt = ck.dtype_name(name)
    return [] if dt in allowed else [f"{name} ({what}): expected dtype {' or '.join(allowed)}, found {dt}"]


def _quant_problems(ck: Checkpoint, layer: str, shape: tuple) -> list[str]:
    """Shape problems of one stored quantized linear whose dense weight is ``shape`` [N, K]."""
    fmt = (ck.quant_format(layer) or {}).get("format")
    have = set(ck.keys())
    w = layer + ".weight"
    if len(shape) != 2:
        return [f"{w}: stored quantized ({fmt or ck.dtype_name(w)}), but {layer} is not a linear layer (its weight "
                f"is {list(shape)}); expected a float tensor"]
    if fmt is not None and fmt != "nvfp4" and fmt not in _WEIGHT_DTYPES:
        return [f"{layer}: quantization format {fmt!r} is not supported (expected nvfp4, "
                f"{', '.join(_WEIGHT_DTYPES)})"]
    if fmt is None and ck.dtype_name(w) == "U8":  # packed NVFP4 bytes or int8 bytes: the reader cannot tell
        return [f"{w}: stored as U8 bytes, but neither a {layer}.comfy_quant marker nor the file's "
                "_quantization_metadata says its format (an nvfp4 file carries one)"]
    if fmt == "nvfp4":
        if w in have and ck.dtype_name(w) in _FLOAT_DTYPES and tuple(ck.shape(w)) == tuple(shape):
            claim = "its comfy_quant marker" if layer + ".comfy_quant" in have else "_quantization_metadata"
            return [f"{w}: the file's {claim} says nvfp4, but the tensor is a dense {ck.dtype_name(w)} "
                    f"{list(shape)} weight; remove the claim or quantize the layer (h3-blackwell quantize)"]
        want = {s: shp for s, (_, shp) in comfy_quant_shapes(*shape).items() if s != ".comfy_quant"}
        out = []
        for suffix, shp in want.items():
            name = layer + suffix
            if name not in have:
                out.append(f"{name}: missing (an nvfp4 layer needs .weight, .weight_scale and .weight_scale_2)")
            elif tuple(ck.shape(name)) != tuple(shp):
                out.append(f"{name} (nvfp4 of a {list(shape)} weight): expected {list(shp)}, found "
                           f"{list(ck.shape(name))}")
            else:
                out += _dtype_problem(ck, name, _NVFP4_DTYPES[suffix], f"nvfp4 of a {list(shape)} weight")
        # the optional activation-side tensors: one calibrated global scale, one AWQ factor per input column
        for suffix, ok, want in ((".input_scale", lambda s: math.prod(s) == 1, "one value"),
                                 (".pre_quant_scale", lambda s: s == (shape[1],), f"[{shape[1]}]")):
            name = layer + suffix
            if name in have:
                if not ok(tuple(ck.shape(name))):
                    out.append(f"{name} (nvfp4 of a {list(shape)} weight): expected {want}, found "
                               f"{list(ck.shape(name))}")
                out += _dtype_problem(ck, name, _FLOAT_DTYPES, f"nvfp4 of a {list(shape)} weight")
        return out
    if w in have and tuple(ck.shape(w)) != tuple(shape):
        return [f"{w} ({fmt or ck.dtype_name(w)}): expected {list(shape)}, found {list(ck.shape(w))}"]
    kind = fmt or "int8_tensorwise"  # how the loader reads a quantized weight without a format claim
    scale = layer + ".weight_scale"
    if fmt is None and w in have and ck.dtype_name(w).startswith("F8") and scale not in have:
        return [f"{w}: an {ck.dtype_name(w)} weight without {scale} (an unscaled fp8 file, or an older scaled_fp8 "
                "one with 'scale_weight'): not supported; expected a comfy_quant fp8 file (each fp8 weight with its "
                "weight_scale), bf16, int8 or NVFP4; convert the bf16 release with `h3-blackwell quantize`"]
    out = _dtype_problem(ck, w, _WEIGHT_DTYPES[kind], kind) if w in have else []
    if scale not in have:
        return out + [f"{scale}: missing (a {kind} weight needs its scale)"]
    out += _dtype_problem(ck, scale, _FLOAT_DTYPES, f"the scale of a {kind} weight")
    found = tuple(ck.shape(scale))
    if math.prod(found) != 1 and found not in ((shape[0],), (shape[0], 1)):
        out.append(f"{scale} (the scale of the {kind} {list(shape)} weight): expected one value or one per row "
                   f"([{shape[0]}] or [{shape[0]}, 1]), found {list(found)}")
    conf = ck.quant_format(layer) or {}
    if kind == "int8_tensorwise" and conf.get("convrot"):
        g = conf.get("convrot_groupsize", 256)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1) or g.bit_length() % 2 == 0 \
                or shape[1] % g:
            out.append(f"{layer}: convrot_groupsize {g!r}: expected a power of 4 that divides the weight's "
                       f"{shape[1]} columns (256 for H3)")
    return out


def check_names_and_shapes(want: dict, src, quant: set[str], label: str, num_layers: int,
                           what: str = "") -> None:
    """Raise CheckpointError naming missing tensors and wrong shapes (expected vs found, at most 5 of each).

    want: {name: shape or tensor} the model needs; src: a Checkpoint or an in-memory source (keys, shape);
    quant: its quantized layers (``quant_layers``), whose stored tensors are checked against the layout of
    their dense [N, K] weight (NVFP4: packed weight and scales). ``what`` describes the config for the message.
    """
    have = set(src.keys())
    missing, bad = [], []
    for k, shape in want.items():
        shape = tuple(getattr(shape, "shape", shape))
        layer = k[: -len(".weight")] if k.endswith(".weight") else None
        if layer in quant:
            bad += _quant_problems(src, layer, shape)
        elif k not in have:
            if k != "rope.inv_freq":
                missing.append(k)
        elif tuple(src.shape(k)) != shape:
            bad.append(f"{k}: expected {list(shape)}, found {list(src.shape(k))}")
        elif isinstance(src, Checkpoint):  # a dense tensor: any float dtype is converted at load, nothing else
            bad += _dtype_problem(src, k, _FLOAT_DTYPES, "a dense tensor")
    what = what or f"the {num_layers}-block H3 config"
    if missing:
        raise CheckpointError(f"checkpoint {label} is missing {len(missing)} tensor(s) that {what} needs, e.g. "
                              f"{missing[:5]}; the file is incomplete: re-download or re-export it")
    if bad:
        raise CheckpointError(f"checkpoint {label}: {len(bad)} tensor(s) with the wrong shape or dtype for {what}: "
                              + "; ".join(bad[:5]) + "; the file is damaged or not an H3 checkpoint")


def check_checkpoint(ck: Checkpoint) -> None:
    """``check_names_and_shapes`` for the config detected from ``ck``'s headers (no tensor data is read); marks
    ``ck.verified`` so the streaming load does not check it again."""
    cfg = ck.config
    check_names_and_shapes(expected_keys(cfg), ck, quant_layers(ck), str(ck.headers[0].path), cfg.num_layers,
                           f"the detected config ({cfg.num_layers} blocks, hidden {cfg.hidden_size}, "
                           f"{cfg.num_heads} heads)")
    ck.verified = True
