#!/usr/bin/env python3
"""The jobs users run against ComfyUI core's own stack on the same card (issue 37) -> bench/results/user-jobs.json.

    python3 bench/user_jobs.py [--jobs turbo8,clip10s,turbo8_sparse] [--caps resident,16,8] [--rows turbo8:8,...]
                               [--stacks ours,core] [--merge] [--out FILE] [--workdir DIR] [--lora-rank R]
                               [--file-dir auto|DIR] [--comfyui .core_peer] [--core-python PY] [--runs N]
                               [--blocks N --steps N] [--tiny]

Rows are (job, cap); each stack of each row runs in a child process of its own, so a hard cap
(``torch.cuda.set_per_process_memory_fraction`` with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) and the
peak host RSS (the kernel's high-water mark of that process) belong to that run alone. The JSON is rewritten after
every child; ``--merge`` keeps the rows of an existing file that this call does not run (several short device calls
build one file). Jobs: bench/jobs.py.

Both stacks load the same random weights (bench/_h3bench.RandomSource, seed 0) from a checkpoint file, each in its
own format, as their users do: in /dev/shm where the host memory holds both (``file_dirs``: each stack then reads
from memory, neither from a page cache that may have dropped its file), else in --workdir. One full-size file of
each does not fit the device's 64 GB disk beside the other (ours ~39 GB, core's ~47 GB), so there the call runs
stack by stack: the stack whose file is present first, then the other, whose file replaces it (``make_room``).
Before a stack's rows, a warm-up child runs the first job on a one-block model of the same widths: the
once-per-machine work (our FC2 extension build, Triton's compiles) stays out of the rows, as it does from a user's
later jobs; its time is recorded.

ours: an NVFP4 checkpoint (``quantize``'s streaming writer) and a turbo-style LoRA of --lora-rank; each run loads
the file as a user does (``open_model`` -> plan -> streaming load), applies the LoRA in our default mode, samples the
job (first and last keyframes as core's payload gives them) with the budget ``cap - 0.5 GB`` (auto when resident)
and, under a cap, the host budget of a 32 GB machine less 4 GB for the process (the full-form AdaLN weights then stay
in the checkpoint file: runtime.io.adaln_file), and records the step and job seconds (the job: the load, the LoRA and
one whole run, its plan included, the clock stopped at its end; with --runs N the same job runs N - 1 more times
after that, each a run of its own, for the hash check; --profile-step's step comes after all of them and core's
after its timed steps, outside both jobs), peaks over every run, host RSS, latent hashes.

core: ComfyUI core's modules in one process, as a workflow drives them: its fp8 checkpoint (comfy_quant
float8_e4m3fn block linears with per-tensor scales, core's fastest weight format on sm_90) loaded by UNETLoader's
``comfy.sd.load_diffusion_model`` (model detection, dtypes, CoreModelPatcher, DynamicVRAM switched on as main.py
does where core uses it), the LoRA by LoraLoaderModelOnly's ``comfy.sd.load_lora_for_models``, ``load_models_gpu``
under ``--reserve-vram``, Sage attention; the modules come from the folder scripts/pack_core_peer.sh packs. A real
ComfyUI server needs its requirements carried as wheels (over the carry limit beside the SageAttention2 build and
core's comfy-kitchen), hence the in-process form. A job core cannot run is recorded with its error.

--tiny: the embedded tiny config on the CPU, the whole flow end to end (our stack; core's where its modules import).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, RandomSource, bench_command, err_text, versions, write_json  # noqa: E402
import jobs as J  # noqa: E402

from h3_blackwell.runtime import (RuntimeOptions, SampleInputs, SamplingSettings, open_model,  # noqa: E402
                                  run, tensor_job)
from h3_blackwell.runtime.budget import Workload  # noqa: E402
from h3_blackwell.runtime.io.header import TORCH_TO_ST  # noqa: E402
from h3_blackwell.runtime.model.conditioning import H3Conditioning, Keyframe  # noqa: E402
from h3_blackwell.runtime.model.config import FULL, TINY  # noqa: E402
from h3_blackwell.runtime.model.layout import latent_shapes  # noqa: E402
from h3_blackwell.runtime.sampling.report import device_info, host_peak_rss_bytes  # noqa: E402

MARGIN_GB = 0.5  # our budget under a cap: the cap less this (the allocator's fragmentation, CUDA's small tensors)
HOST_GB = 32  # a capped row stands for a consumer card in a machine with this much host memory
HOST_MARGIN_GB = 4  # of which the process itself (torch, CUDA's context, the run's host tensors) keeps about this


def parse_rows(a) -> list[tuple[str, int | None]]:
    """--rows job:cap[:runs],... or the product of --jobs and --caps -> [(job, cap_gb or None)] (``row_runs``
    reads the optional runs)."""
    def cap(text):
        return None if text in ("resident", "none", "") else int(text)

    if a.rows:
        out = [(r.split(":")[0], cap(r.split(":")[1] if ":" in r else "resident")) for r in a.rows.split(",")]
    else:
        out = [(j, cap(c)) for j in a.jobs.split(",") for c in a.caps.split(",")]
    bad = [j for j, _ in out if j not in J.JOBS]
    if bad:
        raise SystemExit(f"error: unknown job(s) {bad}: expected {', '.join(J.JOBS)}")
    return out


def row_runs(a) -> dict:
    """{(job, cap_gb): our measured runs} from --rows ``job:cap:runs`` entries; a row without its own runs takes
    --runs."""
    wanted, out = parse_rows(a), {}
    texts = a.rows.split(",") if a.rows else [""] * len(wanted)
    for key, text in zip(wanted, texts):
        parts = text.split(":")
        out[key] = int(parts[2]) if len(parts) > 2 and parts[2] else a.runs
        if out[key] < 1:
            raise SystemExit(f"error: --rows {text!r}: runs must be 1 or more, found {out[key]}")
    return out


def lease_id() -> str:
    """This machine's boot: the kernel's boot id where it has one, else the host name. Two stacks' results with the
    same id ran on one machine without a restart between them (one lease of a device machine), so a row's speedup
    compares like with like (``finish_row``)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket
        return socket.gethostname()


