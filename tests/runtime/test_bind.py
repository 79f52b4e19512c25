"""The plan decides, everything else binds (issue 22): below cli/ and nodes/ only runtime/options.py and
runtime/plan.py read RuntimeOptions, and no choice is re-derived per layer or per call once a model is loaded.

* a scan of runtime/'s source for option reads outside those two files;
* a loaded tiny model (NVFP4 W4A4, W4A8, dense, sparse on the CPU) runs whole sampling runs with every chooser,
  resolver and binder made to raise: the forward only calls what the load bound;
* the FC2 dispatcher matches its table once per kind of call and run, not once per call;
* the plan's producer tiles reach the bound ops and layers (nothing global).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from h3_blackwell.runtime import RuntimeOptions, load_model
from fixtures.sampling import sample
from h3_blackwell.runtime.model.config import TINY

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
READERS = {"options.py", "plan.py"}  # the only modules that read RuntimeOptions
OPTION_NAMES = {f.name for f in dataclasses.fields(RuntimeOptions)} | {
    n for n, v in vars(RuntimeOptions).items() if isinstance(v, property) or (callable(v) and not n.startswith("_"))}


def _option_reads(path: Path) -> list[str]:
    """Option reads in one module: anything read through an ``.options`` attribute (``plan.options.gemm``; handing
    the whole options on is not a read), an option read through a name called ``options`` / ``opts``, and any
    ``RuntimeOptions.<attr>`` other than the ``from_env`` constructor."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        where = f"{path.relative_to(path.parents[1])}:{node.lineno}"
        if isinstance(node.value, ast.Attribute) and node.value.attr == "options":
            found.append(f"{where}: .options.{node.attr}")
        elif isinstance(node.value, ast.Name) and node.value.id in ("options", "opts") and node.attr in OPTION_NAMES:
            found.append(f"{where}: {node.value.id}.{node.attr}")
        elif isinstance(node.value, ast.Name) and node.value.id == "RuntimeOptions" and node.attr != "from_env":
            found.append(f"{where}: RuntimeOptions.{node.attr}")
    return found


def test_only_options_and_plan_read_runtime_options():
    reads = [r for p in sorted(RUNTIME.rglob("*.py")) if p.name not in READERS or p.parent != RUNTIME
             for r in _option_reads(p)]
    assert not reads, ("RuntimeOptions read outside runtime/options.py and runtime/plan.py (take the plan's "
                       f"choices and settings instead): {reads}")


def test_the_scan_finds_option_reads(tmp_path):
    """Control: the scan above sees each kind of read it forbids."""
    p = tmp_path / "_scan_probe.py"
    p.write_text("def f(plan, options):\n    g(plan.options)\n"
                 "    return plan.options.gemm, options.act_scale, RuntimeOptions.CHOICES, RuntimeOptions.from_env()\n")
    got = _option_reads(p)
    assert sorted(g.split(": ", 1)[1] for g in got) == [".options.gemm", "RuntimeOptions.CHOICES", "options.act_scale"]


def _forbid_choosing(monkeypatch):
    """Every chooser, resolver and binder raises from here on (the names where their callers look them up)."""
    from h3_blackwell.runtime import load, plan
    from h3_blackwell.runtime.ops import (attention, block_ops, gemm_backends, linear, nvfp4_producers, registry, sage,
                                          sparse_attention)

    def refuse(name):
        def raiser(*a, **k):
            raise AssertionError(f"{name} called after load: a choice re-derived per call")
        return raiser

    for mod, name in [(registry, "resolve"), (registry, "bind"), (registry, "capability_table"),
                      (gemm_backends, "choose_gemm_backend"), (gemm_backends, "gemm_capability_table"),
                      (gemm_backends, "bind_gemm"), (gemm_backends, "probe_backend"), (linear, "bind_gemm"),
                      (attention, "choose_attention_backend"), (attention, "bind_attention"),
                      (attention, "_available"), (attention, "_probe"), (sage, "v_handling_status"),
                      (sage, "bind_sage2"), (sage, "bind_sage1"), (sparse_attention, "choose_sparse"),
                      (sparse_attention, "sparse_check"), (sparse_attention, "bind_sparse"),
                      (nvfp4_producers, "activation_global_scale"), (plan, "make_plan"), (plan, "resolve_device"),
                      (load, "make_plan"), (load, "bind_attention"), (block_ops, "build_ops")]:
        monkeypatch.setattr(mod, name, refuse(f"{mod.__name__}.{name}"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 6, 5120, generator=g), torch.randn(1, TINY.video_channels, 2, 4, 4, generator=g),
            torch.randn(1, TINY.audio_channels, 2, 4, generator=g))


