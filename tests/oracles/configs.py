"""Model configurations for the core checks besides the one tiny config (``check_core.py --configs``,
``check_core_control.py --configs``, and the CPU test tests/runtime/model/test_configs_core.py). Torch only.

A configuration is a set of ComfyUI core ``MiniMaxH3Model`` constructor arguments (core's names) overriding
``BASE``. Every one is a configuration core's own model code accepts (``comfy/ldm/minimax/model.py``):

- ``6 * rope_inv_freq_len <= attention_head_dim``: core's kitchen rope (``rms_rope_split_half_``) rotates that prefix
  of every head (all of it when equal) and normalises the whole head;
- ``timestep_input_dim`` even: core's sinusoid is ``2 * (dim // 2)`` wide and feeds ``proj_in`` of that width;
- ``adaln_curve_grid`` (a ``[grid, time_embed_dim]`` table instead of the time embedder) puts every case of the
  configuration in curve form; without it, a case marked ``curve`` uses ``CURVE_GRID``;
- ``gate_compress`` adds ``attn.to_gate_compress`` to every block (core builds it only where its model takes the
  argument; its dense forward never reads it).

The cases (tests/oracles/cases.py, control_cases.py) are drawn at 24 video / 32 audio channels and ``TEXT_DIM``
text; ``adapt_case`` redraws their latents and text at a configuration's widths, shapes otherwise unchanged.
"""

from __future__ import annotations

import torch

import cases as case_mod

BASE = dict(hidden_size=96, num_layers=3, token_refiner_num_layers=2, num_attention_heads=4, attention_head_dim=32,
            ffn_hidden_size=160, latents_dim=24, audio_latents_dim=32, text_dim=case_mod.TEXT_DIM,
            timestep_input_dim=256, time_embed_hidden_size=96, time_embed_dim=48, rope_inv_freq_len=4)
CURVE_GRID = 33

# name -> overrides of BASE (comments: inner = heads x head_dim against hidden; rope = rotated / head_dim)
CONFIGS = {
    "base": {},  # inner 128 > hidden 96, rope 24/32
    # two wide heads; inner 128 > hidden 80; 2 blocks, 1 refiner block; a narrower time embedder and text
    "heads2x64": dict(hidden_size=80, num_attention_heads=2, attention_head_dim=64, rope_inv_freq_len=8,
                      ffn_hidden_size=192, num_layers=2, token_refiner_num_layers=1, text_dim=40,
                      timestep_input_dim=128, time_embed_hidden_size=64, time_embed_dim=32),
    # inner 48 < hidden 96, rope 12/16, 5 blocks, no refiner block (final_norm only)
    "heads3x16_5blocks_norefiner": dict(num_attention_heads=3, attention_head_dim=16, rope_inv_freq_len=2,
                                        ffn_hidden_size=64, num_layers=5, token_refiner_num_layers=0),
    # six narrow heads, inner 48 < hidden 72, rope 6/8, one block, odd FFN, text wider than hidden
    "heads6x8_1block": dict(hidden_size=72, num_attention_heads=6, attention_head_dim=8, rope_inv_freq_len=1,
                            ffn_hidden_size=99, num_layers=1, token_refiner_num_layers=1, text_dim=130,
                            time_embed_dim=20),
    # odd hidden and FFN, rope over the whole head (12/12), 16 video / 20 audio channels, odd t_dim
    "odd_hidden_full_rope": dict(hidden_size=75, num_attention_heads=5, attention_head_dim=12, rope_inv_freq_len=2,
                                 ffn_hidden_size=121, text_dim=33, latents_dim=16, audio_latents_dim=20,
                                 timestep_input_dim=64, time_embed_hidden_size=50, time_embed_dim=31),
    # inner == hidden (4 x 24 = 96), rope 18/24, 8 video / 12 audio channels, 2 blocks
    "inner_eq_hidden": dict(num_attention_heads=4, attention_head_dim=24, rope_inv_freq_len=3, ffn_hidden_size=96,
                            latents_dim=8, audio_latents_dim=12, num_layers=2),
    # wider latents (48 video / 64 audio channels), hidden 128, rope 36/48, time embedder 256 -> 160 -> 64
    "wide_latents": dict(hidden_size=128, num_attention_heads=2, attention_head_dim=48, rope_inv_freq_len=6,
                         ffn_hidden_size=256, latents_dim=48, audio_latents_dim=64, text_dim=256,
                         time_embed_hidden_size=160, time_embed_dim=64),
    # curve form with the shipped table shape [1025, 8]
    "curve_1025x8": dict(adaln_curve_grid=1025, time_embed_dim=8),
    # curve form at odd sizes: a [17, 5] table, hidden 75, 2 blocks, no refiner block
    "curve_17x5_odd": dict(adaln_curve_grid=17, time_embed_dim=5, hidden_size=75, num_attention_heads=5,
                           attention_head_dim=12, rope_inv_freq_len=1, ffn_hidden_size=121, num_layers=2,
                           token_refiner_num_layers=0, text_dim=33),
    # attn.to_gate_compress present (VSA / FastH3 files), two heads of 64 with rope 60/64
    "gate_compress": dict(gate_compress=True, num_attention_heads=2, attention_head_dim=64, rope_inv_freq_len=10),
    # text as wide as hidden: core takes such rows as refined and never runs condition_proj or the refiner
    "text_dim_eq_hidden": dict(text_dim=96),
}