def job_of(name: str, a) -> J.Job:
    job = J.JOBS[name](a.lora_rank) if name != "canonical" else J.JOBS[name]()
    job = J.tiny(job) if a.tiny else job
    return replace(job, steps=a.steps) if a.steps else job


def config_of(a):
    """The model: the tiny config (--tiny), else H3's full shapes with --blocks blocks (a device smoke run)."""
    if a.tiny:
        return TINY
    return FULL.replace(num_layers=a.blocks) if a.blocks else FULL


# ---------------------------------------------------------------------------------------------
# files: the checkpoint and the LoRA, written once per workdir
# ---------------------------------------------------------------------------------------------

CHECKPOINT = {"ours": "checkpoint", "core": "core_checkpoint"}  # each stack's checkpoint in the files dict
LORA_FORM = "diffusion_model"  # ``diffusion_model.<name>.lora_A/B``: the form core's generic LoRA key map matches


def file_names(work: Path, cfg, rank: int, dirs: dict | None = None) -> dict:
    """Where each stack's checkpoint and the LoRA of ``cfg`` live: the work folder, or ``dirs[stack]`` where given
    (``file_dirs``)."""
    n, dirs = cfg.num_layers, dirs or {}
    return {"checkpoint": str(dirs.get("ours", work) / f"h3_random_{n}blocks_nvfp4.safetensors"),
            "core_checkpoint": str(dirs.get("core", work) / f"h3_random_{n}blocks_core_fp8.safetensors"),
            "lora": str(work / f"turbo_rank{rank}_{n}blocks_{LORA_FORM}.safetensors")}


SHM = Path("/dev/shm") / "h3_user_jobs"
ROW_HOST_GB = 24  # host memory a row's child needs beside the files in /dev/shm (ours at a cap: ~14 GB measured)


def file_dirs(choice: str, work: Path, cfg) -> tuple[dict, dict]:
    """Where each stack's checkpoint goes (--file-dir): ``auto`` = /dev/shm (host memory, tmpfs) for each stack in
    turn (ours, then core) where it is there already, or where /dev/shm has room for it and 4 GB more and the host
    memory left after the files placed there keeps ``ROW_HOST_GB`` beside it; else the work folder (the device's
    64 GB disk holds one full-size checkpoint of each stack, not both: a call then replaces one with the other,
    ``make_room``). Both stacks then read their weights from memory, neither from a page cache that could have
    dropped them. -> ({stack: folder}, {stack: why})."""
    import shutil

    if choice != "auto":
        return {"ours": Path(choice), "core": Path(choice)}, {"ours": "--file-dir", "core": "--file-dir"}
    if cfg.num_layers < 10:  # the tiny model or a smoke run: nothing to gain, and tests keep to their folder
        why = "the work folder (a small model)"
        return {"ours": work, "core": work}, {"ours": why, "core": why}
    from h3_blackwell.runtime.io.convert import planned_bytes
    from h3_blackwell.runtime.sampling.request import host_available_bytes

    try:
        free = shutil.disk_usage(SHM.parent).free
    except OSError:
        return {"ours": work, "core": work}, {"ours": "no /dev/shm", "core": "no /dev/shm"}
    avail, dirs, why = host_available_bytes(), {}, {}
    for stack in ("ours", "core"):
        need = planned_bytes(checkpoint_plan(stack, cfg))
        there = Path(file_names(work, cfg, 0, {stack: SHM})[CHECKPOINT[stack]]).is_file()
        if there or (free >= need + 4e9 and avail >= need + ROW_HOST_GB * 1e9):
            dirs[stack] = SHM
            why[stack] = (f"/dev/shm (tmpfs): {free / 1e9:.0f} GB free, {avail / 1e9:.0f} GB of host memory "
                          f"available for a {need / 1e9:.1f} GB file" + (" (there already)" if there else ""))
            if not there:
                free, avail = free - need, avail - need
        else:
            dirs[stack] = work
            why[stack] = (f"the work folder: /dev/shm has {free / 1e9:.0f} GB free and the host "
                          f"{avail / 1e9:.0f} GB available, short of a {need / 1e9:.1f} GB file with "
                          f"{ROW_HOST_GB} GB beside it")
    return dirs, why


def checkpoint_plan(stack: str, cfg) -> list:
    """The entries (name, dtype, shape) of ``stack``'s checkpoint of ``cfg`` (its size before it is written)."""
    import _core_model as C
    from h3_blackwell.runtime.io.convert import plan_output

    src = RandomSource(cfg, 0, torch.bfloat16)
    return C.fp8_file_plan(src) if stack == "core" else plan_output(_shapes(src))


def _shapes(src) -> dict:
    """{name: (shape, safetensors dtype)} of a RandomSource, in its order: what the NVFP4 writer plans from."""
    return {k: (src.shape(k), TORCH_TO_ST[src.dtype(k)]) for k in src.keys()}


def write_checkpoint(path: Path, cfg, device: str) -> Path:
    """Our file: random H3 weights of ``cfg`` (bench/_h3bench.RandomSource, seed 0) streamed into an NVFP4
    checkpoint at ``path`` (``quantize``'s streaming writer)."""
    from h3_blackwell.runtime.io.convert import quantize_state_dict_streaming

    if path.is_file():
        return path
    src = RandomSource(cfg, 0, torch.bfloat16)
    stream = ((k, src.tensor(k, device).to("cpu")) for k in src.keys())
    path.parent.mkdir(parents=True, exist_ok=True)
    quantize_state_dict_streaming(stream, path, device, shapes=_shapes(src), metadata={})
    return path


