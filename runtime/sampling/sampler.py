"""The resident sampling loop: noise as ComfyUI draws it, the flow schedule, euler / res_multistep, the
audio carry, inpainting, progress and interruption. One run per call; every step is one call of the
``ModelCall`` core's samplers call too (the plan, timing, FC2 counters, finiteness checks and the report).

Initial noise (ComfyUI ``prepare_noise`` for the nested H3 latent): one CPU generator seeded with
``seed`` draws ``randn(video.shape)`` and then ``randn(audio.shape)``, fp32. The sampler starts from
``sigma0 * noise + (1 - sigma0) * latent`` with the audio slice scaled by audio_scale (the carry).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import H3Error, Interrupted
from ..io.payload import conditioning_from_payload
from ..lora.apply import sync_loras
from ..model.conditioning import H3Conditioning
from ..options import LossySettings, SamplingSettings
from .inpaint import Inpaint
from .model_call import CallOptions, ModelCall
from .report import RunRecord
from .request import check_noise_index
from .schedule import Stepper, audio_scale, get_sigmas, model_sigma


@dataclass
class SampleResult:
    """video [1, C, T, H, W] and audio [1, Ca, 2, Ta] fp32 on the CPU; report: the seed-schema dict of this one
    run; record: its measurements (``runtime.sampling.report.measured_report`` joins several runs')."""

    video: torch.Tensor
    audio: torch.Tensor
    report: dict
    record: RunRecord | None = None


@dataclass
class SampleInputs:
    """What a run samples from: text states [1, L, text_dim] fp32, token tags [L] (1 text, 0 vision) or None (all
    text), the input latent video [1, C, T, H, W] / audio [1, Ca, 2, Ta] (zeros for t2va) and core's
    conditioning (``H3Conditioning``: keyframes, references, denoise masks, noise augmentation, seed,
    sample_sigmas; core's payload, ``minimax_keyframes`` included, becomes one with
    ``conditioning_from_payload``) or None (plain t2va)."""

    text: torch.Tensor
    tags: torch.Tensor | None
    video: torch.Tensor
    audio: torch.Tensor
    conditioning: H3Conditioning | None = None


@dataclass
class Hooks:
    """The caller's side of a run: ``progress(done, total)`` after each step; ``preview(done, total, x0_video)``
    too, with the step's denoised video estimate [1, C, T, H, W] (on the model's device; the callee copies what
    it keeps); ``interrupt()`` asked before each step (true: Interrupted is raised, nothing is returned);
    ``block(step, done, total)`` after each block."""

    progress: Callable[[int, int], None] | None = None
    preview: Callable[[int, int, torch.Tensor], None] | None = None
    interrupt: Callable[[], bool] | None = None
    # ``block(step, blocks done, blocks)`` after each block of a step: progress within a slow step
    block: Callable[[int, int, int], None] | None = None


def initial_noise(seed: int, video_shape, audio_shape, batch_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's noise for a one-clip nested (video, audio) latent: one CPU generator, fp32. ``batch_index`` k: the
    latent's ``batch_index`` [k] (``comfy.sample.prepare_noise``: per stream, video first, k + 1 draws of one
    entry's shape, the last kept); k = 0 is the plain draw of each stream."""
    g = torch.Generator("cpu").manual_seed(int(seed))
    out = []
    for shape in (tuple(video_shape), tuple(audio_shape)):
        for _ in range(int(batch_index) + 1):
            noise = torch.randn(shape, generator=g, dtype=torch.float32)
        out.append(noise)
    return out[0], out[1]


def _check_inputs(rt, text_states, token_tags, video, audio):
    cfg = rt.config
    if text_states.dim() != 3 or text_states.shape[0] != 1:
        raise H3Error(f"text states must be [1, L, {cfg.text_dim}]; found {list(text_states.shape)}")
    if text_states.shape[-1] not in (cfg.text_dim, cfg.hidden_size):
        raise H3Error(f"text states have width {text_states.shape[-1]}; this model expects {cfg.text_dim} "
                      f"(Qwen3-VL states for H3 are [1, L, 5120])")
    if token_tags is not None and token_tags.numel() != text_states.shape[1]:
        raise H3Error(f"token_tags has {token_tags.numel()} entries; text states have {text_states.shape[1]} tokens")
    if video.dim() != 5 or video.shape[0] != 1 or video.shape[1] != cfg.video_channels:
        raise H3Error(f"video latent must be [1, {cfg.video_channels}, T, H, W]; found {list(video.shape)}")
    if audio.dim() != 4 or audio.shape[0] != 1 or audio.shape[1] != cfg.audio_channels or audio.shape[2] != 2:
        raise H3Error(f"audio latent must be [1, {cfg.audio_channels}, 2, Ta]; found {list(audio.shape)}")


def _with_run_schedule(cond: H3Conditioning, sigmas: torch.Tensor) -> H3Conditioning:
    """Core hands the model the sampler's own schedule (sample_sigmas, for PDD heads): a conditioning that names
    another schedule is refused, one without gets the run's."""
    if cond.sample_sigmas is not None and (cond.sample_sigmas.shape != sigmas.shape
                                           or not torch.allclose(cond.sample_sigmas.float(), sigmas.float())):
        raise H3Error(f"sample_sigmas: expected this run's schedule {[round(float(v), 4) for v in sigmas]} (or "
                      f"none); found {[round(float(v), 4) for v in cond.sample_sigmas]}; drop it from the payload")
    return dataclasses.replace(cond, sample_sigmas=sigmas.float().cpu())


@dataclass
class _Start:
    """A run's starting point, prepared once: the (video, audio) shifts, the audio carry's scale, the schedule
    [N + 1] (CPU fp32), the conditioning the plan is made with, the initial state on the model's device (the
    audio carried) and the inpainting (or None)."""

    shifts: tuple[float, float]
    scale: float
    sigmas: torch.Tensor
    cond: H3Conditioning
    xv: torch.Tensor
    y: torch.Tensor
    inpaint: Inpaint | None

    @property
    def options(self) -> CallOptions:
        """What each model call of the run takes besides its tensors: the shifts and the audio carry's scale."""
        return CallOptions(self.shifts, self.scale)


def _check_run(rt, inputs: SampleInputs, control, parallel, hooks: Hooks) -> None:
    _check_inputs(rt, inputs.text, inputs.tags, inputs.video, inputs.audio)
    if parallel is not None and hooks.interrupt is not None:
        raise H3Error("interrupt is not supported in a sequence-parallel run (the ranks would disagree on "
                      "when to stop); pass interrupt=None")
    if control is not None and parallel is not None:
        raise H3Error("the Fun ControlNet tower does not run under sequence parallelism yet; run it on one GPU")


def _start(rt, inputs: SampleInputs, settings: SamplingSettings) -> _Start:
    """Shifts, schedule, the plan's conditioning, core's initial noise and the starting state (module docstring)."""
    shifts = (float(settings.shift_video if settings.shift_video is not None else rt.config.shift_video),
              float(settings.shift_audio if settings.shift_audio is not None else rt.config.shift_audio))
    scale = audio_scale(*shifts)
    sigmas = get_sigmas(settings.scheduler, settings.steps, shifts[0], settings.denoise)
    cond = None if inputs.conditioning is None else _with_run_schedule(inputs.conditioning, sigmas)
    video, audio = inputs.video, inputs.audio
    noise_v, noise_a = initial_noise(settings.seed, video.shape, audio.shape, settings.batch_index)
    # core rounds each stream's noise to its latent's dtype (fp16 / bf16 intermediates); fp32 latents: unchanged
    noise_v, noise_a = (n.to(x.dtype).float() if x.is_floating_point() else n for n, x in ((noise_v, video),
                                                                                        (noise_a, audio)))
    video0, audio0 = video.float().cpu(), audio.float().cpu()
    inpaint = None if cond is None else Inpaint.build(cond, video0, audio0, noise_v, scale, rt.device)
    s0 = sigmas[0]
    xv = (s0 * noise_v + (1.0 - s0) * video0).to(rt.device)
    y = (s0 * noise_a + (1.0 - s0) * (audio0 * scale)).to(rt.device)
    plan_cond = cond if cond is not None else H3Conditioning(seed=int(settings.seed))  # plain t2va: the run's seed
    return _Start(shifts, scale, sigmas, plan_cond, xv, y, inpaint)


@torch.no_grad()
def _steps(call: ModelCall, inputs: SampleInputs, sampler: str, start: _Start, control, hooks: Hooks):
    """The sampling loop: each step one model call (``call``), core's sampler update, progress and preview ->
    (video [1, C, T, H, W], audio [1, Ca, 2, Ta]) on the device, audio uncarried."""
    dev = call.rt.device
    sigmas, shifts, scale, inpaint = start.sigmas, start.shifts, start.scale, start.inpaint
    steps = len(sigmas) - 1
    on_dev = sigmas.to(dev)  # one copy: a per-step copy from host memory would wait for the device
    stepper = Stepper(sampler, on_dev)
    options = start.options
    xv, y = start.xv, start.y
    for i in range(steps):
        if hooks.interrupt is not None and hooks.interrupt():
            raise Interrupted(f"interrupted before step {i + 1} of {steps}")
        s = on_dev[i]
        xv_in, y_in = inpaint.model_input(s, xv, y, shifts, scale) if inpaint is not None else (xv, y)
        # the plan is keyed by the host's model sigma, the audio carry computes with the device's (CallOptions)
        step_options = dataclasses.replace(options, carry_sigma=model_sigma(s)) if start.scale != 1.0 else options
        vv, vy = call(xv_in, y_in, model_sigma(sigmas[i]), inputs.text, inputs.tags, start.cond, step_options,
                      control)
        den = [xv_in - vv * s, y_in - vy * s]
        if inpaint is not None:
            den = list(inpaint.denoised(*den))
        xv, y = stepper.step(i, [xv, y], den)
        if hooks.progress is not None:
            hooks.progress(i + 1, steps)
        if hooks.preview is not None:
            hooks.preview(i + 1, steps, den[0])
    return xv, (y / scale if scale != 1.0 else y)


def _workload_extra(settings: SamplingSettings, cond: H3Conditioning | None, extra: dict | None) -> dict:
    """The sampler's fields of the report's workload (its settings and conditioning), then the caller's own."""
    w = {"seed": int(settings.seed), "sampler": settings.sampler, "scheduler": settings.scheduler,
         "denoise": settings.denoise}
    if cond is not None:
        w["conditioning"] = {
            "keyframes": [k.resolved_frame_index for k in cond.keyframes], "refs": [r.kind for r in cond.refs],
            "denoise_mask": cond.denoise_mask is not None, "audio_denoise_mask": cond.audio_denoise_mask is not None,
            "visual_cond_noise_aug": cond.visual_cond_noise_aug, "audio_cond_noise_aug": cond.audio_cond_noise_aug,
            "seed": cond.seed}
    if settings.batch_index:
        w["batch_index"] = settings.batch_index
    w.update({k: v for k, v in (extra or {}).items() if k not in w})
    return w


def sample(rt, inputs: SampleInputs, settings: SamplingSettings, lossy: LossySettings | None = None, control=None,
           hooks: Hooks | None = None, parallel=None, workload_extra: dict | None = None) -> SampleResult:
    """Sample H3 latents with a resident model (ComfyUI core's math; see module docstring): one run.

    inputs: the text states, tags, input latent and conditioning (``SampleInputs``); a conditioning's masks
    inpaint as core's sampler does (``runtime.sampling.inpaint``), keeping the input latent's content where the
    mask is 0. settings: seed, steps, sampler, scheduler, denoise, shifts, batch index (``SamplingSettings``;
    the initial noise is that batch entry's of the seed, ``initial_noise``). lossy: this run's LOSSY settings
    (sparse attention's tau, the First-Block Cache; default the load options'); the report gains
    ``sparse_attention`` / ``first_block_cache`` blocks when they are on. control: a Fun ControlNet tower
    (``runtime.io.control.load_control``) applied with ``conditioning.control`` (core's
    MiniMaxH3FunControlNetApply); the report gains a ``control`` block. hooks: progress, preview, interrupt
    (``Hooks``; Interrupted is raised between steps, nothing is returned). parallel: a ParallelContext when this
    process is one rank of a sequence-parallel run: every rank calls ``sample`` with the same arguments, the
    rows are split over the ranks, every rank returns the same latents; the report gains a
    ``sequence_parallel`` block. workload_extra: fields added to the report's workload.

    Every step is one call of the per-call object core's samplers call too (``ModelCall``): the plan (layout,
    RoPE tables, refined text, modulation rows of every (step, block)) is built once, before the clock starts.
    Warm-up and repeated measured runs are the caller's (``runtime.job.run``, the benches).
    """
    hooks = hooks or Hooks()
    settings = dataclasses.replace(settings, batch_index=check_noise_index(settings.batch_index))
    _check_run(rt, inputs, control, parallel, hooks)
    sync_loras(rt)  # the shared model carries rt's LoRA stack (a LoraView's, or the runtime's own)
    start = _start(rt, inputs, settings)
    cond = start.cond if inputs.conditioning is not None else None
    workload = _workload_extra(settings, cond, workload_extra)
    call = ModelCall(rt, parallel)
    call.on_block = hooks.block
    # the plan carries the conditioning's schedule only where one was given (as core's payload has it)
    call.begin_run(start.sigmas, lossy, pin_schedule=False)
    try:
        call.prepare(inputs.text, inputs.tags, (tuple(inputs.video.shape), tuple(inputs.audio.shape)),
                     start.cond, start.options, control)
        xv, y = _steps(call, inputs, settings.sampler, start, control, hooks)
    finally:
        call.end_run()
    video, audio = xv.float().cpu(), y.float().cpu()
    report = call.report(video, audio, workload)
    return SampleResult(video, audio, report, call.last_run.record)