# configurations where this repository (runtime and oracle) differs from core on purpose: name -> why. Their
# numbers are recorded but not held to the bound. None today: text as wide as hidden_size was one until the
# runtime took such rows as refined, as core does (H3Model.refine_text).
KNOWN_DIFFERENCES: dict[str, str] = {}

# Fun ControlNet configurations: (base overrides, places of the control blocks or None for each case's own)
CONTROL_CONFIGS = {
    "base": ({}, None),
    "one_block_on_1_block_base": (CONFIGS["heads6x8_1block"], (0,)),
    "five_blocks_every_base_block": (CONFIGS["heads3x16_5blocks_norefiner"], (0, 1, 2, 3, 4)),
    "two_blocks_first_and_last_odd_hidden": (dict(CONFIGS["odd_hidden_full_rope"], latents_dim=24,
                                                  audio_latents_dim=32, text_dim=case_mod.TEXT_DIM), (0, 2)),
    "three_blocks_gapped_heads2x64": (dict(CONFIGS["heads2x64"], num_layers=6, text_dim=case_mod.TEXT_DIM),
                                      (0, 3, 5)),
    "curve_1025x8": (CONFIGS["curve_1025x8"], None),
}

_CASE_WIDTHS = {"latents_dim": 24, "audio_latents_dim": 32, "text_dim": case_mod.TEXT_DIM}
# a case's tensors that carry a width: key -> (config field, dimension)
_WIDTH_OF = {"video": ("latents_dim", 1), "latent": ("latents_dim", 1), "audio": ("audio_latents_dim", 1),
             "audio_latent": ("audio_latents_dim", 1), "text_states": ("text_dim", -1)}


def core_config(name_or_overrides) -> dict:
    """BASE with a configuration's overrides (a CONFIGS name or the overrides themselves), core's names."""
    over = CONFIGS[name_or_overrides] if isinstance(name_or_overrides, str) else name_or_overrides
    return dict(BASE, **over)


def curve_grid(cfg: dict, case: dict) -> int | None:
    """The curve table's grid a case runs with under ``cfg`` (None: full form)."""
    if cfg.get("adaln_curve_grid"):
        return int(cfg["adaln_curve_grid"])
    return CURVE_GRID if case.get("curve") or case.get("base") == "curve" else None


def adapt_case(case: dict, cfg: dict, seed: int = 0) -> dict:
    """``case`` with every latent and text tensor redrawn (N(0, 1), generator ``seed``) at ``cfg``'s widths
    (latents_dim, audio_latents_dim, text_dim), every other shape and value unchanged; ``case`` itself when the
    widths are the cases' own. Masks, token tags, hints and sigmas are never redrawn."""
    if all(cfg[k] == v for k, v in _CASE_WIDTHS.items()):
        return case
    g = torch.Generator().manual_seed(seed)

    def walk(obj, key=None):
        if isinstance(obj, torch.Tensor) and key in _WIDTH_OF:
            field, dim = _WIDTH_OF[key]
            shape = list(obj.shape)
            shape[dim] = cfg[field]
            return torch.randn(shape, generator=g, dtype=obj.dtype)
        if isinstance(obj, dict):
            return {k: walk(v, k) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v, key) for v in obj]
        return obj

    return walk(case)


def runtime_config(cfg: dict, curve: int | None = None, head_bank: int = 1):
    """Core's constructor arguments -> this repository's H3Config (the mapping, field by field)."""
    from h3_blackwell.runtime.model.config import H3Config

    return H3Config(hidden_size=cfg["hidden_size"], num_layers=cfg["num_layers"],
                    num_refiner_layers=cfg["token_refiner_num_layers"], num_heads=cfg["num_attention_heads"],
                    head_dim=cfg["attention_head_dim"], ffn_hidden_size=cfg["ffn_hidden_size"],
                    video_channels=cfg["latents_dim"], audio_channels=cfg["audio_latents_dim"],
                    text_dim=cfg["text_dim"], timestep_input_dim=cfg["timestep_input_dim"],
                    time_embed_hidden_size=cfg["time_embed_hidden_size"], time_embed_dim=cfg["time_embed_dim"],
                    rope_inv_freq_len=cfg["rope_inv_freq_len"], adaln_curve_grid=curve or 0, head_bank=head_bank,
                    gate_compress=bool(cfg.get("gate_compress")))


