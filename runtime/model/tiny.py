"""The embedded tiny H3: random weights from a seed, every structural feature of the full model.

Used by ``h3-blackwell generate`` with no ``--model``, by ``make-tiny`` and by the tests. No file or
download is involved: the same seed always gives the same tensors (and, saved, the same bytes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import TINY, H3Config, config_metadata


def tiny_state_dict(cfg: H3Config = TINY, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """ComfyUI-named random weights for ``cfg``. Linear weights ~ N(0, 1/fan_in); norms 1 + N(0, 0.1);
    AdaLN projections scaled down so modulation stays O(0.1) like a trained model; fp32 islands fp32."""
    from .config import FP32_ISLANDS
    from .h3 import H3Model

    g = torch.Generator("cpu").manual_seed(int(seed))
    with torch.device("meta"):
        m = H3Model(cfg, torch.float32)
    out = {}
    for name, p in m.state_dict().items():
        shape = tuple(p.shape)
        if name == "rope.inv_freq":
            t = cfg.rope_theta ** (-torch.arange(cfg.rope_inv_freq_len, dtype=torch.float64) / cfg.rope_inv_freq_len)
            t = t.float()
        elif name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight") \
                or name.endswith("final_norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "adaln_t_table":
            t = torch.randn(shape, generator=g).cumsum(0) / shape[0] ** 0.5
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[1] if len(shape) > 1 else shape[0]
            std = fan_in ** -0.5
            if "adaln_proj" in name:
                std *= 0.3
            t = std * torch.randn(shape, generator=g)
        keep32 = any(name.startswith(p) for p in FP32_ISLANDS) or (cfg.curve_form and "adaln_proj" in name)
        out[name] = t.to(torch.float32 if keep32 else dtype).contiguous()
    return out


def tiny_model(cfg: H3Config = TINY, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    from .h3 import H3Model

    m = H3Model(cfg, dtype, device=device)
    sd = tiny_state_dict(cfg, seed, dtype)
    m.load_state_dict({k: v.to(device) for k, v in sd.items()})
    return m.eval().requires_grad_(False)


def save_tiny(path: str | Path, cfg: H3Config = TINY, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a tiny checkpoint in ComfyUI naming (bf16 with fp32 islands, like the release). Deterministic bytes."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = tiny_state_dict(cfg, seed, dtype)
    # one metadata entry: safetensors stores metadata in a hash map, so several keys would make the byte
    # order (and the file hash) differ between runs
    # (our config under "h3_blackwell", only core's names under "transformer": core merges that into its model)
    meta = {"config": config_metadata(cfg, h3_blackwell_tiny_seed=seed)}
    save_file(dict(sorted(sd.items())), str(path), metadata=meta)
    return path
