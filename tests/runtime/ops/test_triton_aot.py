"""The ahead-of-time Triton compile (runtime/ops/triton/aot.py, bench/blackwell_build.py): the enumeration finds
every @triton.jit function of the source, the canonical launch table fits every launched kernel's parameters, the
committed build matrix covers every launch x target, and one real compile for sm_121a runs on this CPU machine."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from h3_blackwell.runtime.ops.blackwell_table import TARGETS
from h3_blackwell.runtime.ops.triton import aot

ROOT = Path(aot.__file__).resolve().parents[3]
BUILD_JSON = ROOT / "bench" / "results" / "blackwell-build.json"


def _jit_names_by_regex() -> set[str]:
    """An independent count: the function after every ``@triton.jit`` decorator line in the package's source."""
    names = set()
    for path in (ROOT / "runtime").rglob("*.py"):
        names |= set(re.findall(r"^@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+)", path.read_text(), re.M))
    return names


def test_enumeration_covers_every_jit_function():
    found = aot.jit_functions()
    assert set(found) == _jit_names_by_regex(), "a @triton.jit function outside runtime/ops/triton or missed"
    entries, helpers = set(aot.entry_kernels()), aot.helper_callers()
    assert entries | set(helpers) == set(found) and not entries & set(helpers)
    for helper, callers in helpers.items():
        assert callers, f"{helper} is called by no launched kernel: it would never be compiled"
    launched = {aot.kernel_of(n) for n in aot.canonical_launches()}
    assert launched == entries, f"launch table {sorted(launched ^ entries)} vs entry kernels"


def test_launch_table_fits_each_kernels_parameters():
    for name, launch in aot.canonical_launches().items():
        pos, const, opts = aot.split_launch(name, launch)
        params = aot.kernel_params(aot.kernel_of(name))
        assert len(pos) + len(const) == len(params)
        assert set(opts) <= {"num_warps", "num_stages", "enable_fp_fusion"}
    bad = dict(aot.canonical_launches()["gate_add_kernel"], EXTRA=1)
    with pytest.raises(ValueError, match="unknown \\['EXTRA'\\]"):
        aot.split_launch("gate_add_kernel", bad)


def test_build_matrix_covers_every_launch_and_target():
    data = json.loads(BUILD_JSON.read_text())
    assert set(data["toolchain"]) and set(data["targets"]) == set(TARGETS)
    for target, t in data["targets"].items():
        assert set(t["triton"]) == {aot.kernel_of(n) for n in aot.canonical_launches()}, target
        assert set(data["detail"]["triton_launch_results"][target]) == set(aot.canonical_launches()), target
        for name, r in t["triton"].items():
            assert set(r) == {"ok", "registers", "shared_bytes", "spills", "error"}, (target, name)
            assert r["ok"] or r["error"], (target, name)
        assert set(t["fc2"]) == {"ok", "error"}
        for lib in ("sage2", "sage3"):
            assert t[lib] == "not applicable" or set(t[lib]) == {"ok", "seconds", "error"}, (target, lib)


def test_one_real_compile_for_sm121a():
    """Triton's own compiler and ptxas for sm_121a, no GPU (a subprocess: this session interprets kernels)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = ("import json; from h3_blackwell.runtime.ops.triton import aot; n = 'gate_add_kernel'; "
            "good = aot.canonical_launches()[n]; bad = dict(good, BLOCK_N=100); "  # tl.arange needs a power of 2
            "print(json.dumps([aot.compile_launch(n, good, 121), aot.compile_launch(n, bad, 121)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res, bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert not bad["ok"] and bad["registers"] is None and "power of 2" in bad["error"], bad
    assert res["ok"] and res["error"] is None, res
    assert 0 < res["registers"] <= 255 and res["spills"] == 0 and res["shared_bytes"] >= 0
