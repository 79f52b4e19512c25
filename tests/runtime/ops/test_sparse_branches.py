"""Sparse attention with CFG: two conditionings alternate every step, each with its own layout (the negative prompt's
text length differs), sinks, VSA tiling and carried pooled statistics, as core keys them per (block, rows, uuids).

The eager rule: a call of conditioning c at block b is handed the (kmean, vscale) its previous call of (c, b)
returned, cold (None) on its first; its rows and sinks are c's layout's. Checked with a recording stand-in for
comfy-kitchen (the CPU has no kernel), and end to end through ModelCall: each conditioning's outputs in an
alternating run equal a run of that conditioning alone (the CPU's eager reference depends on the call's own rows
only, so any mixing of layouts or state between the branches would show)."""

import dataclasses

import pytest
import torch

from h3_blackwell.runtime import LossySettings, ModelCall, RuntimeOptions, load_model
from h3_blackwell.runtime.errors import H3Error
from h3_blackwell.runtime.model.block import DiTBlock
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.layout import build_layout, latent_shapes
from h3_blackwell.runtime.ops import sparse_attention as SA
from h3_blackwell.runtime.ops import sparse_methods as SM
from h3_blackwell.runtime.ops.reference import ReferenceOps
from h3_blackwell.runtime.options import SparseSettings


class StateKitchen:
    """sol_attn_chunked as a recorder: the state it was handed and the one it returns (a function of the chunks)."""

    def __init__(self, head_dim):
        self.head_dim, self.calls = head_dim, []

    def sol_attn_chunked(self, chunks, n, h, freqs, norm_w, kmean=None, vscale=None, **kw):
        k = sum(float(c.detach().float().sum()) for c in chunks())
        out = (torch.zeros(1, n, h, self.head_dim), torch.full((h, self.head_dim), k), torch.full((h, 1), abs(k)))
        self.calls.append(dict(n=n, given=kmean, sink=kw["sink_blocks"], returned=out[1]))
        return out


def _layouts():
    return {"pos": build_layout(text_len=70, latent_t=5, lat_h=12, lat_w=6, audio_t=20),
            "neg": build_layout(text_len=9, latent_t=5, lat_h=12, lat_w=6, audio_t=20)}


@pytest.mark.parametrize("method", ["sol-attn", "vsa"])
def test_each_conditioning_carries_its_own_statistics(method):
    cfg = dataclasses.replace(TINY, gate_compress=method == "vsa")
    torch.manual_seed(0)
    blk = DiTBlock(cfg, torch.float32, torch.float32)
    lays = _layouts()
    ck = StateKitchen(cfg.head_dim)
    att = SA.SparseStepAttention(SA.SolAttention(ck, "stand-in"), None, cfg.num_heads, cfg.head_dim,
                                 SparseSettings(method, keep_percent=30, min_tokens=0))
    grid = (5, 6, 3)
    att.begin_run(lays["pos"].segments, grid, 12.0)
    g = torch.Generator().manual_seed(1)
    last, order = {}, []
    for step in range(3):
        for key, name in ((0, "pos"), (1, "neg")):                 # CFG: both conditionings every step
            lay = lays[name]
            att.begin_branch(key, lay.segments, grid)
            att.begin_step(step, 0.5)
            s = lay.seq_len
            ang = torch.randn(s, cfg.rope_dim // 2, generator=g)
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
            for index in (0, 1):
                x = torch.randn(s, cfg.hidden_size, generator=g)
                att.block_attention(blk, SA.SparseBlockCall(ReferenceOps(cfg), index, x, torch.zeros(3, cfg.hidden_size),
                                                            torch.zeros(3, cfg.hidden_size), [(0, s, 0)], cos, sin))
                order.append((name, index))
    for (name, index), call in zip(order, ck.calls):
        lay = lays[name]
        n = SM.vsa_plan(lay.segments, grid, "cpu").n if method == "vsa" else lay.seq_len
        sinks = [0, SM.vsa_plan(lay.segments, grid, "cpu").n_prefix] if method == "vsa" else \
            list(SM.core_sinks(lay.segments, lay.seq_len, "exact_kv_and_rows")[0])
        assert call["n"] == n and call["sink"] == sinks, (name, index)
        prev = last.get((name, index))
        assert (call["given"] is None) is (prev is None), (name, index)
        assert prev is None or torch.equal(call["given"], prev), (name, index)      # its own branch's, not the other's
        last[(name, index)] = call["returned"]
    assert att.summary()["conditionings"] == 2


def _text(rows, seed):
    return torch.randn(1, rows, 5120, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def rt_sparse():
    return load_model(None, RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="sparse",
                                           sparse_min_tokens=0, sparse_extra_tokens=0), tiny_seed=0)


def _run(rt, texts, sigmas, lossy=None):
    v, a = latent_shapes(256, 192, 39)
    video = torch.randn(v, generator=torch.Generator().manual_seed(5))
    audio = torch.randn(a, generator=torch.Generator().manual_seed(6))
    call = ModelCall(rt)
    call.begin_run(torch.tensor(sigmas + [0.0]), lossy)
    outs = {}
    for s in sigmas:
        for name, t in texts.items():
            outs.setdefault(name, []).append(call(video, audio, s, t)[0])
    call.end_run()
    return outs, call.report(video, audio)


def test_cfg_run_equals_each_conditioning_alone(rt_sparse):
    sigmas = [1.0, 0.9, 0.5]                                        # a dense step, then two sparse ones
    texts = {"pos": _text(9, 1), "neg": _text(4, 2)}
    both, report = _run(rt_sparse, texts, sigmas)
    sa = report["sparse_attention"]
    assert sa["conditionings"] == 2 and sa["calls"]["sparse"] > 0
    for name, t in texts.items():
        alone = _run(rt_sparse, {name: t}, sigmas)[0][name]
        assert all(torch.equal(a, b) for a, b in zip(both[name], alone)), name


def test_first_block_cache_with_two_conditionings_is_refused(rt_sparse):
    with pytest.raises(H3Error, match="expected: every evaluation with the run's first conditioning; found: a second"):
        _run(rt_sparse, {"pos": _text(9, 1), "neg": _text(4, 2)}, [1.0, 0.9], LossySettings(first_block_cache=0.1))
