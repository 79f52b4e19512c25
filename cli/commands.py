"""The commands behind ``h3-blackwell``: generate | forward | make-tiny | quantize.

Each command validates its whole request first (numbers, device, memory estimate, output path, input
files and tensors: ``runtime.sampling.request``, ``runtime.io.verify``), then loads and works, then writes
atomically. Refusals are H3Errors; ``cli.main`` turns them into one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..runtime.load import load_model
from ..runtime.errors import H3Error
from ..runtime.io.checkpoint import Checkpoint, open_checkpoint
from ..runtime.io.convert import quantize_checkpoint
from ..runtime.io.finite import is_finite
from ..runtime.io.header import read_header
from ..runtime.io.verify import check_checkpoint
from ..runtime.lora.apply import apply_loras, parse_lora_arg
from ..runtime.model.config import TINY, H3Config
from ..runtime.model.layout import FRAME_PER_TOKEN, latent_shapes
from ..runtime.model.tiny import save_tiny
from ..runtime.options import RuntimeOptions
from ..runtime.parallel import ParallelEnv, check_degree, init_group, launch
from ..runtime.plan import resolve_device, resolve_dtype
from ..runtime.sampling import sampler as sampling
from ..runtime.sampling.preview import check_preview_available, write_preview_webp
from ..runtime.sampling.report import nonfinite_message, summary
from ..runtime.sampling.request import (SEED_RANGE, Request, RequestError, approx_param_bytes, check_denoise,
                                        check_int, check_latents, check_memory, check_memory_rows,
                                        check_output_dir, check_output_file, check_seed, check_text_states,
                                        defaults_for, latent_rows, resolve_request)
from ..runtime.sampling.schedule import model_sigma
from .payload import check_pdd_schedule, load_payload, read_inputs, segments_line
from .progress import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _atomic_dir_write(out_dir: Path, files: dict[str, Callable[[Path], None]]) -> None:
    """Write files into a temp dir inside ``out_dir`` then move them in, so a failure leaves nothing partial
    (``out_dir`` itself is removed again when this call created it and nothing was moved in)."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".h3-tmp-", dir=out_dir))
    moved = False
    try:
        for name, writer in files.items():
            writer(tmp / name)
        for name in files:
            os.replace(tmp / name, out_dir / name)
            moved = True
    finally:
        for p in tmp.glob("*"):
            p.unlink()
        tmp.rmdir()
        if created and not moved:
            out_dir.rmdir()


