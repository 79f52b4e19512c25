"""The generate job: one request validated once, and the one :func:`run` that every caller uses.

A :class:`Job` is made by :func:`make_job` (files and sizes: the CLI's ``generate``, scripts) or by
:func:`tensor_job` (tensors in hand, with a resident model or a ``ModelSpec``: the nodes, the benches).
Validation happens there, before any weight is read: the checkpoint header is read once and every tensor
name and shape checked once (``model_spec``), then the numbers, the device, the memory estimate, the output
location and the request's own tensors. The job carries what the load needs (a ``ModelSpec``: the opened,
checked checkpoint, its config, the options, the LoRAs), so the plan and the streaming load reuse it and
nothing is opened or checked again.

``run(job)``: plan -> load -> LoRAs -> sample -> report, in this process, over N local workers
(``sequence_parallel``: each worker unpickles the job and runs :func:`run_rank`), or as this process's rank
of a torchrun launch. Refusals are H3Errors saying what was expected, what was found and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from .budget import MemoryAsk, TowerSize, Workload
from .interface import Runtime
from .io.atomic import refuse_replacing_inputs
from .io.control import ControlFile, load_control, open_control
from .io.header import read_header, read_tensors
from .io.payload import check_control_args, conditioning_from_payload, load_payload, read_inputs
from .lora.apply import sync_loras
from .model.conditioning import H3Conditioning
from .model.config import H3Config
from .model.layout import FRAME_PER_TOKEN, latent_shapes
from .model_spec import ModelSpec, lora_specs, open_source, runtime_options, source_files, verify_source
from .options import LossySettings, Measure, RuntimeOptions, SamplingSettings
from .parallel import ParallelEnv, check_degree, init_group, launch
from .plan import requested_device, resolve_device, resolve_dtype
from .sampling import sampler as sampling
from .sampling.preview import check_preview_available
from .sampling.report import measured_report
from .sampling.sampler import Hooks, SampleInputs
from .sampling.request import (SEED_RANGE, Request, RequestError, check_denoise, check_int, check_latents,
                               check_noise_index, check_output_dir, check_seed, check_steps, check_text_states,
                               defaults_for, resolve_request)

RANDOM_TEXT_SEED = 1234  # the random text states of a request without any (make_job)
# the files `h3-blackwell generate` writes into a job's output folder (cli/commands.py), and with a preview
OUTPUT_FILES, PREVIEW_FILE = ("latents.safetensors", "report.json"), "preview.webp"
StepCallback = Callable[[int, int], None]


@runtime_checkable
class BlockProgress(Protocol):
    """A step callback that also shows progress within a step: ``block(step, blocks done, blocks)``."""

    def __call__(self, done: int, total: int) -> None: ...

    def block(self, step: int, done: int, total: int) -> None: ...


@dataclass(frozen=True)
class JobFiles:
    """What a generate request reads (``make_job``): ``inputs``, a safetensors with video / audio (the latent to
    sample from: its shape is the canvas), text_states [, token_tags] and the tensors ``payload`` (core's
    conditioning JSON) names; without it ``text_states`` (a file) or random states of ``text_tokens``.
    control: a Fun ControlNet file (core's model patch) applied with the payload's ``control`` field; loras:
    the LoRA stack (``runtime.lora_specs``' forms)."""

    text_states: str | None = None
    text_tokens: int = 32
    inputs: str | None = None
    payload: str | None = None
    control: str | None = None
    loras: tuple = ()


@dataclass(frozen=True)
class Canvas:
    """The clip's size in pixels and frames (None: the model's default); snap: round to the nearest valid size."""

    width: int | None = None
    height: int | None = None
    frames: int | None = None
    snap: bool = False


@dataclass(frozen=True)
class Launch:
    """Where and how a job runs: ``sequence_parallel`` N local workers (None or 1: this process); ``output`` a
    folder that must be writable (``job.output``: where the caller writes); ``write_preview``: Pillow must be
    there; ``progress`` makes the step callback ``(done, total)`` (picklable for a sequence-parallel run);
    ``print_plan``: write the loaded model's plan to stderr; ``env``: the process environment for torchrun's
    variables (default ``os.environ``)."""

    sequence_parallel: int | None = None
    output: str | None = None
    write_preview: bool = False
    progress: Callable[[], StepCallback] | None = None
    print_plan: bool = False
    env: Mapping[str, str] | None = None


@dataclass
class Job:
    """One validated generate request (make it with :func:`make_job` or :func:`tensor_job`).

    model: a ModelSpec (loaded by ``run``) or a resident runtime (an H3Runtime or a LoRA view of one; made to
    carry exactly its LoRA stack before sampling). inputs: ``runtime.sample``'s (text [1, L, text_dim] fp32,
    tags [L] or None, the conditioning); its video / audio the latent to sample from, or None: zeros of
    ``canvas`` (width, height, pixel frames). sampling / lossy: the run's settings; measure: warm-up and
    measured runs (``run`` samples that often and reports the measured runs). control: a Fun ControlNet applied
    with ``conditioning.control``: its opened, checked file (loaded onto the model's plan by ``run``) or a
    loaded tower. hooks: ``runtime.sample``'s preview / interrupt (in-process runs only); progress: makes the
    step callback ``(done, total)``, called on the main rank once the model is loaded (so a bar's clock starts
    with the sampling; picklable for a sequence-parallel run). sequence_parallel: N local workers (None or 1:
    this process); torchrun: this process's place in a torchrun launch, or None. print_plan: write the loaded
    model's plan to stderr. output: the checked output folder (symbolic links resolved) where the caller
    writes, or None.
    """

    model: ModelSpec | Any
    inputs: SampleInputs
    canvas: tuple[int, int, int]
    sampling: SamplingSettings
    lossy: LossySettings = LossySettings()
    measure: Measure = Measure()
    control: Any = None
    hooks: Hooks = field(default_factory=Hooks)
    progress: Callable[[], StepCallback] | None = None
    workload_extra: dict = field(default_factory=dict)
    sequence_parallel: int | None = None
    torchrun: ParallelEnv | None = None
    print_plan: bool = False
    output: Path | None = None

    @property
    def config(self) -> H3Config:
        return self.model.config

    @property
    def device_type(self) -> str:
        return self.model.device.type

    def latents(self, cfg: H3Config) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, audio) to sample from: the job's, or zeros of its canvas."""
        if self.inputs.video is not None:
            return self.inputs.video, self.inputs.audio
        vshape, ashape = latent_shapes(*self.canvas, cfg.video_channels, cfg.audio_channels)
        return torch.zeros(vshape), torch.zeros(ashape)


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
    t = read_tensors(path, "text states file", ("text_states", "token_tags"))[1]  # the checked header reader
    ts, tags = t["text_states"], t.get("token_tags")
    check_text_states(ts, tags, cfg, path)
    tags = None if tags is None else tags.long()
    ts = ts.float()
    return (ts[None] if ts.dim() == 2 else ts), tags


def _inputs_file(path: str, payload: str | None, seed: int, cfg: H3Config, clash: dict) -> dict:
    """``inputs`` (+ ``payload``): text, tags, video, audio, conditioning and canvas. The latents give the canvas;
    a payload without ``seed`` takes ``seed`` (core's payload seed is the sampler's)."""
    given = [f for f, v in clash.items() if v is not None]
    if given:
        raise RequestError(f"{given[0]} with --inputs: the inputs file gives the text states and the latents (their "
                           f"shape is the canvas); drop {given[0]}")
    t = read_inputs(path, ["video", "audio", "text_states"],
                    "video [1,C,T,H,W], audio [1,Ca,2,Ta] (the LATENT to sample from), text_states [1,L,text_dim] "
                    "(optional token_tags [L]; with --payload also every tensor the payload names)")
    check_text_states(t["text_states"], t.get("token_tags"), cfg, path)
    check_latents(t["video"], t["audio"], cfg, path)
    video, audio, text = t["video"].float(), t["audio"].float(), t["text_states"].float()
    cond = load_payload(payload, t, default_seed=seed)
    cond.check_target(video.shape, audio.shape, cfg.video_channels, cfg.audio_channels)
    frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(video.shape[2]))
    return {"text": text[None] if text.dim() == 2 else text, "tags": t.get("token_tags"), "video": video,
            "audio": audio, "conditioning": cond, "canvas": (video.shape[4] * 16, video.shape[3] * 16, frames)}


