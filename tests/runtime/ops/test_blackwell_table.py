"""The Blackwell table (runtime/ops/blackwell_table.py) against the real guards (runtime/blackwell_guards.py):
at every capability, head dim and dtype the guard's verdict must be the table's, with the device's capability
answered by a stand-in (no GPU here) and each library present as a stand-in module, so that only the guards'
own conditions decide. Also: the README's generated rows, and the committed build matrix for every entry
the table says was compiled."""

import json
import types
from pathlib import Path

import pytest
import torch

from h3_blackwell.runtime import blackwell_guards
from h3_blackwell.runtime.fc2 import guard as fc2_guard
from h3_blackwell.runtime.fc2.table import GB10_CANONICAL
from h3_blackwell.runtime.ops import attention, blackwell_attention, gemm_backends, sage
from h3_blackwell.runtime.ops.blackwell_table import (BY_NAME, CAPABILITIES, ENTRIES, README_BEGIN, README_END,
                                                       TARGETS, readme_rows)

ROOT = Path(blackwell_guards.__file__).resolve().parents[1]
DEV = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device whose capability the test sets, with every Blackwell library importable as a stand-in."""
    state = {"cc": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: state["cc"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # probes run a real GEMM / attention call: stood in (the guards' static conditions are under test here)
    monkeypatch.setattr(gemm_backends, "probe_backend", lambda b, d: (True, "probe stood in"))
    monkeypatch.setattr(attention, "_probe", lambda *a, **k: (True, "probe stood in"))
    sa2 = types.SimpleNamespace(sageattn_qk_int8_pv_fp8_cuda=1, sageattn_qk_int8_pv_fp8_cuda_sm90=1,
                                core=types.SimpleNamespace(SM89_ENABLED=True, SM90_ENABLED=True))
    monkeypatch.setattr(sage, "sage2_module", lambda: (sa2, "2.2.0"))
    libs = {"sageattn3": types.SimpleNamespace(sageattn3_blackwell=1),
            "flash_attn.cute": types.SimpleNamespace(flash_attn_func=1)}
    monkeypatch.setattr(blackwell_attention, "_import", lambda name: libs[name])

    def fc2_env(device, build_info=None):  # a build against the entry's own headers and libraries
        e = GB10_CANONICAL
        return fc2_guard.Fc2Environment(state["cc"], 48, e.cuda_header[0] * 1000 + e.cuda_header[1] * 10,
                                        e.cublas_header[0] * 10000 + e.cublas_header[1] * 100, e.cuda_runtime,
                                        e.cublaslt_runtime, device_name="stand-in")
    monkeypatch.setattr(blackwell_guards, "fc2_environment", fc2_env)
    return state


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_guard_runs_exactly_where_the_table_says(fake_gpu, entry):
    for cc in CAPABILITIES:
        fake_gpu["cc"] = cc
        ok, why = blackwell_guards.verdict(entry.name, DEV)
        assert ok == entry.runs_on(cc), f"{entry.name} at sm_{cc[0]}{cc[1]}: guard says {ok} ({why}), table " \
                                        f"says {entry.arch_names()}"
        if not ok:
            assert f"{cc[0]}{cc[1]}" in why or f"{cc[0]}.{cc[1]}" in why, why  # the refusal names this device


@pytest.mark.parametrize("name", ["sage2", "sage3", "fa4"])
def test_guard_head_dims_and_dtypes_are_the_tables(fake_gpu, name):
    entry = BY_NAME[name]
    fake_gpu["cc"] = entry.archs[-1]
    for d in range(1, 300):
        ok, why = blackwell_guards.verdict(name, DEV, head_dim=d)
        assert ok == entry.head_dim_ok(d), f"{name} head_dim {d}: guard {ok} ({why}), table: {entry.head_dims}"
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        ok, why = blackwell_guards.verdict(name, DEV, dtype=dt)
        assert ok == (str(dt).replace("torch.", "") in entry.dtypes), (name, dt, why)


def test_guard_constants_agree_with_the_table():
    """Where a guard keeps its own constants (sage2's plans, the FC2 entry), they are the table's."""
    non_sm90 = {cc for cc, plan in sage.SAGE2_PLANS.items() if plan[0] != sage.SAGE2_SM90_FN}
    assert non_sm90 == set(BY_NAME["sage2"].archs)
    assert (GB10_CANONICAL.cc,) == BY_NAME["fc2_gb10"].archs
    assert blackwell_attention.SAGE3_ARCHS == BY_NAME["sage3"].archs
    assert blackwell_attention.FA4_ARCHS == BY_NAME["fa4"].archs


def test_guards_refuse_off_cuda_without_raising():
    for e in ENTRIES:
        ok, why = blackwell_guards.verdict(e.name, "cpu")
        assert not ok and why, (e.name, why)
    with pytest.raises(ValueError, match="expected one of"):
        blackwell_guards.verdict("fa5", "cpu")


def test_readme_rows_are_generated_from_the_table():
    text = (ROOT / "README.md").read_text()
    assert README_BEGIN in text and README_END in text, "README lacks the generated Blackwell rows"
    block = text[text.index(README_BEGIN):text.index(README_END) + len(README_END)]
    assert block.splitlines() == readme_rows(), "README's Blackwell rows differ: paste readme_rows() in"


def test_compiled_entries_are_ok_in_the_build_matrix():
    """Each entry the table says is compiled ahead of time is ok in bench/results/blackwell-build.json for every
    target it runs on, and the library builds exist for the targets the table lists."""
    data = json.loads((ROOT / "bench" / "results" / "blackwell-build.json").read_text())
    for e in ENTRIES:
        if e.build not in ("sage2", "sage3", "fc2"):
            assert e.build.startswith("none:"), e.build
            continue
        for target, cc in TARGETS.items():
            if e.runs_on(cc):
                rec = data["targets"][target][e.build]
                assert isinstance(rec, dict) and rec["ok"], (e.name, target, rec)
