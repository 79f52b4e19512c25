"""The run report, in the field names of the seed's GB10 production profile.

Counters are per run; hashes are sha256 of the contiguous bytes of each returned latent (dtype and shape
recorded beside them); step times come from events recorded without a per-step synchronisation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..parallel.rank_stats import merge_sections


def latent_sha256(t: torch.Tensor) -> str:
    """sha256 of the contiguous CPU bytes of a tensor."""
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


@dataclass
class RunRecord:
    """One run's measurements. Peaks are None where the device keeps no allocator statistics (the CPU);
    nonfinite: None when every step's latents were finite, else where they first were not."""

    sampling_seconds: float
    per_step_seconds: list
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    video_sha256: str
    audio_sha256: str
    fc2: dict = field(default_factory=lambda: {"attempts": 0, "successes": 0, "fallbacks": 0})
    nonfinite: dict | None = None


STREAMS = ("video", "audio")
NO_PEAKS = "cpu: torch keeps no allocator statistics for host memory, so no peak is measured"


def first_nonfinite(finite: torch.Tensor, run_index: int) -> dict | None:
    """finite: bool [steps, 2] (video, audio) after each step -> None when all true, else
    {"run", "step", "stream"} (1-based) of the first false entry."""
    bad = (~finite).nonzero()
    if bad.numel() == 0:
        return None
    step, stream = (int(v) for v in bad[0])
    return {"run": run_index + 1, "step": step + 1, "steps": int(finite.shape[0]), "stream": STREAMS[stream]}


def nonfinite_message(where: dict) -> str:
    """What a non-finite latent means and what to try (the inputs and weights were checked finite at load)."""
    return (f"the {where['stream']} latents became NaN/Inf at step {where['step']} of {where['steps']} "
            f"(run {where['run']}); the weights and text states were finite, so a backend's numerics diverged: "
            "try another attention or GEMM backend (--attention reference, --gemm reference or --dense), "
            "or check the checkpoint")