def _atomic_file_write(path: Path, writer: Callable[[Path], None]) -> None:
    """``writer(tmp)`` beside ``path``, then one rename; nothing is left on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        writer(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _options(**kw) -> RuntimeOptions:
    """RuntimeOptions from the flags and H3_* variables; a bad value is a refusal, not a crash."""
    try:
        return RuntimeOptions.from_env(**kw)
    except ValueError as e:
        raise RequestError(f"{e}; fix the flag or the H3_* environment variable") from None


def _model_header(path: str) -> tuple[Checkpoint, int]:
    """(the checkpoint opened from its headers, its bytes on disk)."""
    if not Path(path).exists():
        raise RequestError(f"model file not found: {path}")
    ck = open_checkpoint(path)
    return ck, sum(Path(h.path).stat().st_size for h in ck.headers)


def _checked_model(path: str) -> H3Config:
    """The config of a checkpoint whose every tensor is present with its shape (headers only)."""
    ck, _ = _model_header(path)
    check_checkpoint(ck)
    return ck.config


def _text_states_tokens(path: str, cfg: H3Config) -> int:
    """The token count of a text-states file, from its header only (so the memory check runs before reading)."""
    if not Path(path).exists():
        raise RequestError(f"text states file not found: {path}")
    hdr = read_header(path)
    info = hdr.tensors.get("text_states")
    if info is None:
        raise RequestError(f"{path}: expected a tensor 'text_states' [1, L, {cfg.text_dim}]; found "
                           f"{sorted(hdr.tensors)[:5]}")
    shape = list(info.shape)
    if len(shape) not in (2, 3) or shape[-1] != cfg.text_dim or (len(shape) == 3 and shape[0] != 1):
        raise RequestError(f"{path}: text_states has shape {shape}; expected [1, L, {cfg.text_dim}] "
                           "(Qwen3-VL states for H3 are [1, L, 5120])")
    if shape[-2] == 0:
        raise RequestError(f"{path}: text_states is empty ({shape}); expected at least one token")
    return shape[-2]


def _load_text_states(path: str, cfg: H3Config) -> tuple[torch.Tensor, torch.Tensor | None]:
    with safe_open(path, "pt") as f:
        names = set(f.keys())
        ts = f.get_tensor("text_states")
        tags = f.get_tensor("token_tags").long() if "token_tags" in names else None
    check_text_states(ts, tags, cfg, path)
    ts = ts.float()
    return (ts[None] if ts.dim() == 2 else ts), tags


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------

@dataclass
class GenerateJob:
    """Everything one ``generate`` needs after validation, before the model load (pickled to each rank)."""

    model: str | None
    tiny_seed: int
    options: RuntimeOptions
    loras: list
    text: torch.Tensor
    tags: torch.Tensor | None
    canvas: tuple  # (width, height, frames)
    sample_kw: dict
    progress: bool
    latents: tuple | None = None  # (video, audio) from --inputs; None: zeros of the canvas


def _generate_inputs(a, cfg: H3Config):
    """``--inputs`` (+ ``--payload``): (text, tags, (video, audio), conditioning, (width, height, frames)), or None
    without --inputs. The latents give the canvas; a payload without ``seed`` takes --seed (core's payload seed
    is the sampler's). Text states and latents are checked like every other request (shape, finite)."""
    if a.inputs is None:
        return None
    clash = [f for f, v in (("--text-states", a.text_states), ("--width", a.width), ("--height", a.height),
                            ("--frames", a.frames)) if v is not None]
    if clash:
        raise RequestError(f"{clash[0]} with --inputs: the inputs file gives the text states and the latents (their "
                           f"shape is the canvas); drop {clash[0]}")
    t = read_inputs(a.inputs, ["video", "audio", "text_states"],
                    "video [1,C,T,H,W], audio [1,Ca,2,Ta] (the LATENT to sample from), text_states [1,L,text_dim] "
                    "(optional token_tags [L]; with --payload also every tensor the payload names)")
    check_text_states(t["text_states"], t.get("token_tags"), cfg, a.inputs)
    check_latents(t["video"], t["audio"], cfg, a.inputs)
    video, audio, text = t["video"].float(), t["audio"].float(), t["text_states"].float()
    text = text[None] if text.dim() == 2 else text
    cond = load_payload(a.payload, t, default_seed=a.seed)
    cond.check_target(video.shape, audio.shape, cfg.video_channels, cfg.audio_channels)
    frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(video.shape[2]))
    return text, t.get("token_tags"), (video, audio), cond, (video.shape[4] * 16, video.shape[3] * 16, frames)


def _validate_generate(a):
    """Every check of ``generate`` that needs no weights -> (config, request, options, --inputs or None)."""
    ck, weight_bytes = _model_header(a.model) if a.model is not None else (None, approx_param_bytes(TINY))
    cfg = TINY if ck is None else ck.config
    check_seed(a.seed)
    check_int("tiny_seed", a.tiny_seed, *SEED_RANGE)
    check_int("runs", a.runs, 1)
    check_int("warmup", a.warmup, 0)
    check_denoise(a.denoise)
    if a.sequence_parallel is not None:  # the degree first: its message names the devices it needs
        check_degree(a.sequence_parallel, cfg.num_heads, _spec_type(a.device))
    fc2 = {"on": (True, False), "off": (False, False), "strict": (True, True)}[a.fc2]
    opts = _options(device=a.device, dtype=a.dtype, attention=a.attention, gemm=a.gemm, act_format=a.act_format,
                    fc2_lt=fc2[0], fc2_lt_strict=fc2[1], quantize=False if a.dense else None,
                    sparse_tau=a.sparse_tau, sparse_start=a.sparse_start, sparse_extra_tokens=a.sparse_extra_tokens,
                    sparse_min_tokens=a.sparse_min_tokens, first_block_cache=a.first_block_cache)
    device = resolve_device(opts)
    compute_bytes = resolve_dtype(opts, device).itemsize
    if a.inputs is None and a.payload is not None:
        raise RequestError("--payload needs --inputs: the safetensors with video, audio, text_states and the "
                           "tensors the payload names")
    if a.inputs is None:
        tokens = a.text_tokens if a.text_states is None else _text_states_tokens(a.text_states, cfg)
        req = resolve_request(cfg, a.width, a.height, a.frames, a.steps, tokens, a.snap)
        check_memory(cfg, req, device, compute_bytes, weight_bytes)
        inputs = None
    else:
        inputs = _generate_inputs(a, cfg)
        text, (video, audio), (width, height, frames) = inputs[0], inputs[2], inputs[4]
        steps = defaults_for(cfg)["steps"] if a.steps is None else check_int("steps", a.steps)
        req = Request(width, height, frames, steps, text.shape[1])
        check_memory_rows(cfg, latent_rows(video.shape, audio.shape, text.shape[1]), text.shape[1], device,
                          compute_bytes, weight_bytes, f"the latents of {a.inputs}")
    check_output_dir(a.output)
    if ck is not None:  # every tensor and shape (builds the model's key table: after the cheap checks)
        check_checkpoint(ck)
    if a.preview:
        check_preview_available()
    return cfg, req, opts, inputs


