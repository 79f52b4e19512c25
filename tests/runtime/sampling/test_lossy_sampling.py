"""The LOSSY speed options end to end on the CPU (tiny model): First-Block Cache through the sampler and the
model's block stack, sparse attention as a registered backend (its reference kernel on the CPU) with core's
schedule switch, the report blocks, the CLI flags and the refusals."""

import dataclasses
import json
import math

import pytest
import torch

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime import RuntimeOptions, load_model
from fixtures.sampling import sample
from h3_blackwell.runtime.errors import H3Error
from h3_blackwell.runtime.model.layout import latent_shapes
from h3_blackwell.runtime.ops import sparse_attention as SA
from h3_blackwell.runtime.sampling.step_cache import FirstBlockCache
from fixtures.reports import report_hashes

CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def rt():
    return load_model(None, RuntimeOptions(**CPU), tiny_seed=0)


def _inputs(width=128, height=96, frames=22, seed=0):
    v, a = latent_shapes(width, height, frames)
    text = torch.randn(1, 9, 5120, generator=torch.Generator().manual_seed(seed))
    return text, None, torch.zeros(v), torch.zeros(a)


def test_first_block_cache_threshold_zero_is_exactly_uncached(rt):
    plain = sample(rt, *_inputs(), seed=3, steps=4)
    cached = sample(rt, *_inputs(), seed=3, steps=4, first_block_cache=0.0)
    assert report_hashes(cached) == report_hashes(plain)
    fbc = cached.report["first_block_cache"]
    assert fbc["lossy"] and fbc["threshold"] == 0.0 and fbc["reused_steps"] == []
    assert sorted(fbc["rel_l1"]) == ["1", "2", "3"]          # compared every step after the first
    assert "first_block_cache" not in plain.report and "sparse_attention" not in plain.report


def test_first_block_cache_reuses_and_reports_the_steps(rt):
    plain = sample(rt, *_inputs(), seed=3, steps=4)
    cached = sample(rt, *_inputs(), seed=3, steps=4, first_block_cache=10.0, runs=2)
    fbc = cached.report["first_block_cache"]
    assert fbc["reused_steps"] == [1, 2, 3] and fbc["reused_steps_per_measured_run"] == [[1, 2, 3]] * 2
    assert report_hashes(cached) != report_hashes(plain)
    assert cached.report["latent_checksums"]["exact_across_measured_runs"]


def test_forced_reuse_adds_exactly_the_cached_residual_of_the_real_blocks(rt):
    m = rt.model
    text, tags, video, audio = _inputs()
    with torch.no_grad():
        plan = m.plan(text, tuple(video.shape), tuple(audio.shape), [0.9, 0.8])
        g = torch.Generator().manual_seed(5)
        x0 = m.pack(plan, torch.randn(video.shape, generator=g), torch.randn(audio.shape, generator=g))
        x1 = m.pack(plan, torch.randn(video.shape, generator=g), torch.randn(audio.shape, generator=g))
        segs = plan.times[0].mod_segments
        first0 = m.blocks[0](x0.clone(), plan.mods[0][0], segs, plan.cos, plan.sin, rt.ops, 0)
        uncached0 = m.run_blocks(x0.clone(), plan, 0, rt.ops)
        residual = uncached0 - first0
        cache = plan.step_cache = FirstBlockCache(math.inf)  # installed on the plan, as the model call does
        out0 = m.run_blocks(x0.clone(), plan, 0, rt.ops)
        segs1 = plan.times[1].mod_segments
        first1 = m.blocks[0](x1.clone(), plan.mods[1][0], segs1, plan.cos, plan.sin, rt.ops, 0)
        out1 = m.run_blocks(x1.clone(), plan, 1, rt.ops)
    assert torch.equal(out0, uncached0)                     # a computed step is the uncached stack, bit for bit
    assert cache.reused_steps == [1]
    assert torch.equal(out1, first1 + residual)              # a reused step: block 0 plus the cached residual


@pytest.fixture(scope="module")
def rt_sparse():
    return load_model(None, RuntimeOptions(**CPU, quantize=False, attention="sparse", sparse_min_tokens=0,
                                           sparse_extra_tokens=0), tiny_seed=0)


@pytest.fixture(scope="module")
def rt_reference():
    return load_model(None, RuntimeOptions(**CPU, quantize=False, attention="reference"), tiny_seed=0)


# dense linears (the reference stack) keep these runs to seconds on the CPU;
# a canvas long enough for sparse routing to matter: 12 latent frames x 48 rows + 130 audio + 9 text = 715 rows
BIG = dict(width=256, height=192, frames=39)


def test_sparse_backend_registered_and_reported(rt_sparse):
    ch = rt_sparse.plan.report()
    assert ch["attention"]["choice"] == "sparse" and "LOSSY" in ch["attention"]["reason"]
    assert ch["attention_dense"]["choice"] == "reference" and ch["sparse"]["choice"] == "sol-attn (tau 1.3)"
    assert rt_sparse.sparse is not None and rt_sparse.sparse.kernel is None  # the eager reference
    # the blocks consult the bound sparse attention; a copy with another attention (the Fun tower's dense ops,
    # a forward outside a run) never does
    assert rt_sparse.ops.sparse is rt_sparse.sparse and rt_sparse.ops.with_attention(lambda qkv: qkv).sparse is None


