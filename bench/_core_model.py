"""ComfyUI core's MiniMax H3 model (``comfy/ldm/minimax/model.py``) for bench/core_peer.py: imported from the folder
scripts/pack_core_peer.sh fills (a subset of a ComfyUI checkout, comfy-aimdo, comfy-kitchen's archive), with core's
own CLI flag for the attention function, and built at any H3Config with random weights in the format a core user
loads, through core's own operation picker and state-dict loader.

Formats (``FORMATS``): ``int8`` = the shipped H3 DiT files' ``int8_tensorwise`` + ConvRot (group 256, per-row
[N, 1] fp32 scales) on the 200 block linears; ``fp8`` = ``float8_e4m3fn`` with a per-tensor scale on the same
linears (a comfy_quant fp8 file, or an old ``scaled_fp8`` file, which core converts to it); ``dense`` = every
weight at the compute dtype. Everything else (refiner, AdaLN, embedders, heads) is at the compute dtype in all
three, as in the shipped file (its AdaLN weights are f16 there and cast per call; bf16 here).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import sys
import tarfile
import types
from pathlib import Path

import torch

# our name -> (core's CLI flag, core's registered name, the function optimized_attention must resolve to)
ATTENTION = {
    "sage": ("--use-sage-attention", "sage", "attention_sage"),
    "ck": ("--use-ck-attention", "comfy_kitchen_int8", "attention_comfy_kitchen_int8"),
    "flash": ("--use-flash-attention", "flash", "attention_flash"),
    "pytorch": ("--use-pytorch-cross-attention", "pytorch", "attention_pytorch"),
}
FORMATS = ("int8", "fp8", "dense")
BLOCK_LINEARS = re.compile(r"^blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")


def quant_conf(fmt: str, cfg) -> dict | None:
    """The ``comfy_quant`` entry of a block linear in ``fmt``: int8 ConvRot uses the shipped files' group of 256
    where every block linear's input width allows it (the full config), else the largest power of 4 that does
    (the tiny config: 16)."""
    if fmt == "fp8":
        return {"format": "float8_e4m3fn"}
    if fmt != "int8":
        return None
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.ffn_hidden_size)
    group = next(g for g in (256, 64, 16, 4) if all(w % g == 0 for w in widths))
    return {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}


class CoreLog(logging.Handler):
    """Keeps core's log records of level WARNING and above (a sage call that fell back to SDPA logs an ERROR)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.levelname}: {record.getMessage()}"[:400])


def carried_paths(folder: Path, site: Path) -> dict:
    """Put the packed folder on sys.path: its ComfyUI subset, site/ (comfy-aimdo) and comfy-kitchen, unpacked from
    its archive into ``site`` (outside the carried folder, which must stay small) the first time. -> the manifest."""
    folder = folder.resolve()
    model_py = folder / "ComfyUI" / "comfy" / "ldm" / "minimax" / "model.py"
    if not model_py.is_file():
        raise SystemExit(f"error: {model_py} not found: expected the folder scripts/pack_core_peer.sh writes "
                         f"(run `bash scripts/pack_core_peer.sh` here and carry .core_peer)")
    manifest = json.loads((folder / "MANIFEST.json").read_text()) if (folder / "MANIFEST.json").is_file() else {}
    archive = next(iter(sorted(folder.glob("comfy_kitchen-*.tar.xz"))), None)
    if archive is not None:
        target = site / archive.name[: -len(".tar.xz")]
        if not target.is_dir():  # unpacked beside it, then renamed: a cut-short unpack never looks complete
            part = target.with_name(f"{target.name}.part{os.getpid()}")
            with tarfile.open(archive, "r:xz") as tf:
                tf.extractall(part, filter="data")
            os.replace(part, target)
        sys.path.insert(0, str(target))
    sys.path.insert(0, str(folder / "site"))
    sys.path.insert(0, str(folder / "ComfyUI"))
    sys.dont_write_bytecode = True  # no __pycache__ inside the carried folder
    return manifest


def attention_available(name: str) -> str | None:
    """None when core's option ``name`` can run here, else why not (core itself exits at import then)."""
    if name == "sage" and importlib.util.find_spec("sageattention") is None:
        return "the sageattention package is not importable (build SageAttention2: scripts/device_build_sage2.sh)"
    if name == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "the flash_attn package is not importable"
    if name == "ck":
        import comfy_kitchen

        if not comfy_kitchen.int8_attention_is_available():
            return "comfy_kitchen.int8_attention_is_available() is False here"
    if name != "pytorch" and not torch.cuda.is_available():
        return "needs CUDA"
    return None


