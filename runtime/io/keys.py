"""Key maps between H3's three naming schemes: ComfyUI/original (the runtime's own), diffusers and the raw
release (original names, QKV rows interleaved per head)."""

from __future__ import annotations

import re

import torch

from ..errors import CheckpointError

SCHEMES = ("comfy", "diffusers", "raw")


def detect_scheme(keys) -> str:
    """Naming scheme of an H3 DiT state dict: 'comfy' (ComfyUI / original), 'diffusers' or 'raw'.

    ``raw`` is the original MiniMax release: ComfyUI names but QKV stored per-head interleaved. The two
    cannot be told apart from names; a raw release is recognised by its safetensors metadata
    (``format: raw`` / ``qkv_layout: per_head``) or chosen explicitly by the caller.
    """
    keys = set(strip_prefix(k) for k in keys)
    if "video_patch_proj.weight" in keys and "audio_patch_proj.weight" in keys:
        return "comfy"
    if "proj_in.weight" in keys and "audio_proj_in.weight" in keys:
        return "diffusers"
    sample = sorted(keys)[:8]
    raise CheckpointError(
        "unknown naming scheme: expected an H3 DiT with video_patch_proj.weight + audio_patch_proj.weight "
        f"(ComfyUI/original) or proj_in.weight + audio_proj_in.weight (diffusers); found keys like {sample}. "
        "Is this a VAE, text encoder or another model?")


_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "model.")


def strip_prefix(k: str) -> str:
    for p in _PREFIXES:
        if k.startswith(p):
            return k[len(p):]
    return k


# ---------------------------------------------------------------------------------------------

_D2C_BLOCK = [  # inside a block / refiner block: diffusers -> comfy
    ("attn.norm_q.", "attn.q_norm."), ("attn.norm_k.", "attn.k_norm."), ("attn.to_out.0.", "attn.out_proj."),
    ("ff.net.0.proj.", "mlp.fc1."), ("ff.net.2.", "mlp.fc2."),
]
_D2C_TOP = [
    ("proj_in.", "video_patch_proj."), ("audio_proj_in.", "audio_patch_proj."),
    ("context_embedder.", "condition_proj."), ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."), ("norm_out.norm.", "final_layer.norm."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."), ("proj_out.", "final_layer.video_out."),
    ("audio_proj_out.", "final_layer.audio_out."), ("token_refiner.final_norm.", "token_refiner.final_norm."),
    ("adaln_t_table", "adaln_t_table"),
]
# diffusers q/k/v weight names: which third of the fused qkv_proj each one is
QKV_PART = re.compile(r"\.attn\.to_([qkv])\.weight$")


def diffusers_to_comfy_name(key: str) -> str | None:
    """Map one diffusers key to its ComfyUI name (q/k/v parts map to ``...attn.qkv_proj.weight``).
    Returns None for keys with no ComfyUI counterpart."""
    m = re.match(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.*)$", key)
    if m:
        prefix = "blocks." if m.group(1) == "transformer_blocks" else "token_refiner.blocks."
        rest = m.group(3)
        if re.match(r"^attn\.to_[qkv]\.weight$", rest):
            return f"{prefix}{m.group(2)}.attn.qkv_proj.weight"
        for d, c in _D2C_BLOCK:
            if rest.startswith(d):
                rest = c + rest[len(d):]
                break
        return f"{prefix}{m.group(2)}.{rest}"
    for d, c in _D2C_TOP:
        if key.startswith(d):
            return c + key[len(d):]
    return None


def comfy_to_diffusers_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI-named state dict -> diffusers names (for the oracle tests and for export)."""
    c2d_block = [(c, d) for d, c in _D2C_BLOCK]
    c2d_top = [(c, d) for d, c in _D2C_TOP]
    out = {}
    for k, v in sd.items():
        m = re.match(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.*)$", k)
        if m:
            prefix = "transformer_blocks." if m.group(1) == "blocks" else "token_refiner.refiner_blocks."
            rest = m.group(3)
            base = f"{prefix}{m.group(2)}."
            if rest == "attn.qkv_proj.weight":
                q, kk, vv = v.chunk(3, dim=0)
                out[base + "attn.to_q.weight"], out[base + "attn.to_k.weight"], out[base + "attn.to_v.weight"] = q, kk, vv
                continue
            if rest == "mlp.fc1.weight":
                gate, up = v.chunk(2, dim=0)
                out[base + "ff.net.0.proj.weight"] = torch.cat([up, gate])
                continue
            for c, d in c2d_block:
                if rest.startswith(c):
                    rest = d + rest[len(c):]
                    break
            out[base + rest] = v
            continue
        if k == "rope.inv_freq":
            continue
        for c, d in c2d_top:
            if k.startswith(c):
                out[d + k[len(c):]] = v
                break
        else:
            out[k] = v
    return out


def interleave_qkv(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Stacked [q_all; k_all; v_all] rows -> per-head interleaved [h0: q k v | h1: ...] (the raw release)."""
    return w.reshape(3, heads, head_dim, -1).transpose(0, 1).reshape(w.shape)


def deinterleave_qkv(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Per-head interleaved QKV rows -> stacked [q_all; k_all; v_all]."""
    return w.reshape(heads, 3, head_dim, -1).transpose(0, 1).reshape(w.shape)