def write_core_checkpoint(path: Path, cfg, device: str) -> Path:
    """Core's file: the same random weights (RandomSource, seed 0) as a comfy_quant fp8 checkpoint, the format of
    core's fp8 releases (block linears float8_e4m3fn with a per-tensor scale, the rest bf16/fp32 as made;
    bench/_core_model.fp8_file_plan), streamed one tensor at a time. Its metadata ``config`` holds core's
    constructor arguments for ``cfg`` (``config_metadata``), which core's model detection reads, so the tiny and
    the reduced-block configs load as themselves."""
    import _core_model as C
    from h3_blackwell.runtime.io.convert import write_planned
    from h3_blackwell.runtime.model.config import config_metadata

    if path.is_file():
        return path
    src = RandomSource(cfg, 0, torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_planned(path, C.fp8_file_plan(src), C.fp8_file_items(src, device), {"config": config_metadata(cfg)})
    return path


def write_lora(path: Path, cfg, rank: int) -> Path:
    """A turbo-style LoRA of ``rank`` on every block linear and AdaLN (tests/fixtures/tiny_lora: fused qkv as the
    turbo files ship it), in ``LORA_FORM``."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth

    if not path.is_file():
        save_tiny_lora(path, tiny_lora_truth(cfg, seed=7, rank=rank, alpha=float(rank), refiner=False,
                                             extras=False), LORA_FORM)
    return path


def make_room(path: Path, need: int, others: list[Path]) -> list[str]:
    """Remove those of ``others`` (the other stack's checkpoint) on the same filesystem as ``path`` where it lacks
    ``need`` bytes plus 2 GB: the device's 64 GB disk holds one full-size checkpoint of each stack, not both.
    -> what was removed."""
    import shutil

    gone = []
    for o in others:
        if shutil.disk_usage(path.parent).free >= need + 2e9:
            break
        if o.is_file() and o.stat().st_dev == path.parent.stat().st_dev:
            o.unlink()
            gone.append(str(o))
    return gone


# ---------------------------------------------------------------------------------------------
# one stack, one row (in a child process)
# ---------------------------------------------------------------------------------------------

def apply_cap(cap_gb: int | None, device: torch.device) -> None:
    if cap_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 1e9 / total),
                                                  torch.cuda.current_device() if device.index is None else device.index)


def inputs_for(job: J.Job, cfg) -> SampleInputs:
    """Random text states, zero latents, and for fl2va the first and last frames as keyframes (random latents of
    one latent frame each, core's ``minimax_keyframes``)."""
    g = torch.Generator().manual_seed(job.seed)
    vs, as_ = latent_shapes(job.width, job.height, job.frames, cfg.video_channels, cfg.audio_channels)
    text = torch.randn(1, job.text_tokens, cfg.text_dim, generator=g)
    kfs = tuple(Keyframe(f if f >= 0 else job.frames + f, latent=torch.randn(1, vs[1], 1, vs[3], vs[4], generator=g))
                for f in job.keyframes)
    cond = H3Conditioning(keyframes=kfs, seed=job.seed) if kfs else None
    return SampleInputs(text, None, torch.zeros(vs), torch.zeros(as_), cond)


def tiny_budget(rt, job: J.Job, inputs: SampleInputs, cap_gb: int) -> int:
    """The tiny model's stand-in for a cap: the smallest budget its plan accepts for the job (8 GB: every block
    streamed, activations chunked) or 1.5x that (16 GB)."""
    from h3_blackwell.runtime.budget import ModelMemory, smallest_budget

    wl = Workload.from_shapes(inputs.video.shape, inputs.audio.shape, job.text_tokens, job.steps, inputs.conditioning)
    least = smallest_budget(ModelMemory.from_plan(rt.plan, placed=False), wl, "cpu")
    return int(least * (1.0 if cap_gb <= 8 else 1.5)) + 1


class LoadProfile:
    """cProfile over a stack's load (its file, the LoRA, the placement; never the sampling) -> the functions that
    took the most time themselves, for the row's ``load_profile``. It sees the CPU side: asynchronous GPU work
    lands on the call that waits for it."""

    def __init__(self):
        self.prof = cProfile.Profile()

    def __enter__(self):
        self.prof.enable()
        return self

    def __exit__(self, *exc):
        self.prof.disable()

    def top(self, n: int = 20, callers: int = 3) -> list[dict]:
        """The ``n`` functions with the most self time, each with its ``callers`` callers that spent the most time
        in it (where the builtin was called from: an import's compile, a check's host sync)."""
        # {(file, line, function): (primitive calls, calls, self seconds, cumulative seconds, callers)}
        stats = pstats.Stats(self.prof).stats

        def name(f, line, fn):  # folder/file:line(function); a builtin's "~:0(...)"
            folder = Path(f).parent.name
            return f"{folder + '/' if folder else ''}{Path(f).name}:{line}({fn})"

        most = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
        # a caller's entry: (primitive calls, calls, self seconds, cumulative seconds) spent in the callee from there
        return [{"function": name(*key), "calls": nc, "self_seconds": round(tt, 4), "cumulative_seconds": round(ct, 4),
                 "callers": [{"caller": name(*k), "seconds": round(v[3], 4)} for k, v in
                             sorted(by.items(), key=lambda kv: kv[1][3], reverse=True)[:callers]]}
                for key, (_, nc, tt, ct, by) in most]


def modules_imported(before: set) -> dict:
    """The modules imported since ``before`` (a set of sys.modules' names): how many, and the most by top package."""
    new = [m for m in sys.modules if m not in before]
    packages = collections.Counter(m.split(".")[0] for m in new)
    return {"count": len(new), "by_package": dict(packages.most_common(8))}


def step_profile(fn, device: torch.device, n: int = 15) -> dict:
    """``fn()`` (one denoising step of a stack, after its timed runs) under torch.profiler -> where its time went:
    the ``n`` operators with the most device self time (CUDA; CPU self time on the CPU), each with its calls, and
    the totals. Kernel names are the stack's own, so the two stacks' lists are read side by side, not summed."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return {"wall_seconds": round(wall, 3), "clock": "device" if cuda else "cpu",
            "self_seconds_total": round(total / 1e6, 3),
            "top": [{"op": e.key[:120], "calls": e.count, "self_seconds": round(getattr(e, key) / 1e6, 4),
                     "share": round(getattr(e, key) / total, 4) if total else None} for e in top]}


def import_ours() -> list[str]:
    """Every module of our runtime imported before the clock starts, as core's are before its (``import_core_stack``,
    ``core_sample``) and as ComfyUI imports a node pack when it starts: import-time work (Triton parsing its
    kernels' source) is not a job's. The attention packages too (sageattention, comfy-kitchen; their import registers
    their torch.library operators): a ComfyUI process imports both at startup (core's ``comfy.ldm.modules.attention``
    with ``--use-sage-attention``), before any node runs, and core's clock starts after its own import of them.
    And ``torch._dynamo``: ComfyUI's own import loads it (``comfy.sd`` and ``comfy.model_management`` bring 1,940
    modules, dynamo, sympy and mpmath among them, measured on the vendored 0f1fa67a), while our runtime reaches it only
    through the first call of a torch.library operator (Sage2's, in the load's attention probe): 892 modules on the
    CPU here; the first H100 rows' loads spent 4.0 s in 951 calls compiling module sources (each row's
    ``modules_imported_in_the_job`` shows what is left). A node-pack user's job never pays that; the CLI's does.
    -> the modules this machine cannot import (an optional dependency), with why."""
    import importlib
    import pkgutil

    import h3_blackwell.runtime as R

    missing = []
    for m in pkgutil.walk_packages(R.__path__, R.__name__ + "."):
        try:
            importlib.import_module(m.name)
        except ImportError as e:
            missing.append(f"{m.name}: {e}")
    for name in ("sageattention", "comfy_kitchen", "torch._dynamo"):
        try:
            importlib.import_module(name)
        except Exception as e:  # not installed here, or a compiled extension that fails to load
            missing.append(f"{name}: {type(e).__name__}: {e}")
    return missing


def run_ours(job: J.Job, cap_gb: int | None, files: dict, tiny: bool) -> dict:
    from h3_blackwell.runtime.lora.apply import apply_loras, lora_report

    not_imported = import_ours()
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    apply_cap(cap_gb, device)
    budget = "auto" if cap_gb is None or tiny else repr(cap_gb - MARGIN_GB)
    kw = {} if job.sparse is None else dict(attention="sparse", sparse_tau=job.sparse.tau,
                                            sparse_start=job.sparse.start_percent,
                                            sparse_min_tokens=job.sparse.min_tokens,
                                            sparse_extra_tokens=job.sparse.extra_tokens)
    if cap_gb is not None and not tiny:  # the 32 GB machine: AdaLN stays in the file where it does not fit beside
        kw["host_budget"] = repr(HOST_GB - HOST_MARGIN_GB)  # the streamed blocks (runtime.budget._check_host)
    opts = RuntimeOptions.from_env(device=str(device), vram_budget=budget, **kw)
    before = set(sys.modules)
    t0 = time.perf_counter()
    with LoadProfile() as prof:
        spec = open_model(files["checkpoint"], opts)
        inputs = inputs_for(job, spec.config)
        wl = Workload.from_shapes(inputs.video.shape, inputs.audio.shape, job.text_tokens, job.steps,
                                  inputs.conditioning)
        rt = spec.load(workload=wl)  # planned for this job (the run plans again at its start, as every run does)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_load = time.perf_counter()
        lora_phases = None
        if job.lora_rank is not None:
            lora_phases = apply_loras(rt, [(files["lora"], 1.0, job.lora_mode)]).get("phase_seconds")
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_lora = time.perf_counter()
    if tiny and cap_gb is not None:  # the CPU emulates streaming under an explicit budget: 8 -> the smallest the
        rt.plan.options.vram_budget = repr(tiny_budget(rt, job, inputs, cap_gb) / 1e9)  # plan accepts, 16 -> 1.5x
    settings = SamplingSettings(seed=job.seed, steps=job.steps, sampler=job.sampler)
    reps = [run(tensor_job(rt, inputs, settings)).report]
    if device.type == "cuda":
        torch.cuda.synchronize()
    # the job a user runs: the load, the LoRA and one run, whole (its plan included); the clock stops here
    job_seconds = time.perf_counter() - t0
    imported = modules_imported(before)
    for _ in range(files.get("runs", 1) - 1):  # the same job again, each a run of its own, for the hash check
        reps.append(run(tensor_job(rt, inputs, settings)).report)
    rep = reps[-1]
    if lora_phases is None and job.lora_rank is not None:  # merged behind a load that ran behind the first step:
        lora_phases = (lora_report(rt) or {}).get("phase_seconds")  # the report was finished by the last block
    profiled = None
    if files.get("profile_step"):  # one more step, after the timed runs, under the profiler
        one = SamplingSettings(seed=job.seed, steps=1, sampler=job.sampler)
        profiled = step_profile(lambda: run(tensor_job(rt, inputs, one)), device)
    steps = [s["seconds"] for r in reps for s in r["per_step_seconds"][0]]
    sampling = [r["sampling_seconds"][0] for r in reps]
    hashes = {(r["latent_checksums"]["video_sha256"], r["latent_checksums"]["audio_sha256"]) for r in reps}
    return {"step_seconds": statistics.median(steps), "job_seconds": job_seconds,
            "load_seconds": t_load - t0, "lora_seconds": t_lora - t_load, "load_profile": prof.top(),
            "modules_imported_in_the_job": imported, "load_phases": rt.load_phases, "lora_phases": lora_phases,
            "sampling_seconds": statistics.median(sampling), "sampling_seconds_per_run": sampling,
            "peak_allocated_bytes": max(v for r in reps for v in r["peak_allocated_bytes"] or [0]) or None,
            "peak_reserved_bytes": max(v for r in reps for v in r["peak_reserved_bytes"] or [0]) or None,
            "host_peak_rss_bytes": host_peak_rss_bytes(),
            "latent_checksums": {"video_sha256": rep["latent_checksums"]["video_sha256"],
                                 "audio_sha256": rep["latent_checksums"]["audio_sha256"],
                                 # with one run there is nothing to compare (the capped rows' hashes_equal_resident
                                 # compares separate processes of the job)
                                 "exact_across_measured_runs": len(hashes) == 1 if len(reps) > 1 else None},
            "measured_runs": len(reps),
            "memory": {k: (rep.get("memory") or {}).get(k) for k in
                       ("budget", "streamed_blocks", "ffn_chunk_rows", "attn_chunk_rows", "host_bytes_planned",
                        "adaln_from_file", "host_limit_bytes", "refiner_on_host", "copy_exposed_ms_per_step",
                        "estimate")},
            "memory_choice": rep["backends"].get("memory"), "adaln": rep["backends"].get("adaln"),
            "load": rep["backends"].get("load"),
            "modules_not_imported_before_the_clock": not_imported,
            "attention": rep["backends"].get("attention"), "device": rep["device"],
            **({"step_profile": profiled} if profiled is not None else {})}


def import_core_stack(folder: Path, device: torch.device, cap_gb: int | None):
    """core's modules with core's CLI flags (``--reserve-vram`` so core sees a card of the cap's size, ``--cpu`` on
    the CPU, the attention flag) from ``folder``: a ComfyUI checkout (the vendored one) or the folder
    scripts/pack_core_peer.sh fills; comfy-aimdo's library loaded first where core would use DynamicVRAM
    (``core_aimdo_load``). -> (model module, what ``core_aimdo_load`` said)."""
    import _core_model as C

    if (folder / "comfy" / "ldm" / "minimax" / "model.py").is_file():
        sys.path.insert(0, str(folder))
    else:
        C.carried_paths(folder, Path(tempfile.gettempdir()) / "h3_core_site")
    flags = ()
    if cap_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        flags = ("--reserve-vram", f"{max(0.0, total / 1e9 - cap_gb):.2f}")
    attention = "sage" if device.type == "cuda" else "pytorch"
    loaded = []
    mm, _, _, _ = C.import_core(attention, device.type == "cpu", folder, flags,
                                lambda cli: loaded.append(core_aimdo_load(cli, device.type == "cuda")))
    return mm, loaded[0]


def core_missing(job: J.Job) -> str | None:
    """Why the carried core stack cannot run ``job`` at all (before any file or import), or None."""
    if job.sparse is not None:
        return ("missing feature: core's sparse-attention node (comfy_extras/nodes_sparse_attention.py @ "
                "01dafad3, h3-comfyui-facts.md §11.2) is not in the carried ComfyUI snapshot (0f1fa67a), "
                "and that snapshot's H3 model could not run it: its double_block wrapper drops the "
                "patch's args['attention'] and it sets no transformer_options['minimax_h3_layout'] "
                "(the node's sinks and VSA tiling read it); the node needs core's newer model.py")
    return None


def run_core(job: J.Job, cap_gb: int | None, files: dict, tiny: bool) -> dict:
    """ComfyUI core's stack in this process (module docstring); raises what core raises."""
    missing = core_missing(job)
    if missing:
        raise RuntimeError(missing)
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    mm, loaded = import_core_stack(Path(files["comfyui"]), device, cap_gb)
    dynamic = core_dynamic_vram(loaded)  # before any CUDA allocation, as main.py does
    apply_cap(cap_gb, device)
    res = core_sample(mm, job, device, files)
    res["dynamic_vram"] = dynamic
    return res


def core_aimdo_load(cli, cuda: bool) -> str:
    """What main.py does before it imports core's modules, where core would use DynamicVRAM (CUDA, no --cpu /
    --highvram / --gpu-only / --novram): ``comfy_aimdo.control.init`` with --reserve-vram as the headroom, so that
    ``comfy_aimdo.host_buffer`` and the others bind the loaded library when core imports them. -> "loaded", or
    "off: why"."""
    if not cuda or not cli.enables_dynamic_vram():
        return "off: core enables DynamicVRAM only on CUDA without --cpu/--highvram/--gpu-only/--novram"
    args = cli.args
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
    try:
        import comfy_aimdo.control as aimdo

        for kw in ({"simple_vram_headroom": headroom, "nvml_pressure": not getattr(args, "disable_nvml_pressure",
                                                                                  False)},
                   {"simple_vram_headroom": headroom}, {}):
            try:
                aimdo.init(**kw)
                break
            except TypeError:  # an older comfy-aimdo protocol, as main.py falls back
                continue
    except Exception as e:  # noqa: BLE001 - core falls back to its legacy ModelPatcher, and says so
        return f"off: comfy-aimdo failed to load ({type(e).__name__}: {e})"[:300]
    return "loaded" if aimdo.lib is not None else "off: comfy-aimdo's library did not load"


def core_dynamic_vram(loaded: str) -> str:
    """core's DynamicVRAM switched on as main.py does after its modules are imported, where ``core_aimdo_load``
    loaded the library: ``init_devices``, ``CoreModelPatcher = ModelPatcherDynamic`` and ``aimdo_enabled``.
    -> "on", or "off: why" (core then runs its legacy ModelPatcher, as main.py falls back)."""
    if loaded != "loaded":
        return loaded
    import comfy.cli_args as cli
    import comfy.memory_management
    import comfy.model_management as M
    import comfy.model_patcher
    import comfy_aimdo.control as aimdo

    try:
        ok = aimdo.init_devices((d.index, int(cli.args.vram_headroom * 1024 ** 3)) for d in M.get_all_torch_devices())
    except TypeError:
        ok = aimdo.init_devices(d.index for d in M.get_all_torch_devices())
    if not ok:
        return "off: comfy_aimdo.control.init_devices found no working install"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return "on"


def core_payload(mm, job: J.Job, inputs: SampleInputs, context, device, compute) -> dict:
    """``minimax_payload`` as core's ``MiniMaxH3.extra_conds`` builds it: keyframes (and their cond latents), seed,
    audio scale, the packed layout built once per run."""
    kfs = [{"resolved_frame_index": kf.resolved_frame_index, "latent": kf.latent.to(device, torch.float32)}
           for kf in (inputs.conditioning.keyframes if inputs.conditioning is not None else ())]
    vs = inputs.video.shape
    payload = {"seed": job.seed, "audio_scale": 1.0}
    if kfs:
        payload.update(keyframes=kfs, cond_video_latents=[k["latent"] for k in kfs], cond_audio_latents=[])
    payload["layout"] = mm.PackedLayout(context.shape[1], vs[2], (vs[3] + 1) // 2 * 2, (vs[4] + 1) // 2 * 2,
                                        inputs.audio.shape[-1], keyframes=kfs or None)
    return payload


def core_lora(patcher, job: J.Job, files: dict):
    """The turbo LoRA as core's LoraLoaderModelOnly puts it on the model: ``comfy.sd.load_lora_for_models`` at
    strength 1 (core's key map, ``comfy.lora.load_lora``, a patched clone; applied when the weights load).
    Raises where core's key map left a layer of the file unmatched (core would run without it). -> (patcher,
    what was patched)."""
    if job.lora_rank is None:
        return patcher, None
    import comfy.sd
    import comfy.utils

    sd = comfy.utils.load_torch_file(files["lora"], safe_load=True)
    layers = {k.rsplit(".lora_", 1)[0] for k in sd if ".lora_" in k}
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, sd, 1.0, 0)
    done = len(patched.patches)
    if done != len(layers):
        raise RuntimeError(f"core's LoRA key map matched {done} of the {len(layers)} layers of {files['lora']}: "
                           "core would sample without the rest")
    return patched, {"patched_weights": done, "lora_layers": len(layers), "lora_keys": len(sd)}


