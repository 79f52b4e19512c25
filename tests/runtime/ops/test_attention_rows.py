"""Attention over query-row chunks (the memory plan's ``attn_chunk_rows``, issue 37): K and V of every row, Q a chunk
at a time. Row-exact backends give the unchunked bits (``runtime.ops.attention.row_exactness``); the block's
chunked attention half equals its one-pass run; and the plan's estimate at H3's full shapes (no allocation) fits the
10 s clip under an 8 GB card's budget with every block streamed, and says what the 20 s clip needs."""

import pytest
import torch

from h3_blackwell.runtime import RuntimeOptions, load_model
from h3_blackwell.runtime.budget import (Chunking, DeviceMemory, ModelMemory, Workload, decide, estimate,
                                         smallest_budget)
from h3_blackwell.runtime.model.config import FULL
from h3_blackwell.runtime.model.layout import latent_shapes
from h3_blackwell.runtime.ops.attention import ROW_EXACT, bind_attention, bind_attention_qkv, row_exactness
from fixtures.chunks import chunked_evaluations

S, H, D = 700, 4, 128  # not a multiple of 128: the last chunk is partial, as at 73,486 rows


def _qkv(dtype, seed=0):
    return torch.randn(S, 3 * H * D, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "sdpa_math"])
def test_row_chunks_equal_the_whole_bit_for_bit(backend, dtype):
    """One softmax per query row over every key: chunks of 128, 256 or 384 rows give the unchunked bytes."""
    assert row_exactness(backend)[0] and backend in ROW_EXACT
    qkv = _qkv(dtype)
    whole = bind_attention(backend, D)(qkv)
    rows = bind_attention_qkv(backend, D)
    q, k, v = qkv.unflatten(1, (3, -1)).unbind(1)
    for c in (128, 256, 384):
        got = torch.cat([rows(q[a:a + c], k, v) for a in range(0, S, c)])
        assert torch.equal(got, whole), (backend, dtype, c)


def test_a_chunk_sees_every_key():
    """A chunk attending over its own rows only would differ from the whole: the check above can fail."""
    qkv = _qkv(torch.float32, 1)
    whole = bind_attention("reference", D)(qkv)
    rows = bind_attention_qkv("reference", D)
    q, k, v = qkv.unflatten(1, (3, -1)).unbind(1)
    local = torch.cat([rows(q[a:a + 128], k[a:a + 128], v[a:a + 128]) for a in range(0, S, 128)])
    assert not torch.allclose(local, whole, atol=1e-3)


def test_fused_sdpa_kernels_are_not_claimed_row_exact():
    """Kernels that pick tiles or splits from the query length are equal to their rounding only (the CPU flash
    kernel differs in bf16 at some chunk sizes): the plan says so instead of promising equal hashes."""
    for name in ("sdpa", "sdpa_cudnn", "sdpa_flash", "fa3", "fa3_fp8"):
        exact, why = row_exactness(name)
        assert not exact and "not row-exact" in why


@pytest.mark.parametrize("kw", [dict(gemm="fp8", act_format="fp8"), dict(quantize=False),
                                dict(quantize=False, attention="reference")])
def test_block_attention_half_in_row_chunks_equals_one_pass(kw):
    """The tiny model (190 rows) evaluated with the attention half in chunks of 128 and 64 rows: the same bytes."""
    vshape, ashape = latent_shapes(128, 96, 22)
    rt = load_model(None, RuntimeOptions(device="cpu", **kw), workload=Workload.from_shapes(vshape, ashape, 32, 2))
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(1))
    want, chunked, moved = chunked_evaluations(rt, text, (vshape, ashape), rt.ops.set_attn_chunk_rows)
    for rows, got, _ in chunked:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
    assert not torch.equal(want[0], moved[0])


H100 = DeviceMemory("cuda", "NVIDIA H100 80GB HBM3", 80 * 10 ** 9, 79 * 10 ** 9)
CAP8 = int(7.5e9)  # the 8 GB cap's budget (issue 37: per-process fraction 8 GB, budget 7.5)


def _clip(frames: int, steps: int = 8) -> Workload:
    """fl2va at 1344x768 with first and last keyframes (two more timesteps), 100 text tokens."""
    vs, as_ = latent_shapes(1344, 768, frames, FULL.video_channels, FULL.audio_channels)
    wl = Workload.from_shapes(vs, as_, 100, steps)
    return Workload(wl.rows, wl.video_rows, steps, wl.latent_bytes, 4)


W4A8 = ModelMemory.build(FULL, torch.bfloat16, "fp8", "fp8", "sage2", "fused", True)