def config_differences(found, expected) -> dict:
    """{field: (found, expected)} of two H3Configs, over the fields a state dict determines (the time embedder's
    widths only in full form: a curve-form file has no time embedder)."""
    a, b = found.to_dict(), expected.to_dict()
    skip = {"timestep_input_dim", "time_embed_hidden_size"} if expected.curve_form else set()
    return {k: (a[k], b[k]) for k in b if k not in skip and a[k] != b[k]}


def core_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The state dict of core's MiniMaxH3Model built with the arguments ``cfg`` (``adaln_curve_grid`` None or a
    grid; ``gate_compress`` optional), name -> shape, in core's state_dict order; written from core's model.py
    (its module tree), not from ours. check_core.py checks it against core's own model at every configuration."""
    h, c, ca = cfg["hidden_size"], cfg["latents_dim"] * 4, cfg["audio_latents_dim"]
    hd, ffn, t = cfg["attention_head_dim"], cfg["ffn_hidden_size"], cfg["time_embed_dim"]
    inner = cfg["num_attention_heads"] * hd
    out: dict[str, tuple[int, ...]] = {}
    if cfg.get("adaln_curve_grid"):
        out["adaln_t_table"] = (cfg["adaln_curve_grid"], t)  # the model's own buffer comes before its children
    out.update({"video_patch_proj.weight": (h, c), "video_patch_proj.bias": (h,),
                "audio_patch_proj.weight": (h, ca), "audio_patch_proj.bias": (h,),
                "condition_proj.weight": (h, cfg["text_dim"]), "condition_proj.bias": (h,)})
    if not cfg.get("adaln_curve_grid"):
        th = cfg["time_embed_hidden_size"]
        out.update({"time_embedder.proj_in.weight": (th, cfg["timestep_input_dim"]),
                    "time_embedder.proj_in.bias": (th,),
                    "time_embedder.proj_out.weight": (t, th), "time_embedder.proj_out.bias": (t,)})
    out["rope.inv_freq"] = (cfg["rope_inv_freq_len"],)

    def block(p: str, dit: bool) -> None:
        out.update({p + "norm1.weight": (h,), p + "norm2.weight": (h,), p + "attn.qkv_proj.weight": (3 * inner, h),
                    p + "attn.q_norm.weight": (hd,), p + "attn.k_norm.weight": (hd,),
                    p + "attn.out_proj.weight": (h, inner)})
        if dit and cfg.get("gate_compress"):
            out[p + "attn.to_gate_compress.weight"] = (inner, h)
        out.update({p + "mlp.fc1.weight": (2 * ffn, h), p + "mlp.fc2.weight": (h, ffn)})
        if dit:
            out.update({p + "adaln_proj.linear.weight": (18 * h, t), p + "adaln_proj.linear.bias": (18 * h,)})

    for i in range(cfg["token_refiner_num_layers"]):
        block(f"token_refiner.blocks.{i}.", False)
    out["token_refiner.final_norm.weight"] = (h,)
    for i in range(cfg["num_layers"]):
        block(f"blocks.{i}.", True)
    out.update({"final_layer.norm.weight": (h,), "final_layer.adaln_proj.linear.weight": (2 * h, t),
                "final_layer.adaln_proj.linear.bias": (2 * h,), "final_layer.video_out.weight": (c, h),
                "final_layer.video_out.bias": (c,), "final_layer.audio_out.weight": (ca, h),
                "final_layer.audio_out.bias": (ca,)})
    return out


def random_weights(shapes: dict, seed: int, head_bank: int = 1) -> dict[str, torch.Tensor]:
    """Random float32 weights for the state dict ``shapes`` (name -> shape, drawn in that order): norms 1 + N(0,
    0.1), linears N(0, 1/fan_in) (adaLN x 0.3, so modulation stays small as in a trained model), biases N(0,
    0.02^2), the rope frequencies 10000^(-i/n), the curve table a random walk; the output heads ``head_bank`` times
    as many rows (a PDD bank). Never zero."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        shape = list(shape)
        bank = name.startswith("final_layer.") and name.split(".")[1] in ("video_out", "audio_out")
        if name == "rope.inv_freq":
            n = shape[0]
            t = (10000.0 ** (-torch.arange(n, dtype=torch.float64) / n)).float()
        elif name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "adaln_t_table":
            t = torch.randn(shape, generator=g).cumsum(0) / shape[0] ** 0.5
        elif name.endswith(".bias"):
            if bank:
                shape[0] *= head_bank
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            if bank:
                shape[0] *= head_bank
            std = shape[-1] ** -0.5 * (0.3 if "adaln_proj" in name else 1.0)
            t = std * torch.randn(shape, generator=g)
        sd[name] = t.float()
    return sd
