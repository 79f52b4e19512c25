"""The commands behind ``h3-blackwell``: generate | forward | make-tiny | quantize.

Each command hands its flags to the runtime's job (``runtime.make_job`` / ``runtime.forward_job``), which
validates the whole request once before any weight is read (numbers, device, memory estimate, output path,
the checkpoint's header and every tensor name and shape, input files and tensors); then ``runtime.run`` /
``runtime.run_forward`` load and work, and the command writes atomically and prints. Refusals are H3Errors;
``cli.main`` turns them into one ``error:`` line and exit status 2. Only ``h3_blackwell.runtime`` itself is
imported (its public names).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from ..runtime import (PRESETS, SEED_RANGE, Canvas, H3Error, JobFiles, Launch, Measure, SamplingSettings, check_int,
                       check_output_file, cpu_thread_count, folder_transformer, forward_job, latent_rows, make_job,
                       nonfinite_message, open_pipeline, prompt_job, quantize_checkpoint, resolve_device, run,
                       run_forward, runtime_options, save_tensors, save_tiny, summary, write_dir, write_file, write_mp4,
                       write_preview_webp)
from .progress import WARN_AFTER_S, Progress, clock

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def segments_line(layout) -> str:
    """``segments: text[0:6] cond[6:12] ...``: the packed layout in one line."""
    return "segments: " + " ".join(f"{s['kind']}[{s['start']}:{s['stop']}]" for s in layout.describe())


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------

def _generate_options(a) -> dict:
    """generate's option flags as RuntimeOptions overrides (None: the H3_* environment or the default)."""
    return dict(device=a.device, dtype=a.dtype, attention=a.attention, gemm=a.gemm, act_format=a.act_format,
                act_scale=a.act_scale, precision=a.precision, fc2=a.fc2, quantize=False if a.dense else None,
                sparse_tau=a.sparse_tau, sparse_start=a.sparse_start, sparse_extra_tokens=a.sparse_extra_tokens,
                sparse_min_tokens=a.sparse_min_tokens, sparse_method=a.sparse_method,
                sparse_keep_percent=a.sparse_keep_percent, sparse_end=a.sparse_end,
                sparse_dense_blocks=a.sparse_dense_blocks, sparse_sinks=a.sparse_sinks,
                first_block_cache=a.first_block_cache,
                vram_budget=a.vram_budget, host_budget=a.host_budget, cpu_threads=a.cpu_threads,
                load_behind=a.load_behind)


def apply_preset(a, argv) -> tuple[float | None, float | None]:
    """``--preset``: the preset's settings into the flags not given on the command line (``argv``) -> the preset's
    (video, audio) shifts, or (None, None)."""
    if not getattr(a, "preset", None):
        return None, None
    p = PRESETS[a.preset]
    given = {x.split("=", 1)[0] for x in argv if x.startswith("--")}
    for flag, name, value in (("--steps", "steps", p.steps), ("--sampler", "sampler", p.sampler),
                              ("--attention", "attention", "sparse" if p.sparse else None)):
        if flag not in given and value is not None:
            setattr(a, name, value)
    if p.sparse is not None and a.attention == "sparse":
        for flag, name, value in (("--sparse-method", "sparse_method", p.sparse.method),
                                  ("--sparse-keep-percent", "sparse_keep_percent", p.sparse.keep_percent)):
            if flag not in given:
                setattr(a, name, value)
    return p.shift_video, p.shift_audio


def generate_job(a, argv=()):
    """The runtime's validated job for generate's flags (no weight is read); ``argv``: the command line (what
    ``--preset`` leaves alone)."""
    shifts = apply_preset(a, list(argv))
    job = make_job(a.model, sampling=SamplingSettings(a.seed, a.steps, a.sampler, a.scheduler, a.denoise, *shifts),
                   files=JobFiles(a.text_states, a.text_tokens, a.inputs, a.payload, a.control, tuple(a.lora or ())),
                   canvas=Canvas(a.width, a.height, a.frames, a.snap), options=_generate_options(a),
                   measure=Measure(a.runs, a.warmup), tiny_seed=a.tiny_seed,
                   launch=Launch(a.sequence_parallel, a.output, a.preview,
                                 functools.partial(Progress, "sampling", force=a.progress), True, os.environ))
    # the progress line knows the run's size: its estimate after the first blocks, its ETA within a slow step
    job.progress = functools.partial(Progress, "sampling", force=a.progress, steps=job.sampling.steps,
                                     runs=job.measure.runs + job.measure.warmup)
    return job


