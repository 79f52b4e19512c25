"""Sparse attention (Sol-Attn routing for the packed H3 sequence): routing inputs from t2va / fl2va / ref2va
segments, the schedule switch, the fp32 reference against comfy-kitchen's eager oracle, and the fused-kernel
wrapper's feeding from the qkv buffer (strided views, copies counted) and its refusals."""

import math
import types

import pytest
import torch

from h3_blackwell.runtime.model.layout import KeyframeSpec, build_layout
from h3_blackwell.runtime.ops import sparse_attention as SA
from h3_blackwell.runtime.ops import sparse_routing as SR

ck_eager = pytest.importorskip("comfy_kitchen.backends.eager.sol_attn")


def _ceil(a, b):
    return -(-a // b)


def _t2va():
    return build_layout(text_len=100, latent_t=3, lat_h=16, lat_w=24, audio_t=207).segments


def _fl2va():
    return build_layout(text_len=37, latent_t=3, lat_h=16, lat_w=24, audio_t=50,
                        keyframes=(KeyframeSpec(0), KeyframeSpec(21))).segments


def _ref2va():
    # core's ref2va order: [text | reference blocks (image, audio+video) | target audio | target video]
    kinds = [("text", 45), ("ref_img", 96), ("ref_audio", 80), ("ref_img", 192), ("audio", 100), ("video", 288)]
    out, row = [], 0
    for kind, n in kinds:
        out.append((row, row + n, kind))
        row += n
    return out


LAYOUTS = {"t2va": _t2va, "fl2va": _fl2va, "ref2va": _ref2va}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_routing_inputs_from_segments(name):
    segs = LAYOUTS[name]()
    r = SR.routing_for_segments(segs, tau=1.6, token_aug=128)
    video = next((a, b) for a, b, k in segs if k == "video")
    audio = next((a, b) for a, b, k in segs if k == "audio")
    cond = [(a, b) for a, b, k in segs if k not in ("video", "audio")]
    assert r.seq_len == video[1] and (r.tau, r.token_aug) == (1.6, 128)
    # every conditioning and target-audio row is in a sink key block; the sink ends at the block holding the
    # first video row, so at most that one block of video rows is exact for everyone
    s0, s1 = r.sink_rows()
    assert s0 == 0 and all(b <= s1 for a, b in cond + [audio])
    assert r.sink_blocks == (0, _ceil(video[0], 64)) and s1 - video[0] < 64
    # the target-audio query rows are dense, and the dense range starts in the audio's first block
    d0, d1 = r.dense_rows()
    assert d0 <= audio[0] < d0 + 64 and d1 >= audio[1] and d1 - audio[1] < 64
    forced = r.forced_exact()
    n = r.n_blocks
    for row in (0, audio[0], video[0], video[1] - 1):        # any query row ...
        assert forced[row // 64, : r.sink_blocks[1]].all()    # ... attends every sink block exactly
    assert forced[audio[0] // 64 : _ceil(audio[1], 64)].all()  # audio query blocks: every key exact
    far = n - 1
    assert not forced[far, r.sink_blocks[1]: far - 1].any()   # a late video block: only sinks and diagonal


def test_routing_options_and_refusals():
    segs = _t2va()
    assert SR.routing_for_segments(segs, dense_audio_rows=False).dense_q_blocks == (0, 0)
    with pytest.raises(SA.H3Error, match="video last"):
        SR.routing_for_segments([(0, 10, "text"), (10, 100, "video"), (100, 120, "audio")])
    with pytest.raises(SA.H3Error, match="contiguous"):
        SR.routing_for_segments([(0, 10, "text"), (12, 100, "video")])
    with pytest.raises(SA.H3Error, match="extra tokens"):
        SR.routing_for_segments(segs, token_aug=100)
    with pytest.raises(SA.H3Error, match="tau"):
        SR.routing_for_segments(segs, tau=float("nan"))


def test_schedule_switch_core_rule():
    """Core: dense while sigma > percent_to_sigma(0.2) of the shift-12 flow schedule; below min_tokens always."""
    sch = SR.SparseSchedule(shift=12.0)
    assert sch.sigma_start == pytest.approx(9.6 / 9.8, abs=1e-15)
    # the canonical 12-step simple schedule at shift 12 (model sigmas: t = 1 - i/12 warped)
    sig = [12 * t / (1 + 11 * t) for t in (1 - i / 12 for i in range(12))]
    assert sch.sparse_steps(sig, 37810) == [False] * 3 + [True] * 9
    assert sch.dense_reason(sch.sigma_start, 37810) is None          # the boundary itself is sparse (core: >)
    assert "outside" in sch.dense_reason(math.nextafter(sch.sigma_start, 2.0), 37810)
    assert "min_tokens" in sch.dense_reason(0.5, 12287)
    assert SR.SparseSchedule(shift=12.0, start_percent=0.0).sparse_steps(sig, 37810) == [True] * 12


def _qkv(t, h, d, seed, dtype=torch.float32, pad_cols=0):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(t, 3 * h * d + pad_cols, generator=g).to(dtype)
    return buf[:, : 3 * h * d]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_reference_matches_kitchen_eager(name):
    """Our fp32 Sol-Attn against comfy-kitchen's eager reference, fed the routing built from each layout.
    Tolerance 1e-5: the same algorithm in fp32 on both sides; only the summation order differs (a routing
    decision flipping on a tie would show as a ~1e-1 error, far above it)."""
    segs = LAYOUTS[name]()
    r = SR.routing_for_segments(segs, tau=0.7, token_aug=0)
    h, d = 2, 32
    q, k, v = _qkv(r.seq_len, h, d, seed=3).unflatten(1, (3, h, d)).unbind(1)
    ours = SA.sol_attention_reference(q, k, v, r, query_blocks=5)
    theirs = ck_eager.sol_attn(q[None], k[None], v[None], tau=r.tau, sink_blocks=list(r.sink_blocks),
                               sink_q=list(r.dense_q_blocks))[0].reshape(r.seq_len, h * d)
    err = float((ours - theirs).norm() / theirs.norm())
    assert err < 1e-5, err


def test_reference_dense_rows_are_exact_attention():
    """Dense query rows (target audio) equal full softmax attention; the video rows do not (the routing is sparse).
    Tolerance 1e-5: fp32 with k centred by a constant (softmax-invariant), only rounding differs."""
    r = SR.routing_for_segments(_t2va(), tau=1.0, token_aug=0)
    h, d = 2, 32
    q, k, v = _qkv(r.seq_len, h, d, seed=5).unflatten(1, (3, h, d)).unbind(1)
    ours = SA.sol_attention_reference(q, k, v, r)
    p = torch.softmax(torch.einsum("thd,shd->hts", q, k) * d ** -0.5, dim=-1)
    dense = torch.einsum("hts,shd->thd", p, v).reshape(r.seq_len, h * d)
    a, b = r.dense_rows()
    assert float((ours[a:b] - dense[a:b]).norm() / dense[a:b].norm()) < 1e-5
    late = slice(r.seq_len - 64, r.seq_len)
    assert float((ours[late] - dense[late]).norm() / dense[late].norm()) > 1e-2


def test_wrapper_feeds_strided_views_without_copies():
    """At H3 widths the q/k/v views of the packed qkv buffer meet sol_attn's stride rules: no copy, and the
    kernel sees the buffer's own storage. The kernel is stood in by comfy-kitchen's eager sol_attn (CPU)."""
    seen = []

    def fake_sol(q, k, v, **kw):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(), kw))
        return ck_eager.sol_attn(q, k, v, **kw)

    r = SR.routing_for_segments(_t2va(), tau=1.3, token_aug=0)
    heads, hd = 2, 128
    qkv = _qkv(r.seq_len, heads, hd, seed=7)
    sol = SA.SolAttention(types.SimpleNamespace(sol_attn=fake_sol), "eager")
    out = sol(qkv, heads, hd, r)
    row = qkv.stride(0)
    assert seen[0][:3] == (qkv.data_ptr(), qkv.data_ptr() + heads * hd * 4, qkv.data_ptr() + 2 * heads * hd * 4)
    assert seen[0][3][1:] == (row, hd, 1)
    assert seen[0][4]["sink_blocks"] == list(r.sink_blocks) and seen[0][4]["sink_q"] == list(r.dense_q_blocks)
    assert sol.copies == {"tensors": 0, "bytes": 0}
    ref = SA.sol_attention_reference(*qkv.unflatten(1, (3, heads, hd)).unbind(1), r)
    assert float((out - ref).norm() / ref.norm()) < 1e-5   # as test_reference_matches_kitchen_eager


def test_wrapper_counts_copies_when_strides_break_the_rules():
    r = SR.routing_for_segments(_t2va(), token_aug=0)
    heads, hd = 2, 128
    qkv = _qkv(r.seq_len, heads, hd, seed=9, pad_cols=1)      # row stride 769: not a multiple of 8
    assert not SA.stride_rules_hold(qkv[:, : heads * hd].unflatten(1, (heads, hd)).unsqueeze(0))
    sol = SA.SolAttention(types.SimpleNamespace(sol_attn=lambda q, k, v, **kw: ck_eager.sol_attn(q, k, v, **kw)),
                          "eager")
    sol(qkv, heads, hd, r)
    assert sol.copies == {"tensors": 3, "bytes": 3 * r.seq_len * heads * hd * 4}


def test_refusals_say_why(monkeypatch):
    assert "CUDA" in SA.sol_unavailable_reason("cpu")
    with pytest.raises(SA.SparseUnavailable, match="needs a CUDA GPU"):
        SA.SolAttention.resolve("cpu")
    assert "head_dim 128" in SA.sol_unavailable_reason("cuda", head_dim=64)
    assert "bfloat16" in SA.sol_unavailable_reason("cuda", dtype=torch.float32)
    real = SA.importlib.import_module

    def no_kitchen(name, *a, **k):
        if name == "comfy_kitchen":
            raise ImportError("No module named 'comfy_kitchen'")
        return real(name, *a, **k)

    monkeypatch.setattr(SA.importlib, "import_module", no_kitchen)
    assert "not installed" in SA.sol_unavailable_reason("cuda")


def test_load_time_probe_accepts_a_correct_kernel_and_refuses_a_broken_one():
    good = SA.SolAttention(types.SimpleNamespace(sol_attn=ck_eager.sol_attn), "eager")
    rec = good.probe("cpu", heads=2, token_aug=0, seq_len=512)
    assert rec["dense_rows_rel_l2"] < 1e-2          # bf16 output rounding only (eager math is fp32)

    def broken(q, k, v, **kw):                       # e.g. a kernel that ignores the sinks: attends nothing
        return torch.zeros_like(q)

    with pytest.raises(SA.SparseUnavailable, match="load-time probe"):
        SA.SolAttention(types.SimpleNamespace(sol_attn=broken), "broken").probe("cpu", seq_len=512)


def test_sparse_backend_check_and_choice():
    ok, why = SA.sparse_check("cpu")
    assert ok and "LOSSY" in why and "reference" in why
    assert SA.choose_sparse("cpu")[0] == "sparse"
    att = SA.bind_sparse("cpu", torch.float32, 2, 16, dense=lambda qkv: qkv, dense_name="reference")
    assert att.kernel is None and (att.settings.tau, att.settings.token_aug) == (SR.DEFAULT_TAU,
                                                                                SR.DEFAULT_EXTRA_TOKENS)