def import_core(attention: str, cpu: bool, folder: Path, flags: tuple[str, ...] = (), before_modules=None):
    """core's model module, imported with core's CLI flags as main.py would parse them (``flags``, then the
    attention flag, --cpu on the CPU), checked to come from ``folder`` and to have ``optimized_attention`` bound to
    the function the flag selects. ``before_modules(comfy.cli_args)`` runs once the flags are parsed and before any
    of core's model or memory modules is imported, where main.py loads comfy-aimdo's library (core's modules bind
    it at import). -> (model module, comfy.ops, flags, the bound function's name)."""
    why = attention_available(attention)
    if why:
        raise SystemExit(f"error: core's attention option {attention!r} ({ATTENTION[attention][0]}) cannot run: {why}")
    flags = [*flags, ATTENTION[attention][0]] + (["--cpu"] if cpu else [])
    saved = sys.argv
    sys.argv = ["main.py", *flags]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.cli_args

        if before_modules is not None:
            before_modules(comfy.cli_args)
        import comfy.ldm.minimax.model as mm
        import comfy.ops
    finally:
        sys.argv = saved
    src = Path(mm.__file__).resolve()
    if folder.resolve() not in src.parents:
        raise SystemExit(f"error: core's model module came from {src}, not from {folder}: another ComfyUI is on the "
                         f"path ahead of the carried one")
    bound = mm.optimized_attention.__name__
    if bound != ATTENTION[attention][2]:
        raise SystemExit(f"error: {ATTENTION[attention][0]} should bind core's optimized_attention to "
                         f"{ATTENTION[attention][2]}, found {bound}")
    return mm, comfy.ops, flags, bound


def core_kwargs(cfg) -> dict:
    """MiniMaxH3Model's constructor arguments for our H3Config."""
    return dict(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, token_refiner_num_layers=cfg.num_refiner_layers,
                num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
                ffn_hidden_size=cfg.ffn_hidden_size, latents_dim=cfg.video_channels,
                audio_latents_dim=cfg.audio_channels, patch_size=tuple(cfg.patch_size), text_dim=cfg.text_dim,
                timestep_input_dim=cfg.timestep_input_dim, time_embed_hidden_size=cfg.time_embed_hidden_size,
                time_embed_dim=cfg.time_embed_dim, rope_inv_freq_len=cfg.rope_inv_freq_len, norm_eps=cfg.eps,
                qk_norm_eps=cfg.eps, final_norm_eps=cfg.eps, sigma_shift_video=cfg.shift_video,
                sigma_shift_audio=cfg.shift_audio, adaln_curve_grid=cfg.adaln_curve_grid or None)


def shape_check(mm, ops_mod, cfg) -> dict:
    """core's model at ``cfg`` on the meta device against ours (H3Model): parameter counts and every tensor's
    shape by checkpoint key."""
    from h3_blackwell.runtime.model.h3 import H3Model

    with torch.device("meta"):
        core = mm.MiniMaxH3Model(**core_kwargs(cfg), dtype=torch.bfloat16, device="meta",
                                 operations=ops_mod.disable_weight_init)
        ours = H3Model(cfg, torch.bfloat16)
    cs = {k: tuple(v.shape) for k, v in core.state_dict().items()}
    os_ = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    diff = sorted(k for k in cs.keys() | os_.keys() if cs.get(k) != os_.get(k))
    return {"core_parameters": sum(p.numel() for p in core.parameters()),
            "ours_parameters": sum(p.numel() for p in ours.parameters()),
            "keys": len(cs), "keys_with_other_shape_or_missing": diff[:20], "same_shapes": not diff}


def pick_ops(ops_mod, fmt: str, compute: torch.dtype, device: torch.device):
    """The operations class core's BaseModel picks for a file of ``fmt``: comfy_quant layers -> mixed precision
    ops (compute dtype = the manual-cast dtype, bf16 for H3 on a GPU); a plain file at the compute dtype ->
    disable_weight_init. -> (ops, description)."""
    if fmt == "dense":
        ops = ops_mod.pick_operations(compute, None, load_device=device)
        return ops, {"operations": ops.__name__}
    ops = ops_mod.pick_operations(None, compute, load_device=device,
                                  model_config=types.SimpleNamespace(quant_config={"mixed_ops": True}))
    emulated = sorted(getattr(ops, "_disabled", ()))
    return ops, {"operations": ops.__name__, "compute_dtype": str(compute).replace("torch.", ""),
                 "formats_core_emulates_here": emulated,
                 "native": {"int8": "int8_tensorwise", "fp8": "float8_e4m3fn"}[fmt] not in emulated}


