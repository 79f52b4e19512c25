"""One model evaluation for a host that runs its own sampler (ComfyUI's KSampler driving the H3 MODEL).

The contract is core's ``MiniMaxH3Model.forward`` (``comfy/ldm/minimax/model.py``): per call the host hands
over the video latent ``[B, C, T, H, W]``, the audio latent ``[B, Ca, 2, Ta]`` *carried* on the video
schedule (``y = (sigma_v / sigma_a) * x_audio`` when ``audio_scale != 1``, the sampler's ``ModelSamplingAV``),
the video sigma (core passes ``timestep = sigma * 1000`` and divides again, fp32), the text states and the
conditioning. It gets back the negated network output (CONST velocity ``eps - x0``) for the video and, for
the audio, the velocity of the carried variable ``(1 - s) * x_a + (1 + (s - 1) * sigma_a) * v_a``
(``runtime.sampling.schedule.carry_in`` / ``carry_out``): exactly what ``sample`` computes inside its loop.

A sampling run (``begin_run`` .. ``end_run``) plans the device-memory budget for the largest size it sees and builds the run plan once, from the first call's text states,
shapes, conditioning and the host's whole schedule (``schedule``: core's ``sample_sigmas``, trailing 0
included): the refined text, layout, RoPE tables and the modulation rows of every scheduled sigma. A call at a
scheduled sigma then costs only the block stack; a call at another sigma (a sampler's intermediate point)
plans that one sigma. A call whose text, shapes, conditioning or shifts differ (a second conditioning: CFG)
gets its own plan. Sparse attention and the First-Block Cache (``runtime.sampling.lossy``, installed once per
run from its ``LossySettings``) follow the calls: the sparse window from each call's sigma, the cache's steps
are the calls of the run. Sparse attention carries its pooled statistics per conditioning (CFG's two alternate,
each with its own, as core keys them per uuids); the First-Block Cache needs one conditioning per run. ``report(video, audio)`` gives the run's report
(the latent hashes are those of the final latents the host hands in).

The runtime's own sampler (``runtime.sampling.sampler.sample``) steps through this same object, so the
per-call bookkeeping (FC2 counters, control-tower and hint checks, the memory fit, timing, finiteness checks,
the workload record) exists once; it adds a sequence-parallel context (``parallel``: each plan evaluated over
the ranks) and builds its plan before the clock starts (``prepare``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable
from dataclasses import dataclass, field

import torch

from ..errors import H3Error
from ..model.conditioning import H3Conditioning
from ..model.control import bind_control
from ..options import LossySettings
from ..parallel.evaluate import ShardedEvaluator, numerics
from ..parallel.rank_stats import gather_ranks, parallel_section, rank_run
from .lossy import LossyRun, tower_ops
from .report import RunRecord, build_report, first_nonfinite, latent_sha256
from .request import latent_rows
from .schedule import carry_in, carry_out, model_sigma

__all__ = ["ModelCall", "weight_shapes"]

_OFF_SCHEDULE_PLANS = 8  # plans kept for sigmas outside the schedule (a sampler's intermediate points)


def weight_shapes(rt) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every weight of the model under ComfyUI's checkpoint names (``blocks.3.attn.qkv_proj.weight`` ...), with
    the shape and dtype of the dense tensor core would hold: the names a host that patches weights by name
    (ComfyUI's LoRA loaders) addresses. Built on the meta device: no memory, whatever the resident format."""
    from ..model.h3 import H3Model

    cfg = rt.config
    m = H3Model(cfg, rt.dtype, device="meta")
    return {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}


@dataclass
class _Plan:
    """One conditioning's plan within a run: the inputs it was built for, the plan, the schedule's model sigmas."""

    text: torch.Tensor
    tags: torch.Tensor | None
    shapes: tuple
    cond: H3Conditioning | None
    shifts: tuple
    plan: object
    sigmas: list
    cond_full: H3Conditioning | None = None  # cond with the run's schedule as sample_sigmas
    extra: dict = field(default_factory=dict)  # off-schedule sigma -> one-sigma plan
    control: object | None = None  # the Fun ControlNet tower bound to its plans (cond.control holds the hint)
    source: torch.Tensor | None = None  # the caller's text and tags tensors the plan was made from
    source_tags: torch.Tensor | None = None

    def matches(self, text, tags, shapes, cond, shifts, control=None) -> bool:
        if self.shapes != shapes or self.shifts != shifts or self.cond is not cond or self.control is not control:
            return False
        if text is self.source and tags is self.source_tags:  # the same tensors as the first call (a sampler's)
            return True
        if (self.tags is None) != (tags is None) or (tags is not None and not torch.equal(self.tags, tags)):
            return False
        return self.text.shape == text.shape and torch.equal(self.text, text.to(self.text.device, self.text.dtype))


