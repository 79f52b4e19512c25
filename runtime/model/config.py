"""H3Config: the MiniMax H3 DiT hyper-parameters and presets, and the config metadata our files carry.

Detecting a config from a checkpoint's header is ``runtime.io.detect``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError


@dataclass(frozen=True)
class H3Config:
    """MiniMax H3 DiT dimensions.

    Defaults are the released model (ComfyUI ``MiniMaxH3Model`` defaults): hidden 5376, 50 blocks,
    2 refiner blocks, 56 heads x 128, FFN 14336 SwiGLU, video 24 ch with patch (1,2,2), audio 32 ch,
    text 5120, time embedding 256 -> 5376 -> 2688, 16 rope frequencies per axis, eps 1e-5,
    sigma shifts video 12 / audio 3.
    """

    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    num_heads: int = 56
    head_dim: int = 128
    ffn_hidden_size: int = 14336
    video_channels: int = 24
    patch_size: tuple[int, int, int] = (1, 2, 2)
    audio_channels: int = 32
    text_dim: int = 5120
    timestep_input_dim: int = 256
    time_embed_hidden_size: int = 5376
    time_embed_dim: int = 2688
    rope_inv_freq_len: int = 16
    rope_theta: float = 10000.0
    eps: float = 1e-5
    shift_video: float = 12.0
    shift_audio: float = 3.0
    # Curve-form ("pruned") AdaLN: a [grid, k] table replaces the time embedder; 0 = full form.
    adaln_curve_grid: int = 0
    # PDD head bank size n (video_out rows = n * 96); 1 = a plain head.
    head_bank: int = 1
    gate_compress: bool = False

    # -- derived -------------------------------------------------------------------------------
    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.video_channels * pt * ph * pw

    @property
    def rope_dim(self) -> int:
        """Channels of each head that RoPE rotates: 2 * 3 * rope_inv_freq_len (96 of 128 for H3)."""
        return 6 * self.rope_inv_freq_len

    @property
    def curve_form(self) -> bool:
        return self.adaln_curve_grid > 0

    def validate(self) -> "H3Config":
        if self.rope_dim > self.head_dim:
            raise CheckpointError(
                f"rope needs {self.rope_dim} channels per head (6 x rope_inv_freq_len={self.rope_inv_freq_len}) "
                f"but head_dim is {self.head_dim}"
            )
        if self.patch_size[0] != 1:
            raise CheckpointError(f"temporal patch must be 1, found patch_size={self.patch_size}")
        for name in ("eps", "rope_theta", "shift_video", "shift_audio"):  # a config from a file's metadata, too
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise CheckpointError(f"{name}={v!r}: expected a finite number > 0 (H3: eps 1e-5, rope_theta 10000, "
                                      "shift_video 12, shift_audio 3)")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "H3Config":
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "patch_size" in kw:
            kw["patch_size"] = tuple(int(p) for p in kw["patch_size"])
        return cls(**kw).validate()

    def replace(self, **kw) -> "H3Config":
        return dataclasses.replace(self, **kw).validate()


FULL = H3Config()

# Every structural feature of the full model at toy size: head_dim 32 > rope_dim 24 keeps the
# untouched tail of each head, inner_dim (4 x 32 = 128) differs from hidden (96) as in H3 (7168 vs
# 5376), 3 blocks + 2 refiner blocks.
TINY = H3Config(
    hidden_size=96,
    num_layers=3,
    num_refiner_layers=2,
    num_heads=4,
    head_dim=32,
    ffn_hidden_size=160,
    video_channels=24,
    audio_channels=32,
    text_dim=5120,  # real conditioning width, so core CONDITIONING feeds the tiny model
    timestep_input_dim=256,
    time_embed_hidden_size=96,
    time_embed_dim=48,
    rope_inv_freq_len=4,
)

PRESETS = {"full": FULL, "tiny": TINY}


# Our own entry inside the metadata ``config`` JSON. ComfyUI core merges ``config["transformer"]`` into the
# config it detects from the shapes and passes it to its model as keyword arguments, so only core's names
# may appear there (our ``adaln_curve_grid: 0`` read as "curve form on" crashed core's KSampler).
OWN_CONFIG_KEY = "h3_blackwell"


def config_metadata(cfg: H3Config, **extra: Any) -> str:
    """The safetensors metadata ``config`` value for a file holding ``cfg``: JSON with our full config under
    ``h3_blackwell`` (read back by ``runtime.io.detect``) and, under ``transformer``, only what core cannot
    derive from the shapes in core's names (``latents_dim`` = the video latent channels, needed to see a
    PDD head bank). ``extra``: further top-level entries (e.g. the tiny seed). Deterministic (sorted keys)."""
    body = {OWN_CONFIG_KEY: cfg.to_dict(), "transformer": {"latents_dim": cfg.video_channels}, **extra}
    return json.dumps(body, sort_keys=True)


def core_safe_config_metadata(value: str | None, cfg: H3Config) -> str:
    """A carried-over metadata ``config`` value rewritten for a file holding ``cfg``: our config moves under
    ``h3_blackwell``, ``transformer`` keeps core's names only; other top-level entries stay. Used by the
    converter so a file written by an older make-tiny (our names under ``transformer``) comes out loadable
    by core."""
    try:
        old = json.loads(value) if value else {}
    except (json.JSONDecodeError, RecursionError):
        old = {}
    extra = {k: v for k, v in old.items() if k not in ("transformer", OWN_CONFIG_KEY)} if isinstance(old, dict) \
        else {}
    return config_metadata(cfg, **extra)


# fp32 islands of the original checkpoint (kept fp32 whatever the compute dtype)
FP32_ISLANDS = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                "final_layer.audio_out.", "rope.", "adaln_t_table")

# block linears that become NVFP4
QUANT_LINEARS = re.compile(r"^blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")
ADALN_KEY = re.compile(r"^blocks\.\d+\.adaln_proj\.linear\.(weight|bias)$")  # a block's full-form AdaLN tensors