def _generate_job(a) -> tuple[GenerateJob, H3Config]:
    """Validate every input of ``generate`` (no model load) -> (the job, the model's H3Config)."""
    cfg, req, opts, inputs = _validate_generate(a)
    loras = [parse_lora_arg(s) for s in a.lora]
    if inputs is not None:
        text, tags, latents, cond, _ = inputs
    elif a.text_states:
        text, tags = _load_text_states(a.text_states, cfg)
    else:
        text = torch.randn(1, req.text_tokens, cfg.text_dim, generator=torch.Generator().manual_seed(1234))
        tags = None
    kw = {"seed": a.seed, "steps": req.steps, "sampler": a.sampler, "scheduler": a.scheduler, "denoise": a.denoise,
          "runs": a.runs, "warmup": a.warmup,
          "workload_extra": {"frames": req.frames, "text_source": a.inputs or a.text_states or "random (seed 1234)"}}
    if inputs is not None:
        kw["conditioning"] = cond
    return GenerateJob(a.model, a.tiny_seed, opts, loras, text, tags, (req.width, req.height, req.frames), kw,
                       a.progress, None if inputs is None else latents), cfg


def generate_rank(ctx, job: GenerateJob):
    """Load the model and sample: the whole run (ctx None) or one rank of a sequence-parallel run (ctx: its
    ParallelContext; each rank uses ctx.device). -> (video, audio, report); every rank returns the same latents."""
    opts = job.options if ctx is None else dataclasses.replace(job.options, device=str(ctx.device))
    main = ctx is None or ctx.is_main
    rt = load_model(job.model, opts, tiny_seed=job.tiny_seed)
    if job.loras:
        apply_loras(rt, job.loras)
    if main:
        print(rt.describe(), file=sys.stderr)
    if job.latents is not None:
        video, audio = job.latents
    else:
        vshape, ashape = latent_shapes(*job.canvas, rt.config.video_channels, rt.config.audio_channels)
        video, audio = torch.zeros(vshape), torch.zeros(ashape)
    prog = Progress("sampling", force=job.progress) if main else None
    res = sampling.sample(rt, job.text, job.tags, video, audio, progress=prog, parallel=ctx, **job.sample_kw)
    return res.video, res.audio, res.report


def _spec_type(spec: str | None) -> str:
    """The device type a ``--device`` value asks for (auto: cuda when there is one), before it is checked."""
    if spec in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if str(spec).startswith("cuda") else "cpu"


def _device_type(opts: RuntimeOptions) -> str:
    return resolve_device(opts).type


def _parallel_generate(a, job: GenerateJob, heads: int):
    """Run ``generate`` as torchrun's rank (its environment present), over N local workers
    (``--sequence-parallel N`` > 1), or in this process. -> (video, audio, report), or None on ranks > 0."""
    penv = ParallelEnv.from_env(os.environ)
    n = penv.world_size if penv is not None else (1 if a.sequence_parallel is None else a.sequence_parallel)
    if penv is not None and a.sequence_parallel not in (None, n):
        raise RequestError(f"--sequence-parallel {a.sequence_parallel} but torchrun started WORLD_SIZE={n} ranks; "
                           "drop the flag under torchrun or make them match")
    dev_type = _device_type(job.options)
    check_degree(n, heads, dev_type)
    if n > 1 and job.options.device not in ("auto", "cpu", "cuda"):
        raise RequestError(f"--device {job.options.device} with --sequence-parallel {n}: rank r uses cuda:r; pass "
                           "--device cuda and pick the GPUs with CUDA_VISIBLE_DEVICES")
    if penv is not None:
        ctx = init_group(penv, dev_type)
        try:
            res = generate_rank(ctx, job)
            ctx.barrier()
        finally:
            ctx.destroy()
        if not ctx.is_main:
            return None
        res[2]["sequence_parallel"]["launch"] = "torchrun"
        return res
    if n == 1:
        return generate_rank(None, job)
    res = launch(generate_rank, (job,), world_size=n, device_type=dev_type)
    res[2]["sequence_parallel"]["launch"] = f"{n} local workers (h3-blackwell --sequence-parallel)"
    return res


