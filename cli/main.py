"""``h3-blackwell``: generate | forward | make-tiny | quantize | tune-fc2 | comfy-run.

Every user error ends as one line ``error: ...`` on stderr and exit status 2; nothing partial is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.errors import H3Error, Interrupted

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CliError(H3Error):
    pass


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _atomic_dir_write(out_dir: Path, files: dict[str, callable]) -> None:
    """Write files into a temp dir beside ``out_dir`` then move them in, so a failure leaves nothing partial."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".h3-tmp-", dir=out_dir))
    try:
        for name, writer in files.items():
            writer(tmp / name)
        for name in files:
            os.replace(tmp / name, out_dir / name)
    finally:
        for p in tmp.glob("*"):
            p.unlink()
        tmp.rmdir()


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal or the run is long)."""

    def __init__(self, label: str, force: bool = False):
        self.label, self.t0 = label, time.perf_counter()
        self.enabled = force or sys.stderr.isatty()

    def __call__(self, done: int, total: int):
        if not self.enabled and time.perf_counter() - self.t0 < 5.0:
            return
        w = 30
        fill = int(w * done / max(total, 1))
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (w - fill)}] {done}/{total} {el:6.1f}s")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _load_text_states(path: str, text_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    from safetensors import safe_open

    from ..runtime.io.header import read_header

    hdr = read_header(path)  # clear errors for missing / not safetensors
    if "text_states" not in hdr.tensors:
        raise CliError(f"{path}: expected a tensor 'text_states' [1, L, {text_dim}]; found {sorted(hdr.tensors)[:5]}")
    with safe_open(path, "pt") as f:
        ts = f.get_tensor("text_states").float()
        tags = f.get_tensor("token_tags").long() if "token_tags" in hdr.tensors else None
    if ts.dim() == 2:
        ts = ts[None]
    if ts.dim() != 3 or ts.shape[0] != 1 or ts.shape[-1] != text_dim:
        raise CliError(f"{path}: text_states has shape {list(ts.shape)}; expected [1, L, {text_dim}]")
    if tags is not None and tags.numel() != ts.shape[1]:
        raise CliError(f"{path}: token_tags has {tags.numel()} entries for {ts.shape[1]} text tokens")
    return ts, tags


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------

@dataclass
class GenerateJob:
    """Everything one ``generate`` needs after validation, before the model load (pickled to each rank)."""

    model: str | None
    tiny_seed: int
    options: object  # RuntimeOptions
    loras: list
    text: torch.Tensor
    tags: torch.Tensor | None
    canvas: tuple  # (width, height, frames)
    sample_kw: dict
    progress: bool
    latents: tuple | None = None  # (video, audio) from --inputs; None: zeros of the canvas


def _generate_job(a) -> tuple[GenerateJob, object]:
    """Validate every input of ``generate`` (no model load) -> (the job, the model's H3Config)."""
    from ..runtime.io.checkpoint import detect_config
    from ..runtime.lora.apply import parse_lora_arg
    from ..runtime.model.config import TINY
    from ..runtime.model.layout import check_canvas, check_frames, snap_frames
    from ..runtime.options import RuntimeOptions
    from ..runtime.sampling.preview import check_preview_available

    if a.model is not None and not Path(a.model).exists():
        raise CliError(f"model file not found: {a.model}")
    model_cfg = TINY if a.model is None else detect_config(a.model)[0]
    # small models (the embedded tiny one, make-tiny files) default to a small canvas that runs in seconds
    tiny = model_cfg.hidden_size <= 512
    width = a.width or (256 if tiny else 1344)
    height = a.height or (256 if tiny else 768)
    frames = a.frames or (22 if tiny else 124)
    steps = a.steps or (8 if tiny else 20)
    check_canvas(width, height)
    if a.snap:
        frames = snap_frames(frames)
    check_frames(frames)
    if a.text_states is not None and not Path(a.text_states).exists():
        raise CliError(f"text states file not found: {a.text_states}")
    inputs = _generate_inputs(a, model_cfg)
    fc2 = {"on": (True, False), "off": (False, False), "strict": (True, True)}[a.fc2]
    try:
        opts = RuntimeOptions.from_env(device=a.device, dtype=a.dtype, attention=a.attention, gemm=a.gemm,
                                       act_format=a.act_format, fc2_lt=fc2[0], fc2_lt_strict=fc2[1],
                                       quantize=False if a.dense else None, sparse_tau=a.sparse_tau,
                                       sparse_start=a.sparse_start, sparse_extra_tokens=a.sparse_extra_tokens,
                                       sparse_min_tokens=a.sparse_min_tokens, first_block_cache=a.first_block_cache)
    except ValueError as e:  # an option out of range: one error line, exit 2
        raise CliError(str(e)) from e
    loras = [parse_lora_arg(s) for s in a.lora]
    if a.preview:
        check_preview_available()
    if inputs is not None:
        text, tags, latents, cond, (width, height, frames) = inputs
    elif a.text_states:
        text, tags = _load_text_states(a.text_states, model_cfg.text_dim)
    else:
        g = torch.Generator().manual_seed(1234)
        text, tags = torch.randn(1, a.text_tokens, model_cfg.text_dim, generator=g), None
    kw = {"seed": a.seed, "steps": steps, "sampler": a.sampler, "scheduler": a.scheduler, "denoise": a.denoise,
          "runs": a.runs, "warmup": a.warmup,
          "workload_extra": {"frames": frames, "text_source": a.inputs or a.text_states or "random (seed 1234)"}}
    if inputs is not None:
        kw["conditioning"] = cond
    return GenerateJob(a.model, a.tiny_seed, opts, loras, text, tags, (width, height, frames), kw, a.progress,
                       None if inputs is None else latents), model_cfg


def _generate_inputs(a, cfg):
    """``--inputs`` (+ ``--payload``): (text, tags, (video, audio), conditioning, (width, height, frames)), or None
    without --inputs. The latents give the canvas; a payload without ``seed`` takes --seed (core's payload seed
    is the sampler's)."""
    from ..runtime.model.layout import FRAME_PER_TOKEN
    from .payload import load_payload, read_inputs

    if a.inputs is None:
        if a.payload is not None:
            raise CliError("--payload needs --inputs: the safetensors with video, audio, text_states and the tensors "
                           "the payload names")
        return None
    clash = [f for f, v in (("--text-states", a.text_states), ("--width", a.width), ("--height", a.height),
                            ("--frames", a.frames)) if v is not None]
    if clash:
        raise CliError(f"{clash[0]} with --inputs: the inputs file gives the text states and the latents (their "
                       f"shape is the canvas); drop {clash[0]}")
    t = read_inputs(a.inputs, ["video", "audio", "text_states"],
                    "video [1,C,T,H,W], audio [1,Ca,2,Ta] (the LATENT to sample from), text_states [1,L,text_dim] "
                    "(optional token_tags [L]; with --payload also every tensor the payload names)")
    video, audio, text = t["video"].float(), t["audio"].float(), t["text_states"].float()
    if text.dim() != 3 or text.shape[0] != 1 or text.shape[-1] != cfg.text_dim:
        raise CliError(f"{a.inputs}: text_states has shape {list(text.shape)}; expected [1, L, {cfg.text_dim}]")
    if video.dim() != 5 or audio.dim() != 4:
        raise CliError(f"{a.inputs}: video {list(video.shape)} / audio {list(audio.shape)}; expected [1, "
                       f"{cfg.video_channels}, T, H, W] and [1, {cfg.audio_channels}, 2, Ta]")
    cond = load_payload(a.payload, t, default_seed=a.seed)
    cond.check_target(video.shape, audio.shape, cfg.video_channels, cfg.audio_channels)
    frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(video.shape[2]))
    return text, t.get("token_tags"), (video, audio), cond, (video.shape[4] * 16, video.shape[3] * 16, frames)