def cpu_threads(job) -> int | None:
    """Set torch's intra-op threads for a job on the CPU in this process (runtime.cpu_thread_count: one thread
    for small work, else the free cores; H3_CPU_THREADS / --cpu-threads / OMP_NUM_THREADS override) -> the count,
    or None (a GPU job, or sequence-parallel workers, which split the cores themselves)."""
    if job.device_type != "cpu" or job.sequence_parallel not in (None, 1):
        return None
    video, audio = job.latents(job.config)
    rows = latent_rows(video.shape, audio.shape, job.inputs.text.shape[-2], job.inputs.conditioning)
    n = cpu_thread_count(job.model.options.cpu_threads, rows, job.config.hidden_size, torch.get_num_threads())
    torch.set_num_threads(n)
    return n


SLOWEST_CPU_FLOPS = 1e9  # fp32 matmul FLOP/s every CPU exceeds: work done within WARN_AFTER_S at it is not timed


def cpu_matmul_flops(job) -> float:
    """The matmul FLOPs of a CPU job's sampling: block linears and attention of every block, step and run (the
    rest left out, so the time they take is a lower bound)."""
    cfg = job.config
    video, audio = job.latents(cfg)
    rows = latent_rows(video.shape, audio.shape, job.inputs.text.shape[-2], job.inputs.conditioning)
    per_block = 2 * rows * (4 * cfg.hidden_size * cfg.inner_dim + 3 * cfg.hidden_size * cfg.ffn_hidden_size) \
        + 4 * rows * rows * cfg.inner_dim
    return per_block * cfg.num_layers * job.sampling.steps * (job.measure.runs + job.measure.warmup)


def measured_flops_per_s() -> float:
    """This CPU's fp32 matmul speed now: a 1024 x 1024 product, the best of three."""
    x = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024 ** 3 / best


def warn_if_hours(job) -> float | None:
    """A CPU job whose matmul FLOPs alone need WARN_AFTER_S or more at the speed measured here: a warning before it
    starts. -> that lower bound in seconds, or None where it was not measured (not the CPU, or too little work to
    take that long on any CPU)."""
    if job.device_type != "cpu":
        return None
    flops = cpu_matmul_flops(job)
    if flops / SLOWEST_CPU_FLOPS < WARN_AFTER_S:
        return None
    s = flops / measured_flops_per_s()
    if s >= WARN_AFTER_S:
        print(f"warning: this run needs at least {clock(s)} on this CPU (its matrix products alone, at the speed "
              f"measured here); Ctrl-C stops it, and fewer pixels, frames or steps shorten it", file=sys.stderr)
    return s


def cmd_generate(a) -> int:
    if a.pipeline is not None or a.prompt is not None or a.first_frame is not None or a.last_frame is not None:
        return cmd_generate_prompt(a)
    job = generate_job(a, a.argv)  # every input validated before the (possibly long) model load
    cpu_threads(job)
    warn_if_hours(job)
    res = run(job)
    if res is None:  # a torchrun rank other than 0: rank 0 writes
        return 0
    video, audio, report = _finite(res)
    _write_run(a, job, (video, audio), report)
    shown = Path(a.output)
    print(f"wrote {shown / 'latents.safetensors'} and {shown / 'report.json'}"
          + (f" and {shown / 'preview.webp'}" if a.preview else ""))
    return 0


def _finite(res):
    """A run's (video, audio, report); H3Error (nothing is written) when its latents are not finite."""
    if not res.report["latents_finite"]:
        raise H3Error(nonfinite_message(res.report["nonfinite"]) + "; nothing was written")
    return res.video, res.audio, res.report


def _write_run(a, job, latents, report: dict, extra: dict | None = None) -> None:
    """A run's files into the output folder together (``write_dir``): latents.safetensors, the ``extra`` files
    ({name: writer}), report.json with the command line and, with --preview, preview.webp (an earlier run's preview
    never stays beside this run's latents); then the report's summary."""
    video, audio = latents
    report["command"] = " ".join(["h3-blackwell"] + sys.argv[1:]) if sys.argv else "h3-blackwell generate"
    write_dir(job.output, {
        "latents.safetensors": lambda p: save_tensors(p, {"video": video, "audio": audio}),
        **(extra or {}),
        "report.json": lambda p: p.write_text(json.dumps(report, indent=2)),
        **({"preview.webp": lambda p: write_preview_webp(video, p)} if a.preview else {}),
    }, replaces=("preview.webp",))
    print(summary(report))