def _comfy_quant(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_CONF = {"format": "float8_e4m3fn"}


def fp8_file_plan(src) -> list[tuple[str, str, tuple]]:
    """The entries (name, safetensors dtype, shape) of ``src``'s weights as a comfy_quant fp8 file stores them
    (``fp8_file_items`` yields them in this order): each block linear's ``weight`` (F8_E4M3), ``weight_scale`` (F32
    scalar) and ``comfy_quant`` (U8 JSON), everything else at its own dtype. ``src``: keys(), shape(k), dtype(k)."""
    from h3_blackwell.runtime.io.header import TORCH_TO_ST

    plan = []
    for k in src.keys():
        if k.endswith(".weight") and BLOCK_LINEARS.match(k[:-7]):
            plan += [(k, "F8_E4M3", src.shape(k)), (k[:-7] + ".weight_scale", "F32", ()),
                     (k[:-7] + ".comfy_quant", "U8", (len(_comfy_quant(FP8_CONF)),))]
        else:
            plan.append((k, TORCH_TO_ST[src.dtype(k)], src.shape(k)))
    return plan


def fp8_file_items(src, device):
    """``src``'s tensors, made on ``device`` one at a time, in ``fp8_file_plan``'s order: a block linear w as
    core's fp8 layout dequantizes it (``weight.to(dtype) * weight_scale``): scale = amax(|w|) / 448, weight =
    w / scale in e4m3; the rest unchanged. Yields (name, CPU tensor)."""
    for k in src.keys():
        t = src.tensor(k, device)
        if k.endswith(".weight") and BLOCK_LINEARS.match(k[:-7]):
            scale = (t.abs().amax().float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            q = (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            del t
            yield k, q.cpu()
            yield k[:-7] + ".weight_scale", scale.cpu()
            yield k[:-7] + ".comfy_quant", _comfy_quant(FP8_CONF)
        else:
            yield k, t.cpu()
            del t


def build_core(mm, ops, cfg, fmt: str, compute: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """core's MiniMaxH3Model at ``cfg`` on ``device`` with random weights in ``fmt``, made on the device one module
    at a time: linears N(0, 1/fan_in) (AdaLN x0.3), biases N(0, 0.02), norms 1, rope frequencies from theta.
    Quantized block linears go through core's own loader (``_load_from_state_dict`` -> QuantizedTensor): int8 codes
    uniform in [-127, 127] with per-row scales, fp8 = the N(0, 1) weight in e4m3 with a per-tensor scale, both
    dequantizing to the same N(0, 1/fan_in) spread."""
    g = torch.Generator(device=device).manual_seed(seed)
    model = mm.MiniMaxH3Model(**core_kwargs(cfg), dtype=compute, device=device, operations=ops)
    model.requires_grad_(False)  # as core's BaseModel does

    def normal(shape, dtype, std):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    mixed = fmt != "dense"
    linears = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, ops.Linear):
            continue
        linears.add(name)
        n, k = mod.out_features, mod.in_features
        std = k ** -0.5 * (0.3 if "adaln" in name else 1.0)
        if not mixed:
            mod.weight.normal_(0.0, std, generator=g)
            if mod.bias is not None:
                mod.bias.normal_(0.0, 0.02, generator=g)
            continue
        sd = {"bias": normal((n,), compute, 0.02)} if mod.bias is not None else {}
        if BLOCK_LINEARS.match(name):
            if fmt == "int8":
                sd["weight"] = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
                sd["weight_scale"] = torch.full((n, 1), std * math.sqrt(3.0) / 127.0, device=device)
            else:
                sd["weight"] = normal((n, k), compute, 1.0).to(torch.float8_e4m3fn)
                sd["weight_scale"] = torch.tensor(std, dtype=torch.float32, device=device)
            sd["comfy_quant"] = _comfy_quant(quant_conf(fmt, cfg))
        else:
            sd["weight"] = normal((n, k), compute, std)
        mod.load_state_dict(sd, strict=True)
    for name, p in model.named_parameters():
        if name.rpartition(".")[0] in linears:
            continue
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    n = cfg.rope_inv_freq_len
    model.rope.inv_freq.copy_(cfg.rope_theta ** (-torch.arange(n, dtype=torch.float64) / n))
    if cfg.adaln_curve_grid:
        model.adaln_t_table.normal_(0.0, 1.0, generator=g)
    missing = [name for name in linears if getattr(model.get_submodule(name), "weight", None) is None]
    if missing:
        raise RuntimeError(f"core's loader left {len(missing)} linears without a weight, e.g. {missing[:3]}")
    return model.eval()


def weight_summary(model) -> dict:
    """Bytes of the built model's weights by how core holds them (QuantizedTensor layouts count their codes)."""
    kinds: dict[str, int] = {}
    for p in model.parameters():
        q = getattr(p, "_qdata", None)
        key = p._layout_cls if q is not None else str(p.dtype).replace("torch.", "")
        t = q if q is not None else p
        kinds[key] = kinds.get(key, 0) + t.numel() * t.element_size()
    return {"bytes": sum(kinds.values()), "bytes_by_kind": kinds}


def forward_inputs(mm, model, text: torch.Tensor, vshape, ashape, sigma: float, compute, device, seed: int):
    """The arguments of one core denoising call as core's sampler makes them: text refined once per sampling run
    (``MiniMaxH3.extra_conds`` -> ``preprocess_text_embeds``), the packed layout prebuilt once per run, the
    timestep sigma * 1000, the latents at the compute dtype. -> (args, kwargs)."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(vshape, generator=g).to(device, compute)
    audio = torch.randn(ashape, generator=g).to(device, compute)
    with torch.inference_mode():
        context = model.preprocess_text_embeds(text.to(device, compute))
    layout = mm.PackedLayout(text.shape[1], vshape[2], (vshape[3] + 1) // 2 * 2, (vshape[4] + 1) // 2 * 2, ashape[-1])
    payload = {"seed": seed, "audio_scale": 1.0, "layout": layout}
    ts = torch.tensor([sigma * 1000.0], dtype=torch.float32, device=device)
    return ([video, audio], ts, context), {"transformer_options": {}, "minimax_payload": payload}, layout.seq_len


PROBE_SKIP = {"sub_quad", "split", "sage3", "xformers"}  # memory-bound fallbacks, Blackwell-only, not installed


def timed(fn, iters: int, device: torch.device, warmup: int = 1) -> list[float]:
    """Seconds of each of ``iters`` calls after ``warmup`` calls (CUDA events on a GPU, synchronized around each
    call, so host work inside the call counts)."""
    import time

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1000)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def top_kernels(fn, n: int = 6) -> list[dict]:
    """The CUDA kernels one call of ``fn`` launches, by total device time (name cut at 160 characters)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    acc: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            a = acc.setdefault(ev.name[:160], [0.0, 0])
            a[0] += ev.device_time / 1000
            a[1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in acc.values())
    return [{"kernel": k, "ms": round(v[0], 3), "launches": v[1],
             "percent": round(100 * v[0] / total, 1) if total else None} for k, v in rows[:n]]


def attention_probe(seq: int, heads: int, head_dim: int, device: torch.device, dtype, iters: int = 5) -> dict:
    """Every attention function core registered in this process, called as core's ``Attention.forward`` calls
    ``optimized_attention`` (q, k: strided [1, H, S, D] views of the qkv buffer; v: a clone; in containers;
    skip_reshape): seconds per call (median of ``iters`` after a warm-up), the kernels one call launched, and the
    output's rel-L2 against core's ``pytorch`` function (SDPA). -> {name: {...}}."""
    import statistics

    import comfy.ldm.modules.attention as A

    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=g, device=device, dtype=dtype)

    def call(fn):
        q, k, v = qkv.split(heads * head_dim, dim=-1)
        q, k = (t.view(seq, heads, head_dim).transpose(0, 1).unsqueeze(0) for t in (q, k))
        v = v.view(seq, heads, head_dim).clone().transpose(0, 1).unsqueeze(0)
        c = [A.AttentionTensorContainer(t) for t in (q, k, v)]
        return fn(*c, heads, mask=None, skip_reshape=True, transformer_options={})

    names = [n for n in A.REGISTERED_ATTENTION_FUNCTIONS if n not in PROBE_SKIP]
    with torch.inference_mode():
        ref = call(A.REGISTERED_ATTENTION_FUNCTIONS["pytorch"]).double()
        out = {}
        for name in names:
            fn = A.REGISTERED_ATTENTION_FUNCTIONS[name]
            try:
                o = call(fn)
                ts = timed(lambda: call(fn), iters, device)
                r = {"function": fn.__name__, "seconds_median": statistics.median(ts), "seconds": ts,
                     "rel_l2_vs_pytorch": float((o.double() - ref).norm() / ref.norm())}
                if name != "pytorch" and r["rel_l2_vs_pytorch"] == 0.0:  # core's sage/flash fall back to SDPA
                    r["fell_back_to_pytorch"] = True
                if device.type == "cuda":
                    r["kernels_of_one_call"] = top_kernels(lambda: call(fn), 4)
            except Exception as e:  # noqa: BLE001 - one option failing is a finding, not the end of the probe
                r = {"function": fn.__name__, "error": f"{type(e).__name__}: {e}"[:400]}
            out[name] = r
    return out


def option_of(registered: str) -> str | None:
    """Our option name for core's registered attention name."""
    return next((k for k, v in ATTENTION.items() if v[1] == registered), None)