def test_clip10s_fits_an_8gb_budget_only_with_query_row_chunks():
    """clip10s (243 frames, 73,486 rows) at H3's full shapes: with every block streamed and the FFN chunked the
    attention half alone needs more than 7.5 GB; in query-row chunks the plan fits it, streaming (nearly) every
    block, with the token refiner in host memory."""
    wl = _clip(243)
    assert wl.rows == 73_486
    ffn_only = estimate(W4A8, wl, 0, 2, 2048, "cuda")
    assert ffn_only.total > CAP8 and ffn_only.peak_phase == "attention"
    p = decide(W4A8, wl, H100, CAP8, host_free=64 * 10 ** 9)
    assert p.attn_chunk_rows is not None and p.attn_chunk_rows % 128 == 0 and p.estimate.total <= CAP8
    assert "query-row chunks" in p.choice().reason and p.report()["attn_chunk_rows"] == p.attn_chunk_rows
    assert len(p.streamed) >= FULL.num_layers - 5 and p.refiner_on_host
    least = smallest_budget(W4A8, wl)  # every block streamed, the smallest chunks: well below the cap
    assert least < CAP8 - 1e9


def test_clip20s_fits_an_8gb_budget_with_k_and_v_in_sages_operands():
    """20 s (481 frames, 144,840 rows): held at the compute dtype, K and V of every row (4.15 GB), the residual x
    (1.56 GB) and Sage's per-call int8/fp8 copies of them (2.08 GB) leave no room under 7.5 GB. Held once as
    Sage2's operands (ops.sage_kv: int8 K, fp8 V, 2.08 GB), with the head's video rows in the same chunks, the
    plan fits the cap: every activation phase under the budget's room, and it says that K and V are held in
    Sage's form and why that is not row-exact. Without Sage2's sm_90 stages (v_handling "library") it still
    does not fit, and the plan names the budget it would need."""
    wl = _clip(481)
    assert wl.rows == 144_840
    kv_bf16 = wl.rows * 2 * FULL.inner_dim * 2
    bf16_least = estimate(W4A8, wl, 0, 2, Chunking(2048, 2048), "cuda").total
    assert kv_bf16 > 4e9 and bf16_least > CAP8
    p = decide(W4A8, wl, H100, CAP8, host_free=64 * 10 ** 9)
    assert p.attn_kv_form == "sage" and p.attn_chunk_rows % 128 == 0 and p.estimate.total <= CAP8
    assert "Sage2's int8/fp8 operands; not row-exact" in p.choice().reason
    assert p.report()["attn_kv_form"] == "sage"
    assert smallest_budget(W4A8, wl) < CAP8 - 0.5e9
    library = ModelMemory.build(FULL, torch.bfloat16, "fp8", "fp8", "sage2", "library", True)
    assert not library.attn_kv_sage and smallest_budget(library, wl) > CAP8
    # clip10s keeps K and V at the compute dtype (row-exact): the Sage form is the last tier
    assert decide(W4A8, _clip(243), H100, CAP8, host_free=64 * 10 ** 9).attn_kv_form == "bf16"


def test_block_holds_k_and_v_in_sages_operands_on_the_emulated_kernels():
    """The tiny model with the attention half in 128-row chunks holding K and V as Sage2's operands
    (ops.sage_kv with the emulated kernels: the PyTorch reference of the quantizers, dequantized fp32
    attention): the same bytes on a second evaluation, and within the quantization's error of the exact run:
    int8 q/k and e4m3 v cost 4e-4 rel-L2 of the model output here (the residual stream carries most of it
    through the blocks), bounded at 5e-3 for other BLAS orderings, and the output still tells apart a latent
    moved by 1 % (8e-4 from the exact output)."""
    from h3_blackwell.runtime.ops.attention import rel_l2
    from h3_blackwell.runtime.ops.sage_kv import EMULATED

    vshape, ashape = latent_shapes(128, 96, 22)
    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False, attention="reference"),
                    workload=Workload.from_shapes(vshape, ashape, 32, 2))
    rt.ops.base.sage_kv_kernels = EMULATED
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(1))
    want, chunked, moved = chunked_evaluations(rt, text, (vshape, ashape),
                                               lambda r: rt.ops.set_attn_chunk_rows(r, "sage"), rows=(128,))
    (rows, got, again), = chunked
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
    err = rel_l2(got[0], want[0])
    assert 0 < err < 5e-3 and rel_l2(moved[0], want[0]) > err, err
    rt.ops.base.sage_kv_kernels = None
    with pytest.raises(RuntimeError, match="no Sage2 sm_90 kernels bound"):
        rt.ops.set_attn_chunk_rows(128, "sage")


