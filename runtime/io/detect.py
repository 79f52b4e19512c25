"""Detect an H3Config from a checkpoint's tensor names and shapes (any naming scheme) and its metadata.

Detection reads only the JSON header of a safetensors file (``read_header``): no tensor data is read and
no tensor is allocated, so detecting the full 33B model costs a few kilobytes of I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CheckpointError
from ..model.config import OWN_CONFIG_KEY, H3Config
from .keys import diffusers_to_comfy_name, detect_scheme, strip_prefix


def _comfy_shapes(shapes: dict[str, tuple[int, ...]], scheme: str | None) -> dict[str, tuple[int, ...]]:
    """``shapes`` under ComfyUI names (prefixes stripped; a diffusers file's q/k/v rows summed into qkv_proj)."""
    shapes = {strip_prefix(k): tuple(v) for k, v in shapes.items()}
    scheme = scheme or detect_scheme(shapes)
    if scheme != "diffusers":
        return shapes
    conv: dict[str, tuple[int, ...]] = {}
    for k, s in shapes.items():
        ck = diffusers_to_comfy_name(k)
        if ck is None:
            continue
        if ck.endswith("qkv_proj.weight"):
            prev = conv.get(ck)
            s = (s[0] + (prev[0] if prev else 0),) + tuple(s[1:])
        conv[ck] = s
    return conv


def _need(shapes: dict[str, tuple[int, ...]], k: str) -> tuple[int, ...]:
    if k not in shapes:
        raise CheckpointError(f"missing key {k!r} needed to detect the H3 config")
    return shapes[k]


def _count(shapes: dict[str, tuple[int, ...]], prefix: str) -> int:
    """The number of numbered children ``<prefix><i>.``: their indices must be 0 .. n-1 (a gap, or a stray
    ``blocks.1000000000.`` key that would make the model a billion blocks long, is a CheckpointError)."""
    idx = set()
    for k in shapes:
        if k.startswith(prefix):
            rest = k[len(prefix):].split(".", 1)[0]
            if rest.isdigit():
                idx.add(int(rest))
    n = len(idx)
    if idx and max(idx) != n - 1:
        gap = min(set(range(n)) - idx)
        raise CheckpointError(f"the file numbers {n} blocks up to {prefix}{max(idx)} but has no {prefix}{gap}; "
                              f"expected {prefix}0 .. {prefix}{n - 1}; the file is damaged or incomplete: re-download "
                              "or re-export it")
    return n


def _io_kw(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """hidden size, block counts, latent channels and the head bank, from the patch projections and heads."""
    kw: dict[str, Any] = {}
    hidden, patch_dim = _need(shapes, "video_patch_proj.weight")
    kw["hidden_size"] = hidden
    kw["num_layers"] = _count(shapes, "blocks.")
    kw["num_refiner_layers"] = _count(shapes, "token_refiner.blocks.")
    audio_ch = _need(shapes, "final_layer.audio_out.weight")[0]
    ain = _need(shapes, "audio_patch_proj.weight")[1]
    kw["audio_channels"] = ain
    patch_area = 4
    if patch_dim <= 0 or patch_dim % patch_area:
        raise CheckpointError(f"video_patch_proj.weight has shape {[hidden, patch_dim]}; its {patch_dim} input "
                              f"columns must be video_channels x {patch_area} (96 for H3's 24 channels); the file is "
                              "damaged or not an H3 checkpoint")
    kw["video_channels"] = patch_dim // patch_area
    vout = _need(shapes, "final_layer.video_out.weight")[0]
    bank = vout // patch_dim
    if bank == 0 or bank * patch_dim != vout:
        raise CheckpointError(f"final_layer.video_out.weight has {vout} rows and video_patch_proj.weight "
                              f"{patch_dim} input columns; the head must have a positive multiple of {patch_dim} "
                              "rows (one per patch feature and head); one of the two tensors is damaged")
    if ain <= 0 or audio_ch % ain:
        raise CheckpointError(f"final_layer.audio_out.weight has {audio_ch} rows; expected a positive multiple of "
                              f"audio_patch_proj.weight's {ain} input columns")
    kw["head_bank"] = bank
    return kw


def _block_kw(shapes: dict[str, tuple[int, ...]], has_blocks: bool) -> dict[str, Any]:
    """head_dim, heads, FFN width and gate compression from the first block (a refiner block when the file
    has no main blocks)."""
    first = "blocks.0." if has_blocks else "token_refiner.blocks.0."
    head_dim = _need(shapes, first + "attn.q_norm.weight")[0]
    if head_dim <= 0:
        raise CheckpointError(f"{first}attn.q_norm.weight has shape {list(shapes[first + 'attn.q_norm.weight'])}; "
                              "expected [head_dim] with head_dim > 0 (128 for H3); the file is damaged")
    kw: dict[str, Any] = {"head_dim": head_dim,
                          "num_heads": _need(shapes, first + "attn.qkv_proj.weight")[0] // (3 * head_dim),
                          "ffn_hidden_size": _need(shapes, first + "mlp.fc1.weight")[0] // 2}
    if "rope.inv_freq" in shapes:
        kw["rope_inv_freq_len"] = shapes["rope.inv_freq"][0]
    else:
        kw["rope_inv_freq_len"] = (head_dim * 3 // 4) // 6  # diffusers drops the buffer; H3 rotates 3/4 of a head
    kw["gate_compress"] = "blocks.0.attn.to_gate_compress.weight" in shapes
    return kw


def _time_kw(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The time embedding: the curve-form table (grid, width) or the full-form embedder's widths."""
    if "adaln_t_table" in shapes:
        grid, k = shapes["adaln_t_table"]
        return {"adaln_curve_grid": grid, "time_embed_dim": k}
    out = _need(shapes, "time_embedder.proj_out.weight")[0]
    th, tin = _need(shapes, "time_embedder.proj_in.weight")
    return {"time_embed_dim": out, "timestep_input_dim": tin, "time_embed_hidden_size": th}


def _with_metadata(cfg: H3Config, metadata: dict[str, str] | None) -> H3Config:
    """``cfg`` overridden by the safetensors metadata's ``config`` JSON (ours under ``h3_blackwell``, else
    core's / diffusers' names under ``transformer``, else the top level)."""
    if not (metadata and metadata.get("config")):
        return cfg
    try:
        over = json.loads(metadata["config"])
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"safetensors metadata 'config' is not JSON ({type(e).__name__}: {str(e)[:200]})"
                              ) from None
    if not isinstance(over, dict):
        raise CheckpointError(f"safetensors metadata 'config' is a JSON {type(over).__name__}; expected an object of "
                              "config fields; re-export the file")
    if isinstance(over.get(OWN_CONFIG_KEY), dict):
        over = over[OWN_CONFIG_KEY]  # ours, in our names (files written since issue 15)
    elif isinstance(over.get("transformer"), dict):
        over = over["transformer"]  # core's / diffusers' names, or our names in older files
    over = _checked_override(_normalise_override(over), cfg)
    for k in ("num_layers", "num_refiner_layers"):  # counted from the names: a different claim is a damaged file
        if k in over and over[k] != getattr(cfg, k):
            raise CheckpointError(f"safetensors metadata 'config' says {k}={over[k]}, but the file holds "
                                  f"{getattr(cfg, k)} such blocks; the metadata or the tensors are damaged; re-export "
                                  "the file")
    try:
        return H3Config.from_dict({**cfg.to_dict(), **over})
    except CheckpointError as e:
        raise CheckpointError(f"safetensors metadata 'config': {e}; re-export the file") from None


def _checked_override(over: dict, cfg: H3Config) -> dict:
    """The config fields of ``over`` with the base's JSON type: integers >= 0 for sizes, finite numbers, booleans,
    lists of integers >= 0; anything else is a CheckpointError naming the field."""
    base = cfg.to_dict()
    for k, v in over.items():
        if k not in base:
            continue
        want = base[k]
        if isinstance(want, bool):
            ok = isinstance(v, bool)
        elif isinstance(want, int):
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        elif isinstance(want, float):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        elif isinstance(want, list):
            ok = isinstance(v, list) and len(v) == len(want) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        else:
            ok = isinstance(v, type(want))
        if not ok:
            raise CheckpointError(f"safetensors metadata 'config': field {k} is {str(v)[:80]!r}; expected "
                                  f"{'a finite number' if isinstance(want, float) else type(want).__name__} like "
                                  f"{want!r}; re-export the file")
    return over


def config_from_shapes(shapes: dict[str, tuple[int, ...]], scheme: str | None = None,
                       metadata: dict[str, str] | None = None) -> H3Config:
    """Derive H3Config from tensor names and shapes (no data).

    ``shapes`` may be in any scheme; ``metadata`` is the safetensors ``__metadata__`` whose ``config``
    entry (JSON, optionally under ``transformer``) overrides the derived values.
    """
    shapes = _comfy_shapes(shapes, scheme)
    kw = _io_kw(shapes)
    kw.update(_block_kw(shapes, bool(kw["num_layers"])))
    kw["text_dim"] = _need(shapes, "condition_proj.weight")[1]
    kw.update(_time_kw(shapes))
    return _with_metadata(H3Config(**kw), metadata).validate()


# ComfyUI / diffusers config names -> ours
_OVERRIDE_NAMES = {
    "num_attention_heads": "num_heads", "attention_head_dim": "head_dim", "latents_dim": "video_channels",
    "in_channels": "video_channels", "audio_latents_dim": "audio_channels", "audio_in_channels": "audio_channels",
    "token_refiner_num_layers": "num_refiner_layers", "ffn_dim": "ffn_hidden_size",
    "freq_dim": "timestep_input_dim", "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len", "norm_eps": "eps",
}


def _normalise_override(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        out[_OVERRIDE_NAMES.get(k, k)] = v
    return out
