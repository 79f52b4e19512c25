"""The resident sampling loop: noise as ComfyUI draws it, the flow schedule, euler / res_multistep, the
audio carry, keyframes, deferred step timing, progress and interruption.

Initial noise (ComfyUI ``prepare_noise`` for the nested H3 latent): one CPU generator seeded with
``seed`` draws ``randn(video.shape)`` and then ``randn(audio.shape)``, fp32. The sampler starts from
``sigma0 * noise + (1 - sigma0) * latent`` with the audio slice scaled by audio_scale (the carry).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import H3Error, Interrupted
from ..io.payload import conditioning_from_payload
from ..lora.apply import sync_loras
from ..model.conditioning import H3Conditioning
from ..model.control import bind_control
from ..parallel.evaluate import ShardedEvaluator, numerics
from ..parallel.rank_stats import gather_ranks, parallel_section, rank_run
from .inpaint import Inpaint
from .lossy import LossyRun, tower_ops
from .report import RunRecord, StepTimer, build_report, first_nonfinite, latent_sha256
from .request import check_noise_index
from .schedule import Stepper, audio_scale, carry_in, carry_out, get_sigmas, model_sigma


@dataclass
class SampleResult:
    """video [1, C, T, H, W] and audio [1, Ca, 2, Ta] fp32 on the CPU; report: the seed-schema dict."""

    video: torch.Tensor
    audio: torch.Tensor
    report: dict


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


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peaks(device) -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) bytes of the run on CUDA; (None, None) on the CPU (no allocator
    statistics for host memory: the report says so)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return None, None


@torch.no_grad()
def _run_once(rt, plan, sigmas, sampler, video0, audio0, noise_v, noise_a, scale, shifts, progress, interrupt,
              run_index: int, total_runs: int, preview=None, evaluate=None, inpaint: Inpaint | None = None,
              lossy: LossyRun | None = None, measured: bool = True):
    model = rt.model
    cache = lossy.cache if lossy is not None else None
    if evaluate is None:
        def evaluate(plan_, i_, video_, audio_):
            return model.evaluate(plan_, i_, video_, audio_, rt.ops, cache)
    dev = rt.device
    steps = len(sigmas) - 1
    s0 = sigmas[0]
    xv = (s0 * noise_v + (1.0 - s0) * video0).to(dev)
    y = (s0 * noise_a + (1.0 - s0) * (audio0 * scale)).to(dev)
    stepper = Stepper(sampler, sigmas.to(dev))
    timer = StepTimer(dev, steps)
    fc2 = rt.fc2
    if fc2 is not None:
        fc2.begin_run()
    stack = rt.ops
    direct0 = getattr(stack, "fc2_direct_calls", 0)
    finite = torch.ones(steps, 2, dtype=torch.bool, device=dev)  # [step, (video, audio)]: read once at the end
    _peak_reset(dev)
    if lossy is not None:
        lossy.begin_run(plan, shifts[0])
    t0 = time.perf_counter()
    for i in range(steps):
        if interrupt is not None and interrupt():
            raise Interrupted(f"interrupted before step {i + 1} of {steps}")
        if lossy is not None:
            lossy.begin_step(i, plan.sigmas[i])
        timer.start(i)
        s = sigmas[i].to(dev)
        sm = model_sigma(s)
        xv_in, y_in = inpaint.model_input(s, xv, y, shifts, scale) if inpaint is not None else (xv, y)
        xa = carry_in(y_in, sm, *shifts) if scale != 1.0 else y_in
        vv, va = evaluate(plan, i, xv_in, xa)
        vy = carry_out(va, xa, sm, shifts[0], shifts[1], scale) if scale != 1.0 else va
        den = [xv_in - vv * s, y_in - vy * s]
        if inpaint is not None:
            den = list(inpaint.denoised(*den))
        xv, y = stepper.step(i, [xv, y], den)
        finite[i, 0], finite[i, 1] = torch.isfinite(xv).all(), torch.isfinite(y).all()  # no host sync
        timer.stop(i)
        if progress is not None:
            progress(i + 1, steps)
        if preview is not None:
            preview(i + 1, steps, den[0])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    if lossy is not None:
        lossy.end_run(measured)
    video = xv.float().cpu()
    audio = (y / scale).float().cpu() if scale != 1.0 else y.float().cpu()
    pa, pr = _peaks(dev)
    counts = fc2.end_run() if fc2 is not None else {"attempts": 0, "successes": 0, "fallbacks": 0}
    counts = {k: counts[k] for k in ("attempts", "successes", "fallbacks")}
    counts["direct_calls"] = getattr(stack, "fc2_direct_calls", 0) - direct0  # FC2 run without the dispatcher
    rec = RunRecord(secs, timer.seconds(), pa, pr, latent_sha256(video), latent_sha256(audio), counts,
                    nonfinite=first_nonfinite(finite.cpu(), run_index))
    return video, audio, rec


def _measure(run_args: tuple, warmup: int, runs: int, parallel, preview=None, inpaint=None, lossy=None):
    """``warmup`` + ``runs`` resident runs -> (the last run's (video, audio, record), the measured records,
    the ``sequence_parallel`` report block or None). With ``parallel`` every run goes through one
    ShardedEvaluator; each rank's numbers are gathered once, after the last run."""
    rt, plan, sigmas = run_args[:3]
    ev = ShardedEvaluator(parallel, rt.model, plan, rt.ops, attention=None if rt.ops.attends_exactly else rt.attention
                          ) if parallel is not None else None
    steps = len(sigmas) - 1
    out, records, rank_runs = None, [], []
    for r in range(warmup + runs):
        if ev is not None:
            ev.reset_stats()
        out = _run_once(*run_args, r, warmup + runs, preview, evaluate=None if ev is None else ev.evaluate,
                        inpaint=inpaint, lossy=lossy, measured=r >= warmup)
        if r < warmup:
            continue
        rec = out[2]
        records.append(rec)
        if ev is not None:
            rank_runs.append(rank_run([s["seconds"] for s in rec.per_step_seconds], ev.stats.per_step_seconds(steps),
                                      rec.peak_allocated_bytes, rec.peak_reserved_bytes,
                                      (rec.video_sha256, rec.audio_sha256), ev.amax_stats.per_step_seconds(steps),
                                      ev.amax_stats.per_step_calls(steps)))
    if ev is None:
        return out, records, None
    ranks = gather_ranks(parallel, rank_runs)
    return out, records, parallel_section(parallel, ev.shard, ev.stats, ranks, rt.config.num_layers,
                                          numerics(rt.ops), ev.amax_stats)