@dataclass
class _Run:
    schedule: list | None
    pin_schedule: bool = True  # the plans' conditioning carries the schedule as sample_sigmas (core's hosts)
    round_trip: bool = True  # the network sees the schedule's sigmas through core's sigma * 1000 / 1000 (fp32)
    plans: list = field(default_factory=list)
    lossy: LossyRun | None = None
    lossy_plan: object = None
    calls: int = 0
    marks: list = field(default_factory=list)  # (start, stop) CUDA events or perf_counter floats per call
    finite: list = field(default_factory=list)  # 0-d bool tensors per call (video, audio): read at the end
    t0: float = 0.0
    seconds: float | None = None
    direct0: int = 0
    fc2: dict | None = None
    lossy_settings: LossySettings = LossySettings()
    peaks: tuple = (None, None)  # (peak allocated, peak reserved) bytes on CUDA, from the clock's start
    evaluator: ShardedEvaluator | None = None  # a sequence-parallel run's evaluator of the run plan
    record: RunRecord | None = None  # once reported: the run's measurements
    last: tuple | None = None  # (text shape, video shape, audio shape, shifts) of the last call, for the report
    summary: list = field(default_factory=list)  # per conditioning, once the run ended: what the report shows
    fitted_rows: int = 0  # the packed rows the memory budget was last planned for in this run
    control: object | None = None  # the last ControlRun that ran (a Fun ControlNet), until the run ends
    control_calls: int = 0  # calls the tower ran in (its FC2 calls: one per control block in each)
    control_summary: dict | None = None  # once the run ended: the tower's summary and block count (the report's);
    control_blocks: int = 0  # the run keeps no reference to the tower, so a dropped tower's memory can go


@dataclass(frozen=True)
class CallOptions:
    """What a call takes besides its tensors (core's ``transformer_options`` and payload): the (video, audio) flow
    shifts (None: the model's), the audio carry's scale (1: no carry; ``schedule.audio_scale``), the sigma
    a Fun ControlNet's window is tested on (core's ``transformer_options["sigmas"][0]``; None: the call's), and
    the video sigma the audio carry computes with, a 0-d fp32 tensor on the model's device (None: the call's
    sigma). A sampler that derives the model sigma from its own schedule on the device (``model_sigma`` of a
    device tensor; CUDA divides by a scalar as a multiply by its reciprocal, so the value can differ by an ulp
    from the host's, which keys the plan) passes that tensor here: the carry then uses the device's value and
    the plan the host's, as the runtime's sampler has always done."""

    shifts: tuple | None = None
    audio_scale: float = 1.0
    window_sigma: float | None = None
    carry_sigma: torch.Tensor | None = None


def _peaks(device) -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) bytes since the clock started on CUDA; (None, None) on the CPU (no
    allocator statistics for host memory: the report says so)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return None, None