def test_sparse_runs_on_the_schedule_and_changes_only_sparse_steps(rt_sparse, rt_reference):
    dense = sample(rt_reference, *_inputs(**BIG), seed=1, steps=4)
    sparse = sample(rt_sparse, *_inputs(**BIG), seed=1, steps=4)
    rep = sparse.report["sparse_attention"]
    # 4 steps at shift 12: model sigmas 1.0, 0.973, 0.923, 0.8; core's rule: sparse at or below 0.9796
    assert rep["lossy"] and rep["dense_steps"] == [0] and rep["sparse_steps"] == [1, 2, 3]
    assert rep["calls"] == {"sparse": 3 * 3, "dense": 3}  # 3 tiny blocks per step
    lay_rows = sparse.report["workload"]["packed_tokens"]
    assert rep["sink_rows"][1] >= lay_rows - 12 * 48 and rep["dense_query_rows"][0] <= 9
    rel = float((sparse.video - dense.video).norm() / dense.video.norm())
    # never sparse (start at 100 %): every step runs the dense backend (fp32 exact attention on the qkv buffer), so
    # the reference run up to fp32 summation order (the reference stack's attention is torch SDPA on q, k, v)
    never = sample(rt_sparse, *_inputs(**BIG), seed=1, steps=4,
                   sparse=dataclasses.replace(rt_sparse.sparse.settings, start_percent=1.0))
    assert never.report["sparse_attention"]["sparse_steps"] == []
    rel_never = float((never.video - dense.video).norm() / dense.video.norm())
    assert rel_never < 1e-5 and 100 * rel_never < rel < 0.5, (rel_never, rel)   # lossy, but the same picture


def test_sparse_tau_per_call_and_refusals(rt, rt_sparse):
    a = sample(rt_sparse, *_inputs(**BIG), seed=1, steps=2, sparse_tau=0.5)
    b = sample(rt_sparse, *_inputs(**BIG), seed=1, steps=2, sparse_tau=3.0)
    assert a.report["sparse_attention"]["tau"] == 0.5 and b.report["sparse_attention"]["tau"] == 3.0
    assert report_hashes(a) != report_hashes(b)
    with pytest.raises(H3Error, match="attention=sparse"):
        sample(rt, *_inputs(), seed=1, steps=2, sparse_tau=1.3)
    if not torch.cuda.is_available():
        with pytest.raises(SA.SparseUnavailable, match="cannot run"):
            SA.choose_sparse("cuda")
    for bad in (dict(sparse_tau=-1.0), dict(sparse_start=1.5), dict(sparse_extra_tokens=100),
                dict(first_block_cache=float("nan"))):
        with pytest.raises(ValueError):
            RuntimeOptions(**CPU, **bad)


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "g"
    assert cli.main(["generate", "--output", str(out), "--steps", "2", "--dense", "--attention", "sparse",
                     "--sparse-min-tokens", "0", "--sparse-extra-tokens", "0", "--sparse-tau", "1.6",
                     "--first-block-cache", "0.05"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["sparse_attention"]["tau"] == 1.6 and rep["sparse_attention"]["lossy"]
    assert rep["first_block_cache"]["threshold"] == 0.05
    assert cli.main(["generate", "--output", str(tmp_path / "bad"), "--sparse-tau", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: option sparse_tau=-1.0")


def test_cli_sparse_method_flags(tmp_path):
    """--sparse-method / --sparse-keep-percent / --dense-blocks reach the run (the report's settings) and VSA on a
    checkpoint without to_gate_compress runs the fine stage with the warning in the report."""
    out = tmp_path / "v"
    assert cli.main(["generate", "--output", str(out), "--steps", "3", "--dense", "--attention", "sparse",
                     "--sparse-method", "vsa", "--sparse-keep-percent", "30", "--dense-blocks", "1",
                     "--sparse-min-tokens", "0", "--width", "256", "--height", "192", "--frames", "39"]) == 0
    rep = json.loads((out / "report.json").read_text())["sparse_attention"]
    assert (rep["method"], rep["keep_percent"], rep["extra_tokens"], rep["dense_blocks"]) == ("vsa", 30.0, 0, [1])
    assert rep["sparse_steps"] == [1, 2] and rep["calls"]["sparse"] == 2 * 2          # blocks 0 and 2, 2 steps
    assert "to_gate_compress" in rep["notes"][0]


def test_cli_fasth3_preset(tmp_path):
    """--preset fasth3: 4 steps, euler, shifts 12 / 3, attention sparse with vsa at 10 %; a flag given wins."""
    out = tmp_path / "f"
    assert cli.main(["generate", "--output", str(out), "--dense", "--preset", "fasth3", "--sparse-min-tokens", "0",
                     "--width", "256", "--height", "192", "--frames", "39", "--sparse-keep-percent", "25"]) == 0
    rep = json.loads((out / "report.json").read_text())
    sa, wl = rep["sparse_attention"], rep["workload"]
    assert (sa["method"], sa["keep_percent"]) == ("vsa", 25.0) and len(sa["sparse_steps"] + sa["dense_steps"]) == 4
    assert (wl["steps"], wl["sampler"]) == (4, "euler"), wl
    assert wl["shifts"] == [12.0, 3.0], wl
    from h3_blackwell.cli.commands import apply_preset
    from h3_blackwell.cli.parser import build_parser

    argv = ["generate", "--output", str(out), "--preset", "fasth3", "--steps", "6", "--attention", "sdpa"]
    a = build_parser().parse_args(argv)
    assert apply_preset(a, argv) == (12.0, 3.0)                    # the shifts go into SamplingSettings
    assert (a.steps, a.sampler, a.attention, a.sparse_method) == (6, "euler", "sdpa", None)   # given flags win