def test_the_head_in_row_chunks_is_the_head():
    """H3Model.head over the video rows in chunks of 16 (the Sage form's tier runs it in the attention's chunks):
    the fp32 projection per row is the whole one's, to fp32 GEMM blocking (the chunk changes the GEMM's M)."""
    vshape, ashape = latent_shapes(128, 96, 22)
    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False), workload=Workload.from_shapes(vshape, ashape,
                                                                                                    32, 2))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        plan = rt.model.plan(torch.randn(1, 32, 5120, generator=g), vshape, ashape, [0.7])
        x = torch.randn(plan.layout.seq_len, rt.config.hidden_size, generator=g)
        whole, chunked = rt.model.head(x, plan, 0), rt.model.head(x, plan, 0, rows=16)
    assert plan.layout.segment("video")[1] - plan.layout.segment("video")[0] > 16
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(chunked[1], whole[1])


@pytest.mark.parametrize("cc, form", [((9, 0), "fused"), ((12, 0), "library"), ((10, 0), "library")])
def test_the_request_check_counts_sages_operands_on_sm90_only(monkeypatch, cc, form):
    """Before a load (the request's memory check) the estimate takes Sage2's sm_90 stages only on an sm_90 GPU,
    so a 20 s clip at 7.5 GB is not accepted there for a card whose load would refuse it."""
    from h3_blackwell.runtime.plan import memory_choices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    choices = memory_choices(RuntimeOptions(), FULL, torch.device("cuda"))
    mm = ModelMemory.for_options(FULL, choices, torch.bfloat16)
    assert choices["v_handling"] == form and mm.attn_kv_sage == (form == "fused")
    assert (smallest_budget(mm, _clip(481)) < CAP8) == (form == "fused")


@pytest.mark.parametrize("masked", [False, True])
def test_the_head_runs_its_norm_in_row_chunks_without_changing_a_bit(monkeypatch, masked):
    """H3Model.head computes the norm and modulation HEAD_ROWS rows at a time into one fp32 input (the 10 s clip's
    head at the 8 GB cap ran out of memory on the fp32 temporaries of every video row at once): with chunks of 16
    rows the output is the whole one's to the bit, and equals the head written out at once. With a soft denoise mask
    each video row has its own t-table row (a LongTensor index), sliced with its chunk, also in the Sage tier's
    projection chunks."""
    import torch.nn.functional as F
    from h3_blackwell.runtime.model import h3
    from h3_blackwell.runtime.model.conditioning import H3Conditioning

    vshape, ashape = latent_shapes(128, 96, 22)
    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False), workload=Workload.from_shapes(vshape, ashape,
                                                                                                    32, 2))
    g = torch.Generator().manual_seed(5)
    cond = None
    if masked:  # a soft mask: rows at different mask levels get different t
        cond = H3Conditioning(denoise_mask=torch.rand(1, 1, *vshape[2:], generator=g))
    with torch.no_grad():
        plan = rt.model.plan(torch.randn(1, 32, 5120, generator=g), vshape, ashape, [0.7], cond=cond)
        x = torch.randn(plan.layout.seq_len, rt.config.hidden_size, generator=g)
        idx = plan.times[0].video_t_index
        assert isinstance(idx, torch.Tensor) == masked and (not masked or idx.unique().numel() > 1)
        monkeypatch.setattr(h3, "HEAD_ROWS", 10 ** 9)
        whole = rt.model.head(x, plan, 0)
        monkeypatch.setattr(h3, "HEAD_ROWS", 16)
        chunked, tier = rt.model.head(x, plan, 0), rt.model.head(x, plan, 0, rows=48)
        va, vz = plan.layout.segment("video")
        shift, scale = plan.final_mod[0]
        vw, vb, _, _ = plan.heads[0]
        direct = F.linear((rt.model.final_layer.norm(x[va:vz]) * (1.0 + scale[idx]) + shift[idx]).float(), vw, vb)
    assert vz - va > 3 * 16
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    ref = -h3.unpatchify_video(direct, plan.layout.latent_t, plan.layout.lat_h, plan.layout.lat_w,
                               rt.config.video_channels)[..., :plan.orig_hw[0], :plan.orig_hw[1]]
    if plan.video_mask is not None:
        ref = ref * plan.video_mask
    assert torch.equal(whole[0], ref)
    torch.testing.assert_close(tier[0], whole[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(tier[1], whole[1])
