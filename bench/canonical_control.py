#!/usr/bin/env python3
"""The canonical H3 job with and without a v2 Fun ControlNet tower, in the same process on the same model.

    python3 bench/canonical_control.py [--runs 2 --warmup 1] [--steps 12] [--out bench/results/canonical-h200-control.json]

1. A full-size H3 (50 blocks, random weights) through the runtime's own plan + streaming load (bench/_h3bench.py),
   and a v2 tower (10 control blocks after base blocks 0, 5, .., 45; full-form adaLN; random weights) through
   ``runtime.io.control.load_control`` on the same plan: its block linears quantized like the base's (NVFP4,
   run by the same W4A8 / W4A4 BlockOps), its adaLN where the plan keeps the base's.
2. The canonical workload (1344x768, 124 frames, 37,810 rows, 12 steps, seed 440420, res_multistep): --runs
   measured runs after --warmup, first without the tower, then with it active at every step (a 49-channel hint,
   strength 1, window [0, 1]), then without it again (drift check).
3. The tower's share of the step: (with - without) / with, from the medians; per active step the tower also adds
   ``len(places)`` FC2 calls, which the reports' FC2 counts must show.

``--tiny`` runs the same stages on the embedded tiny config on any device (a smoke test of the script).
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
from _h3bench import ROOT, bench_command, build, versions, write_json  # noqa: E402

from h3_blackwell.runtime.io.control import ControlSpec, load_control  # noqa: E402
from h3_blackwell.runtime.model.conditioning import ControlHint, H3Conditioning  # noqa: E402
from h3_blackwell.runtime.model.config import FULL, TINY  # noqa: E402
from h3_blackwell.runtime.model.control import FunControl  # noqa: E402
from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402
from h3_blackwell.runtime import Measure, SampleInputs, SamplingSettings, run, tensor_job  # noqa: E402


class RandomControlSource:
    """Random tower weights made one tensor at a time on the device (the reading interface load_control takes):
    norms 1, vectors N(0, 0.02), matrices N(0, 1/fan_in) (adaLN x0.3, after/before_proj x0.1)."""

    def __init__(self, spec: ControlSpec, seed: int, dtype: torch.dtype):
        with torch.device("meta"):
            m = FunControl(spec.block_config, spec.places, dtype)
        self._meta = m.state_dict()
        self._index = {k: i for i, k in enumerate(self._meta)}
        self.spec, self.seed, self.name = spec, seed, f"random v2 tower (seed {seed})"

    def keys(self):
        return list(self._meta)

    def quant_layers(self):
        return set()

    def quant_format(self, layer):
        return None

    def tensor(self, k, device="cpu"):
        if torch.device(device).type == "cpu" and torch.cuda.is_available():
            return self.tensor(k, "cuda").cpu()
        ref = self._meta[k]
        g = torch.Generator(device=device).manual_seed(self.seed * 100003 + self._index[k])
        t = torch.empty(ref.shape, dtype=ref.dtype, device=device)
        if t.dim() == 1:
            return t.fill_(1.0) if "norm" in k else t.normal_(0.0, 0.02, generator=g)
        scale = 0.3 if "adaln" in k else 0.1 if ("after_proj" in k or "before_proj" in k) else 1.0
        return t.normal_(0.0, t.shape[1] ** -0.5 * scale, generator=g)


def _run(rt, text, vshape, ashape, steps, runs, warmup, tower=None, hint=None):
    cond = H3Conditioning(seed=440420, control=hint)
    r = run(tensor_job(rt, SampleInputs(text, None, torch.zeros(vshape), torch.zeros(ashape), cond),
                       SamplingSettings(seed=440420, steps=steps, sampler="res_multistep"),
                       measure=Measure(runs, warmup), control=tower,
                       workload_extra={"frames": 124, "text_source": "random (seed 440420)"}))
    rep = r.report
    flat = [s["seconds"] for run in rep["per_step_seconds"] for s in run]
    return {"median_step_seconds": statistics.median(flat), "median_sampling_seconds": rep["median_sampling_seconds"],
            "per_step_seconds": rep["per_step_seconds"], "peak_allocated_bytes": rep["peak_allocated_bytes"],
            "latent_checksums": rep["latent_checksums"], "fc2_dispatch": rep["fc2_dispatch"],
            "control": rep.get("control"), "memory": _memory(rep.get("memory"))}, r


def _memory(m):
    """The report's memory block, less its per-block lists: the budget and what the plan made of it."""
    if not m:
        return m
    keep = ("budget", "vram_budget_bytes", "outside_bytes", "ffn_chunk_rows", "control_tower_streams",
            "peak_allocated_bytes", "bytes_copied_per_step", "copy_ms_per_step", "copy_exposed_ms_per_step")
    out = {k: m[k] for k in keep if k in m}
    out["streamed_block_count"] = len(m.get("streamed_blocks") or [])
    out["estimate_total_bytes"] = (m.get("estimate") or {}).get("total_bytes")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "canonical-h200-control.json"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    cuda = torch.cuda.is_available()
    cfg = TINY if a.tiny else FULL
    res = {"name": "canonical-h200-control", "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions()}
    t0 = time.perf_counter()
    opts = RuntimeOptions.from_env(device="cuda" if cuda else "cpu")
    rt = build(opts, 0, cfg)
    res["build_seconds"] = time.perf_counter() - t0
    res["backends"] = rt.backends
    blocks = 10 if not a.tiny else 2
    places = tuple(range(0, 50, 5)) if not a.tiny else (0, 2)
    spec = ControlSpec(blocks, places, cfg.curve_form, cfg.time_embed_dim, cfg.hidden_size, cfg.num_heads,
                       cfg.head_dim, cfg.ffn_hidden_size)
    resident_before = torch.cuda.memory_allocated() if cuda else None
    t1 = time.perf_counter()
    tower = load_control(RandomControlSource(spec, 7, rt.dtype), rt.plan, rt.config)
    if cuda:
        torch.cuda.synchronize()
    res["tower"] = {"describe": tower.describe(), "load_seconds": time.perf_counter() - t1,
                    "block_linear_types": sorted({type(getattr(getattr(b, p), n)).__name__
                                                  for b in tower.control_blocks
                                                  for p, n in (("attn", "qkv_proj"), ("attn", "out_proj"),
                                                               ("mlp", "fc1"), ("mlp", "fc2"))}),
                    "device_bytes": tower.device_bytes(rt.device) if cuda else 0}
    if cuda:
        res["tower"]["resident_bytes_after_tower"] = torch.cuda.memory_allocated()
        res["tower"]["resident_bytes_before_tower"] = resident_before
    write_json(res, out)

    g = torch.Generator().manual_seed(440420)
    if a.tiny:
        vshape, ashape, text_len = (1, 24, 7, 16, 16), (1, 32, 2, 37), 32
    else:
        vshape, ashape, text_len = (1, 24, 37, 48, 84), (1, 32, 2, 207), 100
    text = torch.randn(1, text_len, cfg.text_dim, generator=g)
    hint = ControlHint(torch.randn(1, 49, *vshape[2:], generator=g), 1.0, 1.0, 0.0)
    res["without"], _ = _run(rt, text, vshape, ashape, a.steps, a.runs, a.warmup)
    write_json(res, out)
    res["with_control"], rc = _run(rt, text, vshape, ashape, a.steps, a.runs, a.warmup, tower, hint)
    write_json(res, out)
    res["without_again"], _ = _run(rt, text, vshape, ashape, a.steps, max(1, a.runs - 1), 0)
    base = statistics.median([res["without"]["median_step_seconds"], res["without_again"]["median_step_seconds"]])
    w = res["with_control"]["median_step_seconds"]
    res["tower_share_of_step"] = (w - base) / w
    res["tower_seconds_per_step"] = w - base
    res["summary"] = {
        "step_seconds_without": base, "step_seconds_with_v2_tower": w,
        "tower_share_of_step": res["tower_share_of_step"],
        "control_active_steps": len(res["with_control"]["control"]["active_steps"]),
        "fc2_consistent_with": res["with_control"]["fc2_dispatch"].get("consistent_with_configuration"),
        "fc2_required_per_run_with": res["with_control"]["fc2_dispatch"].get("required_per_run"),
        "hashes_exact_with": res["with_control"]["latent_checksums"].get("exact_across_measured_runs"),
        "peak_allocated_with": max(res["with_control"]["peak_allocated_bytes"] or [0]),
        "peak_allocated_without": max(res["without"]["peak_allocated_bytes"] or [0]),
    }
    res["total_seconds"] = time.perf_counter() - t0
    write_json(res, out)
    print(res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