def _check_numbers(sampling: SamplingSettings, measure: Measure) -> None:
    check_seed(sampling.seed)
    check_int("runs", measure.runs, 1)
    check_int("warmup", measure.warmup, 0)
    check_denoise(sampling.denoise)


def _spec_type(options) -> str:
    """The device type the options ask for (auto: cuda when there is one), before the device is checked."""
    spec = requested_device(options) if isinstance(options, RuntimeOptions) else dict(options or {}).get("device")
    if spec in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if str(spec).startswith("cuda") else "cpu"


def _parallel(n: int | None, env: Mapping[str, str] | None, spec: ModelSpec) -> tuple[int, ParallelEnv | None]:
    """(ranks, torchrun's environment or None): the degree agrees with torchrun's world size, divides the heads,
    has its devices; rank r of a local multi-GPU run uses cuda:r."""
    penv = ParallelEnv.from_env(os.environ if env is None else env)
    world = penv.world_size if penv is not None else (1 if n is None else n)
    if penv is not None and n not in (None, world):
        raise RequestError(f"--sequence-parallel {n} but torchrun started WORLD_SIZE={world} ranks; "
                           "drop the flag under torchrun or make them match")
    check_degree(world, spec.config.num_heads, spec.device.type)
    if world > 1 and spec.device.index is not None:  # cuda:N named: each rank needs its own device
        raise RequestError(f"--device {spec.device} with --sequence-parallel {world}: rank r uses cuda:r; "
                           "pass --device cuda and pick the GPUs with CUDA_VISIBLE_DEVICES")
    return world, penv


