#!/usr/bin/env python3
"""ComfyUI core's own H3 model code and ours, timed in one process at the canonical workload.

    bash scripts/pack_core_peer.sh                          # here: core's model path -> .core_peer/ (ignored)
    python3 bench/core_peer.py [--comfyui .core_peer]        # on the GPU, with run(carry=[".core_peer"])
    python3 bench/core_peer.py --config tiny                 # on the CPU: the whole flow on the tiny config

1. Core's attention options: every attention function core registered (sage, comfy-kitchen int8, flash, pytorch
   where importable), called at the workload's sequence length as core's Attention calls it, in a child process
   (the option is a CLI flag that core reads once, at import): time, kernels, rel-L2 against SDPA. ``auto`` takes
   the fastest whose output is within rel-L2 0.1 of SDPA's and that did not fall back to SDPA; the flag is then
   given to core as main.py would parse it, and the function core's ``optimized_attention`` resolved to is checked.
2. Core's model (comfy/ldm/minimax/model.py, from the carried checkout subset) at our config, built through core's
   operation picker and state-dict loader with random weights in each of ``--core-formats`` (bench/_core_model.py:
   int8 = the shipped files' int8 ConvRot, fp8 = comfy_quant e4m3), one at a time: one core step = one forward
   call at the workload's shapes with the text refined and the layout built once, as core's sampler does (the
   sampler's own arithmetic is a few elementwise ops on the latents). ``--core-warmup`` then ``--core-iters``
   timed forwards, median; the kernels of one more forward. The headline is the fastest format.
3. Ours, after core's model is freed: the runtime's default plan on the same random-weight recipe as
   bench/canonical.py (NVFP4 file), ``--our-warmup`` + ``--our-runs`` runs of ``--our-steps`` res_multistep steps,
   median step.
The JSON is rewritten after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, build, versions, write_json  # noqa: E402
import _core_model as C  # noqa: E402

from h3_blackwell.runtime import Measure, RuntimeOptions, SampleInputs, SamplingSettings, run, tensor_job  # noqa: E402
from h3_blackwell.runtime.model.config import FULL, TINY  # noqa: E402
from h3_blackwell.runtime.model.layout import latent_shapes  # noqa: E402

SEED = 440420
WORKLOADS = {"full": (FULL, (1344, 768, 124), 100), "tiny": (TINY, (256, 192, 39), 9)}  # cfg, (w, h, frames), text
T0 = time.perf_counter()
MAX_ATTENTION_REL_L2 = 0.1  # auto skips an attention option whose output is further from SDPA's (Sage2: ~0.04)


def say(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def torch_settings() -> dict:
    """The process-wide torch switches core's import may set (model_management sets some at import)."""
    b = torch.backends
    mm = b.cuda.matmul
    return {"cudnn.benchmark": b.cudnn.benchmark, "matmul.allow_tf32": mm.allow_tf32,
            "matmul.allow_bf16_reduced_precision_reduction": mm.allow_bf16_reduced_precision_reduction,
            "matmul.allow_fp16_accumulation": getattr(mm, "allow_fp16_accumulation", None),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "flash_sdp": b.cuda.flash_sdp_enabled(), "mem_efficient_sdp": b.cuda.mem_efficient_sdp_enabled(),
            "math_sdp": b.cuda.math_sdp_enabled(),
            "fp16_bf16_reduction_math_sdp": b.cuda.fp16_bf16_reduction_math_sdp_allowed()}


def package(name: str, version: str | None = None) -> dict:
    """Version and location of an imported package (``version`` when it carries no metadata)."""
    try:
        mod = __import__(name)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    import importlib.metadata as md

    try:
        version = md.version(name.replace("_", "-"))
    except md.PackageNotFoundError:
        version = getattr(mod, "__version__", version)
    return {"version": version, "file": getattr(mod, "__file__", None) or list(getattr(mod, "__path__", []))[:1]}


