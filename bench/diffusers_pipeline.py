#!/usr/bin/env python3
"""The canonical workload through diffusers' MiniMax H3 pipeline with our transformer, against ``generate``'s step
time on the same model in the same process.

    python3 bench/diffusers_pipeline.py [--steps 12] [--attention auto] [--out-dir bench/results]   # -> diffusers-pipeline-<card>.json
    python3 bench/diffusers_pipeline.py --tiny      # the tiny DiT on the CPU: the same stages in seconds

1. One resident model: the full-size H3 (50 blocks) with random weights (``bench/_h3bench.RandomSource``), loaded
   through the runtime's plan + streaming load (NVFP4 on the GPU, Sage2 where present), as bench/canonical.py.
2. diffusers' ``MiniMaxH3ModularPipeline`` (its blocks up to the latents; no decode) with a tiny random conditioner
   and VAEs (``runtime.pipeline.tiny``, text width 5120) and ``DiffusersTransformer(rt)`` as its transformer: the
   canonical request, 1344x768, 124 frames, a 100-byte prompt (100 tokens of the byte-level tokenizer),
   ``num_inference_steps = steps + 1`` (diffusers' grid counts the terminal 0: ``steps`` model calls). A warm-up
   request, then the measured one: a repeated request is planned whole from the previous run's sigmas, as a user's
   second prompt of the same size is. Step time: the wall time between the starts of consecutive transformer calls
   (synchronized: the model, our mapping of the call, and diffusers' scheduler step), and the model calls' own
   CUDA-event seconds (ModelCall's, the numbers ``generate`` reports).
3. ``generate``'s run (``runtime.run`` over ``tensor_job``, the sampler behind ``h3-blackwell generate``) on the same
   model with the conditioner's text states, ``steps`` steps: its per-step seconds.
The JSON (rewritten after each stage) has both medians and their ratio; the issue's bar is within 2 %.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, RandomSource, bench_command, versions, write_json  # noqa: E402

from h3_blackwell.runtime import (DiffusersTransformer, Measure, SampleInputs, SamplingSettings, open_model,  # noqa: E402
                                  run, tensor_job)
from h3_blackwell.runtime.model.config import FULL  # noqa: E402
from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402
from h3_blackwell.runtime.pipeline.tiny import TINY_PIPELINE_DIT, TinyPipeline, tiny_components  # noqa: E402

PROMPT = ("A red fox trots along a snowy ridge at dawn, wind lifting powder off the pines, a distant owl calls. "
          * 2)[:100]
SEED = 440420
last: tuple | None = None  # the last pipeline request's (video, audio) latents on the CPU


class Clocked:
    """The pipeline's transformer, timed: the wall clock at the start of every call (device synchronized first),
    so consecutive starts bound one pipeline step."""

    def __init__(self, inner: DiffusersTransformer):
        self.inner, self.config, self.starts = inner, inner.config, []

    def forward(self, *args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())
        return self.inner(*args, **kwargs)

    __call__ = forward


Clocked.forward.__signature__ = DiffusersTransformer.forward.__signature__  # the layout names diffusers reads


def pipeline_run(pipe, clocked: Clocked, size: tuple, steps: int) -> dict:
    """One request through the pipeline -> its step times (the last step ends at the loop's end)."""
    width, height, frames = size
    clocked.starts.clear()
    out = pipe(prompt=PROMPT, height=height, width=width, num_frames=frames, num_inference_steps=steps + 1,
               generator=torch.Generator().manual_seed(SEED), output=["latents", "audio_latents"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ends = clocked.starts[1:] + [time.perf_counter()]
    wall = [b - a for a, b in zip(clocked.starts, ends)]
    call = clocked.inner.call
    marks = call.run.marks if call.run is not None else []
    model = [a.elapsed_time(b) / 1e3 for a, b in marks] if torch.cuda.is_available() else [b - a for a, b in marks]
    global last
    last = (out["latents"].float().cpu(), out["audio_latents"].float().cpu())
    return {"step_wall_seconds": wall, "model_call_seconds": model,
            "median_step_wall_seconds": statistics.median(wall), "median_model_call_seconds": statistics.median(model),
            "mean_step_wall_seconds": statistics.mean(wall),
            "video_latent_shape": list(out["latents"].shape), "audio_latent_shape": list(out["audio_latents"].shape),
            "latents_finite": bool(torch.isfinite(out["latents"]).all() and torch.isfinite(out["audio_latents"]).all())}


def model_report(transformer: DiffusersTransformer, latents) -> dict:
    """The run report of the transformer's last run (ModelCall's: what ran, FC2 dispatches, peak memory), for the
    pipeline's final latents (video [1, C, T, H, W]; audio [2, Ca, Ta] -> ours [1, Ca, 2, Ta])."""
    call = transformer.call
    call.end_run()
    video, audio = latents
    rep = call.report(video, audio.permute(1, 0, 2)[None].contiguous())
    keep = ("configuration", "backends", "fc2_dispatch", "peak_allocated_bytes", "peak_reserved_bytes",
            "latents_finite", "per_step_seconds")
    return {k: rep[k] for k in keep if k in rep}


def make_pipeline(dit_config):
    """diffusers' H3 blocks up to the latents (decode left out) with the tiny conditioner and VAEs at the DiT's text
    width, on the run's device."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")
    pipe = blocks.init_pipeline()
    pipe.update_components(**tiny_components(TinyPipeline(dit=dit_config), transformer=False))
    return pipe.to("cuda" if torch.cuda.is_available() else "cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--generate-runs", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="the tiny DiT at 96x64 on the CPU (checks the stages)")
    ap.add_argument("--out", default=None, help="the JSON (default OUT_DIR/diffusers-pipeline-<card>.json)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    name = torch.cuda.get_device_name() if cuda else ""
    card = next((k.lower() for k in ("GB10", "B200", "H200", "H100", "A100") if k in name),
                name.replace(" ", "-").lower()) if cuda else "cpu-tiny"
    out = Path(a.out or Path(a.out_dir) / f"diffusers-pipeline-{card}.json")
    cfg, size = (FULL, (1344, 768, 124)) if not a.tiny else (TINY_PIPELINE_DIT, (96, 64, 124))
    res = {"name": "diffusers-pipeline", "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions(),
           "workload": {"width": size[0], "height": size[1], "frames": size[2], "steps": a.steps,
                        "prompt_tokens": len(PROMPT.encode()), "weights": "random, seed 0", "dit": "full" if
                        cfg is FULL else "tiny"}}
    t0 = time.perf_counter()
    opts = RuntimeOptions.from_env(device="cuda" if cuda else "cpu", attention=a.attention)
    dt = torch.bfloat16 if cuda else torch.float32
    rt = open_model(RandomSource(cfg, 0, dt), opts).load()
    res["build_seconds"], res["backends"] = time.perf_counter() - t0, rt.backends
    write_json(res, out)

    pipe = make_pipeline(cfg)
    ours = Clocked(DiffusersTransformer(rt))
    pipe.update_components(transformer=ours)
    res["pipeline_warmup"] = pipeline_run(pipe, ours, size, a.steps)
    res["pipeline"] = pipeline_run(pipe, ours, size, a.steps)
    res["pipeline"]["planned_from_previous_run"] = ours.inner.call.run.schedule is not None
    res["pipeline"]["model_report"] = model_report(ours.inner, last)
    write_json(res, out)

    text, tags = encode(pipe)
    del pipe
    video, audio = torch.zeros(1, cfg.video_channels, 37, size[1] // 16, size[0] // 16), torch.zeros(1, 32, 2, 207)
    r = run(tensor_job(rt, SampleInputs(text, tags, video, audio), SamplingSettings(seed=SEED, steps=a.steps),
                       measure=Measure(a.generate_runs, 0)))
    steps = r.report["per_step_seconds"]  # one list per measured run (a single run's: its steps)
    per = [s["seconds"] for run_ in (steps if isinstance(steps[0], list) else [steps]) for s in run_]
    res["generate"] = {"per_step_seconds": per, "median_step_seconds": statistics.median(per),
                       "mean_step_seconds": statistics.mean(per),
                       "latents_finite": r.report["latents_finite"]}
    g, p = res["generate"]["median_step_seconds"], res["pipeline"]
    res["step_time_ratio_pipeline_wall_over_generate"] = p["median_step_wall_seconds"] / g
    res["step_time_ratio_model_calls_over_generate"] = p["median_model_call_seconds"] / g
    res["total_seconds"] = time.perf_counter() - t0
    write_json(res, out)
    print(f"pipeline step {p['median_step_wall_seconds']:.3f} s (model call {p['median_model_call_seconds']:.3f} s), "
          f"generate step {g:.3f} s: ratio {res['step_time_ratio_pipeline_wall_over_generate']:.4f}; wrote {out}")
    return 0


def encode(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's text states and tags from the pipeline's conditioner (diffusers' t2va text encoder block)."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    step = MiniMaxH3TextEncoderStep().init_pipeline()
    step.update_components(text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, processor=pipe.processor)
    out = step(prompt=PROMPT, output=["prompt_embeds", "text_token_tags"])
    return out["prompt_embeds"].float().cpu(), out["text_token_tags"].long().cpu()


if __name__ == "__main__":
    sys.exit(main())