def _sized_request(model: ModelSpec, text_states, text_tokens, size: tuple, steps, snap) -> Request:
    """The request's sizes from the flags (the model's defaults where not given), checked against the memory."""
    tokens = text_tokens if text_states is None else _text_states_tokens(text_states, model.config)
    cfg = model.config
    req = resolve_request(cfg, *size, steps, tokens, snap)
    shapes = latent_shapes(req.width, req.height, req.frames, cfg.video_channels, cfg.audio_channels)
    model.check_memory(Workload.from_shapes(*shapes, req.text_tokens, req.steps),
                       MemoryAsk(f"{req.width}x{req.height}, {req.frames} frames, {req.text_tokens} text tokens",
                                 "--width/--height/--frames/--text-tokens"))
    return req


def _latents_request(model: ModelSpec, given: dict, steps, path: str) -> Request:
    """The request of an inputs file: its latents are the canvas; checked against the memory."""
    cfg = model.config
    req = Request(*given["canvas"], defaults_for(cfg)["steps"] if steps is None else check_steps(steps),
                  given["text"].shape[1])
    cond = given["conditioning"]
    model.check_memory(Workload.from_shapes(given["video"].shape, given["audio"].shape, req.text_tokens, req.steps,
                                            cond),
                       MemoryAsk(f"the latents of {path}" + ("" if cond is None or cond.is_empty else
                                                             " and the payload's rows"),
                                 "the latents, the text length, or the payload's keyframes and references"))
    return req


def _file_request(spec: ModelSpec, files: JobFiles, canvas: Canvas, sampling: SamplingSettings
                  ) -> tuple[dict | None, Request]:
    """(the inputs file's tensors or None, the request's sizes), checked against the memory; the payload and
    the control file need an inputs file."""
    if files.inputs is None and files.payload is not None:
        raise RequestError("--payload needs --inputs: the safetensors with video, audio, text_states and the "
                           "tensors the payload names")
    if files.inputs is None:
        size = (canvas.width, canvas.height, canvas.frames)
        req = _sized_request(spec, files.text_states, files.text_tokens, size, sampling.steps, canvas.snap)
        given = None
    else:
        given = _inputs_file(files.inputs, files.payload, sampling.seed, spec.config, {
            "--text-states": files.text_states, "--width": canvas.width, "--height": canvas.height,
            "--frames": canvas.frames})
        req = _latents_request(spec, given, sampling.steps, files.inputs)
    if files.control is not None and files.inputs is None:
        raise RequestError(f"--control {files.control} needs --inputs and --payload: the payload's control field "
                           "holds the hint, strength, sigma window and fades")
    if given is not None:
        check_control_args(files.control, given["conditioning"])
    return given, req


def _text_request(files: JobFiles, req: Request, cfg: H3Config) -> dict:
    """A request without an inputs file: its text states (the file's or random ones), zeros of its canvas."""
    text, tags = (_load_text_states(files.text_states, cfg) if files.text_states else
                  (torch.randn(1, req.text_tokens, cfg.text_dim,
                               generator=torch.Generator().manual_seed(RANDOM_TEXT_SEED)), None))
    return {"text": text, "tags": tags, "video": None, "audio": None, "conditioning": None,
            "canvas": (req.width, req.height, req.frames)}