def probe_child(a) -> int:
    """--probe-attention: import core with the pytorch flag (every importable option registers regardless), probe,
    print one JSON line."""
    C.carried_paths(Path(a.comfyui), Path(a.site_dir))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = C.CoreLog()
    logging.getLogger().addHandler(log)
    C.import_core("pytorch", dev.type == "cpu", Path(a.comfyui))
    cfg, canvas, text_len = WORKLOADS[a.config]
    vs, as_ = latent_shapes(*canvas)
    seq = text_len + 2 * as_[-1] + vs[2] * (vs[3] // 2) * (vs[4] // 2)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    options = C.attention_probe(seq, cfg.num_heads, cfg.head_dim, dev, dt)
    print(json.dumps({"seq": seq, "options": options, "core_log_warnings": log.records[-20:]}))
    return 0


def choose_attention(a, res, out) -> tuple[str, str]:
    """The attention option and why: the probe's fastest (auto) or the one asked for, the probe kept as evidence."""
    probe = None
    why_not = C.attention_available(a.core_attention) if a.core_attention != "auto" else None
    if why_not:
        raise SystemExit(f"error: core's attention option {a.core_attention!r} "
                         f"({C.ATTENTION[a.core_attention][0]}) cannot run: {why_not}")
    if "probe" not in a.skip:
        say("core attention probe (child process)")
        p = subprocess.run([sys.executable, __file__, "--probe-attention", "--comfyui", a.comfyui,
                            "--site-dir", a.site_dir, "--config", a.config], capture_output=True, text=True,
                           timeout=300)
        line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
        probe = json.loads(line) if line else {"error": (p.stderr or p.stdout)[-2000:]}
        res["core_attention_probe"] = probe
        write_json(res, out)
    if a.core_attention != "auto":
        return a.core_attention, "asked for (--core-attention)"
    timed = {C.option_of(k): v for k, v in (probe or {}).get("options", {}).items()
             if "seconds_median" in v and C.option_of(k)}
    usable = {k: v for k, v in timed.items()
              if v["rel_l2_vs_pytorch"] <= MAX_ATTENTION_REL_L2 and not v.get("fell_back_to_pytorch")}
    if not usable:
        fallback = "sage" if C.attention_available("sage") is None else "pytorch"
        return fallback, f"auto without a probe: {fallback} ({'importable' if fallback == 'sage' else 'no sage'})"
    best = min(usable, key=lambda k: usable[k]["seconds_median"])
    ms = ", ".join(f"{k} {v['seconds_median'] * 1e3:.1f} ms (rel-L2 vs SDPA {v['rel_l2_vs_pytorch']:.3g})"
                   for k, v in sorted(timed.items()))
    return best, (f"auto: the fastest of core's attention options at S={probe['seq']} whose output is within rel-L2 "
                  f"{MAX_ATTENTION_REL_L2} of SDPA's on random q/k/v: {ms}")


def time_core(mm, ops_mod, cfg, fmt, text, vs, as_, dev, compute, a) -> dict:
    """Build core's model in ``fmt`` and time its forwards (the model goes when this returns; then ``free``)."""
    t = time.perf_counter()
    ops, ops_info = C.pick_ops(ops_mod, fmt, compute, dev)
    with torch.inference_mode():
        model = C.build_core(mm, ops, cfg, fmt, compute, dev, seed=0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    r = {"format": fmt, "quant_config": C.quant_conf(fmt, cfg), "ops": ops_info,
         "build_seconds": time.perf_counter() - t, "weights": C.weight_summary(model)}
    if dev.type != "cuda" and fmt != "dense":
        r["cpu_emulated"] = "core's CPU fallbacks for the quantized linears: a plumbing check, not a timing"
    args, kw, rows = C.forward_inputs(mm, model, text, vs, as_, 0.95, compute, dev, SEED)
    r["packed_rows"] = rows
    say(f"core {fmt}: built in {r['build_seconds']:.1f} s ({r['weights']['bytes'] / 1e9:.1f} GB); {rows} rows")
    last = {}

    def forward():
        with torch.inference_mode():
            last["out"] = model(*args, **kw)

    for i in range(a.core_warmup):
        forward()
        say(f"core {fmt}: warm-up forward {i + 1} done")
    ts = C.timed(forward, a.core_iters, dev, warmup=0)
    v, au = last["out"]
    r.update({"forward_seconds": ts, "median_forward_seconds": statistics.median(ts),
              "outputs_finite": bool(torch.isfinite(v).all() and torch.isfinite(au).all()),
              "output_shapes": [list(v.shape), list(au.shape)]})
    if dev.type == "cuda":
        r["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    say(f"core {fmt}: median forward {r['median_forward_seconds']:.3f} s over {[round(x, 3) for x in ts]}")
    if dev.type == "cuda" and "profile" not in a.skip:
        r["kernels_of_one_forward"] = C.top_kernels(forward, 12)
    return r  # the model goes with this frame; the caller frees the cached memory (free)


def nvfp4_note(res: dict) -> str:
    """Why NVFP4 (our file's format) is not among core's formats here, from core's own capability check."""
    caps = res.get("core_capabilities")
    if caps is None:
        return "NVFP4 not measured (no GPU)."
    if caps["supports_nvfp4_compute"]:
        return "NVFP4 not measured although core runs it natively here (supports_nvfp4_compute): add it."
    return (f"NVFP4 not measured: core's supports_nvfp4_compute is False on compute capability "
            f"{'.'.join(map(str, caps['compute_capability']))}, so core would dequantize it per call (emulated).")


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def time_ours(cfg, text, vs, as_, dev, a) -> dict:
    t = time.perf_counter()
    rt = build(RuntimeOptions.from_env(device=dev.type), 0, cfg)
    r = {"build_seconds": time.perf_counter() - t, "backends": rt.backends}
    say(f"ours: built in {r['build_seconds']:.1f} s")
    job = tensor_job(rt, SampleInputs(text, None, torch.zeros(vs), torch.zeros(as_)),
                     SamplingSettings(seed=SEED, steps=a.our_steps, sampler="res_multistep"),
                     measure=Measure(a.our_runs, a.our_warmup), workload_extra={"text_source": f"random (seed {SEED})"})
    rep = run(job).report
    steps = [s["seconds"] for one in rep["per_step_seconds"] for s in one]
    r.update({"median_step_seconds": statistics.median(steps), "per_step_seconds": rep["per_step_seconds"],
              "steps": a.our_steps, "runs": a.our_runs, "warmup_runs": a.our_warmup, "workload": rep["workload"],
              "configuration": rep["configuration"], "peak_allocated_bytes": max(rep["peak_allocated_bytes"] or [0]),
              "latent_checksums": rep["latent_checksums"]})
    say(f"ours: median step {r['median_step_seconds']:.3f} s")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", default=str(ROOT / ".core_peer"), help="the folder scripts/pack_core_peer.sh wrote")
    ap.add_argument("--site-dir", default="/tmp/core_peer_site", help="where comfy-kitchen's archive is unpacked")
    ap.add_argument("--config", choices=sorted(WORKLOADS), default="full")
    ap.add_argument("--core-formats", default=None, help="comma list of int8,fp8,dense (default: int8,fp8 on a GPU, "
                                                         "dense on the CPU)")
    ap.add_argument("--core-attention", choices=["auto", *C.ATTENTION], default="auto")
    ap.add_argument("--core-warmup", type=int, default=1)
    ap.add_argument("--core-iters", type=int, default=3)
    ap.add_argument("--our-steps", type=int, default=3)
    ap.add_argument("--our-runs", type=int, default=2)
    ap.add_argument("--our-warmup", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list: probe,profile,ours")
    ap.add_argument("--out", default=None, help="default bench/results/core-peer-h200.json (full), "
                                                "/tmp/core-peer-tiny.json (tiny)")
    ap.add_argument("--probe-attention", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.skip = set(filter(None, a.skip.split(",")))
    low = [f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
           if k in ("core_iters", "our_steps", "our_runs") and v < 1]
    if low:
        raise SystemExit(f"error: {', '.join(low)}: expected at least 1")
    if a.probe_attention:
        return probe_child(a)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    formats = (a.core_formats or ("int8,fp8" if dev.type == "cuda" else "dense")).split(",")
    bad = [f for f in formats if f not in C.FORMATS or (f != "dense" and dev.type != "cuda" and a.config != "tiny")]
    if bad:
        raise SystemExit(f"error: --core-formats {','.join(bad)}: expected {', '.join(C.FORMATS)}; int8 and fp8 run "
                         f"core's quantized linears on comfy-kitchen's CUDA kernels and need a GPU (found {dev.type}; "
                         f"on the CPU only --config tiny builds them, through core's emulation, as a plumbing check)")
    if a.config == "full" and dev.type != "cuda":
        raise SystemExit("error: --config full needs the GPU (33B parameters); on the CPU use --config tiny")
    out = Path(a.out or (ROOT / "bench" / "results" / "core-peer-h200.json" if a.config == "full"
                         else "/tmp/core-peer-tiny.json"))
    cfg, canvas, text_len = WORKLOADS[a.config]
    vs, as_ = latent_shapes(*canvas)
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    core_log = C.CoreLog()
    logging.getLogger().addHandler(core_log)

    manifest = C.carried_paths(Path(a.comfyui), Path(a.site_dir))
    res = {"name": "core-peer-h200" if a.config == "full" else "core-peer-tiny",
           "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                                  if k.startswith("H3_")),
                                "python3", *(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])])]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
           "versions": versions(sageattention=package("sageattention")),
           "comfyui": {"repository": "kat3ri/ComfyUI (a snapshot of Comfy-Org/ComfyUI)",
                       "commit": manifest.get("commit"), "files_carried": len(manifest.get("files", {})),
                       "all_files_match_commit": manifest.get("all_files_match_commit"),
                       "packages": manifest.get("versions"), "carried_folder": a.comfyui},
           "workload": {"canvas": list(canvas), "video_latent": list(vs), "audio_latent": list(as_),
                        "text_tokens": text_len, "sampler": "res_multistep", "steps_of_the_canonical_run": 12,
                        "one_core_step": "one MiniMaxH3Model forward (text refined and layout built once per run, "
                                         "as core's extra_conds does); timestep sigma 0.95 x 1000"}}
    write_json(res, out)

    attention, why = choose_attention(a, res, out)
    before = torch_settings()
    mm, ops_mod, flags, bound = C.import_core(attention, dev.type == "cpu", Path(a.comfyui))
    import comfy.model_management as cmm

    res["versions"]["comfy_kitchen"] = package("comfy_kitchen")
    pinned = manifest.get("versions", {}).get("comfy-kitchen")
    if pinned and res["versions"]["comfy_kitchen"].get("version") != pinned:
        raise SystemExit(f"error: comfy-kitchen {res['versions']['comfy_kitchen']} was imported, not the carried "
                         f"{pinned} (another comfy_kitchen was imported first)")
    res["versions"]["comfy_aimdo"] = package("comfy_aimdo", manifest.get("versions", {}).get("comfy-aimdo"))
    res["configuration"] = {"core_flags": flags, "attention": {
        "option": attention, "flag": C.ATTENTION[attention][0], "optimized_attention_resolved_to": bound,
        "kernels_of_one_call": (res.get("core_attention_probe", {}).get("options", {})
                                .get(C.ATTENTION[attention][1], {}).get("kernels_of_one_call")),
        "why": why}}
    after = torch_settings()
    res["torch_settings_changed_by_core_import"] = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
    res["shape_check_full_config"] = C.shape_check(mm, ops_mod, FULL)
    if dev.type == "cuda":
        res["core_capabilities"] = {"supports_fp8_compute": cmm.supports_fp8_compute(dev),
                                    "supports_nvfp4_compute": cmm.supports_nvfp4_compute(dev),
                                    "compute_capability": list(torch.cuda.get_device_capability())}
    say(f"core imported: {bound} ({' '.join(flags)}); full-config parameters "
        f"{res['shape_check_full_config']['core_parameters'] / 1e9:.2f} B, same shapes as ours: "
        f"{res['shape_check_full_config']['same_shapes']}")
    write_json(res, out)

    text = torch.randn(1, text_len, cfg.text_dim, generator=torch.Generator().manual_seed(SEED))
    res["core"] = {}
    for fmt in formats:
        try:
            res["core"][fmt] = time_core(mm, ops_mod, cfg, fmt, text, vs, as_, dev, compute, a)
        except Exception as e:  # noqa: BLE001 - keep what the other formats measured
            res["core"][fmt] = {"error": f"{type(e).__name__}: {e}"[:400], "traceback": traceback.format_exc()[-1500:]}
            say(f"core {fmt}: FAILED {res['core'][fmt]['error']}")
        free(dev)
        if dev.type == "cuda":
            say(f"core {fmt}: freed; {torch.cuda.memory_allocated() / 1e9:.1f} GB still allocated")
        res["core_log_warnings"] = core_log.records[-20:]
        write_json(res, out)
    timed = {f: r for f, r in res["core"].items() if r.get("median_forward_seconds")}
    if any(f != "dense" for f in timed):  # the candidates: the fp8 or the int8 file; dense is a reference
        timed = {f: r for f, r in timed.items() if f != "dense"}
    if timed:
        best = min(timed, key=lambda f: timed[f]["median_forward_seconds"])
        res["core_median_step_seconds"] = timed[best]["median_forward_seconds"]
        res["core_forward_seconds"] = timed[best]["forward_seconds"]
        ms = ", ".join(f"{f} {r['median_forward_seconds']:.3f} s" for f, r in timed.items())
        res["configuration"]["weights"] = {
            "format": best, "quant_config": C.quant_conf(best, cfg), "ops": timed[best]["ops"],
            "why": f"the fastest of the formats measured ({ms}). int8 = the format of the shipped H3 DiT files "
                   "(int8_tensorwise ConvRot: comfy-kitchen quantizes each activation row, int8 GEMM); fp8 = a "
                   "comfy_quant float8_e4m3fn file (per-tensor weight scale, no input_scale: core casts activations "
                   "to e4m3 at scale 1, comfy-kitchen's fp8 linear). " + nvfp4_note(res)}
    fell_back = [r for r in core_log.records if "using pytorch attention instead" in r or "default SDPA" in r]
    res["configuration"]["attention"]["fallback_logged_during_core_forwards"] = fell_back[:3] or False
    write_json(res, out)

    if "ours" not in a.skip:
        try:
            res["ours"] = time_ours(cfg, text, vs, as_, dev, a)
        except Exception as e:  # noqa: BLE001 - keep core's numbers
            res["ours"] = {"error": f"{type(e).__name__}: {e}"[:400], "traceback": traceback.format_exc()[-1500:]}
        res["our_median_step_seconds"] = res["ours"].get("median_step_seconds")
        if res.get("core_median_step_seconds") and res["ours"].get("median_step_seconds"):
            res["ratio_core_over_ours"] = res["core_median_step_seconds"] / res["ours"]["median_step_seconds"]
    res["order"] = "core first (attention probe in a child process, then each format built, timed and freed), ours last"
    res["notes"] = [
        "Random weights at the real shapes for both; only the step time is compared.",
        "Core's model is built directly on the GPU (fully resident, as core's ModelPatcher loads a 33B model on a "
        "141 GB GPU): no ModelPatcher, no comfy-aimdo dynamic VRAM, PyTorch's default allocator (main.py would "
        "switch to cudaMallocAsync). The sampler's own arithmetic around the model call is not timed.",
        f"Ours: {a.our_runs} measured runs of {a.our_steps} steps after {a.our_warmup} warm-up run(s) (the "
        "canonical run has 12 steps; every res_multistep step makes one model call of the same shape).",
        "Core's AdaLN weights are bf16 here (the shipped int8 file keeps them in f16, cast per call) and the model "
        "is the full (not the pruned curve-form) AdaLN, as our canonical model.",
    ]
    res["total_seconds"] = time.perf_counter() - T0
    write_json(res, out)
    say(f"wrote {out}: core {res.get('core_median_step_seconds')} s/step, ours "
        f"{res.get('ours', {}).get('median_step_seconds')} s/step, ratio {res.get('ratio_core_over_ours')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
