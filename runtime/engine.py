"""load_model: a resident H3 model with its backend choices, ready for ``sample``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import CheckpointError
from .io.checkpoint import load_state, open_checkpoint
from .model.config import TINY, H3Config
from .model.h3 import H3Model
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
        from .model.tiny import tiny_state_dict

        cfg = TINY
        model = H3Model(cfg, dtype, device=device)
        sd = tiny_state_dict(cfg, tiny_seed, dtype)
        model.load_state_dict({k: v.to(device) for k, v in sd.items()})
        source = f"embedded tiny (seed {tiny_seed})"
    else:
        ck = open_checkpoint(path)
        cfg = ck.config
        model = H3Model(cfg, dtype, device="meta")
        stored = {} if options.quantize else None
        load_state(model, ck, device, progress=progress, keep_nvfp4=stored)
        if stored:
            from .stack import quantize_block_linears

            quantize_block_linears(model, options.gemm, options.act_scale, stored=stored)
        left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
        if left:
            raise CheckpointError(f"{path}: no tensor for {left[:5]}")
        source = str(path)
    model.eval().requires_grad_(False)
    rt = H3Runtime(model, cfg, device, dtype, options, source)
    rt.backends["attention"] = _choose_attention(model, options, device)
    if options.quantize:
        prepare_nvfp4(rt)
    else:
        rt.backends["gemm"] = {"choice": "dense",
                               "reason": f"quantize off: dense linears at {str(dtype).replace('torch.', '')}"}
    rt.load_seconds = time.perf_counter() - t0
    return rt


def apply_tile_table(path: str | Path) -> dict:
    """Install the producer tile table at ``path`` (written by bench/producers_h200.py --tiles-out) ->
    {"choice", "reason"}. Tiles change speed only. A missing or malformed file raises H3Error naming it."""
    import json

    from .errors import H3Error
    from .ops import fp8_producers as f8
    from .ops import quant_kernels as qk

    try:
        table = json.loads(Path(path).read_text())
        if not isinstance(table, dict):
            raise ValueError(f"expected a JSON object, found {type(table).__name__}")
        installed = f8.set_tile_table(table)
        fp8 = qk.set_fp8_tiles(table.get("to_fp8_rowwise"))
    except (OSError, ValueError) as e:
        raise H3Error(f"producer tile table {path}: {e}; write one with bench/producers_h200.py --tiles-out, "
                      "or unset H3_PRODUCER_TILES for the built-in tiles") from e
    if fp8:
        installed["to_fp8_rowwise"] = list(fp8)
    return {"choice": str(path), "reason": f"measured on {table.get('device', '?')}: {installed}"}


def prepare_nvfp4(rt: H3Runtime) -> None:
    """Make the block linears NVFP4 (quantized on the device, one layer at a time, unless already NVFP4),
    install the NVFP4 block stack and, on CUDA, the guarded FC2 dispatcher (prepared before any capture)."""
    from .stack import Nvfp4Stack, quantize_block_linears

    o = rt.options
    reasons = quantize_block_linears(rt.model, o.gemm, o.act_scale)
    blk = rt.model.blocks[0] if len(rt.model.blocks) else None
    if blk is not None:
        lin = blk.mlp.fc2
        rt.backends["gemm"] = {"choice": lin.backend, "reason": "; ".join(reasons)}
        rt.backends["act_scale"] = {"choice": o.act_scale, "reason": lin.act_scale_reason}
    if rt.device.type == "cuda":
        from .fc2.dispatcher import Fc2Dispatcher

        rt.fc2 = Fc2Dispatcher(o)
        prep = rt.fc2.prepare(rt.device)
        rt.backends["fc2_lt"] = {"choice": "dispatcher" if o.fc2_lt else "off",
                                 "reason": prep.get("reason") or "prepared: " + ", ".join(
                                     f"{k}: {v.get('status', v) if isinstance(v, dict) else v}"
                                     for k, v in prep.get("entries", {}).items())}
    else:
        rt.backends["fc2_lt"] = {"choice": "off", "reason": "cpu: no cuBLASLt; FC2 runs the fallback GEMM"}
    attn = rt.backends.get("attention", {}).get("choice", "reference")
    if attn == "sage2":
        from .ops import attention as attn_ops

        v_pad, why = attn_ops.sage_v_pad_status(o.sage_v_pad, rt.device, rt.config.head_dim)
    else:
        v_pad, why = o.sage_v_pad, f"no effect: attention runs {attn} (it acts on sage2's sm_90 kernel)"
    rt.backends["sage_v_pad"] = {"choice": v_pad, "reason": why}
    rt.model.stack = Nvfp4Stack(rt.model, attn, rt.fc2, o.act_scale, act_format=o.act_format, sage_v_pad=v_pad,
                                silu=o.silu, fp8_fast_accum=o.fp8_accum == "fast")
    rt.backends["act_format"] = {"choice": rt.model.stack.act_format, "reason": rt.model.stack.act_format_reason}
    if o.producer_tiles:
        rt.backends["producer_tiles"] = apply_tile_table(o.producer_tiles)
    if rt.model.stack.act_format == "fp8":
        cpu = rt.device.type != "cuda"
        rt.backends["fp8_accum"] = {"choice": o.fp8_accum, "reason": (
            "fast: Hopper's reduced-precision fp8 accumulation in the W4A8 GEMMs (H3_FP8_ACCUM=fp32 turns it off)"
            if o.fp8_accum == "fast" else "fp32: the W4A8 GEMMs accumulate in fp32 (no fast accumulation)") + (
            "; CPU: exact products, fp32 accumulation either way" if cpu else "")}
        rt.backends["silu"] = {"choice": o.silu, "reason": (
            "fast: the SwiGLU producer's silu uses the hardware exp2 and an approximate division "
            "(H3_SILU=exact for the bit-exact one)"
            if o.silu == "fast" else "exact: the SwiGLU producer's silu is bit-exact against its reference") + (
            "; CPU: the torch reference either way" if cpu else "")}
    if o.adaln_cache and rt.device.type == "cuda" and not rt.config.curve_form:
        moved = rt.model.offload_adaln()
        rt.backends["adaln"] = {"choice": "rows per run",
                                "reason": f"modulation rows precomputed per run; {moved / 1e9:.2f} GB of full-form "
                                          "AdaLN weights kept in pinned host memory"}
    else:
        rt.backends["adaln"] = {"choice": "resident",
                                "reason": "curve form (small tables)" if rt.config.curve_form else
                                "adaln_cache off or not CUDA: AdaLN weights stay with the model"}