def generate_rank(ctx, job: GenerateJob):
    """Load the model and sample: the whole run (ctx None) or one rank of a sequence-parallel run (ctx: its
    ParallelContext; each rank uses ctx.device). -> (video, audio, report); every rank returns the same latents."""
    import dataclasses

    from ..runtime.engine import load_model
    from ..runtime.lora.apply import apply_loras
    from ..runtime.model.layout import latent_shapes
    from ..runtime.sampling.sampler import sample

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
    res = sample(rt, job.text, job.tags, video, audio, progress=prog, parallel=ctx, **job.sample_kw)
    return res.video, res.audio, res.report


def _device_type(opts) -> str:
    if opts.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(opts.device).type


def _parallel_generate(a, job: GenerateJob, heads: int):
    """Run ``generate`` as torchrun's rank (its environment present), over N local workers
    (``--sequence-parallel N`` > 1), or in this process. -> (video, audio, report), or None on ranks > 0."""
    from ..runtime.parallel import ParallelEnv, check_degree, init_group, launch

    penv = ParallelEnv.from_env(os.environ)
    n = penv.world_size if penv is not None else (1 if a.sequence_parallel is None else a.sequence_parallel)
    if penv is not None and a.sequence_parallel not in (None, n):
        raise CliError(f"--sequence-parallel {a.sequence_parallel} but torchrun started WORLD_SIZE={n} ranks; "
                       "drop the flag under torchrun or make them match")
    dev_type = _device_type(job.options)
    check_degree(n, heads, dev_type)
    if n > 1 and job.options.device not in ("auto", "cpu", "cuda"):
        raise CliError(f"--device {job.options.device} with --sequence-parallel {n}: rank r uses cuda:r; pass "
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
    from safetensors.torch import save_file

    from ..runtime.sampling.preview import write_preview_webp
    from ..runtime.sampling.report import summary

    job, cfg = _generate_job(a)  # every input validated before the (possibly long) model load
    res = _parallel_generate(a, job, cfg.num_heads)
    if res is None:  # a torchrun rank other than 0: rank 0 writes
        return 0
    video, audio, report = res
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
# forward / make-tiny
# ---------------------------------------------------------------------------------------------

def cmd_forward(a) -> int:
    from safetensors.torch import save_file

    from ..runtime.engine import load_model
    from ..runtime.options import RuntimeOptions
    from ..runtime.sampling.schedule import model_sigma
    from .payload import check_pdd_schedule, load_payload, read_inputs, segments_line

    t = read_inputs(a.inputs, ["video", "audio", "text_states", "sigma"],
                    "video [1,C,T,H,W], audio [1,Ca,2,Ta], text_states [1,L,text_dim], sigma [1] (optional token_tags "
                    "[L]; with --payload also every tensor the payload names)")
    cond = load_payload(a.payload, t)
    # the reference evaluation by default: stored weights (dequantized where the file is quantized), exact
    # attention; --fast runs the block stack the load plan picks (NVFP4 / W4A8, fast attention)
    fast = a.fast and not a.dense
    opts = RuntimeOptions.from_env(device=a.device, dtype=a.dtype, quantize=None if fast else False,
                                   attention=None if fast else "reference")
    rt = load_model(a.model, opts)
    check_pdd_schedule(cond, rt.config.head_bank)
    video, audio = t["video"].float(), t["audio"].float()
    sigma = float(model_sigma(t["sigma"].flatten()[0]))  # core's timestep round trip (sigma * 1000 / 1000, fp32)
    with torch.no_grad():
        plan = rt.model.plan(t["text_states"].float(), tuple(video.shape), tuple(audio.shape), [sigma],
                             token_tags=t.get("token_tags"), cond=cond)
        v, au = rt.model.evaluate(plan, 0, video, audio, rt.ops)
    _atomic_dir_write(Path(a.out).parent, {Path(a.out).name: lambda p: save_file(
        {"video": v.float().cpu().contiguous(), "audio": au.float().cpu().contiguous()}, str(p))})
    print(segments_line(plan.layout))
    print(f"wrote {a.out}: video {list(v.shape)}, audio {list(au.shape)}")
    return 0


def cmd_make_tiny(a) -> int:
    from ..runtime.model.tiny import save_tiny

    p = save_tiny(a.out, seed=a.seed, dtype=DTYPES[a.dtype])
    print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0


def cmd_quantize(a) -> int:
    from ..runtime.io.convert import quantize_checkpoint

    prog = Progress("quantize", force=a.progress)
    quantize_checkpoint(a.input, a.output, device=a.device, progress=lambda i, n, name: prog(i + 1, n))
    print(f"wrote {a.output}")
    return 0


def cmd_tune_fc2(argv) -> int:
    from ..runtime.fc2.tune import main as tune_main

    return int(tune_main(argv) or 0)


def cmd_comfy_run(argv) -> int:
    from .comfy_run import main as run_main

    return int(run_main(argv) or 0)


# ---------------------------------------------------------------------------------------------

def _add_lossy_args(g) -> None:
    """generate's LOSSY speed options (sparse attention's settings, the First-Block Cache)."""
    g.add_argument("--sparse-tau", type=float, default=None,
                   help="LOSSY: sparse routing threshold (default 1.3, ComfyUI core's; higher = faster, less exact)")
    g.add_argument("--sparse-start", type=float, default=None,
                   help="LOSSY: fraction of the timestep range that stays dense before sparse starts (default 0.2)")
    g.add_argument("--sparse-extra-tokens", type=int, default=None, choices=[0, 64, 128, 192, 256],
                   help="LOSSY: exact extra tokens per 64-row query block (default 256, core's)")
    g.add_argument("--sparse-min-tokens", type=int, default=None,
                   help="sequences shorter than this stay dense with --attention sparse (default 12288, core's)")
    g.add_argument("--first-block-cache", type=float, default=None, metavar="THRESHOLD",
                   help="LOSSY step reuse: skip blocks 1.. when the first block's residual change is within this "
                        "relative L1 of the last computed step's (off by default; 0 never reuses; peers ~0.05-0.1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h3-blackwell", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="sample latents (default: the embedded tiny model, random text states)")
    g.add_argument("--output", required=True, help="directory for latents.safetensors and report.json")
    g.add_argument("--model", help="H3 DiT checkpoint (.safetensors or sharded .index.json); default: embedded tiny")
    g.add_argument("--tiny-seed", type=int, default=0)
    g.add_argument("--text-states", help="safetensors with text_states [1,L,5120] and optional token_tags [L]")
    g.add_argument("--text-tokens", type=int, default=32, help="length of the random text states (no --text-states)")
    g.add_argument("--inputs", help="safetensors with video / audio (the LATENT to sample from: its shape is the canvas), "
                                    "text_states [, token_tags] and the tensors --payload names")
    g.add_argument("--payload", help="JSON conditioning with core's field names (keyframes, refs, denoise masks, noise "
                                     "augmentation, seed: default --seed); needs --inputs")
    g.add_argument("--width", type=int)
    g.add_argument("--height", type=int)
    g.add_argument("--frames", type=int)
    g.add_argument("--snap", action="store_true", help="snap --frames up to the 17k+5 grid")
    g.add_argument("--steps", type=int)
    g.add_argument("--seed", type=int, default=440420)
    g.add_argument("--sampler", default="res_multistep", choices=["euler", "res_multistep"])
    g.add_argument("--scheduler", default="simple", choices=["simple"])
    g.add_argument("--denoise", type=float, default=1.0)
    g.add_argument("--runs", type=int, default=1)
    g.add_argument("--warmup", type=int, default=0)
    g.add_argument("--device", default=None, help="auto | cpu | cuda[:N]")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    g.add_argument("--attention", default=None, choices=["auto", "sage2", "sage1", "sdpa", "reference", "sparse"],
                   help="attention backend; sparse = LOSSY training-free sparse attention (comfy-kitchen sol_attn; "
                        "refused with the reason where it cannot run)")
    _add_lossy_args(g)
    g.add_argument("--gemm", default=None, choices=["auto", "native", "emulated", "fp8", "bf16", "reference"])
    g.add_argument("--act-format", default=None, choices=["auto", "nvfp4", "fp8"],
                   help="block activations: auto (W4A8 where the fp8 GEMM backend runs, else NVFP4), nvfp4, fp8")
    g.add_argument("--fc2", default="on", choices=["on", "off", "strict"])
    g.add_argument("--dense", action="store_true", help="keep dense linears (no NVFP4; the reference stack)")
    g.add_argument("--progress", action="store_true", help="always show the progress bar")
    g.add_argument("--preview", action="store_true",
                   help="also write preview.webp: the final video latent as an animated low-resolution preview "
                        "(core's latent->RGB factors, one pixel per latent pixel; needs Pillow)")
    g.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="split the packed rows over N ranks (Ulysses attention): starts N local workers, one per GPU "
                        "(cuda:0..N-1, NCCL) or CPU processes (gloo); N must divide the head count. Under torchrun "
                        "the ranks come from its environment")
    g.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH[:MODE]",
                   help="apply a LoRA after loading (repeat to stack); MODE merge (default: into the weights, "
                        "NVFP4 re-quantized) or side (bf16 low-rank path per step)")
    g.set_defaults(fn=cmd_generate)

    f = sub.add_parser("forward", help="one model evaluation (t2va, or core's conditioning with --payload)")
    f.add_argument("--model", required=True)
    f.add_argument("--inputs", required=True, help="safetensors: video, audio, text_states, sigma [, token_tags] "
                                                   "and the tensors the payload names")
    f.add_argument("--payload", help="JSON conditioning with core's field names (keyframes, refs, denoise_mask, "
                                     "audio_denoise_mask, sample_sigmas, *_cond_noise_aug, seed)")
    f.add_argument("--out", required=True)
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    f.add_argument("--device", default="cpu")
    f.add_argument("--dense", action="store_true", help="the reference evaluation (the default): dense linears, exact attention")
    f.add_argument("--fast", action="store_true",
                   help="run the fast block stack (NVFP4/W4A8 linears, fast attention) instead of the reference")
    f.set_defaults(fn=cmd_forward)

    t = sub.add_parser("make-tiny", help="write a tiny random H3 checkpoint in ComfyUI naming")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    t.set_defaults(fn=cmd_make_tiny)

    q = sub.add_parser("quantize", help="convert an H3 checkpoint to NVFP4 (comfy_quant format)")
    q.add_argument("input")
    q.add_argument("output")
    q.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    q.add_argument("--progress", action="store_true")
    q.set_defaults(fn=cmd_quantize)

    sub.add_parser("tune-fc2", help="sweep cuBLASLt configurations for FC2 on this GPU", add_help=False)
    sub.add_parser("comfy-run", help="submit a workflow to a running ComfyUI server", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "tune-fc2":
            return cmd_tune_fc2(argv[1:])
        if argv and argv[0] == "comfy-run":
            return cmd_comfy_run(argv[1:])
        a = build_parser().parse_args(argv)
        return a.fn(a)
    except (H3Error, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"interrupted: {e}; nothing was written", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
