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
from pathlib import Path

import torch

from ..runtime import (SEED_RANGE, Canvas, H3Error, JobFiles, Launch, Measure, SamplingSettings, check_int,
                       check_output_file, forward_job, make_job, nonfinite_message, quantize_checkpoint, resolve_device,
                       run, run_forward, runtime_options, save_tensors, save_tiny, summary, write_dir, write_file,
                       write_preview_webp)
from .progress import Progress

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
                sparse_min_tokens=a.sparse_min_tokens, first_block_cache=a.first_block_cache,
                vram_budget=a.vram_budget)


def generate_job(a):
    """The runtime's validated job for generate's flags (no weight is read)."""
    return make_job(a.model, sampling=SamplingSettings(a.seed, a.steps, a.sampler, a.scheduler, a.denoise),
                    files=JobFiles(a.text_states, a.text_tokens, a.inputs, a.payload, a.control, tuple(a.lora or ())),
                    canvas=Canvas(a.width, a.height, a.frames, a.snap), options=_generate_options(a),
                    measure=Measure(a.runs, a.warmup), tiny_seed=a.tiny_seed,
                    launch=Launch(a.sequence_parallel, a.output, a.preview,
                                  functools.partial(Progress, "sampling", force=a.progress), True, os.environ))


def cmd_generate(a) -> int:
    job = generate_job(a)  # every input validated before the (possibly long) model load
    res = run(job)
    if res is None:  # a torchrun rank other than 0: rank 0 writes
        return 0
    video, audio, report = res.video, res.audio, res.report
    if not report["latents_finite"]:
        raise H3Error(nonfinite_message(report["nonfinite"]) + "; nothing was written")
    out = job.output
    report["command"] = " ".join(["h3-blackwell"] + sys.argv[1:]) if sys.argv else "h3-blackwell generate"
    write_dir(out, {
        "latents.safetensors": lambda p: save_tensors(p, {"video": video, "audio": audio}),
        "report.json": lambda p: p.write_text(json.dumps(report, indent=2)),
        **({"preview.webp": lambda p: write_preview_webp(video, p)} if a.preview else {}),
    }, replaces=("preview.webp",))  # an earlier run's preview never stays beside this run's latents
    shown = Path(a.output)
    print(summary(report))
    print(f"wrote {shown / 'latents.safetensors'} and {shown / 'report.json'}"
          + (f" and {shown / 'preview.webp'}" if a.preview else ""))
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
