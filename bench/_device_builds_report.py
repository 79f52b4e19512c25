"""The JSON of bench/blackwell_device_builds.sh: per build its exit status, seconds, error (the log's last error
lines) and what it produced (each .so with its size and the cubin architectures ``cuobjdump --list-elf`` lists).

    python bench/_device_builds_report.py WORK_DIR LOG_DIR START_EPOCH > device-builds.json
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time


def _elf_archs(path: str) -> list[str]:
    tool = shutil.which("cuobjdump")
    if tool is None:
        return ["(cuobjdump not found)"]
    r = subprocess.run([tool, "--list-elf", path], capture_output=True, text=True, timeout=60)
    return sorted(set(re.findall(r"sm_\d+[af]?", r.stdout))) or [f"(none listed; rc {r.returncode})"]


def _produced(site: str) -> list[dict]:
    out = []
    for root, _, files in os.walk(site):
        for f in sorted(files):
            if f.endswith(".so"):
                p = os.path.join(root, f)
                out.append({"file": os.path.relpath(p, site), "bytes": os.path.getsize(p), "cubins": _elf_archs(p)})
    return out


def _error(log: str) -> str:
    try:
        lines = open(log, errors="replace").read().splitlines()
    except OSError:
        return "no log"
    hits = [ln for ln in lines if re.search(r"error|Error|ERROR|Killed|Terminated", ln)]
    return " | ".join((hits or lines)[-6:])[-1500:]


def _one(name: str, work: str, logs: str) -> dict:
    try:
        rc, secs, limit = (int(x) for x in open(os.path.join(logs, f"{name}.rc")).read().split())
    except (OSError, ValueError):
        return {"ok": False, "rc": None, "seconds": None, "error": "no status file: the build never finished"}
    site = os.path.join(work, f"site_{name}")
    produced = _produced(site) if os.path.isdir(site) else []
    ok = rc == 0 and bool(produced)
    err = None
    if rc == 124 or rc == 137:
        err = f"stopped at its time limit of {limit} s (the device budget of this call), not a compile error"
    elif not ok:
        err = _error(os.path.join(logs, f"{name}.log")) if rc else "exit 0 but no .so produced"
    return {"ok": ok, "rc": rc, "seconds": secs, "limit_s": limit, "error": err, "produced": produced}


def main(work: str, logs: str, t0: str) -> dict:
    names = sorted(f[:-3] for f in os.listdir(logs) if f.endswith(".rc"))
    names += [n for n in ("sage2_sm90", "sage2_sm100a", "sage2_sm120a", "sage2_sm121a", "sage3_sm100a",
                          "sage3_sm120a", "sage3_sm121a") if n not in names]
    toolchain = open(os.path.join(logs, "toolchain.txt"), errors="replace").read().splitlines()
    return {"toolchain": toolchain, "wall_s": int(time.time()) - int(t0),
            "builds": {n: _one(n, work, logs) for n in sorted(set(names))}}


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(f"usage: {sys.argv[0]} WORK_DIR LOG_DIR START_EPOCH")
    print(json.dumps(main(*sys.argv[1:]), indent=1))
