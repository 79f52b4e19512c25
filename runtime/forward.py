"""The forward job: one model evaluation (``h3-blackwell forward``), validated once like the generate job.

:func:`forward_job` checks everything before any weight is read (the checkpoint header read once and every
name and shape checked once, the output location, the inputs file's tensors, the payload, the device);
:func:`run_forward` loads the model from the job's opened checkpoint and evaluates it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .budget import MemoryAsk, Workload
from .errors import H3Error
from .io.atomic import refuse_replacing_inputs
from .io.finite import is_finite
from .io.control import load_control, open_control
from .io.payload import PayloadError, check_control_args, load_payload, read_inputs
from .model_spec import ModelSpec, open_source, runtime_options, source_files, verify_source
from .model.conditioning import H3Conditioning
from .model.control import bind_control
from .plan import resolve_device, resolve_dtype
from .sampling.request import RequestError, check_latents, check_output_file, check_text_states
from .sampling.schedule import model_sigma


@dataclass
class ForwardJob:
    """One validated evaluation: text [1, L, text_dim] fp32, tags [L] or None, video [1, C, T, H, W] and audio
    [1, Ca, 2, Ta] fp32, sigma in [0, 1], the conditioning (core's payload, parsed), an optional Fun ControlNet."""

    model: ModelSpec
    text: torch.Tensor
    tags: torch.Tensor | None
    video: torch.Tensor
    audio: torch.Tensor
    sigma: torch.Tensor
    conditioning: H3Conditioning
    control: Any = None  # the Fun ControlNet's opened, checked file (io.control.ControlFile), or None
    output: Path | None = None  # the checked output file (symbolic links resolved) where the caller writes


def _inputs(path: str, cfg) -> dict[str, torch.Tensor]:
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


def forward_job(model, inputs: str, *, payload: str | None = None, output: str | None = None,
                device: str = "cpu", dtype: str = "float32", fast: bool = False,
                control: str | None = None) -> ForwardJob:
    """Validate one evaluation -> the ForwardJob; no weight is read.

    model: a checkpoint path (or an opened Checkpoint); inputs: a safetensors with video, audio, text_states,
    sigma [, token_tags] and the tensors ``payload`` (core's conditioning JSON) names; output: a file path
    that must be writable. By default the reference evaluation (stored weights, dequantized where the file is
    quantized; exact attention); ``fast``: the block stack the load plan picks (NVFP4 / W4A8, fast attention).
    control: a Fun ControlNet file applied with the payload's ``control`` field.
    """
    source, cfg, _ = open_source(model)
    verify_source(source)
    out = None if output is None else check_output_file(output, "--out")
    if out is not None:
        refuse_replacing_inputs([out], {"--model": source_files(source), "--inputs": [inputs], "--payload": [payload],
                                        "--control": [control]})
    t = _inputs(inputs, cfg)
    cond = load_payload(payload, t)
    check_control_args(control, cond)
    tower = None if control is None else open_control(control).check_base(cfg)
    opts = runtime_options({"device": device, "dtype": dtype, "quantize": None if fast else False,
                            "attention": None if fast else "reference"})
    dev = resolve_device(opts)
    spec = ModelSpec(source, cfg, opts, dev, resolve_dtype(opts, dev))
    text = t["text_states"].shape[-2]  # every packed row, condition rows too, before the model loads
    spec.check_memory(Workload.from_shapes(t["video"].shape, t["audio"].shape, text, 1, cond),
                      MemoryAsk(f"the evaluation of {inputs}", "the latents or the payload's keyframes and references"))
    return ForwardJob(spec, t["text_states"].float(), t.get("token_tags"), t["video"].float(), t["audio"].float(),
                      t["sigma"].flatten()[0], cond, tower, out)


def check_pdd_schedule(cond: H3Conditioning, head_bank: int) -> None:
    """Core refuses a PDD head bank without the sampler's schedule; so do we, naming the field."""
    if head_bank > 1 and cond.sample_sigmas is None:
        raise PayloadError(f"sample_sigmas: expected the run's full sigma schedule (this checkpoint has a PDD head "
                           f"bank of {head_bank} heads, which needs it); found null; add it to the payload")


def run_forward(job: ForwardJob) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Load the job's model and evaluate it once -> (video, audio velocities, the packed layout). A non-finite
    output of finite inputs and weights is an H3Error."""
    rt = job.model.load()
    check_pdd_schedule(job.conditioning, rt.config.head_bank)
    sigma = float(model_sigma(job.sigma))  # core's timestep round trip (sigma * 1000 / 1000, fp32)
    with torch.no_grad():
        plan = rt.model.plan(job.text, tuple(job.video.shape), tuple(job.audio.shape), [sigma],
                             token_tags=job.tags, cond=job.conditioning)
        if job.control is not None:  # core's window reads the sampler's fp32 sigma; the tower runs dense attention
            bind_control(rt.model, load_control(job.control, rt.plan), job.conditioning.control, plan,
                         [float(job.sigma.float())],
                         ops=None if rt.sparse is None else rt.ops.with_attention(rt.sparse.dense))
        v, au = rt.model.evaluate(plan, 0, job.video, job.audio, rt.ops)
    for name, x in (("video", v), ("audio", au)):
        if not is_finite(x):
            raise H3Error(f"the model's {name} output is NaN/Inf although its inputs and weights are finite; try "
                          "--dtype float32, --dense or check the checkpoint; nothing was written")
    return v.float().cpu(), au.float().cpu(), plan.layout
