#!/usr/bin/env python3
"""The bound attention function on the model's own qkv buffers against random ones, at the canonical shape.

    python3 bench/attention_inmodel.py [--blocks 0,25,49] [--out bench/results/attention-inmodel-h200.json]

In the canonical step the attention component takes more per block than the same bound call on random q/k/v in
``attention_h200.py``. This separates the two candidate causes: the data (a full-size random-weight H3's own
normed q/k/v, captured from one evaluation at sigma 0.95, for the listed blocks) and the surroundings (the
isolated loop here vs the step). Each buffer is timed in an isolated loop (CUDA events, median of --iters after
--warmup calls), and one evaluation of the whole model is timed with every attention call wrapped in events.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, bench_command, build, time_ms, versions, write_json  # noqa: E402

from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402
from h3_blackwell.runtime.sampling.sampler import initial_noise  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="0,25,49")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention-inmodel-h200.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    want = {int(b) for b in a.blocks.split(",")}
    res = {"name": "attention-inmodel-h200", "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
           "versions": versions()}
    rt = build(RuntimeOptions.from_env(device="cuda", attention=a.attention), 0)
    res["attention"] = rt.backends["attention"]
    fn = rt.ops.attention  # the run's bound attention function, through its ops
    captured, events, calls = {}, [], [0]

    def wrapped(qkv):
        i = calls[0]
        calls[0] += 1
        if i in want:
            captured[i] = qkv.clone()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = fn(qkv)
        e1.record()
        events.append((e0, e1))
        return out

    g = torch.Generator().manual_seed(440420)
    text = torch.randn(1, 100, rt.config.text_dim, generator=g)
    vshape, ashape = (1, 24, 37, 48, 84), (1, 32, 2, 207)
    nv, na = initial_noise(440420, vshape, ashape)
    ops = rt.ops.with_attention(wrapped)
    with torch.no_grad():
        plan = rt.model.plan(text, vshape, ashape, [0.95])
        rt.model.evaluate(plan, 0, nv, na, ops)  # warm
        torch.cuda.synchronize()
        events.clear()
        calls[0] = 0
        captured.clear()
        rt.model.evaluate(plan, 0, nv, na, ops)
        torch.cuda.synchronize()
    in_step = [e0.elapsed_time(e1) for e0, e1 in events]
    res["in_evaluation_ms"] = {"median": statistics.median(in_step), "min": min(in_step), "max": max(in_step),
                               "calls": len(in_step), "first_5": [round(t, 3) for t in in_step[:5]]}
    rows = {}
    for i, qkv in sorted(captured.items()):
        t = time_ms(lambda: fn(qkv), a.iters, a.warmup)
        rnd = torch.randn(qkv.shape, device=qkv.device, dtype=torch.float32).to(qkv.dtype)
        t_rnd = time_ms(lambda: fn(rnd), a.iters, a.warmup)
        q = qkv.float()
        rows[f"block_{i}"] = {"model_qkv_ms": round(t["median"], 3), "random_same_shape_ms": round(t_rnd["median"], 3),
                              "model_qkv_absmax": float(q.abs().max()), "model_qkv_std": float(q.std())}
        rnd = q = None
        print(f"block {i}: model qkv {t['median']:.2f} ms, random {t_rnd['median']:.2f} ms", flush=True)
    res["isolated"] = rows
    print(f"in evaluation: median {res['in_evaluation_ms']['median']:.2f} ms over {len(in_step)} calls", flush=True)
    print(f"wrote {write_json(res, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