def make_job(model=None, *, sampling: SamplingSettings, files: JobFiles = JobFiles(), canvas: Canvas = Canvas(),
             options: RuntimeOptions | Mapping[str, Any] | None = None, measure: Measure = Measure(),
             launch: Launch = Launch(), tiny_seed: int = 0) -> Job:
    """Validate a generate request given as files and sizes (the CLI's flags) -> the Job; no weight is read.

    model: a checkpoint path (or an opened Checkpoint / in-memory source), None for the embedded tiny model.
    sampling: seed, steps (None: the model's default), sampler, scheduler, denoise; files: what to read
    (``JobFiles``); canvas: the sizes (``Canvas``; not given: the model's defaults); measure: warm-up and
    measured runs; launch: workers, output folder, preview, progress (``Launch``). Checks run cheap first,
    each refusal an H3Error (RequestError, CheckpointError, ParallelError, ...)."""
    source, cfg, weight_bytes = open_source(model)
    check_int("tiny_seed", tiny_seed, *SEED_RANGE)
    _check_numbers(sampling, measure)
    if launch.sequence_parallel is not None:  # the degree first: its message names the devices it needs
        check_degree(launch.sequence_parallel, cfg.num_heads, _spec_type(options))
    opts = runtime_options(options)
    device = resolve_device(opts)
    spec = ModelSpec(source, cfg, opts, device, resolve_dtype(opts, device), tiny_seed, (), weight_bytes)
    given, req = _file_request(spec, files, canvas, sampling)
    out = None if launch.output is None else check_output_dir(launch.output)
    verify_source(source)  # every tensor and shape (builds the model's key table: after the cheap checks)
    tower = None if files.control is None else open_control(files.control).check_base(cfg)  # its fit, from headers
    if launch.write_preview:
        check_preview_available()
    spec.loras = lora_specs(files.loras)
    if out is not None:
        refuse_replacing_inputs([out / n for n in OUTPUT_FILES + ((PREVIEW_FILE,) if launch.write_preview else ())],
                                {"--model": source_files(source), "--inputs": [files.inputs],
                                 "--text-states": [files.text_states], "--payload": [files.payload],
                                 "--control": [files.control], "--lora": [s.path for s in spec.loras]})
    given = given if given is not None else _text_request(files, req, cfg)
    n, penv = _parallel(launch.sequence_parallel, launch.env, spec)
    extra = {"frames": req.frames,
             "text_source": files.inputs or files.text_states or f"random (seed {RANDOM_TEXT_SEED})"}
    inputs = SampleInputs(given["text"], given["tags"], given["video"], given["audio"], given["conditioning"])
    return Job(spec, inputs, given["canvas"], dataclasses.replace(sampling, steps=req.steps), measure=measure,
               control=tower, progress=launch.progress, workload_extra=extra, sequence_parallel=n, torchrun=penv,
               print_plan=launch.print_plan, output=out)


def _check_model(model) -> None:
    """A ModelSpec or a resident runtime (an H3Runtime or a LoraView of one: ``runtime.interface.Runtime``)."""
    if not isinstance(model, (ModelSpec, Runtime)):
        raise RequestError(f"model: expected a ModelSpec (runtime.open_model) or a loaded H3 runtime; got "
                           f"{type(model).__name__}")


def tensor_job(model, inputs: SampleInputs, sampling: SamplingSettings,
               sources: tuple[str, str] = ("text states", "latents"), **job) -> Job:
    """Validate a request given as tensors -> the Job. inputs: text [1, L, text_dim] (or [L, text_dim]) finite,
    tags None or [L] of 0/1, video [1, C, T, H, W] / audio [1, Ca, 2, Ta] finite with the model's channels, the
    conditioning (an H3Conditioning or core's payload dict with tensors as values) checked against the latents;
    sampling: the seed, steps (given) and batch index are checked, then the memory estimate on the model's
    device. ``model``: a ModelSpec or a resident runtime. ``sources`` name the text and the latents in
    messages; ``job``: the other Job fields (lossy, measure, control, hooks, progress, workload_extra,
    sequence_parallel, print_plan)."""
    cfg = model.config
    _check_model(model)
    text, tags, video, audio = inputs.text, inputs.tags, inputs.video, inputs.audio
    check_text_states(text, tags, cfg, sources[0])
    check_latents(video, audio, cfg, sources[1])
    _check_numbers(sampling, job.get("measure", Measure()))
    if sampling.steps is None:
        raise RequestError("steps: expected a step count (an int >= 1); found None")
    check_steps(int(sampling.steps))
    check_noise_index(sampling.batch_index)
    conditioning = inputs.conditioning
    if isinstance(conditioning, Mapping):
        conditioning = conditioning_from_payload(conditioning)
    if conditioning is not None:
        conditioning.check_target(video.shape, audio.shape, cfg.video_channels, cfg.audio_channels)
    wl = Workload.from_shapes(tuple(video.shape), tuple(audio.shape), text.shape[-2], int(sampling.steps), conditioning)
    model.check_memory(wl, MemoryAsk(  # condition rows counted too
        f"a {video.shape[4] * 16}x{video.shape[3] * 16} latent of {video.shape[2]} latent frames"
        + (" and its conditioning" if conditioning is not None and not conditioning.is_empty else "")))
    n = job.pop("sequence_parallel", None)
    if n not in (None, 1):
        if not isinstance(model, ModelSpec):
            raise RequestError(f"sequence_parallel={n} with a resident model: each rank loads its own copy; pass a "
                               "ModelSpec (runtime.open_model)")
        n = _parallel(n, {}, model)[0]
    frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(video.shape[2]))
    text = text.float()
    inputs = dataclasses.replace(inputs, text=text[None] if text.dim() == 2 else text, conditioning=conditioning)
    settings = dataclasses.replace(sampling, seed=int(sampling.seed), steps=int(sampling.steps))
    return Job(model, inputs, (video.shape[4] * 16, video.shape[3] * 16, frames), settings, sequence_parallel=n,
               **job)


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