def _check_prompt_flags(a) -> None:
    if a.pipeline is None or a.prompt is None:
        raise H3Error("generate --prompt: expected --pipeline DIR and --prompt TEXT together (--first-frame / "
                      "--last-frame need both); found " + ("--prompt" if a.pipeline is None else "--pipeline")
                      + " without the other")
    other = [f for f, v in (("--text-states", a.text_states), ("--inputs", a.inputs), ("--payload", a.payload),
                            ("--control", a.control)) if v is not None]
    if other:
        raise H3Error(f"generate --prompt: the conditioner makes the text states and keyframes; drop {', '.join(other)}")
    if a.sequence_parallel not in (None, 1):
        raise H3Error("generate --prompt runs in this process; drop --sequence-parallel")


def _stage(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def cmd_generate_prompt(a) -> int:
    """generate --pipeline DIR --prompt TEXT: every input checked first (the model, sizes, output, the folder's
    components and their fit with the model, the prompt's length, the images), then encode -> sample -> decode,
    each stage's models freed before the next; the output folder gets every file together or nothing."""
    _check_prompt_flags(a)
    if a.model is None and Path(a.pipeline).is_dir():  # the folder's own transformer weights, read by our loader
        a.model = folder_transformer(a.pipeline)
    job = generate_job(a, getattr(a, "argv", ()))
    folder = open_pipeline(a.pipeline, job.config, job.model.options.vram_budget)
    req = folder.request(a.prompt, a.first_frame, a.last_frame)
    device = job.model.device
    _stage(f"encoding the prompt{' and keyframes' if req.images else ''} with {a.pipeline}'s conditioner")
    text, tags, cond = folder.encode(req, job.canvas, device, job.sampling.seed)
    job = prompt_job(job, text, tags, cond)
    cpu_threads(job)
    _stage(f"sampling {text.shape[1]} text tokens, {job.canvas[0]}x{job.canvas[1]}, {job.canvas[2]} frames")
    video, audio, report = _finite(run(job))
    _stage("decoding with the pipeline's VAEs")
    dec = folder.decode(video, audio, device)
    report["pipeline"] = {"folder": str(a.pipeline), "prompt_tokens": int(text.shape[1]),
                          "keyframes": [k.resolved_frame_index for k in cond.keyframes] if cond is not None else [],
                          "decoded_video": list(dec.video.shape), "decoded_audio": list(dec.audio.shape),
                          "sample_rate": dec.rate, "stage_devices": dict(folder.stages)}
    _stage("writing video.mp4")
    _write_run(a, job, (video, audio), report, {
        "decoded.safetensors": lambda p: save_tensors(p, {"video": dec.video, "audio": dec.audio},
                                                      metadata={"sample_rate": str(dec.rate), "fps": "24"}),
        "video.mp4": lambda p: write_mp4(p, dec)})
    print(f"wrote {Path(a.output) / 'video.mp4'}, decoded.safetensors, latents.safetensors and report.json"
          + (" and preview.webp" if a.preview else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# forward / make-tiny / quantize
# ---------------------------------------------------------------------------------------------

def cmd_forward(a) -> int:
    # the reference evaluation by default: stored weights (dequantized where the file is quantized), exact
    # attention; --fast runs the block stack the load plan picks (NVFP4 / W4A8, fast attention)
    job = forward_job(a.model, a.inputs, payload=a.payload, output=a.out, device=a.device, dtype=a.dtype,
                      fast=a.fast and not a.dense, control=a.control)
    v, au, layout = run_forward(job)
    write_file(job.output, lambda p: save_tensors(p, {"video": v.contiguous(), "audio": au.contiguous()}))
    print(segments_line(layout))
    print(f"wrote {a.out}: video {list(v.shape)}, audio {list(au.shape)}")
    return 0


def cmd_make_tiny(a) -> int:
    out = check_output_file(a.out, "make-tiny output")
    check_int("seed", a.seed, *SEED_RANGE)
    write_file(out, lambda p: save_tiny(p, seed=a.seed, dtype=DTYPES[a.dtype]))
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def cmd_quantize(a) -> int:
    out = check_output_file(a.output, "quantize output")
    resolve_device(runtime_options({"device": a.device}))
    prog = Progress("quantize", force=a.progress)
    done = quantize_checkpoint(a.input, out, device=a.device, progress=lambda i, n, name: prog(i + 1, n))
    print(f"wrote {out}: {done['quantized_layers']} block linears as NVFP4 (comfy_quant format \"nvfp4\": e2m1 "
          f"values, e4m3 scales per 16, an fp32 global scale), every other tensor as stored; "
          f"{out.stat().st_size:,} bytes")
    return 0