def device_info(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"SM{cc[0]}{cc[1]}"
    return f"CPU ({platform.processor() or platform.machine()})", "cpu"


def tools_info(rt=None) -> dict:
    tools = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    fc2 = getattr(rt, "fc2", None) if rt is not None else None
    info = getattr(fc2, "build_info", None)
    if callable(info):
        try:
            bi = info()
            if bi and bi.get("cublaslt_runtime_version"):
                tools["cublaslt_runtime"] = bi["cublaslt_runtime_version"]
        except Exception as e:  # a report never fails because an optional probe did
            tools["cublaslt_runtime"] = f"unavailable: {e}"
    return tools


def fc2_consistency(fc2: dict, required: int, runs: list) -> tuple[bool, str]:
    """Whether every measured run's FC2 counts are what the configuration implies -> (ok, what was expected).

    W4A8 (``lt_path`` "not applicable ..."): no dispatcher attempts, ``required`` direct calls per run. The
    NVFP4 stack with the dispatcher: ``required`` attempts per run, each a success or a fallback (strict
    mode: successes only; the guard's refusals are fallbacks, not errors). No dispatcher (dense or CPU
    stacks): no attempts."""
    lt = str(fc2.get("lt_path", ""))
    if lt.startswith("not applicable"):
        want = f"0 dispatcher attempts and {required} direct FC2 calls per run ({lt})"
        ok = all(r["attempts"] == 0 and r.get("direct_calls") == required for r in runs)
    elif lt == "dispatcher":  # (also when the path is off: each call is then an attempt and a fallback)
        strict = bool(fc2.get("strict"))
        want = (f"{required} attempts per run, all successes (strict)" if strict else
                f"{required} attempts per run, each a success or a fallback")
        ok = all(r["attempts"] == required and r["successes"] + r["fallbacks"] == required
                 and (not strict or r["successes"] == required) for r in runs)
    else:
        want = "no dispatcher attempts (FC2 runs without the guarded path)"
        ok = all(r["attempts"] == 0 for r in runs)
    return bool(runs) and ok, want


def _memory(rt, measured: list) -> dict:
    """The ``memory`` block (runtime.budget / runtime.ops.streaming) when the runtime has a memory plan."""
    fn = getattr(rt, "memory_report", None)
    peaks = [r.peak_allocated_bytes for r in measured if r.peak_allocated_bytes is not None]
    block = fn(max(peaks) if peaks else None) if callable(fn) else None
    return {"memory": block} if block is not None else {}


def _fc2_status(rt) -> dict:
    """The FC2 block's state fields: the guarded dispatcher's (where one is bound) and the block ops'; without a
    dispatcher, why none runs."""
    out = rt.fc2.status() if rt.fc2 is not None and hasattr(rt.fc2, "status") else {}
    out = {**(out or {}), **rt.ops.status()}
    if rt.fc2 is None:
        out["status"] = (f"not active: {rt.plan.choices['fc2_lt'].reason}" if rt.ops.name != "reference" else
                         "not active: the block stack runs dense linears (no NVFP4 FC2 path)")
    return out


def host_peak_rss_bytes() -> int | None:
    """This process's peak resident host memory so far (the kernel's high-water mark: ``ru_maxrss``, KiB on Linux,
    bytes on macOS); None where the platform keeps none. Everything the process held counts: the load, pinned
    streamed blocks, AdaLN weights kept in host memory, the run's host tensors."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if platform.system() == "Darwin" else int(peak) * 1024


def build_report(rt, workload: dict, measured: list, warmup_runs: int, video: torch.Tensor,
                 audio: torch.Tensor, fc2_required: int) -> dict:
    """The seed-schema report for ``measured`` runs (RunRecord list, warm-ups excluded)."""
    dev_name, cc = device_info(rt.device)
    secs = [r.sampling_seconds for r in measured]
    bad = [r.nonfinite for r in measured if r.nonfinite is not None]
    peaks = all(r.peak_allocated_bytes is not None for r in measured)
    videos = {r.video_sha256 for r in measured}
    audios = {r.audio_sha256 for r in measured}
    runs_fc2 = [dict(r.fc2) for r in measured]
    fc2 = {"required_per_run": fc2_required, "runs": runs_fc2,
           "all_passed": bool(fc2_required) and all(
               r["attempts"] == fc2_required and r["successes"] == fc2_required and r["fallbacks"] == 0
               for r in runs_fc2)}
    fc2.update(_fc2_status(rt))
    fc2["consistent_with_configuration"], fc2["expected"] = fc2_consistency(fc2, fc2_required, runs_fc2)
    config = rt.plan.configuration()
    config.update({f"backend_{k}": v["choice"] for k, v in rt.backends.items()})
    config["dtype"] = str(rt.dtype).replace("torch.", "")
    return {
        "name": "h3-blackwell-run",
        "measurement_date": time.strftime("%Y-%m-%d"),
        "device": dev_name,
        "compute_capability": cc,
        "tools": tools_info(rt),
        "model": {"source": rt.source, "blocks": rt.config.num_layers, "hidden": rt.config.hidden_size},
        "workload": workload,
        "configuration": config,
        "backends": rt.backends,
        "capabilities": rt.plan.capabilities,
        "sampling_seconds": secs,
        "median_sampling_seconds": statistics.median(secs) if secs else None,
        "per_step_seconds": [r.per_step_seconds for r in measured],
        "peak_allocated_bytes": [r.peak_allocated_bytes for r in measured] if peaks else None,
        "peak_reserved_bytes": [r.peak_reserved_bytes for r in measured] if peaks else None,
        **({} if peaks else {"peak_bytes_reason": NO_PEAKS}),
        "host_peak_rss_bytes": host_peak_rss_bytes(),
        "latents_finite": not bad,
        **({"nonfinite": bad[0]} if bad else {}),
        "latent_checksums": {
            "video_sha256": measured[-1].video_sha256,
            "audio_sha256": measured[-1].audio_sha256,
            "video": {"dtype": str(video.dtype).replace("torch.", ""), "shape": list(video.shape)},
            "audio": {"dtype": str(audio.dtype).replace("torch.", ""), "shape": list(audio.shape)},
            "exact_across_measured_runs": len(videos) == 1 and len(audios) == 1,
        },
        "fc2_dispatch": fc2,
        **_memory(rt, measured),
        "measurement_policy": {
            "canonical_warmup_runs": warmup_runs,
            "measured_runs": len(measured),
            "authoritative_timing": "median synchronized resident sampling_seconds",
            "step_timing": ("deferred CUDA event elapsed time; no per-step synchronization"
                            if rt.device.type == "cuda" else "perf_counter per step (CPU)"),
            "profiling": False,
        },
        "load_seconds": rt.load_seconds,
        "load_phases": rt.load_phases,  # where that load's time went (``load_model``)
        # a resident model serves many runs: its one load is not this run's time
        "load_seconds_scope": ("the resident model's one load, whenever it happened (before this run or before an "
                               "earlier one it served); not part of sampling_seconds"),
    }


def _amax_text(red: dict | None) -> str:
    """The summary's words for the W4A4 amax all-reduces of a sequence-parallel run ('' when there were none)."""
    if not red or not red.get("calls_per_step"):
        return ""
    med = red.get("median_seconds_per_step_all_ranks")
    return (f"; amax all-reduce {red['calls_per_step']} per step"
            + (f", {med * 1e3:.1f} ms per step" if med is not None else ""))


def summary(report: dict) -> str:
    w = report["workload"]
    lc = report["latent_checksums"]
    med = report["median_sampling_seconds"]
    steps = w.get("steps") or 1
    text = (f"{report['device']} ({report['compute_capability']}): {w['resolution'][0]}x{w['resolution'][1]}, "
            f"{w['frames']} frames, {w['packed_tokens']} packed rows, {steps} steps -> median {med:.3f} s "
            f"({med / steps:.3f} s/step) over {len(report['sampling_seconds'])} run(s)\n"
            f"video sha256 {lc['video_sha256'][:16]}..  audio sha256 {lc['audio_sha256'][:16]}..  "
            + (f"exact across runs: {lc['exact_across_measured_runs']}" if len(report["sampling_seconds"]) > 1
               else "1 run, nothing to compare"))
    sp = report.get("sequence_parallel")
    if sp:
        a2a = sp["all_to_all"]
        med_a2a = a2a["median_seconds_per_step_all_ranks"]
        text += (f"\nsequence parallel: {sp['world_size']} ranks ({sp['backend']}), {sp['rows_per_rank']} rows per "
                 f"rank; all-to-all {a2a['bytes_per_block'] / 1e6:.1f} MB per block per rank, "
                 + (f"{med_a2a * 1e3:.1f} ms per step (median over ranks)" if med_a2a is not None else "none")
                 + _amax_text(sp.get("amax_all_reduce"))
                 + f"; latents identical across ranks: {sp['latents_identical_across_ranks']}")
    mem = report.get("memory")
    if mem and mem.get("streamed_blocks"):
        text += (f"\nmemory: {len(mem['resident_blocks'])} resident / {len(mem['streamed_blocks'])} streamed blocks "
                 f"({mem['budget']}); {(mem['bytes_copied_per_step'] or 0) / 1e9:.3f} GB copied per step, copies "
                 f"{mem['copy_ms_per_step'] or 0:.1f} ms per step ({mem['copy_exposed_ms_per_step'] or 0:.1f} ms "
                 "exposed)" + (f"; peak {mem['peak_allocated_bytes'] / 1e9:.2f} GB allocated"
                               if mem.get("peak_allocated_bytes") else ""))
    return text


def measured_report(rt, results: list, warmup: int) -> dict:
    """One report over the measured runs of one request (``results``: their SampleResults, each with its one
    run's report and record; ``warmup`` runs before them went unreported): the per-run lists (seconds, step
    times, peaks, FC2 counts) joined, their median, whether their latents are the same bytes, where a latent
    first became non-finite (runs counted from the first warm-up); the last run's blocks otherwise."""
    last = results[-1]
    records = []
    for k, res in enumerate(results):
        bad = res.record.nonfinite
        records.append(res.record if bad is None else
                       dataclasses.replace(res.record, nonfinite=dict(bad, run=warmup + k + 1)))
    report = dict(last.report)
    report.update(build_report(rt, last.report["workload"], records, warmup, last.video, last.audio,
                               last.report["fc2_dispatch"]["required_per_run"]))
    if "first_block_cache" in report:
        report["first_block_cache"] = dict(report["first_block_cache"], reused_steps_per_measured_run=[
            r.report["first_block_cache"]["reused_steps"] for r in results])
    if "sequence_parallel" in report:
        report["sequence_parallel"] = merge_sections([r.report["sequence_parallel"] for r in results])
    return report