def core_sample(mm, job: J.Job, device, files: dict) -> dict:
    """core's model as a user's workflow loads it: UNETLoader (``comfy.sd.load_diffusion_model`` over core's fp8
    file: core's model detection, dtype choice, CoreModelPatcher, the weights where core's loader puts them),
    LoraLoaderModelOnly (``core_lora``) and ``load_models_gpu`` (dynamic VRAM under the reserve); then
    ``job.steps`` Euler steps, one core forward each (the text refined once per run, the layout built once, as
    core's sampler does; core's sampler arithmetic is these few elementwise ops)."""
    import comfy.model_management as M
    import comfy.sd
    from h3_blackwell.runtime import latent_sha256

    before = set(sys.modules)
    t0 = time.perf_counter()
    with LoadProfile() as prof:
        patcher = comfy.sd.load_diffusion_model(files["core_checkpoint"])
        t_file = time.perf_counter()
        model = patcher.model.diffusion_model
        compute = patcher.model.get_dtype_inference()
        cfg = files["config"]
        patcher, lora = core_lora(patcher, job, files)
        t_lora = time.perf_counter()
        M.load_models_gpu([patcher])
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_load = time.perf_counter()
    inputs = inputs_for(job, cfg)
    with torch.inference_mode():
        context = model.preprocess_text_embeds(inputs.text.to(device, compute))
        payload = core_payload(mm, job, inputs, context, device, compute)
        g = torch.Generator().manual_seed(job.seed)
        x = [torch.randn(t.shape, generator=g).to(device) for t in (inputs.video, inputs.audio)]
        sigmas = [1.0 - i / job.steps for i in range(job.steps)] + [0.0]
        times, used = [], 0
        for s, nxt in zip(sigmas[:-1], sigmas[1:]):
            t = time.perf_counter()
            ts = torch.tensor([s * 1000.0], dtype=torch.float32, device=device)
            out = model([v.to(compute) for v in x], ts, context, transformer_options={}, minimax_payload=payload)
            x = [v + (nxt - s) * o.float() for v, o in zip(x, out)]
            if device.type == "cuda":
                torch.cuda.synchronize()
                free, total = torch.cuda.mem_get_info(device)
                used = max(used, int(total - free))
            times.append(time.perf_counter() - t)
        t_end = time.perf_counter()  # the job a user runs ends with its last step; the profiled forward is not in it
        imported = modules_imported(before)
        profiled = None
        if files.get("profile_step"):  # one more forward, after the timed steps, under the profiler
            ts = torch.tensor([sigmas[0] * 1000.0], dtype=torch.float32, device=device)
            profiled = step_profile(lambda: model([v.to(compute) for v in x], ts, context, transformer_options={},
                                                  minimax_payload=payload), device)
    cuda = device.type == "cuda"
    return {"step_seconds": statistics.median(times), "job_seconds": t_end - t0,
            "load_seconds": t_file - t0, "lora_seconds": t_lora - t_file,  # the patches are computed when the
            "load_models_gpu_seconds": t_load - t_lora,  # weights load (or per use, under DynamicVRAM)
            "load_profile": prof.top(), "modules_imported_in_the_job": imported,
            "sampling_seconds": t_end - t_load,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "device_used_after_steps_max_bytes": used if cuda else None,  # the driver's view: aimdo's own memory too
            "host_peak_rss_bytes": host_peak_rss_bytes(),
            "latent_checksums": {"video_sha256": latent_sha256(x[0]), "audio_sha256": latent_sha256(x[1])},
            "weights": "core's fp8 file (float8_e4m3fn, per-tensor scale, block linears; the rest bf16/fp32), "
                       "loaded by comfy.sd.load_diffusion_model",
            "compute_dtype": str(compute).replace("torch.", ""),
            "loaded_by": f"comfy.sd.load_diffusion_model + comfy.model_patcher.{type(patcher).__name__} + "
                         "comfy.model_management.load_models_gpu", "lora": lora,
            "note": "Euler over linear sigmas, one core forward per step", "device": device_info(device)[0],
            **({"step_profile": profiled} if profiled is not None else {})}


