#!/usr/bin/env python3
"""SM clocks, power and throttle reasons while the canonical evaluation runs, against isolated loops of its two
big kernels, plus the step's kernels by name.

    python3 bench/step_clocks.py [--evals 3] [--attn-iters 120] [--gemm-iters 100] [--out bench/results/step-clocks-h200.json]

``attention-inmodel-h200.json`` showed the bound attention taking ~50.5 ms in an isolated loop and a median
56.2 ms inside one evaluation, on the same buffers. This records what the GPU reports (``nvidia-smi`` sampled
every 20 ms in the background: SM clock, power draw, temperature, the active clock-event reasons) during
each phase: idle, a sustained loop of the bound attention (per-call CUDA-event times), a sustained loop of the
largest block GEMM (fc1's shape, fp8 rowwise ``_scaled_mm``), and back-to-back evaluations of the full model
with every attention call timed. Then one evaluation under the profiler: kernel time by kernel name (top 40).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, bench_command, build, component, is_annotation, time_ms, versions, write_json  # noqa: E402

from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402
from h3_blackwell.runtime.sampling.sampler import initial_noise  # noqa: E402

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


class Sampler:
    """``nvidia-smi --query-gpu`` every ``ms`` in a background process; each line stamped with the host's
    monotonic clock on arrival (the phases are stamped with the same clock after a device synchronize)."""

    def __init__(self, ms: int = 20):
        self.rows: list[tuple[float, str]] = []
        self.error = None
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                          f"-lms={ms}"], stdout=subprocess.PIPE, text=True)
        except Exception as e:  # no nvidia-smi: the phases still run, without samples
            self.proc, self.error = None, repr(e)
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.rows.append((time.monotonic(), line.strip()))

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def between(self, t0: float, t1: float) -> dict:
        vals = defaultdict(list)
        reasons = defaultdict(int)
        for t, line in self.rows:
            if not (t0 <= t <= t1):
                continue
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 5:
                continue
            for name, p in zip(("sm_mhz", "mem_mhz", "power_w", "temp_c"), parts[:4]):
                try:
                    vals[name].append(float(p))
                except ValueError:
                    pass
            reasons[parts[4]] += 1
        out = {"samples": len(vals["sm_mhz"])}
        for name, v in vals.items():
            if v:
                out[name] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        out["clock_event_reasons"] = dict(reasons)  # bitmask -> samples (0x4 sw power cap, 0x20/0x40 thermal)
        return out


def events_loop(fn, iters: int) -> list[float]:
    """CUDA-event times of ``iters`` back-to-back calls, in call order (no warmup)."""
    return time_ms(fn, iters, 0)["all"]


def summary(ts: list[float]) -> dict:
    n = len(ts)
    q = max(1, n // 4)
    return {"calls": n, "median": round(statistics.median(ts), 3), "min": round(min(ts), 3),
            "first_quarter_median": round(statistics.median(ts[:q]), 3),
            "last_quarter_median": round(statistics.median(ts[-q:]), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evals", type=int, default=3)
    ap.add_argument("--attn-iters", type=int, default=120)
    ap.add_argument("--gemm-iters", type=int, default=100)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step-clocks-h200.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    res = {"name": "step-clocks-h200", "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
           "versions": versions()}
    try:
        res["nvidia_smi_q"] = subprocess.run(["nvidia-smi", "-q", "-d", "POWER,CLOCK,PERFORMANCE,TEMPERATURE"],
                                             capture_output=True, text=True, timeout=30).stdout[-6000:]
    except Exception as e:
        res["nvidia_smi_q"] = repr(e)
    rt = build(RuntimeOptions.from_env(device="cuda", attention=a.attention), 0)
    res["attention"] = rt.backends["attention"]
    fn = rt.ops.attention
    cfg = rt.config
    dev = torch.device("cuda")
    s = 37810
    phases = {}
    smp = Sampler()
    res["sampler_error"] = smp.error

    def phase(name, body):
        torch.cuda.synchronize()
        time.sleep(1.0)  # idle between phases, so each starts from the same state
        t0 = time.monotonic()
        out = body()
        torch.cuda.synchronize()
        t1 = time.monotonic()
        phases[name] = {"seconds": round(t1 - t0, 3), "gpu": smp.between(t0, t1), **(out or {})}
        print(name, {k: v for k, v in phases[name].items() if k != "gpu"}, phases[name]["gpu"].get("sm_mhz"),
              phases[name]["gpu"].get("power_w"), flush=True)

    t0 = time.monotonic()
    time.sleep(1.5)
    phases["idle"] = {"gpu": smp.between(t0, time.monotonic())}

    qkv = torch.randn(s, 3 * cfg.num_heads * cfg.head_dim, device=dev, dtype=torch.float32).to(torch.bfloat16)
    fn(qkv)
    phase("attention_loop", lambda: {"ms": summary(events_loop(lambda: fn(qkv), a.attn_iters))})
    del qkv

    k, n = cfg.hidden_size, 2 * cfg.ffn_hidden_size
    a8 = torch.randn(s, k, device=dev).to(torch.float8_e4m3fn)
    w8 = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    sa = torch.rand(s, 1, device=dev) + 0.5
    sb = torch.rand(1, n, device=dev) + 0.5

    def gemm():
        return torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)

    gemm()
    flop = 2 * s * k * n

    def gemm_phase():
        ts = events_loop(gemm, a.gemm_iters)
        return {"ms": summary(ts), "tflops_median": round(flop / (statistics.median(ts) * 1e-3) / 1e12, 1)}

    phase("fc1_gemm_loop", gemm_phase)
    del a8, w8

    g = torch.Generator().manual_seed(440420)
    text = torch.randn(1, 100, cfg.text_dim, generator=g)
    vshape, ashape = (1, 24, 37, 48, 84), (1, 32, 2, 207)
    nv, na = initial_noise(440420, vshape, ashape)
    ev_all = []

    def wrapped(x):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = fn(x)
        e1.record()
        ev_all.append((e0, e1))
        return out

    ops = rt.ops.with_attention(wrapped)
    with torch.no_grad():
        plan = rt.model.plan(text, vshape, ashape, [0.95])
        rt.model.evaluate(plan, 0, nv, na, rt.ops)  # warm

        def evals():
            ev_all.clear()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(a.evals):
                rt.model.evaluate(plan, 0, nv, na, ops)
            e1.record()
            torch.cuda.synchronize()
            ts = [x.elapsed_time(y) for x, y in ev_all]
            per = len(ts) // a.evals
            return {"evaluation_ms": round(e0.elapsed_time(e1) / a.evals, 1),
                    "attention_ms_all": summary(ts),
                    "attention_ms_by_evaluation": [summary(ts[i * per:(i + 1) * per]) for i in range(a.evals)],
                    "attention_first_5": [round(t, 3) for t in ts[:5]]}

        phase("evaluations", evals)

        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rt.model.evaluate(plan, 0, nv, na, rt.ops)
            torch.cuda.synchronize()
    smp.stop()
    by_name = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and not is_annotation(ev.name):
            by_name[ev.name][0] += ev.device_time / 1000
            by_name[ev.name][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
    res["kernels_by_name"] = [{"name": n[:160], "component": component(n), "ms": round(v[0], 3), "launches": v[1]}
                              for n, v in top]
    res["phases"] = phases
    print(f"wrote {write_json(res, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