def _load(ctx, job: Job, video: torch.Tensor, audio: torch.Tensor):
    """The job's runtime: its ModelSpec loaded (onto ctx.device for a rank), its memory budget planned for this
    run's size (``video`` / ``audio``); or the resident model made to carry exactly this job's LoRA stack."""
    if isinstance(job.model, ModelSpec):
        return job.model.load(device=None if ctx is None else str(ctx.device), workload=Workload.from_shapes(
            video.shape, audio.shape, job.inputs.text.shape[-2], job.sampling.steps, job.inputs.conditioning,
            TowerSize.of(job.control)))
    sync_loras(job.model)  # a shared resident model carries exactly this job's LoRA stack (none for a plain runtime)
    return job.model


def run_rank(ctx, job: Job):
    """Load (or take the resident model) and sample ``job.measure``'s warm-up and measured runs: the whole run
    (``ctx`` None) or one rank of a sequence-parallel run (``ctx``: its ParallelContext; the rank loads onto
    ctx.device). -> SampleResult of the last run, its report over the measured runs; every rank returns the
    same latents."""
    main = ctx is None or ctx.is_main
    video, audio = job.latents(job.config)
    rt = _load(ctx, job, video, audio)
    if main and job.print_plan:
        print(rt.describe(), file=sys.stderr)
    tower = load_control(job.control, rt.plan, rt.config) if isinstance(job.control, ControlFile) else job.control
    prog = job.progress() if main and job.progress is not None else None
    hooks = dataclasses.replace(job.hooks, progress=prog,
                                block=prog.block if isinstance(prog, BlockProgress) else job.hooks.block)
    inputs = dataclasses.replace(job.inputs, video=video, audio=audio)
    results = []
    for _ in range(job.measure.warmup + job.measure.runs):
        results.append(sampling.sample(rt, inputs, job.sampling, lossy=job.lossy, control=tower, hooks=hooks,
                                       parallel=ctx, workload_extra=job.workload_extra or None))
        if len(results) > job.measure.runs:  # warm-ups: only the last runs are reported
            results.pop(0)
    last = results[-1]
    return dataclasses.replace(last, report=measured_report(rt, results, job.measure.warmup))


def run(job: Job):
    """Run a validated job: plan -> load -> LoRAs -> sample -> report. -> SampleResult (video, audio, report),
    or None on a torchrun rank other than 0 (rank 0 has the result). ``job.sequence_parallel`` > 1 starts that
    many local workers (one per GPU, or CPU processes); under torchrun this process is one rank."""
    if job.torchrun is not None:
        ctx = init_group(job.torchrun, job.device_type)
        try:
            res = run_rank(ctx, job)
            ctx.barrier()
        finally:
            ctx.destroy()
        if not ctx.is_main:
            return None
        res.report["sequence_parallel"]["launch"] = "torchrun"
        return res
    n = job.sequence_parallel or 1
    if n == 1:
        return run_rank(None, job)
    res = launch(run_rank, (job,), world_size=n, device_type=job.device_type)
    res.report["sequence_parallel"]["launch"] = f"{n} local workers (h3-blackwell --sequence-parallel)"
    return res