def _with_run_schedule(cond: H3Conditioning, sigmas: torch.Tensor) -> H3Conditioning:
    """Core hands the model the sampler's own schedule (sample_sigmas, for PDD heads): a conditioning that names
    another schedule is refused, one without gets the run's."""
    if cond.sample_sigmas is not None and (cond.sample_sigmas.shape != sigmas.shape
                                           or not torch.allclose(cond.sample_sigmas.float(), sigmas.float())):
        raise H3Error(f"sample_sigmas: expected this run's schedule {[round(float(v), 4) for v in sigmas]} (or "
                      f"none); found {[round(float(v), 4) for v in cond.sample_sigmas]}; drop it from the payload")
    return dataclasses.replace(cond, sample_sigmas=sigmas.float().cpu())


def _plan_conditioning(cond: H3Conditioning | None, keyframes: list | None, seed: int) -> H3Conditioning:
    """What the model plans the run with: the conditioning, or core's ``minimax_keyframes`` dicts and the seed
    parsed as a payload (a plain t2va conditioning without either)."""
    if cond is not None:
        return cond
    return conditioning_from_payload({"keyframes": list(keyframes or ()), "seed": int(seed)})


def _workload(rt, plan, video, audio, steps, seed, sampler, scheduler, denoise, shifts, workload_extra,
              cond: H3Conditioning | None) -> dict:
    """The report's workload block: shapes, packed layout (its segment table), run settings, conditioning."""
    lay = plan.layout
    workload = {
        "resolution": [video.shape[4] * 16, video.shape[3] * 16],
        "frames": workload_extra.get("frames") if workload_extra else None,
        "latent_frames": video.shape[2],
        "audio_frames": audio.shape[3],
        "packed_tokens": lay.seq_len,
        "text_tokens": lay.text_len,
        "cond_tokens": lay.cond_rows,
        "steps": steps,
        "seed": int(seed),
        "sampler": sampler,
        "scheduler": scheduler,
        "denoise": denoise,
        "shifts": list(shifts),
        "attention": rt.backends.get("attention", {}).get("choice"),
    }
    if workload_extra:
        workload.update({k: v for k, v in workload_extra.items() if k not in workload or workload[k] is None})
    workload["segments"] = [[k, a, b] for a, b, k in lay.segments]
    if cond is not None:
        workload["conditioning"] = {
            "keyframes": [k.resolved_frame_index for k in cond.keyframes], "refs": [r.kind for r in cond.refs],
            "denoise_mask": cond.denoise_mask is not None, "audio_denoise_mask": cond.audio_denoise_mask is not None,
            "visual_cond_noise_aug": cond.visual_cond_noise_aug, "audio_cond_noise_aug": cond.audio_cond_noise_aug,
            "seed": cond.seed}
    return workload


