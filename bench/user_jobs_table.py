#!/usr/bin/env python3
"""The README's results table against ComfyUI core, generated from bench/results/user-jobs.json (issue 37).

    python3 bench/user_jobs_table.py [--json bench/results/user-jobs.json] [--readme README.md] [--check]

Writes the section between ``<!-- user-jobs:begin -->`` and ``<!-- user-jobs:end -->`` of the README (appended under
"## Results against ComfyUI core" when the markers are absent): one line per row of the JSON, its date and card.
Nothing is written without the JSON (no placeholder numbers); --check exits 1 when the README is not current.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- user-jobs:begin -->", "<!-- user-jobs:end -->"


def _cell(side: dict, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if "error" in side:
        return "error"
    v = side.get(key)
    return "-" if v is None else fmt.format(v / scale)


def _load(side: dict) -> str:
    """Seconds before sampling: the file, the LoRA and (core) load_models_gpu."""
    parts = [side.get(k) for k in ("load_seconds", "lora_seconds", "load_models_gpu_seconds")]
    return "error" if "error" in side else "-" if parts[0] is None else f"{sum(p or 0.0 for p in parts):.1f}"


def _error(side: dict, name: str) -> str:
    """A stack's error in a line: its first sentence or two (an out-of-memory error to what it tried to allocate) and
    the innermost frame of the traceback outside site-packages."""
    err = side.get("error")
    if not err:
        return ""
    text = err.split(". GPU ")[0].split("\n")[0][:100]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', side.get("traceback", ""))
    ours = [f for f in frames if "site-packages" not in f[0]]
    where = f" (at {Path(ours[-1][0]).name}:{ours[-1][1]} {ours[-1][2]})" if ours else ""
    return f"{name}: {text}{where}"


def _core_device_key(side: dict) -> str:
    """Core's device memory: the driver's view after each step where measured (DynamicVRAM's weights live outside
    torch's allocator, so its peak reserved misses them), else torch's peak reserved."""
    return "device_used_after_steps_max_bytes" if side.get("device_used_after_steps_max_bytes") else \
        "peak_reserved_bytes"


def _vs_resident(o: dict) -> str:
    """A capped row of ours against the same job's resident row, as the bench compared them
    (``user_jobs.compare_to_resident``: same card only): its step over the resident step, and the hashes."""
    if o.get("resident_note"):
        return "ours: resident row on another card"
    if o.get("step_ratio_to_resident") is None:
        return ""
    text = f"ours {o['step_ratio_to_resident']:.2f}x its resident step"
    same = o.get("hashes_equal_resident")
    return text + ("" if same is None else ", the resident hashes" if same else ", hashes differ from resident")


def _ordered(rows: list) -> list:
    """Rows grouped by job (in the order the jobs first appear), each job's resident row first, then the larger
    cap: the order a reader compares them in, whichever call measured them."""
    jobs = list(dict.fromkeys(r["job"] for r in rows))
    return sorted(rows, key=lambda r: (jobs.index(r["job"]), -(r["cap_gb"] or float("inf"))))


def _lease(r: dict) -> str:
    """The lease (device machine) that measured a row, short: both stacks' where they differ (a stack not run has
    none)."""
    ids = list(dict.fromkeys(r[s]["lease"][:8] for s in ("ours", "core") if r[s].get("lease")))
    return " / ".join(ids) or "-"


def table(res: dict) -> str:
    """The markdown section for one results file."""
    lines = [f"Measured {res['date'][:10]} on {res['device']} (the last call: `{res['command']}`; core: "
             f"{res['core_stack']}). The lease column names the device machine that measured the row.", "",
             "| job | cap | ours s/step | ours load+LoRA s | ours job s | ours peak reserved GB | ours host RSS GB | "
             "core s/step | core load+LoRA s | core job s | core device GB | core host RSS GB | speedup | lease | "
             "note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in _ordered(res["rows"]):
        o, c = r["ours"], r["core"]
        cap = _cap_text(r)
        sp = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        note = "; ".join(x for x in (f"card: {r['card']}" if r.get("card") else "", _vs_resident(o),
                                     _error(o, "ours"),
                                     _error(c, "core"),
                                     "error" not in o and "error" not in c and r.get("speedup_note", "")[:80])
                         if x).replace("|", "/")
        lines.append(f"| {r['job']} | {cap} | {_cell(o, 'step_seconds')} | {_load(o)} | "
                     f"{_cell(o, 'job_seconds', fmt='{:.1f}')} | {_cell(o, 'peak_reserved_bytes', 1e9)} | "
                     f"{_cell(o, 'host_peak_rss_bytes', 1e9)} | {_cell(c, 'step_seconds')} | {_load(c)} | "
                     f"{_cell(c, 'job_seconds', fmt='{:.1f}')} | {_cell(c, _core_device_key(c), 1e9)} | "
                     f"{_cell(c, 'host_peak_rss_bytes', 1e9)} | {sp} | {_lease(r)} | {note} |")
    if any(r["core"].get("dynamic_vram") == "on" for r in res["rows"]):
        lines += ["", "Core's load+LoRA column is its file open, patch set-up and `load_models_gpu`: under DynamicVRAM "
                  "its weights reach the device, with the LoRA's patches, during its first step, which its job time "
                  "holds (and its s/step, a median, does not). Its host RSS counts the pages of its memory-mapped "
                  "checkpoint file (the whole file, at every cap). Its device GB is the driver's view after each step, "
                  "the largest (this process's and the CUDA context's; torch's peak reserved misses DynamicVRAM's "
                  "weights): under a cap it can exceed the cap, since the per-process fraction binds torch's "
                  "allocator only."]
    behind = [f"{r['job']} {_cap_text(r)}" for r in res["rows"]
              if ((r["ours"].get("load") or {}).get("choice") == "behind the first step")]
    if behind:
        lines += ["", "Ours loaded behind the first step on " + ", ".join(behind) + " (`runtime.pending_load`): its "
                  "load+LoRA column there is the time before sampling starts (the plan, and the LoRA file read and "
                  "checked); the pass and the block merges run into the first step, which its job time holds."]
    return "\n".join(lines)


def _cap_text(row: dict) -> str:
    return "resident" if row["cap_gb"] is None else f"{row['cap_gb']} GB"


def render(readme: str, section: str) -> str:
    body = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in readme and END in readme:
        head, rest = readme.split(BEGIN, 1)
        return head + body + rest.split(END, 1)[1]
    return readme.rstrip("\n") + "\n\n## Results against ComfyUI core\n\n" + body + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "user-jobs.json"))
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    src = Path(a.json)
    if not src.is_file():
        print(f"error: {src} not found: run bench/user_jobs.py on the GPU first (no table without measurements)",
              file=sys.stderr)
        return 2
    readme = Path(a.readme).read_text()
    new = render(readme, table(json.loads(src.read_text())))
    if a.check:
        return 0 if new == readme else 1
    Path(a.readme).write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