class ModelCall:
    """Evaluate the resident model ``rt`` (an H3Runtime or a LoRA view of it) one sigma at a time.

    Use: ``begin_run(schedule, lossy)``, then ``__call__`` once per model evaluation, then ``end_run()``; a call
    outside a run starts one implicitly (no schedule known: each sigma is planned alone). ``parallel``: this
    process's ParallelContext in a sequence-parallel run (every rank makes the same calls), else None.
    """

    def __init__(self, rt, parallel=None):
        self.rt = rt
        self.parallel = parallel
        self.run: _Run | None = None
        self.last_run: _Run | None = None
        # (step, blocks done, blocks) after each block of a run plan's step: progress within a slow step
        self.on_block: Callable[[int, int, int], None] | None = None

    # -- run boundaries ------------------------------------------------------------------------
    def begin_run(self, schedule=None, lossy: LossySettings | None = None, pin_schedule: bool = True,
                  round_trip: bool = True) -> None:
        """Start a sampling run. schedule: the host's sigmas [N + 1] (trailing 0) or None; lossy: this run's
        LOSSY settings, installed once for the run (None: the load options'); pin_schedule: give the plans'
        conditioning the schedule as its sample_sigmas (core's rule; the runtime's sampler passes the
        conditioning it planned with); round_trip: the calls' sigmas are the schedule's through core's
        ``timestep = sigma * 1000`` and back (``schedule.model_sigma``; core's samplers and ours), or, False, the
        schedule's own fp32 values (a host that hands the network its sigma as is: diffusers' pipeline)."""
        if self.run is not None:
            self.end_run()
        sched = None if schedule is None else [float(s) for s in torch.as_tensor(schedule).flatten().float()]
        self.run = _Run(sched, pin_schedule=pin_schedule, round_trip=round_trip,
                        lossy_settings=lossy or LossySettings())
        self._start_clock()

    def _start_clock(self) -> None:
        """Zero the run's FC2 counters, peak memory and clock (again after ``prepare`` built the plan)."""
        rt, run = self.rt, self.run
        run.direct0 = rt.ops.fc2_direct_calls
        if rt.fc2 is not None:
            rt.fc2.begin_run()
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
            torch.cuda.reset_peak_memory_stats(rt.device)
        run.t0 = time.perf_counter()

    def prepare(self, text_states, token_tags, shapes, cond, options: CallOptions, control=None) -> None:
        """Build the run's plan for these inputs now (what the first call would), then start the clock, so the
        run's seconds, FC2 counts and peaks are the steps' own (the runtime's sampler)."""
        shifts = tuple(float(s) for s in options.shifts)
        self._check_control(cond, control)
        p = self._plan_for(text_states, token_tags, shapes, cond, shifts, control)
        if p.plan is not None:
            self._lossy(p, p.plan)
        self._start_clock()

    def end_run(self) -> None:
        """Close the run: its FC2 counters, lossy summaries and timings are kept for ``report``."""
        run, rt = self.run, self.rt
        if run is None:
            return
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        run.seconds = time.perf_counter() - run.t0
        run.peaks = _peaks(rt.device)
        counts = rt.fc2.end_run() if rt.fc2 is not None else {"attempts": 0, "successes": 0, "fallbacks": 0}
        run.fc2 = {k: counts[k] for k in ("attempts", "successes", "fallbacks")}
        run.fc2["direct_calls"] = rt.ops.fc2_direct_calls - run.direct0
        if run.lossy is not None:
            run.lossy.end_run(True)
        # the plans (modulation rows of every scheduled sigma) are freed as the run ends; the report keeps a summary
        for p in run.plans:
            plan = p.plan if p.plan is not None else next(iter(p.extra.values()), None)
            run.summary.append({"layout": None if plan is None else plan.layout, "text_tokens": p.text.shape[1],
                                "shifts": p.shifts, "off_schedule_sigmas": list(dict.fromkeys(k[0] for k in p.extra))})
        run.plans, run.lossy_plan = [], None
        if run.control is not None:
            run.control_summary, run.control_blocks = run.control.summary(), len(run.control.tower.places)
            run.control = None
        self.last_run, self.run = run, None

    # -- one evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, video: torch.Tensor, audio: torch.Tensor, sigma, text_states: torch.Tensor,
                 token_tags: torch.Tensor | None = None, cond: H3Conditioning | None = None,
                 options: CallOptions | None = None, control=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(video [1, C, T, H, W], audio [1, Ca, 2, Ta] carried when options.audio_scale != 1) at video sigma
        ``sigma`` (the value the network sees: core's ``timestep / 1000`` in fp32, clamped at 1e-6; a scheduled
        sigma s arrives as ``(s * 1000) / 1000``, ``schedule.model_sigma``) -> (video velocity, carried audio
        velocity), fp32, on the inputs' device. text_states [1, L, text_dim] (or already refined [1, L, hidden]);
        cond: the conditioning (its ``sample_sigmas`` is replaced by the run's schedule); options: the shifts,
        audio scale and control window sigma (``CallOptions``). Batch 1 (core's model refuses more; the host
        loops). control: a Fun ControlNet tower (``runtime.model.control.FunControl``, loaded onto this model's
        plan) run with the hint ``cond.control`` (both or neither); its window is tested, as core's wrapper
        does, on the sampler's sigma of each scheduled step (the schedule's values), and on
        ``options.window_sigma`` (default ``sigma``) for a call between them."""
        rt = self.rt
        if self.run is None:
            self.begin_run()
        run = self.run
        options = options or CallOptions()
        if video.shape[0] != 1 or audio.shape[0] != 1 or text_states.shape[0] != 1:
            raise H3Error(f"one clip per call (batch 1); got video {list(video.shape)}, audio {list(audio.shape)}, "
                          f"text {list(text_states.shape)}")
        shifts = (tuple(float(s) for s in options.shifts) if options.shifts is not None
                  else (rt.config.shift_video, rt.config.shift_audio))
        self._check_control(cond, control)
        sm = torch.as_tensor(sigma, dtype=torch.float32).reshape(()).cpu().clamp(min=1e-6)
        p = self._plan_for(text_states, token_tags, (tuple(video.shape), tuple(audio.shape)), cond, shifts, control)
        window = float(sm) if options.window_sigma is None else float(options.window_sigma)
        plan, i = self._step(p, float(sm), window)
        lossy = self._lossy(p, plan)
        if lossy is not None:
            lossy.begin_step(run.calls, float(sm))
        self._mark_start()
        s_dev = options.carry_sigma if options.carry_sigma is not None else sm
        out = self._evaluate(plan, i, video, audio, s_dev, options.audio_scale, shifts)
        if plan.control is not None and plan.control.active[i]:
            run.control = plan.control
            run.control_calls += 1
        run.finite.append((torch.isfinite(out[0]).all(), torch.isfinite(out[1]).all()))  # read once at the end
        self._mark_stop()
        run.calls += 1
        run.last = (tuple(text_states.shape), tuple(video.shape), tuple(audio.shape), shifts)
        return out[0].float().to(video.device), out[1].float().to(video.device)

    def _evaluate(self, plan, i: int, video, audio, sm, scale: float, shifts):
        """The network at step i of ``plan`` on the model's device, the audio carried in and out at video sigma
        ``sm`` (0-d fp32) when ``scale`` != 1 -> (video velocity, carried audio velocity)."""
        dev = self.rt.device
        xv = video.to(dev, torch.float32)
        y = audio.to(dev, torch.float32)
        s_dev = sm.to(dev)
        xa = carry_in(y, s_dev, *shifts) if scale != 1.0 else y
        if self.parallel is not None:
            vv, va = self._evaluator(plan).evaluate(plan, i, xv, xa)
        else:
            vv, va = self.rt.model.evaluate(plan, i, xv, xa, self.rt.ops)
        return vv, (carry_out(va, xa, s_dev, shifts[0], shifts[1], scale) if scale != 1.0 else va)

    def _evaluator(self, plan) -> ShardedEvaluator:
        """The run's sequence-parallel evaluator, bound to the run plan (one plan per run under parallelism)."""
        run, rt = self.run, self.rt
        if run.evaluator is None:
            run.evaluator = ShardedEvaluator(self.parallel, rt.model, plan, rt.ops, attention=None
                                             if rt.ops.attends_exactly else rt.attention)
        elif run.evaluator.plan is not plan:
            raise H3Error("a sequence-parallel run evaluates one plan (its schedule, one conditioning); this call "
                          "needs another (a sigma off the schedule or a second conditioning)")
        return run.evaluator

    @staticmethod
    def _check_control(cond, control) -> None:
        hint = None if cond is None else cond.control
        if (control is None) != (hint is None):
            found = "the hint" if control is None else "the tower"
            raise H3Error("a Fun ControlNet needs both the tower (control=) and the conditioning's hint "
                          f"(cond.control); got {found} only")

    # -- plans -----------------------------------------------------------------------------------
    def _plan_for(self, text, tags, shapes, cond, shifts, control=None) -> _Plan:
        run = self.run
        for p in run.plans:
            if p.matches(text, tags, shapes, cond, shifts, control):
                return p
        sched = run.schedule
        seen = model_sigma if run.round_trip else (lambda s: s.float().clamp(min=1e-6))
        sigmas = [float(seen(torch.tensor(s))) for s in sched[:-1]] if sched else []
        c = cond if cond is not None else H3Conditioning()
        if sched and run.pin_schedule:
            c = dataclasses.replace(c, sample_sigmas=torch.tensor(sched, dtype=torch.float32))
        self._fit(text, shapes, c, max(1, len(sigmas)), control)
        plan = None
        if sigmas:
            plan = self.rt.model.plan(text.float(), shapes[0], shapes[1], sigmas, token_tags=tags, shifts=shifts,
                                      cond=c)
            self._bind(plan, control, c, [float(s) for s in torch.tensor(sched[:-1], dtype=torch.float32)])
            plan.on_block = self.on_block
        p = _Plan(text.detach().clone(), None if tags is None else tags.detach().clone(), shapes, cond, shifts,
                  plan, sigmas, c, control=control, source=text, source_tags=tags)
        run.plans.append(p)
        return p

    def _bind(self, plan, control, cond, window_sigmas) -> None:
        """Bind the tower (if any) to ``plan`` with the hint ``cond.control`` (``bind_control`` with ``tower_ops``:
        the tower runs dense attention, as core's)."""
        if control is not None:
            bind_control(self.rt.model, control, cond.control, plan, window_sigmas, ops=tower_ops(self.rt))

    def _fit(self, text, shapes, cond, steps: int, control=None) -> None:
        """The device-memory budget planned again for this conditioning's size
        (``H3Runtime.fit_memory``: blocks move between the device and host memory if the decision changes; the
        host's latents may be larger than the size the load planned for). Within a run only a conditioning with
        more packed rows than any before plans again (CFG's second conditioning, or a shorter prompt, keeps the
        decision made for the larger). Raises BudgetError (nothing moved) when the budget cannot run it."""
        rows = latent_rows(shapes[0], shapes[1], text.shape[1], cond)
        if rows <= self.run.fitted_rows:
            return
        self.rt.fit_memory(shapes[0], shapes[1], text.shape[1], steps, cond, control=control,
                           sparse=self.run.lossy_settings.sparse)
        self.run.fitted_rows = rows

    def _step(self, p: _Plan, sigma: float, window_sigma: float):
        """(plan, step index) for a model sigma: the run plan's step when the schedule has it, else a one-sigma
        plan (kept for a few sigmas; a tower bound to it with ``window_sigma``)."""
        for i, s in enumerate(p.sigmas):
            if s == sigma:
                return p.plan, i
        key = (sigma, window_sigma)
        if key not in p.extra:
            if len(p.extra) >= _OFF_SCHEDULE_PLANS:
                p.extra.pop(next(iter(p.extra)))
            plan = self.rt.model.plan(p.text.float(), p.shapes[0], p.shapes[1], [sigma], token_tags=p.tags,
                                      shifts=p.shifts, cond=p.cond_full)
            self._bind(plan, p.control, p.cond_full, [window_sigma])
            if self.run.lossy is not None:
                self.run.lossy.install(plan)
            p.extra[key] = plan
        return p.extra[key], 0

    def _lossy(self, p: _Plan, plan) -> LossyRun | None:
        """The run's sparse attention / First-Block Cache context, switched to this conditioning (the run's first
        is branch 0; sparse attention keeps its carried statistics per conditioning, the cache refuses a second)."""
        run, rt = self.run, self.rt
        if run.lossy is None:
            run.lossy = LossyRun.for_run(rt, run.lossy_settings, self.parallel)
            if run.lossy is None:
                return None
            run.lossy_plan = p
            run.lossy.begin_run(plan, p.shifts[0])
            for q in [p.plan, *p.extra.values()]:
                if q is not None:
                    run.lossy.install(q)
        run.lossy.branch(0 if run.lossy_plan is p else id(p), plan)
        return run.lossy

    # -- timing ----------------------------------------------------------------------------------
    def _mark_start(self):
        if self.rt.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.run.marks.append([e, None])
        else:
            self.run.marks.append([time.perf_counter(), None])

    def _mark_stop(self):
        if self.rt.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.run.marks[-1][1] = e
        else:
            self.run.marks[-1][1] = time.perf_counter()

    # -- the report ------------------------------------------------------------------------------
    def report(self, video: torch.Tensor, audio: torch.Tensor, workload_extra: dict | None = None) -> dict:
        """The last finished run's report: per-call seconds as ``per_step_seconds``, the FC2 counters, peak
        memory, the lossy and control blocks, ``latents_finite`` from every call's output and the final
        latents (``nonfinite``: the first call whose output was not, else the last step), the sha256 of
        ``video`` / ``audio`` (the host's final latents), the workload (``workload_extra`` overrides its fields)
        and, in a sequence-parallel run, the ranks' block (a collective: every rank reports). Raises H3Error
        when no run has finished."""
        run = self.last_run
        if run is None or run.seconds is None:
            raise H3Error("no sampling run of this model has finished yet; connect the report after the sampler")
        rt = self.rt
        if rt.device.type == "cuda":
            per_call = [a.elapsed_time(b) / 1000.0 for a, b in run.marks]
        else:
            per_call = [b - a for a, b in run.marks]
        # each call's outputs (a backend's numerics), then the final latents (the host's last update)
        finite = [torch.stack(f) for f in run.finite] + [torch.stack([torch.isfinite(video).all(),
                                                                      torch.isfinite(audio).all()]).to(rt.device)]
        bad = first_nonfinite(torch.stack(finite).cpu(), 0)
        if bad is not None:
            bad["steps"] = len(run.finite)
            bad["step"] = min(bad["step"], bad["steps"])
        run.record = RunRecord(run.seconds, [{"step": k + 1, "seconds": v} for k, v in enumerate(per_call)],
                               *run.peaks, latent_sha256(video.float()), latent_sha256(audio.float()), dict(run.fc2),
                               nonfinite=bad)
        tower_fc2 = run.control_calls * run.control_blocks
        report = build_report(rt, _workload(rt, run, video, audio, workload_extra), [run.record], 0, video.float(),
                              audio.float(), fc2_required=rt.config.num_layers * run.calls + tower_fc2)
        if run.lossy is not None:
            report.update(run.lossy.report())
        if run.control_summary is not None:
            report["control"] = dict(run.control_summary, model_calls_with_control=run.control_calls)
        if run.evaluator is not None:
            report["sequence_parallel"] = self._parallel_section(run)
        return report

    def _parallel_section(self, run: _Run) -> dict:
        """The ``sequence_parallel`` block: this rank's numbers of the run, gathered from every rank."""
        ev, rec, ctx = run.evaluator, run.record, self.parallel
        steps = run.calls
        mine = rank_run([s["seconds"] for s in rec.per_step_seconds], ev.stats.per_step_seconds(steps),
                        rec.peak_allocated_bytes, rec.peak_reserved_bytes, (rec.video_sha256, rec.audio_sha256),
                        ev.amax_stats.per_step_seconds(steps), ev.amax_stats.per_step_calls(steps))
        return parallel_section(ctx, ev.shard, ev.stats, gather_ranks(ctx, [mine]), self.rt.config.num_layers,
                                numerics(self.rt.ops), ev.amax_stats)