def sample(rt, text_states: torch.Tensor, token_tags: torch.Tensor | None, video: torch.Tensor,
           audio: torch.Tensor, seed: int, steps: int, sampler: str = "res_multistep", scheduler: str = "simple",
           shift_video: float | None = None, shift_audio: float | None = None, denoise: float = 1.0,
           keyframes: list | None = None, progress: Callable[[int, int], None] | None = None,
           interrupt: Callable[[], bool] | None = None, runs: int = 1, warmup: int = 0,
           workload_extra: dict | None = None,
           preview: Callable[[int, int, torch.Tensor], None] | None = None, parallel=None,
           conditioning: H3Conditioning | None = None, sparse_tau: float | None = None,
           first_block_cache: float | None = None, control=None, batch_index: int = 0) -> SampleResult:
    """Sample H3 latents with a resident model (ComfyUI core's math; see module docstring).

    text_states [1, L, text_dim] fp32; token_tags LongTensor [L] (1 text, 0 vision) or None (all text);
    video [1, C, T, H, W] / audio [1, Ca, 2, Ta]: the input latent (zeros for t2va);
    keyframes: [{"resolved_frame_index": int, "latent": [1, C, t, H, W]}] (fl2va; or use ``conditioning``).
    conditioning: core's conditioning (``runtime.model.conditioning.H3Conditioning``: keyframes, references,
    denoise masks, noise augmentation, seed, sample_sigmas); its masks inpaint as core's sampler does
    (``runtime.sampling.inpaint``), keeping the input latent's content where the mask is 0.
    runs / warmup: the seed's measurement policy (median of ``runs`` after ``warmup`` resident runs).
    progress(done, total) after each step; preview(done, total, x0_video) too, with the step's denoised video
    estimate [1, C, T, H, W] (on the model's device; the callee copies what it keeps), for live previews.
    The layout, RoPE tables, refined text and the modulation rows of every (step, block) are computed once.
    Raises Interrupted between steps when ``interrupt()`` is true; nothing is returned or written then.
    parallel: a ParallelContext (runtime.parallel) when this process is one rank of a sequence-parallel run:
    every rank calls ``sample`` with the same arguments, the rows are split over the ranks, and every rank
    returns the same latents; the report gains a ``sequence_parallel`` block.
    control: a Fun ControlNet tower (``runtime.io.control.load_control``) applied with ``conditioning.control``
    (its hint, strength, sigma window and fades; core's MiniMaxH3FunControlNetApply); the report gains a
    ``control`` block when it runs at some step.
    sparse_tau / first_block_cache: this call's LOSSY settings (runtime.sampling.lossy; default the load
    options'); the report gains ``sparse_attention`` / ``first_block_cache`` blocks when they are on.
    batch_index: the input latent's batch index k (core's ``batch_index`` [k]): the initial noise is that batch
    entry's of the seed (``initial_noise``); the report's workload gains ``batch_index`` when k > 0.
    """
    cfg = rt.config
    batch_index = check_noise_index(batch_index)
    _check_inputs(rt, text_states, token_tags, video, audio)
    sync_loras(rt)  # the shared model carries rt's LoRA stack (a LoraView's, or the runtime's own)
    if parallel is not None and interrupt is not None:
        raise H3Error("interrupt is not supported in a sequence-parallel run (the ranks would disagree on "
                      "when to stop); pass interrupt=None")
    if runs < 1 or warmup < 0:
        raise H3Error(f"runs={runs}, warmup={warmup}: need runs >= 1 and warmup >= 0")
    shifts = (float(shift_video if shift_video is not None else cfg.shift_video),
              float(shift_audio if shift_audio is not None else cfg.shift_audio))
    scale = audio_scale(*shifts)
    sigmas = get_sigmas(scheduler, steps, shifts[0], denoise)
    model_sigmas = [float(model_sigma(s)) for s in sigmas[:-1]]
    if conditioning is not None and keyframes:
        raise H3Error("pass keyframes inside conditioning (H3Conditioning.keyframes), not both")
    if conditioning is not None:
        conditioning = _with_run_schedule(conditioning, sigmas)
    hint = None if conditioning is None else conditioning.control
    if (control is None) != (hint is None):
        raise H3Error("a Fun ControlNet needs both the tower (control=, --control FILE) and the conditioning's "
                      f"control hint (payload field control); found {'the tower' if hint is None else 'the hint'} only")
    if control is not None and parallel is not None:
        raise H3Error("the Fun ControlNet tower does not run under sequence parallelism yet; run it on one GPU")
    fit = getattr(rt, "fit_memory", None)  # the device-memory budget for this run's size (runtime.budget)
    if callable(fit):
        fit(tuple(video.shape), tuple(audio.shape), text_states.shape[1], len(model_sigmas), conditioning,
            control=control)
    with torch.no_grad():
        plan = rt.model.plan(text_states.float(), tuple(video.shape), tuple(audio.shape), model_sigmas,
                             token_tags=token_tags, shifts=shifts, seed=seed,
                             cond=_plan_conditioning(conditioning, keyframes, seed))
        if control is not None:  # core's window reads the sampler's sigma; the tower runs dense attention
            bind_control(rt.model, control, hint, plan, [float(s) for s in sigmas[:-1]], ops=tower_ops(rt))
    noise_v, noise_a = initial_noise(seed, video.shape, audio.shape, batch_index)
    # core rounds each stream's noise to its latent's dtype (fp16 / bf16 intermediates); fp32 latents: unchanged
    noise_v, noise_a = (n.to(x.dtype).float() if x.is_floating_point() else n for n, x in ((noise_v, video),
                                                                                        (noise_a, audio)))
    video0, audio0 = video.float().cpu(), audio.float().cpu()
    inpaint = None if conditioning is None else Inpaint.build(conditioning, video0, audio0, noise_v, scale, rt.device)
    lossy = LossyRun.for_call(rt, sparse_tau, first_block_cache, parallel)
    run_args = (rt, plan, sigmas, sampler, video0, audio0, noise_v, noise_a, scale, shifts, progress, interrupt)
    out, records, sp_section = _measure(run_args, warmup, runs, parallel, preview, inpaint, lossy)
    workload = _workload(rt, plan, video, audio, steps, seed, sampler, scheduler, denoise, shifts, workload_extra,
                         conditioning)
    if batch_index:
        workload["batch_index"] = batch_index
    report = build_report(rt, workload, records, warmup, out[0], out[1],
                          fc2_required=cfg.num_layers * steps + (0 if plan.control is None else plan.control.fc2_calls))
    if plan.control is not None:
        report["control"] = plan.control.summary()
    if sp_section is not None:
        report["sequence_parallel"] = sp_section
    if lossy is not None:
        report.update(lossy.report())
    return SampleResult(out[0], out[1], report)
