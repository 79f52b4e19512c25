"""Core's block-sparse methods (sol-attn, sla, vsa) in the runtime: the eager reference against comfy-kitchen's
eager oracle for every selection, core's sinks table, VSA's cube tiling and gather, the settings, and one tiny
block through the step-aware backend on the CPU (window frozen, dense blocks, min_tokens, the carried statistics,
VSA with and without to_gate_compress)."""

import dataclasses

import pytest
import torch

from h3_blackwell.runtime.model.block import DiTBlock
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.layout import build_layout
from h3_blackwell.runtime.ops import sparse_attention as SA
from h3_blackwell.runtime.ops import sparse_methods as SM
from h3_blackwell.runtime.ops import sparse_step as SS
from h3_blackwell.runtime.ops.reference import ReferenceOps, modulated, qk_norm_rope
from h3_blackwell.runtime.options import SparseSettings, parse_dense_blocks

ck_eager = pytest.importorskip("comfy_kitchen.backends.eager.sol_attn")

# the eager reference and comfy-kitchen's eager sol_attn are both fp32 over the same selection; they differ in
# summation order only (measured ~3e-8)
REF_TOL = 1e-5


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _live(t, block_len):
    rows = SM._lengths(t, -(-t // 64), block_len, "cpu")
    return (torch.arange(t) % 64) < rows[torch.arange(t) // 64]


CASES = {
    "sol-attn": dict(tau=1.0, sink=(0, 3), sink_q=(2, 4)),
    "sla": dict(tau=1.3, topk_ratio=0.2, sink=(0, 3), sink_q=(2, 4)),
    "vsa": dict(tau=1.3, topk_ratio=0.1, sink=(0, 2), sink_q=(0, 2), tail=False, block_len=True, coarse_gate=True),
    "vsa_no_gate": dict(tau=1.3, topk_ratio=0.1, sink=(0, 2), sink_q=(0, 2), tail=False, block_len=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_equals_comfy_kitchen_eager(case):
    t, h, d = 1000, 2, 128
    q, k, v = (_rand(t, h, d, seed=s) for s in (1, 2, 3))
    kw = dict(CASES[case])
    if kw.pop("block_len", False):
        kw["block_len"] = torch.randint(1, 65, (16,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    if kw.pop("coarse_gate", False):
        kw["coarse_gate"] = _rand(t, h, d, seed=5)
    args = SM.KernelArgs(**kw)
    theirs = ck_eager.sol_attn(q[None], k[None], v[None], tau=args.tau, sink_blocks=list(args.sink),
                               sink_q=list(args.sink_q), topk_ratio=args.topk_ratio, tail=args.tail,
                               block_len=args.block_len,
                               coarse_gate=None if args.coarse_gate is None else args.coarse_gate[None])[0]
    ours = SM.sol_reference(q, k, v, args, query_blocks=5)
    live = _live(t, args.block_len)          # rows of padded tiles are unspecified in both
    rel = float((ours[live] - theirs[live]).norm() / theirs[live].norm())
    assert rel < REF_TOL, rel
    dense = SM.sol_reference(q, k, v, dataclasses.replace(args, sink_q=(0, 16), coarse_gate=None))
    assert float((dense[live] - ours[live]).norm() / dense[live].norm()) > 1e-3   # the selection matters


def test_core_sinks_table():
    segs = [(0, 100, "text"), (100, 300, "cond"), (300, 514, "audio"), (514, 2000, "video")]
    assert SM.core_sinks(segs, 2000, "exact_kv") == ((0, 9), (0, 0))
    assert SM.core_sinks(segs, 2000, "exact_kv_and_rows") == ((0, 9), (4, 9))
    assert SM.core_sinks(segs, 2000, "off") == ((0, 0), (0, 0))
    assert SM.core_sinks(segs, 1999, "exact_kv") == ((0, 0), (0, 0))              # the layout is not these rows
    no_audio = [(0, 100, "text"), (100, 2000, "video")]
    assert SM.core_sinks(no_audio, 2000, "exact_kv_and_rows") == ((0, 2), (0, 2))
    assert SM.core_sinks([(0, 500, "video")], 500, "exact_kv_and_rows") == ((0, 0), (0, 0))


def test_vsa_tiling_and_gather():
    lay = build_layout(text_len=70, latent_t=5, lat_h=12, lat_w=6, audio_t=20)   # grid 5 x 6 x 3: every axis pads
    grid = (5, 6, 3)
    plan = SM.vsa_plan(lay.segments, grid, "cpu")
    tiles = plan.src.view(-1, 64)
    prefix = [(a, b) for a, b, k in lay.segments if k != "video"]
    assert plan.n_prefix == sum(-(-(b - a) // 64) for a, b in prefix)
    assert plan.n % 64 == 0 and torch.equal(plan.block_len, (tiles >= 0).sum(1).to(torch.int32))
    live = plan.src[plan.live]
    assert torch.equal(live.sort().values, torch.arange(lay.seq_len))               # every row once
    assert torch.equal(plan.src[plan.inv], torch.arange(lay.seq_len))                # inv is the gather back
    for tile in tiles:                                                               # live rows first, one segment
        n_live = int((tile >= 0).sum())
        assert (tile[:n_live] >= 0).all() and (tile[n_live:] < 0).all()
    v0 = lay.segment("video")[0]
    for tile in tiles[plan.n_prefix:]:                                               # one 4x4x4 cube per video tile
        r = tile[tile >= 0] - v0
        t, hw = r // (6 * 3), r % (6 * 3)
        cube = torch.stack([t // 4, (hw // 3) // 4, (hw % 3) // 4], 1)
        assert (cube == cube[0]).all()
    x = _rand(lay.seq_len, 8, seed=3)
    padded = SM.pad_rows(x, plan)
    assert torch.equal(padded[plan.inv], x) and (padded[~plan.live] == 0).all()
    with pytest.raises(Exception, match="latent grid"):
        SM.vsa_plan(lay.segments, (5, 6, 4), "cpu")


def test_settings():
    assert parse_dense_blocks("0, 1, 47-49, 3-2") == (0, 1, 2, 3, 47, 48, 49) and parse_dense_blocks("") == ()
    s = SparseSettings()
    assert (s.method, s.tau, s.start_percent, s.end_percent, s.min_tokens, s.extra_tokens, s.sinks) == (
        "sol-attn", 1.3, 0.2, 1.0, 12288, 256, "exact_kv_and_rows")                # core's node defaults
    assert s.topk_ratio == 0.0 and SparseSettings("sla", keep_percent=12.5).topk_ratio == 0.125
    assert SparseSettings("vsa").token_aug == 0 and SparseSettings("sla").token_aug == 256
    for bad in (dict(method="bsa"), dict(keep_percent=0.1), dict(extra_tokens=100), dict(sinks="all"),
                dict(end_percent=1.5)):
        with pytest.raises(ValueError, match="sparse attention setting"):
            SparseSettings(**bad).check()


# -- one tiny block through the step-aware backend (the eager reference: the CPU path) ----------------------

def _block(gate: bool, seed=0):
    cfg = dataclasses.replace(TINY, gate_compress=gate)
    torch.manual_seed(seed)
    blk = DiTBlock(cfg, torch.float32, torch.float32)
    for p in blk.parameters():
        p.data.normal_(0, 0.3)
    return cfg, blk


def _call(cfg, lay, seed=1):
    s = lay.seq_len
    x = _rand(s, cfg.hidden_size, seed=seed)
    shift, scale = _rand(3, cfg.hidden_size, seed=seed + 1) * 0.1, _rand(3, cfg.hidden_size, seed=seed + 2) * 0.1
    mod_segs = [(0, s // 2, 0), (s // 2, s, 1)]
    ang = _rand(s, cfg.rope_dim // 2, seed=seed + 3)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return x, shift, scale, mod_segs, cos, sin


def _attention(cfg, settings, lay, shift_video=12.0):
    att = SA.SparseStepAttention(None, lambda qkv: qkv[:, : cfg.num_heads * cfg.head_dim].clone(), cfg.num_heads,
                                 cfg.head_dim, settings)
    att.begin_run(lay.segments, lay.token_grid, shift_video)
    return att


LAY = dict(text_len=70, latent_t=5, lat_h=12, lat_w=6, audio_t=20)   # 70 text + 40 audio + 90 video rows


@pytest.mark.parametrize("method", ["sol-attn", "sla"])
def test_block_path_equals_the_reference_with_core_sinks(method, monkeypatch):
    monkeypatch.setattr(SS, "PRODUCER_CHUNK", 64)               # several qkv chunks at this size
    cfg, blk = _block(False)
    lay = build_layout(**LAY)
    att = _attention(cfg, SparseSettings(method, tau=0.5, keep_percent=30, min_tokens=0), lay)
    x, shift, scale, segs, cos, sin = _call(cfg, lay)
    ops = ReferenceOps(cfg)
    att.begin_step(1, 0.5)
    assert att.takes(0, x)
    out = att.block_attention(blk, SA.SparseBlockCall(ops, 0, x, shift, scale, segs, cos, sin))
    qkv = ops.qkv(0, blk, x, shift, scale, segs)
    q, k, v = qk_norm_rope(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, cos, sin, cfg.num_heads,
                           cfg.head_dim, cfg.eps)
    sink, sink_q = SM.core_sinks(lay.segments, lay.seq_len, "exact_kv_and_rows")
    args = SM.KernelArgs(0.5, 0.0 if method == "sol-attn" else 0.3, sink, sink_q)
    want = SM.sol_reference(q, k, v, args).reshape(lay.seq_len, -1)
    assert torch.allclose(out, want, rtol=0, atol=1e-6)         # the same fp32 math, row-chunked qkv
    assert torch.equal(att.pooled[(0, lay.seq_len)][0], SM.pooled_stats(k, v)[0])


def test_window_dense_blocks_min_tokens_and_state_across_calls():
    cfg, blk = _block(False)
    lay = build_layout(**LAY)
    s = SparseSettings("sla", dense_blocks=parse_dense_blocks("1-2"), min_tokens=0, start_percent=0.2)
    att = _attention(cfg, s, lay)
    assert att.window[1] == pytest.approx(12 * 0.8 / (1 + 11 * 0.8))             # frozen at the run's shift
    frozen = _attention(cfg, dataclasses.replace(s, sigma_start=0.5, sigma_end=0.1), lay)
    assert frozen.window == (0.1, 0.5)                                             # frozen where applied
    x, shift, scale, segs, cos, sin = _call(cfg, lay)
    att.begin_step(0, 1.0)
    assert not att.takes(0, x)                                                     # before the window
    states = []
    for step, sigma in enumerate((0.9, 0.7, 0.5), start=1):
        att.begin_step(step, sigma)
        assert att.takes(0, x) and not att.takes(1, x) and not att.takes(2, x)
        att.block_attention(blk, SA.SparseBlockCall(ReferenceOps(cfg), 0, x * (1 + step), shift, scale, segs, cos,
                                                    sin))
        states.append(att.pooled[(0, lay.seq_len)])
    assert len(states) == 3 and not torch.equal(states[0][1], states[2][1])       # carried, updated per call
    assert not att.takes(0, x[:-1])                                                # not this layout's rows
    rep = att.summary()
    assert rep["sparse_steps"] == [1, 2, 3] and rep["dense_steps"] == [0] and rep["dense_blocks"] == [1, 2]
    short = _attention(cfg, dataclasses.replace(s, min_tokens=lay.seq_len + 1), lay)
    short.begin_step(1, 0.5)
    assert not short.takes(0, x) and "min_tokens" in short.steps[0]["dense_because"]


@pytest.mark.parametrize("gate", [True, False])
def test_vsa_block_path(gate, caplog):
    cfg, blk = _block(gate)
    lay = build_layout(**LAY)
    att = _attention(cfg, SparseSettings("vsa", keep_percent=30, min_tokens=0), lay)
    x, shift, scale, segs, cos, sin = _call(cfg, lay)
    ops = ReferenceOps(cfg)
    att.begin_step(1, 0.5)
    out = att.block_attention(blk, SA.SparseBlockCall(ops, 0, x, shift, scale, segs, cos, sin))
    plan = SM.vsa_plan(lay.segments, (5, 6, 3), "cpu")
    # independently: project the zero-padded modulated rows (core's order of work), then norm, rope on the
    # scattered table, attend in tile order, gather back
    h = SM.pad_rows(modulated(x, blk.norm1, shift, scale, segs), plan)
    rope = [SM.pad_rows(t, plan) for t in (cos, sin)]
    q, k, v = qk_norm_rope(blk.attn.qkv_proj(h), blk.attn.q_norm.weight, blk.attn.k_norm.weight, *rope,
                           cfg.num_heads, cfg.head_dim, cfg.eps)
    g = None if not gate else blk.attn.to_gate_compress(h).view(plan.n, cfg.num_heads, cfg.head_dim)
    args = SM.KernelArgs(1.3, 0.3, (0, plan.n_prefix), (0, plan.n_prefix), tail=False, block_len=plan.block_len,
                         coarse_gate=g)
    want = SM.sol_reference(q, k, v, args).reshape(plan.n, -1)[plan.inv]
    assert torch.allclose(out, want, rtol=0, atol=1e-5)                 # fp32; qkv gathered vs projected padded
    assert (att.summary()["notes"] != []) is (not gate)                 # the fine-stage-only warning
    assert att.summary()["extra_tokens"] == 0                           # VSA forces 0


# -- against core's own code (its nodes_sparse_attention.py read by commit, cached outside git) ------------------

def test_sinks_and_vsa_plan_equal_cores_own_code():
    """core's SparseAttnPatch.sinks / vsa_plan / vsa_rope_freqs on the CPU against ours, t2va and fl2va layouts."""
    from fixtures.core_src import CoreLayout, load_core_sparse, missing_reason
    from h3_blackwell.runtime.model.layout import KeyframeSpec

    core = load_core_sparse()
    if core is None:
        pytest.skip(missing_reason())
    for lay in (build_layout(**LAY), build_layout(text_len=37, latent_t=7, lat_h=10, lat_w=14, audio_t=50,
                                                  keyframes=(KeyframeSpec(0), KeyframeSpec(21)))):
        cl = CoreLayout(lay)
        for mode in ("exact_kv", "exact_kv_and_rows", "off"):
            patch = core.SparseAttnPatch(1.3, 0.0, False, 1.0, 0.0, 0, set(), mode, 0, False)
            assert patch.sinks({"minimax_h3_layout": cl}, lay.seq_len) == SM.core_sinks(lay.segments, lay.seq_len,
                                                                                          mode)
        theirs = patch.vsa_plan(cl, "cpu")
        ours = SM.vsa_plan(lay.segments, lay.token_grid, "cpu")
        assert (theirs["n"], theirs["n_prefix"]) == (ours.n, ours.n_prefix)
        for k in ("src", "inv", "block_len"):
            assert torch.equal(theirs[k], getattr(ours, k)), k
        ang = _rand(lay.seq_len, 48, seed=9)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        freqs = SM.rope_freqs(cos, sin)
        padded = patch.vsa_rope_freqs(freqs, theirs)
        assert torch.equal(padded, SM.rope_freqs(SM.pad_rows(cos, ours), SM.pad_rows(sin, ours)))


class RecordingKitchen:
    """comfy-kitchen's sol_attn_chunked as a recorder (the CPU has no kernel): what each call was handed; the
    statistics it returns are a function of the chunks, so equal inputs give equal carried state."""

    def __init__(self):
        self.calls = []

    def sol_attn_is_available(self, device=None):
        return True

    def sol_attn_chunked(self, chunks, n, h, freqs, norm_w, kmean=None, vscale=None, **kw):
        rows = [c.clone() for c in (chunks() if callable(chunks) else chunks)]
        state = [None if t is None else t.clone() for t in (kmean, vscale)]   # core reuses its buffers (copy_)
        self.calls.append(dict(chunks=rows, n=n, h=h, freqs=freqs, norm_w=norm_w, kmean=state[0], vscale=state[1],
                               kw={k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}))
        k = sum(float(c.float().sum()) for c in rows)
        return torch.zeros(1, n, h, 128, dtype=torch.bfloat16), torch.full((h, 128), k), torch.full((h, 128), -k)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("method", ["sol-attn", "sla", "vsa", "vsa_no_gate"])
def test_kernel_is_called_with_cores_arguments(method):
    """Core's own h3_sparse_attention and ours on one real-size layout (tests/fixtures/sparse_parity.py) on the CPU,
    comfy-kitchen replaced by a recorder on both sides: each call hands the kernel the same qkv chunks (bytes),
    rope table, norm weights and keywords (tau, topk_ratio, token_aug, sinks, tail, block_len, coarse gate,
    rope_eps), and the same carried statistics: cold on the first call, then what the previous call returned."""
    from fixtures.core_src import load_core_sparse, missing_reason
    from fixtures.sparse_parity import CALLS, run_both

    if load_core_sparse() is None:
        pytest.skip(missing_reason())
    ck = RecordingKitchen()
    same_chunks = run_both(method, dev="cpu", kitchen=ck)[4]
    assert same_chunks == [True] * CALLS                                # the GPU test's own check agrees
    core_calls, our_calls = ck.calls[0::2], ck.calls[1::2]             # the calls alternate: core, ours
    assert len(core_calls) == len(our_calls) == CALLS
    for i, (c, o) in enumerate(zip(core_calls, our_calls)):
        assert (c["n"], c["h"]) == (o["n"], o["h"]) and _same(c["freqs"], o["freqs"]), i
        assert _same(c["norm_w"], o["norm_w"]) and _same(c["kw"], o["kw"]), (i, sorted(c["kw"]), sorted(o["kw"]))
        assert _same(c["chunks"], o["chunks"]), i
        assert ("coarse_gate" in c["kw"]) is (method == "vsa") and c["kw"].get("tail", True) is ("vsa" not in method)
        assert (c["kmean"] is None) is (o["kmean"] is None) is (i == 0)
        if i:
            assert _same((c["kmean"], c["vscale"]), (o["kmean"], o["vscale"]))
            k = torch.tensor(sum(float(x.float().sum()) for x in core_calls[i - 1]["chunks"]), dtype=torch.float32)
            assert c["kmean"][0, 0] == k                       # the previous call's statistics, carried