def child(a) -> int:
    """--child STACK: one stack of one row; writes {result} or {error} to --child-out. --child files:STACK: that
    stack's checkpoint and the LoRA (a process of its own, so the parent never holds device memory the rows would
    then lack)."""
    if a.child.startswith("files:"):  # files:ours / files:core
        files, stack = json.loads(a.child_files), a.child.split(":")[1]
        device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
        (write_checkpoint if stack == "ours" else write_core_checkpoint)(Path(files[CHECKPOINT[stack]]),
                                                                          config_of(a), device)
        write_lora(Path(files["lora"]), config_of(a), lora_rank(a))
        return 0
    job = job_of(a.rows.split(":")[0], a)
    cap = parse_rows(a)[0][1]
    files = json.loads(a.child_files)
    files["config"], files["runs"], files["profile_step"] = config_of(a), a.runs, a.profile_step
    try:
        res = (run_ours if a.child == "ours" else run_core)(job, cap, files, a.tiny)
    except BaseException as e:  # noqa: BLE001 - a refusal, an OOM or a missing feature is the row's finding
        res = {"error": err_text(e), "traceback": traceback.format_exc()[-2000:],
               "host_peak_rss_bytes": host_peak_rss_bytes()}
    Path(a.child_out).write_text(json.dumps(res))
    return 0


