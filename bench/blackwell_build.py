#!/usr/bin/env python3
"""The Blackwell build matrix (issue 40): everything of ours compiled for sm_100a, sm_120a and sm_121a without a
Blackwell GPU, into ``bench/results/blackwell-build.json``.

    TRITON_DEFAULT_FP_FUSION=1 python3 bench/blackwell_build.py --device-json DIR/device-builds.json \
        [--device-logs DIR/logs] [--targets sm_100a,sm_120a,sm_121a] [--out bench/results/blackwell-build.json]

* Triton: every launched kernel of ours (``runtime/ops/triton/aot.py`` finds them in the source; the device
  helpers are inlined into them) at the canonical job's launch, compiled for each target by this machine's
  Triton (no GPU needed); registers and spills from its ptxas log, shared memory from the compiled metadata.
* FC2 (``csrc/fc2_nvfp4_lt.cpp``): compiled by nvcc for each target (``-x cu -gencode arch=compute_Xa,code=sm_Xa``,
  object only: the source is host C++ calling cuBLASLt, so the object is the same for every target and there is
  no device code to link; the runtime builds it with the host compiler at load, ``runtime/fc2/ext.py``).
* SageAttention2 / SageAttention3: built from source on the GPU machine by ``bench/blackwell_device_builds.sh``
  (all seven builds at once on 16 cores, so each ``seconds`` is a wall time under that shared load); this script
  reads that machine's ``device-builds.json`` and, with ``--device-logs``, counts ptxas's registers and spills per
  build from its logs.
* FlashAttention-4: what the package index holds (``detail.flash_attention_4``) and its import and guard on the
  GPU machine (from the logs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said out loud (before the import)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _h3bench import ROOT, bench_command, versions, write_json  # noqa: E402

from h3_blackwell.runtime.fc2 import ext as fc2_ext  # noqa: E402
from h3_blackwell.runtime.ops.blackwell_table import TARGETS  # noqa: E402
from h3_blackwell.runtime.ops.triton import aot  # noqa: E402

NOT_APPLICABLE = "not applicable"


def _run(cmd: list[str], timeout: int = 60) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({type(e).__name__}: {e})"


def local_toolchain(nvcc: str) -> dict:
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = {p.name: _run([str(p), "--version"]).splitlines()[-1] for p in sorted(bin_dir.glob("ptxas*"))}
    return {"nvcc": _run([nvcc, "--version"]).splitlines()[-2:], "nvcc_path": nvcc,
            "nvcc_gpu_archs": _run([nvcc, "--list-gpu-arch"]).split(), "triton": triton.__version__,
            "triton_ptxas": ptxas, "gcc": _run(["gcc", "--version"]).splitlines()[0],
            "machine": "CPU only (no GPU), 2 cores shared"}


def device_toolchain(lines: list[str]) -> dict:
    out = {}
    for ln in lines:
        key, _, val = ln.partition(":") if ":" in ln.split(" ")[0] else ln.partition(" ")
        out[key.strip()] = val.strip()
    return out


def triton_target(arch: int) -> tuple[dict, dict]:
    """({launch: result}, {launch: seconds}) for one target."""
    res, secs = {}, {}
    for name, launch in aot.canonical_launches().items():
        t0 = time.perf_counter()
        res[name] = aot.compile_launch(name, launch, arch)
        secs[name] = round(time.perf_counter() - t0, 2)
        print(f"  triton {name} sm_{arch}a: {res[name]}", flush=True)
    return res, secs


def by_kernel(launches: dict[str, dict]) -> dict[str, dict]:
    """``{kernel name: result}`` from ``{launch name: result}``: a kernel launched in several modes
    (``name[MODE=m]``) is ok only where every mode compiled; its registers, shared bytes and spills are the
    largest of its modes, its error the first (each mode's own record stays in ``detail.triton_launch_results``)."""
    out: dict[str, dict] = {}
    for launch, r in launches.items():
        k = aot.kernel_of(launch)
        if k not in out:
            out[k] = dict(r)
            continue
        o = out[k]
        o["ok"] = bool(o["ok"] and r["ok"])
        for f in ("registers", "shared_bytes", "spills"):
            vals = [v for v in (o[f], r[f]) if v is not None]
            o[f] = max(vals) if vals else None
        o["error"] = o["error"] or r["error"]
    return out


def _fc2_flags() -> list[str]:
    from torch.utils import cpp_extension
    import torch
    paths = fc2_ext.find_cuda()
    inc = [*paths.include_dirs, *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([f"-I{d}" for d in inc] + ["-std=c++17", "-O2", "-Xcompiler", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-DTORCH_EXTENSION_NAME={fc2_ext.EXT_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H"])


def fc2_target(nvcc: str, target: str, flags: list[str]) -> tuple[dict, dict]:
    """({"ok", "error"}, detail) of the FC2 source compiled by nvcc for ``target`` (sm_XXXa)."""
    arch = target[3:]
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / "fc2.o"
        cmd = [nvcc, "-x", "cu", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-c", str(fc2_ext.SOURCE),
               "-o", str(obj), *flags]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        secs = round(time.perf_counter() - t0, 1)
        ok = r.returncode == 0 and obj.exists()
        detail = {"seconds": secs, "command": " ".join(cmd[:7]) + " <flags: torch, CUDA 13 headers>",
                  "object_bytes": obj.stat().st_size if ok else None}
        if ok:
            import triton  # its wheel carries a cuobjdump where the toolkit has none
            dirs = (Path(nvcc).resolve().parent, Path("/usr/local/cuda/bin"),
                    Path(triton.__file__).parent / "backends" / "nvidia" / "bin")
            tool = next((str(d / "cuobjdump") for d in dirs if (d / "cuobjdump").exists()), shutil.which("cuobjdump"))
            detail["cuobjdump_list_elf"] = _run([tool, "--list-elf", str(obj)]) if tool else "(no cuobjdump)"
        err = None if ok else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:1500]
    return {"ok": ok, "error": err}, detail


def ptxas_summary(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", text)]
    return {"entry_functions": len(re.findall(r"Compiling entry function", text)),
            "max_registers": max(regs) if regs else None,
            "functions_with_spill_stores": sum(1 for s in spills if s > 0),
            "max_spill_store_bytes": max(spills) if spills else None,
            "local_memory_warnings": len(re.findall(r"Local memory used", text))}


def fa4_record(device_logs: str | None) -> dict:
    """FlashAttention-4 on the package index (``pip download --pre --no-deps flash-attn-4``: what the newest wheel
    holds) and, from the GPU machine's log, its import there and its guard's answer."""
    import zipfile
    rec: dict = {"package": "flash-attn-4"}
    with tempfile.TemporaryDirectory() as tmp:
        out = _run([sys.executable, "-m", "pip", "download", "-q", "--pre", "--no-deps", "-d", tmp, "flash-attn-4"],
                   timeout=300)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            return {**rec, "index": f"no wheel downloaded: {out[-500:]}"}
        with zipfile.ZipFile(wheels[0]) as zf:
            names = zf.namelist()
            meta = next(zf.read(n).decode() for n in names if n.endswith("METADATA"))
    rec.update(
        wheel=wheels[0].name, files=len(names),
        compiled_files=[n for n in names if n.endswith((".so", ".cubin", ".fatbin"))],
        sm100_sources=sorted(n for n in names if "sm100" in n and n.endswith(".py")),
        requires=[ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")
                  and "extra ==" not in ln],
        build_for_sm100="no prebuilt binary exists: a pure-Python wheel whose SM100 kernels the CuTe DSL compiles "
                        "at the first call (nothing to build ahead of time here)")
    log = Path(device_logs or "") / "fa4.txt"
    if device_logs and log.exists():
        rec["gpu_machine"] = log.read_text(errors="replace").strip().splitlines()[-12:]
    return rec


def sage_entry(build: dict | None) -> dict | str:
    if build is None:
        return NOT_APPLICABLE
    return {"ok": bool(build.get("ok")), "seconds": build.get("seconds"), "error": build.get("error")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-json", required=True, help="device-builds.json of bench/blackwell_device_builds.sh")
    ap.add_argument("--device-logs", default=None, help="its logs folder (for ptxas figures per build)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/bin/nvcc")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "blackwell-build.json"))
    a = ap.parse_args(argv)
    dev = json.loads(Path(a.device_json).read_text())
    builds = dev.get("builds", {})
    targets = [t for t in a.targets.split(",") if t]
    flags = _fc2_flags()
    out = {"name": "blackwell-build", "command": bench_command(argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": {"triton_and_fc2": "this CPU machine (no GPU)",
                      "sage_builds": next((v for k, v in device_toolchain(dev["toolchain"]).items() if k == "gpu"),
                                          "?") + " machine, 16 cores (no Blackwell GPU: compiled, never run)"},
           "versions": versions(),
           "toolchain": {"cpu_machine": local_toolchain(a.nvcc), "gpu_machine": device_toolchain(dev["toolchain"])},
           "targets": {}, "detail": {"triton_launches": {}, "triton_seconds": {}, "fc2": {}, "sage_builds": {}}}
    out["detail"]["triton_helpers_inlined_into"] = aot.helper_callers()
    out["detail"]["triton_launches"] = {n: {k: (str(v) if not isinstance(v, (int, float, bool)) else v)
                                            for k, v in launch.items()}
                                        for n, launch in aot.canonical_launches().items()}
    for target in targets:
        arch = int(target[3:-1])
        print(f"== {target}", flush=True)
        tri, secs = triton_target(arch)
        fc2, fc2_detail = fc2_target(a.nvcc, target, flags)
        print(f"  fc2 {target}: {fc2} {fc2_detail.get('seconds')} s", flush=True)
        short = target.replace("_", "")
        out["detail"].setdefault("triton_launch_results", {})[target] = tri
        out["targets"][target] = {"triton": by_kernel(tri), "fc2": fc2, "sage2": sage_entry(builds.get(f"sage2_{short}")),
                                  "sage3": sage_entry(builds.get(f"sage3_{short}"))}
        out["detail"]["triton_seconds"][target] = secs
        out["detail"]["fc2"][target] = fc2_detail
        write_json(out, a.out)  # rewritten after every target, so a cut-short run keeps what it compiled
    for name, b in builds.items():
        d = {k: b.get(k) for k in ("ok", "rc", "seconds", "limit_s", "error", "produced")}
        if a.device_logs:
            logs = Path(a.device_logs)  # scripts/device_build_sage2.sh keeps pip's (verbose) log apart
            d["ptxas"] = ptxas_summary(logs / f"{name}.pip.log" if (logs / f"{name}.pip.log").exists()
                                       else logs / f"{name}.log")
        out["detail"]["sage_builds"][name] = d
    out["detail"]["sage_builds_wall_s"] = dev.get("wall_s")
    out["detail"]["flash_attention_4"] = fa4_record(a.device_logs)
    write_json(out, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