@pytest.mark.parametrize("kw, ops_name", [
    (dict(), "nvfp4"),
    (dict(gemm="fp8"), "w4a8"),
    (dict(quantize=False), "reference"),
    (dict(attention="sparse", sparse_min_tokens=0, sparse_start=0.0), "nvfp4"),
])
def test_a_forward_calls_no_chooser_after_load(monkeypatch, kw, ops_name):
    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", **kw))
    assert rt.ops.name == ops_name
    if rt.plan.quantize:
        lins = [blk.mlp.fc2 for blk in rt.model.blocks]
        assert {lin.backend for lin in lins} == {rt.plan.gemm}  # the plan's choice, bound in every layer
    text, video, audio = _inputs()
    before = sample(rt, text, None, video, audio, seed=2, steps=1)
    _forbid_choosing(monkeypatch)
    again = sample(rt, text, None, video, audio, seed=2, steps=1)  # raises if anything chooses per call
    assert again.report["latent_checksums"]["video_sha256"] == before.report["latent_checksums"]["video_sha256"]
    if "attention" in kw:
        assert rt.sparse is not None and rt.sparse.calls["sparse"] > 0


def test_fc2_table_is_matched_once_per_run_not_per_call(monkeypatch, tmp_path):
    """The tiny NVFP4 model with a guarded FC2 dispatcher (its extension absent here, so every call falls back on
    the same bytes): blocks x steps FC2 calls per run, one table match per run."""
    from h3_blackwell.runtime.fc2 import dispatcher as D
    from h3_blackwell.runtime.fc2.ext import ExtStatus
    from h3_blackwell.runtime.fc2.lt_plans import LtPlanLayer
    from h3_blackwell.runtime.fc2.table import GB10_CANONICAL, Fc2Table

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32"))
    cache = str(tmp_path / "cache")
    d = D.Fc2Dispatcher(cache, table=Fc2Table([GB10_CANONICAL]),
                        plan_layer=LtPlanLayer(cache, ExtStatus(ok=False, reason="no extension in this CPU test")),
                        compat=False)
    assert not hasattr(d, "options")
    rt.fc2, rt.ops.base.fc2_dispatcher = d, d
    matches = []
    real = D.match_call
    monkeypatch.setattr(D, "match_call", lambda table, call: matches.append(call) or real(table, call))
    text, video, audio = _inputs()
    steps = 2
    for run in range(2):
        res = sample(rt, text, None, video, audio, seed=2, steps=steps)
        n = TINY.num_layers * steps
        assert res.report["fc2_dispatch"]["runs"][0]["attempts"] == n
        assert len(matches) == run + 1, f"{len(matches)} table matches after {run + 1} runs of {n} FC2 calls"
    assert res.report["fc2_dispatch"]["runs"][0]["fallbacks"] == n


def test_the_plans_tiles_reach_the_bound_ops_and_layers(tmp_path):
    """producer_tiles: read once by the plan (a choice in the report), handed to the W4A8 ops' producers and to
    every layer's fp8 expansion; no module state changes."""
    p = tmp_path / "tiles.json"
    p.write_text('{"device": "test", "rms": ["row", 1, 256, 4], "to_fp8_rowwise": [8, 512, 4]}')
    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", gemm="fp8", producer_tiles=str(p)))
    assert rt.backends["producer_tiles"]["choice"] == str(p) and "measured on test" in rt.backends["producer_tiles"]["reason"]
    assert rt.ops.base.tiles is rt.plan.tiles and rt.plan.tiles.fp8 == {"rms": ("row", 1, 256, 4)}
    assert {blk.attn.qkv_proj.fp8_tiles for blk in rt.model.blocks} == {(8, 512, 4)}
    plain = load_model(None, RuntimeOptions(device="cpu", dtype="float32", gemm="fp8"))
    assert plain.ops.base.tiles.fp8 == {} and "producer_tiles" not in plain.backends
    assert {blk.attn.qkv_proj.fp8_tiles for blk in plain.model.blocks} == {None}
