#!/usr/bin/env python3
"""What a first run on a Blackwell GPU (GB10 sm_121, RTX 50 sm_120, B200 sm_100) must measure, with its own
PASS / FAIL lines (issue 40).

    python3 bench/blackwell_first_run.py [--device cuda:0] [--out bench/results/canonical-gb10.json]
                                         [--canonical-json FILE] [--runs 3 --warmup 1]

1. Guards: every entry of ``runtime/ops/blackwell_table.py`` asked of its real guard on this device
   (``runtime/blackwell_guards.py``). On a device the table lists for the entry, the guard must let it run
   (PASS) or it is a FAIL with the guard's reason (a missing package says how to get it). On any other device the
   line says it is REFUSED here and why: that is the expected answer, not a failure, and nothing is claimed.
2. On a Blackwell device only (or on ``--canonical-json``, a canonical JSON measured before): the canonical job
   with the seed's measurement policy (``bench/canonical.py``: 1 warm-up, 3 measured runs, the profiled step),
   then FC2 600/600 with no fallback (sm_121, the seed's entry), latent hashes exact across the measured runs,
   and the seed's canonical figures side by side with ours and with the GB10 plan's expectation
   (``bench/results/blackwell-plan.json``).
Exit status 1 only for a FAIL on a device the entries target; elsewhere 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(HERE.parent.parent))  # the folder holding h3_blackwell/

from h3_blackwell.runtime.blackwell_guards import verdict  # noqa: E402
from h3_blackwell.runtime.ops.blackwell_table import ENTRIES, TARGETS  # noqa: E402

# the seed's GB10 profile (shared/seeds/000_3e334eaf6714be9c.txt, 2026-08-26, torch 2.9.1+cu130, CUDA 13.0):
SEED = {
    "median_sampling_seconds": 255.447, "median_step_seconds": 21.3, "peak_allocated_gb": 44.446,
    "fc2": "600/600, 0 fallbacks, every run",
    "video_sha256": "c62d23a42972eab907ba42f93c50247ff17a9c454b4a53fe93d2e34f9fefe578",
    "components_ms": {"sage2": 13029.2, "nvfp4_gemms": 4167.9, "nvfp4_packing": 2026.9, "norm_and_rope": 1084.4,
                      "remaining_gate_add": 549.3, "other": 37.4},
}
PLAN_JSON = HERE / "results" / "blackwell-plan.json"  # bench/blackwell_plan.py
PLAN_PART = {(12, 1): "gb10", (12, 0): "rtx5090"}  # the plan's expectation for this capability (else GB10's)
PLAN_NAMES = {"sage2": "attention", "nvfp4_gemms": "nvfp4_gemms", "nvfp4_packing": "producers_and_packing",
              "norm_and_rope": "norm_and_rope", "remaining_gate_add": "gate_add", "other": "other"}


def _cc(device: torch.device):
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def guard_lines(device: torch.device) -> tuple[list[str], int]:
    """The guard line of every entry, and the number of FAILs."""
    cc = _cc(device)
    here = f"sm_{cc[0]}{cc[1]}" if cc else str(device)
    lines, fails = [], 0
    for e in ENTRIES:
        ok, why = verdict(e.name, device)
        if cc is not None and e.runs_on(cc):
            tag = "PASS" if ok else "FAIL"
            fails += not ok
        elif ok:
            tag, fails = "FAIL", fails + 1
            why = f"the guard lets it run on {here}, the table says {e.arch_names()} only: {why}"
        else:
            tag = "REFUSED here (expected)"
            why = f"{why}  [{e.name} runs on {e.arch_names()}; this device is {here}]"
        lines.append(f"{tag:<24} guard {e.name}: {why}")
    return lines, fails


def _gb(b) -> str:
    return f"{b / 1e9:.1f} GB" if isinstance(b, (int, float)) else "-"


def _plan() -> dict:
    try:
        return json.loads(PLAN_JSON.read_text())
    except (OSError, ValueError):
        return {}


def canonical_lines(d: dict, cc) -> tuple[list[str], int]:
    """PASS/FAIL lines and the side-by-side table for a canonical JSON ``d`` measured on capability ``cc``."""
    lines, fails = [], 0
    fc2 = d.get("fc2_dispatch", {})
    runs = fc2.get("runs", [])
    if cc == (12, 1):
        ok = bool(runs) and all(r.get("attempts") == r.get("successes") == 600 and r.get("fallbacks") == 0
                                for r in runs)
        fails += not ok
        lines.append(f"{'PASS' if ok else 'FAIL':<24} FC2 600/600: runs {runs} (seed: {SEED['fc2']})")
    else:
        lines.append(f"{'NOT APPLICABLE':<24} FC2 600/600: the seed's entry is sm_121 only; runs here {runs}")
    exact = d.get("latent_checksums", {}).get("exact_across_measured_runs")
    fails += exact is not True
    lines.append(f"{'PASS' if exact is True else 'FAIL':<24} latent hashes exact across measured runs: {exact} "
                 f"(video {str(d.get('latent_checksums', {}).get('video_sha256'))[:16]}...; the seed's "
                 f"{SEED['video_sha256'][:16]}... is another model's weights: not comparable)")
    part = PLAN_PART.get(tuple(cc) if cc else None, "gb10")
    plan = _plan().get("expected", {}).get(part, {})
    lines.append(f"{'':<24} {'figure':<26}{'seed (GB10)':>14}{'expected ' + part:>18}{'measured':>14}")
    rows = [("sampling s (median)", SEED["median_sampling_seconds"], plan.get("sampling_seconds"),
             d.get("median_sampling_seconds")),
            ("s/step (median)", SEED["median_step_seconds"], plan.get("step_seconds"), d.get("median_step_seconds")),
            ("peak allocated", _gb(SEED["peak_allocated_gb"] * 1e9), _gb(plan.get("peak_allocated_bytes")),
             _gb(d.get("peak_allocated_bytes")))]
    comps = d.get("components", {}) or {}
    for name, ms in SEED["components_ms"].items():
        got = comps.get(name, comps.get("attention") if name == "sage2" else None)
        got = got.get("milliseconds") if isinstance(got, dict) else got
        rows.append((f"{name} ms/step", ms, plan.get("components_ms", {}).get(PLAN_NAMES[name]), got))
    for name, seed, exp, got in rows:
        f = (lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else str(v if v is not None else "-"))
        lines.append(f"{'':<24} {name:<26}{f(seed):>14}{f(exp):>18}{f(got):>14}")
    return lines, fails


def run_canonical(out: str, runs: int, warmup: int) -> dict:
    cmd = [sys.executable, str(HERE / "canonical.py"), "--runs", str(runs), "--warmup", str(warmup),
           "--skip", "peer", "--out", out]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(HERE / "results" / "canonical-gb10.json"))
    ap.add_argument("--canonical-json", default=None, help="evaluate this canonical JSON instead of running it")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cc = _cc(dev)
    name = torch.cuda.get_device_name(dev) if cc else "no CUDA device"
    print(f"device {dev}: {name}, capability {cc}, torch {torch.__version__}, cuda {torch.version.cuda}")
    blackwell = cc in TARGETS.values()
    lines, fails = guard_lines(dev)
    print("\n".join(lines))
    if a.canonical_json or blackwell:
        d = json.loads(Path(a.canonical_json).read_text()) if a.canonical_json else run_canonical(
            a.out, a.runs, a.warmup)
        more, f2 = canonical_lines(d, tuple(d.get("compute_capability", cc) or ()) or cc)
        print("\n".join(more))
        fails += f2
    else:
        targets = ", ".join(TARGETS)
        print(f"{'NOT RUN':<24} canonical job, FC2 600/600, hashes, the seed's figures: this device is not a "
              f"Blackwell target ({targets}); nothing is measured or claimed here")
    print(f"summary: {fails} FAIL" + ("" if blackwell else " (not a Blackwell device: exit 0)"))
    return 1 if (blackwell and fails) else 0


if __name__ == "__main__":
    sys.exit(main())