def _workload(rt, run: _Run, video, audio, extra: dict | None) -> dict:
    """The report's workload block: shapes, the packed layout (its segment table), the run's calls, shifts and
    attention backend; ``extra`` (the caller's settings: seed, sampler, ..., or the host) overrides."""
    p = run.summary[0] if run.summary else None
    lay = None if p is None else p["layout"]
    w = {"resolution": [video.shape[-1] * 16, video.shape[-2] * 16], "frames": None,
         "latent_frames": video.shape[2], "audio_frames": audio.shape[-1],
         "packed_tokens": lay.seq_len if lay is not None else None,
         "text_tokens": p["text_tokens"] if p is not None else None,
         "cond_tokens": lay.cond_rows if lay is not None else None,
         "steps": max(len(run.schedule) - 1, 0) if run.schedule else run.calls,
         "model_calls": run.calls, "conditionings": len(run.summary),
         "off_schedule_calls": sum(len(s["off_schedule_sigmas"]) for s in run.summary),
         "shifts": list(p["shifts"]) if p is not None else None, "sampler": "host (ComfyUI core)",
         "attention": rt.backends.get("attention", {}).get("choice")}
    if lay is not None:
        w["segments"] = [[k, a, b] for a, b, k in lay.segments]
    if extra:
        w.update(extra)
    return w