def cmd_generate(a) -> int:
    job, cfg = _generate_job(a)  # every input validated before the (possibly long) model load
    res = _parallel_generate(a, job, cfg.num_heads)
    if res is None:  # a torchrun rank other than 0: rank 0 writes
        return 0
    video, audio, report = res
    if not report["latents_finite"]:
        raise H3Error(nonfinite_message(report["nonfinite"]) + "; nothing was written")
    out = Path(a.output)
    report["command"] = " ".join(["h3-blackwell"] + sys.argv[1:]) if sys.argv else "h3-blackwell generate"
    _atomic_dir_write(out, {
        "latents.safetensors": lambda p: save_file({"video": video.contiguous(), "audio": audio.contiguous()},
                                                   str(p)),
        "report.json": lambda p: p.write_text(json.dumps(report, indent=2)),
        **({"preview.webp": lambda p: write_preview_webp(video, p)} if a.preview else {}),
    })
    print(summary(report))
    print(f"wrote {out / 'latents.safetensors'} and {out / 'report.json'}"
          + (f" and {out / 'preview.webp'}" if a.preview else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# forward / make-tiny / quantize
# ---------------------------------------------------------------------------------------------

def _forward_inputs(path: str, cfg: H3Config) -> dict[str, torch.Tensor]:
    """The inputs file's tensors, the evaluation's own checked against the model (shapes, finite, sigma)."""
    t = read_inputs(path, ["video", "audio", "text_states", "sigma"],
                    "video [1,C,T,H,W], audio [1,Ca,2,Ta], text_states [1,L,text_dim], sigma [1] (optional token_tags "
                    "[L]; with --payload also every tensor the payload names)")
    check_text_states(t["text_states"], t.get("token_tags"), cfg, path)
    check_latents(t["video"], t["audio"], cfg, path)
    sigma = t["sigma"].flatten()
    if sigma.numel() != 1 or not is_finite(sigma) or not 0.0 <= float(sigma[0]) <= 1.0:
        raise RequestError(f"{path}: sigma must be one finite value in [0, 1]; found {sigma.tolist()[:4]}")
    if t["text_states"].dim() == 2:
        t["text_states"] = t["text_states"][None]
    return t


def cmd_forward(a) -> int:
    cfg = _checked_model(a.model)
    out = check_output_file(a.out, "--out")
    t = _forward_inputs(a.inputs, cfg)
    cond = load_payload(a.payload, t)
    # the reference evaluation by default: stored weights (dequantized where the file is quantized), exact
    # attention; --fast runs the block stack the load plan picks (NVFP4 / W4A8, fast attention)
    fast = a.fast and not a.dense
    opts = _options(device=a.device, dtype=a.dtype, quantize=None if fast else False,
                    attention=None if fast else "reference")
    resolve_device(opts)
    rt = load_model(a.model, opts)
    check_pdd_schedule(cond, rt.config.head_bank)
    video, audio = t["video"].float(), t["audio"].float()
    sigma = float(model_sigma(t["sigma"].flatten()[0]))  # core's timestep round trip (sigma * 1000 / 1000, fp32)
    with torch.no_grad():
        plan = rt.model.plan(t["text_states"].float(), tuple(video.shape), tuple(audio.shape), [sigma],
                             token_tags=t.get("token_tags"), cond=cond)
        v, au = rt.model.evaluate(plan, 0, video, audio, rt.ops)
    for name, x in (("video", v), ("audio", au)):
        if not is_finite(x):
            raise H3Error(f"the model's {name} output is NaN/Inf although its inputs and weights are finite; try "
                          "--dtype float32, --dense or check the checkpoint; nothing was written")
    _atomic_file_write(out, lambda p: save_file({"video": v.float().cpu().contiguous(),
                                                 "audio": au.float().cpu().contiguous()}, str(p)))
    print(segments_line(plan.layout))
    print(f"wrote {a.out}: video {list(v.shape)}, audio {list(au.shape)}")
    return 0


def cmd_make_tiny(a) -> int:
    out = check_output_file(a.out, "make-tiny output")
    check_int("seed", a.seed, *SEED_RANGE)
    _atomic_file_write(out, lambda p: save_tiny(p, seed=a.seed, dtype=DTYPES[a.dtype]))
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def cmd_quantize(a) -> int:
    out = check_output_file(a.output, "quantize output")
    resolve_device(_options(device=a.device))
    prog = Progress("quantize", force=a.progress)
    quantize_checkpoint(a.input, out, device=a.device, progress=lambda i, n, name: prog(i + 1, n))
    print(f"wrote {out}")
    return 0