# ---------------------------------------------------------------------------------------------
# the parent: rows, merge, JSON
# ---------------------------------------------------------------------------------------------

def run_stack(stack: str, job: str, cap, files: dict, a, blocks: int | None = None, steps: int | None = None,
              runs: int | None = None) -> dict:
    """One stack of one row in a child process (--blocks/--steps/--runs of ``a`` unless given) -> its result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    py = a.core_python if stack == "core" and a.core_python else sys.executable
    cmd = [py, __file__, "--child", stack, "--rows", f"{job}:{cap or 'resident'}", "--child-out", out,
           "--child-files", json.dumps(files), "--lora-rank", str(a.lora_rank),
           "--steps", str(a.steps if steps is None else steps), "--blocks", str(a.blocks if blocks is None else blocks),
           "--runs", str(a.runs if runs is None else runs)] + (["--tiny"] if a.tiny else []) \
        + (["--profile-step"] if a.profile_step and blocks is None else [])
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        p.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        Path(out).unlink(missing_ok=True)
        return {"error": f"the {stack} child ran past --timeout {a.timeout} s and was killed"}
    finally:  # a parent stopped (SIGTERM from the device's timeout, Ctrl-C) takes its child with it
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    try:
        if not Path(out).stat().st_size:
            return {"error": f"the {stack} child exited with status {p.returncode} and wrote nothing (killed?)"}
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink(missing_ok=True)


def lora_rank(a) -> int:
    return 4 if a.tiny else a.lora_rank


def prepare_files(stack: str, files: dict, cfg, a) -> dict:
    """``stack``'s checkpoint and the LoRA in the work folder (written by a child where absent, after removing the
    other stack's checkpoint where the disk lacks room for both). -> {"seconds", "removed"} or {"error"}."""
    from h3_blackwell.runtime.io.convert import planned_bytes

    path, t0 = Path(files[CHECKPOINT[stack]]), time.perf_counter()
    if path.is_file() and Path(files["lora"]).is_file():
        return {"seconds": 0.0, "removed": []}
    path.parent.mkdir(parents=True, exist_ok=True)
    other = "core" if stack == "ours" else "ours"
    removed = make_room(path, planned_bytes(checkpoint_plan(stack, cfg)), [Path(files[CHECKPOINT[other]])])
    print(f"[user_jobs] writing {path.name} and the LoRA" + (f" (removed {removed})" if removed else ""), flush=True)
    p = subprocess.run([sys.executable, __file__, "--child", f"files:{stack}", "--child-files", json.dumps(files),
                        "--lora-rank", str(a.lora_rank), "--blocks", str(0 if a.tiny else cfg.num_layers)]
                       + (["--tiny"] if a.tiny else []), timeout=a.timeout, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": f"writing {path} failed (status {p.returncode}): {p.stderr[-1500:]}"}
    return {"seconds": time.perf_counter() - t0, "removed": removed}


def finish_row(row: dict) -> None:
    """The row's ``speedup`` (core's job over ours) where both stacks ran in the same lease on the same card, else
    None with the reason in ``speedup_note``; ``card``: the card the row ran on."""
    o, c = row["ours"], row["core"]
    row["speedup"] = None
    row.pop("speedup_note", None)
    if "error" in o or "error" in c:
        row["speedup_note"] = "a stack did not run (its error)"
    elif o.get("lease") != c.get("lease") or o.get("device") != c.get("device"):
        row["speedup_note"] = (f"the stacks ran in different leases or on different cards (ours {o.get('device')} "
                               f"lease {o.get('lease')}, core {c.get('device')} lease {c.get('lease')}): not compared")
    else:
        row["speedup"] = c["job_seconds"] / o["job_seconds"]
    row["card"] = o.get("device") or c.get("device")


def compare_to_resident(rows: list) -> None:
    """Each capped row of ours against the resident row of the same job, where both ran on the same card:
    ``hashes_equal_resident`` and ``step_ratio_to_resident`` (its step time over the resident one's; the issue's
    line for clip10s at 8 GB is 1.10). On different cards neither is computed, and ``resident_note`` says why."""
    key = ("video_sha256", "audio_sha256")
    resident = {r["job"]: r["ours"] for r in rows if r["cap_gb"] is None and "error" not in r["ours"]}
    for r in rows:
        o, base = r["ours"], resident.get(r["job"])
        if r["cap_gb"] is None or base is None or "error" in o:
            continue
        for k in ("hashes_equal_resident", "step_ratio_to_resident", "resident_note"):
            o.pop(k, None)
        if o.get("device") != base.get("device"):
            o["resident_note"] = (f"the resident row ran on {base.get('device')}, this one on {o.get('device')}: "
                                  "not compared")
            continue
        want, got = base.get("latent_checksums"), o.get("latent_checksums")
        if want and got:
            o["hashes_equal_resident"] = all(want[k] == got[k] for k in key)
        if base.get("step_seconds") and o.get("step_seconds"):
            o["step_ratio_to_resident"] = o["step_seconds"] / base["step_seconds"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default=",".join(J.USER_JOBS))
    ap.add_argument("--caps", default="resident,16,8")
    ap.add_argument("--rows", default="", help="job:cap[:runs],... (cap resident|16|8; runs: this row's --runs): "
                    "overrides --jobs/--caps")
    ap.add_argument("--stacks", default="ours,core")
    ap.add_argument("--merge", action="store_true", help="keep the rows of --out this call does not run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default=os.environ.get("H3_USER_JOBS_DIR", "/tmp/h3_user_jobs"))
    ap.add_argument("--lora-rank", type=int, default=J.TURBO_LORA_RANK)
    ap.add_argument("--comfyui", default=str(ROOT / ".core_peer"), help="the folder scripts/pack_core_peer.sh fills")
    ap.add_argument("--file-dir", default="auto", help="where both stacks' checkpoints go (auto: /dev/shm for each "
                    "where host memory allows, else --workdir)")
    ap.add_argument("--core-python", default="", help="the python core's child runs with (one with ComfyUI's "
                    "requirements, e.g. .comfyui/venv/bin/python here); default this one")
    ap.add_argument("--blocks", type=int, default=0, help="a device smoke run: H3's full widths with this many "
                    "blocks (0: all 50)")
    ap.add_argument("--steps", type=int, default=0, help="steps of every job (0: the job's own)")
    ap.add_argument("--runs", type=int, default=1, help="our measured runs per row (2+: hashes compared across them)")
    ap.add_argument("--profile-step", action="store_true", help="after each stack's timed runs, one more step under "
                    "torch.profiler: the operators with the most device time (the row's step_profile)")
    ap.add_argument("--tiny", action="store_true", help="the tiny config on the CPU: the whole flow, end to end")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per stack and row")
    ap.add_argument("--prepare-only", action="store_true", help="write the stacks' checkpoints, the LoRA and the "
                    "warm-up files, run nothing (e.g. beside a build on a fresh machine); the files' seconds go to "
                    "--out's files")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-files", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    return parent(a, argv)


def parent(a, argv) -> int:
    """The rows stack by stack: the stack whose checkpoint is on disk first (one full-size checkpoint of each does
    not fit the device's disk, so each call writes at most one), each preceded by a warm-up child on a one-block
    model of the same widths (the once-per-machine work, e.g. our FC2 extension build and Triton's compiles, which
    a user's later jobs do not repeat), then every row of the call. The JSON is rewritten after every child."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_stack, which ends the child
    wanted = parse_rows(a)
    name = "user-jobs" + ("-tiny" if a.tiny else f"-smoke-{a.blocks}blocks" if a.blocks else "")
    out = Path(a.out or ROOT / "bench" / "results" / f"{name}.json")
    old = json.loads(out.read_text()) if a.merge and out.is_file() else {}
    work = Path(a.workdir) / ("tiny" if a.tiny else "full")
    cfg = config_of(a)
    dirs, dirs_why = file_dirs(a.file_dir, work, cfg)
    files = {**file_names(work, cfg, lora_rank(a), dirs), "comfyui": a.comfyui}
    stacks = sorted((s for s in ("ours", "core") if s in a.stacks.split(",")),
                    key=lambda s: not Path(files[CHECKPOINT[s]]).is_file())
    runs = row_runs(a)
    kept = {(r["job"], r["cap_gb"]): r for r in old.get("rows", [])}
    # a stack this call does not run keeps its result from --out (--merge): a row's two stacks may come from two
    # calls, and the row compares them only where both ran in one lease (finish_row)
    rows = {(job, cap): {"job": job, "cap_gb": cap, "definition": job_of(job, a).as_dict(),
                         "lora_rank_source": J.TURBO_LORA_RANK_SOURCE,
                         **{s: kept.get((job, cap), {}).get(s) or {"error": "not run in this call (--stacks)"}
                            for s in ("ours", "core")}} for job, cap in wanted}
    res = {"name": name, "command": bench_command(argv), "blocks": cfg.num_layers,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": old.get("device"), "versions": versions(),  # the parent never touches the GPU: rows name it
           "files": {"checkpoints_in": dirs_why}, "warmup": {},
           "core_stack": "in-process (bench/user_jobs.py docstring)",
           "rows": [r for r in old.get("rows", []) if (r["job"], r["cap_gb"]) not in rows] + list(rows.values())}
    warm_cfg = cfg if a.tiny else cfg.replace(num_layers=1)  # H3's widths, one block
    warm_files = {**file_names(work, warm_cfg, lora_rank(a)), "comfyui": a.comfyui}
    if a.prepare_only:  # the files alone; the rows of --out stay as they were
        res["rows"] = old.get("rows", [])
        for stack in stacks:
            res["files"][stack] = {"warmup": prepare_files(stack, warm_files, warm_cfg, a),
                                   "checkpoint": prepare_files(stack, files, cfg, a)}
            print(f"[user_jobs] {stack}'s files: {res['files'][stack]}", flush=True)
        write_json(_without_own_card(res), out)
        return 0 if not any("error" in f for st in stacks for f in res["files"][st].values()) else 1
    for stack in stacks:
        for r in rows.values():  # a result kept from --out stays until this call replaces it
            if "error" in r[stack]:
                r[stack] = {"error": "not run yet (the call ended first)"}
        # rows the carried core cannot run at all get that error here, without core's files or a child process
        missing = {key: core_missing(job_of(key[0], a)) for key in rows} if stack == "core" else {}
        for (job, cap), row in rows.items():
            if missing.get((job, cap)):
                row[stack] = {"error": missing[(job, cap)], "lease": lease_id()}
                finish_row(row)
                write_json(_without_own_card(res), out)
        if missing and all(missing.values()):
            continue
        w = prepare_files(stack, warm_files, warm_cfg, a)  # --tiny: the tiny model itself
        w.update(run_stack(stack, wanted[0][0], None, warm_files, a, blocks=1, steps=1, runs=1)
                 if "error" not in w else {})
        res["warmup"][stack] = {k: w[k] for k in ("job_seconds", "error") if k in w}
        res["files"][stack] = prepare_files(stack, files, cfg, a)
        for (job, cap), row in rows.items():
            if missing.get((job, cap)):
                continue
            print(f"[user_jobs] {stack}: {job} cap={cap or 'resident'}", flush=True)
            row[stack] = {"error": res["files"][stack]["error"]} if "error" in res["files"][stack] else \
                run_stack(stack, job, cap, files, a, runs=runs[(job, cap)])
            row[stack]["lease"] = lease_id()
            finish_row(row)
            compare_to_resident(res["rows"])
            res["device"] = res["device"] or row["card"]
            write_json(_without_own_card(res), out)
    print(json.dumps([{k: r.get(k) for k in ("job", "cap_gb", "speedup")} for r in res["rows"]]))
    return 0


def _without_own_card(res: dict) -> dict:
    """The JSON as written: a row names its card only where it differs from ``device`` (the issue's schema)."""
    rows = [{k: v for k, v in r.items() if not (k == "card" and (v is None or v == res["device"]))}
            for r in res["rows"]]
    return {**res, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
