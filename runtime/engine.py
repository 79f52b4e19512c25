"""load_model: a resident H3 model with its backend choices, ready for ``sample``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import CheckpointError, load_state, open_checkpoint
from .config import TINY, H3Config
from .model import H3Model
from .options import RuntimeOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class H3Runtime:
    """A loaded model that stays resident across runs.

    backends: {op: {"choice": name, "reason": why}} chosen once at load (printed, and copied into every report).
    """

    model: H3Model
    config: H3Config
    device: torch.device
    dtype: torch.dtype
    options: RuntimeOptions
    source: str
    backends: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    fc2: object | None = None  # the guarded FC2 dispatcher, when the NVFP4 stack is active

    def describe(self) -> str:
        lines = [f"H3 model {self.source}: {self.config.num_layers} blocks, hidden {self.config.hidden_size}, "
                 f"{self.device} {str(self.dtype).replace('torch.', '')}"]
        for op, b in self.backends.items():
            lines.append(f"  {op:<10} {b['choice']:<12} {b['reason']}")
        return "\n".join(lines)


def resolve_device(options: RuntimeOptions) -> torch.device:
    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(options.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device 'cuda' was requested but torch sees no CUDA device; use --device cpu")
    return dev


def resolve_dtype(options: RuntimeOptions, device: torch.device) -> torch.dtype:
    if options.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[options.dtype]


def _choose_attention(model: H3Model, options: RuntimeOptions, device: torch.device) -> dict:
    try:
        from .ops import attention as attn_ops
    except ImportError as e:  # the ops package is optional only while it is being built
        return {"choice": "reference", "reason": f"runtime.ops.attention unavailable ({e})"}
    name, reason = attn_ops.choose_attention_backend(device, options.attention)
    if name != "reference":
        model.attn_fn = lambda qkv, heads, head_dim, _n=name: attn_ops.attention(qkv, heads, head_dim, _n)
    return {"choice": name, "reason": reason}


def load_model(path: str | Path | None = None, options: RuntimeOptions | None = None, tiny_seed: int = 0,
               progress: Callable[[int, int, str], None] | None = None) -> H3Runtime:
    """Load an H3 DiT (or the embedded tiny model when ``path`` is None) onto the chosen device.

    Tensors stream from disk one at a time; quantized sources are dequantized to the compute dtype for the
    reference stack. Raises CheckpointError with the problem named for bad files.
    """
    options = options or RuntimeOptions.from_env()
    device = resolve_device(options)
    dtype = resolve_dtype(options, device)
    t0 = time.perf_counter()
    if path is None:
        from .tiny import tiny_state_dict

        cfg = TINY
        model = H3Model(cfg, dtype, device=device)
        sd = tiny_state_dict(cfg, tiny_seed, dtype)
        model.load_state_dict({k: v.to(device) for k, v in sd.items()})
        source = f"embedded tiny (seed {tiny_seed})"
    else:
        ck = open_checkpoint(path)
        cfg = ck.config
        model = H3Model(cfg, dtype, device="meta")
        load_state(model, ck, device, progress=progress)
        left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
        if left:
            raise CheckpointError(f"{path}: no tensor for {left[:5]}")
        source = str(path)
    model.eval().requires_grad_(False)
    rt = H3Runtime(model, cfg, device, dtype, options, source)
    rt.backends["attention"] = _choose_attention(model, options, device)
    rt.backends["gemm"] = {"choice": "dense", "reason": f"reference linears at {str(dtype).replace('torch.', '')}"}
    rt.load_seconds = time.perf_counter() - t0
    return rt
