"""Fused norm+RoPE and gate+add Triton kernels vs their torch references.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before the
kernels are first defined), on small shapes. With CUDA they run compiled, on the GPU.

Tolerances:
* norm_rope_: "within one rounding of the buffer dtype": every element within 1 ulp (of the dtype, at
  the reference's magnitude) of the reference, plus 1e-6 absolute. Both compute in fp32 and cast once;
  they differ only in fp32 op order / rsqrt, which moves the fp32 value by a few fp32 ulps of the O(1)
  normed inputs (so ~1e-7 absolute even where x1*cos - x2*sin cancels to a tiny output) and can flip
  one final rounding.
* gate_add_: bit-exact. Kernel and reference both round g*y to fp32, then x + (g*y) to fp32 (the kernel
  is launched without FMA contraction), then cast once with round-to-nearest-even.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from h3_blackwell.runtime.ops.elementwise import NormRopeLaunch, gate_add_, norm_rope_  # noqa: E402
from h3_blackwell.runtime.ops.operand_checks import check_segments  # noqa: E402
from h3_blackwell.runtime.ops.reference import gate_add_reference, norm_rope_qkv_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at |t| (fp32 tensor in, fp32 tensor out)."""
    fi = torch.finfo(dtype)
    mag = t.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _rope_tables(s, rope_dim, gen, device=DEV):
    half = torch.rand(s, rope_dim // 2, generator=gen) * 50.0  # angles of many turns, like far positions
    ang = torch.cat([half, half], dim=1)
    return ang.cos().to(device), ang.sin().to(device)


def _inputs(s, h, d, r, dtype, seed=0, row_pad=0):
    gen = torch.Generator().manual_seed(seed)
    cols = 3 * h * d
    base = (torch.randn(s, cols + row_pad, generator=gen) * 3.0 + 0.5).to(dtype).to(DEV)
    qkv = base[:, :cols]  # row stride = cols + row_pad when padded
    qw = (torch.rand(d, generator=gen) + 0.5).to(DEV)
    kw = (torch.rand(d, generator=gen) + 0.5).to(DEV)
    cos, sin = _rope_tables(s, r, gen)
    return qkv, qw, kw, cos, sin


def _assert_within_one_rounding(out, ref, dtype):
    diff = (out.float() - ref.float()).abs()
    bound = _ulp(ref.float(), dtype) + 1e-6
    bad = diff > bound
    assert not bad.any(), (
        f"{int(bad.sum())} elements differ by more than 1 ulp of {dtype} + 1e-6; worst diff {diff.max().item():.3g}"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "s,h,d,r,hpp",
    [
        (37, 3, 128, 96, 2),  # the model's head layout (D=128, R=96), 6 q/k heads, odd row count
        (20, 2, 64, 48, 4),  # R/2 = 24 not a power of two; 4 heads per program covers all 4 q/k heads
        (9, 3, 32, 32, 4),  # R = D: no pass-through channels; 6 heads with 4 per program (ragged tail)
        (11, 1, 32, 0, 1),  # R = 0: norm only
    ],
)
def test_norm_rope_kernel_matches_reference(dtype, s, h, d, r, hpp):
    qkv, qw, kw, cos, sin = _inputs(s, h, d, r, dtype, seed=s + r)
    ref = norm_rope_qkv_reference(qkv, qw, kw, cos, sin, 1e-5, r)
    before = qkv.clone()
    out = norm_rope_(qkv, qw, kw, cos, sin, 1e-5, r, launch=NormRopeLaunch(block_s=8, heads_per_program=hpp))
    assert out is qkv
    _assert_within_one_rounding(qkv, ref, dtype)
    hd = h * d
    assert torch.equal(qkv[:, 2 * hd :], before[:, 2 * hd :]), "v third must be untouched"
    assert (qkv[:, : 2 * hd] != before[:, : 2 * hd]).float().mean() > 0.9, "kernel did not rewrite q and k"


def test_norm_rope_row_strided_view_and_bf16_weights():
    # qkv as a view with row stride > 3*H*D (the kernel must use the buffer's stride), bf16 weights
    s, h, d, r = 19, 2, 128, 96
    qkv, qw, kw, cos, sin = _inputs(s, h, d, r, torch.bfloat16, seed=7, row_pad=24)
    assert qkv.stride(0) == 3 * h * d + 24
    qw, kw = qw.to(torch.bfloat16), kw.to(torch.bfloat16)
    tail = qkv.as_strided((s, 24), (qkv.stride(0), 1), qkv.storage_offset() + 3 * h * d).clone()
    ref = norm_rope_qkv_reference(qkv, qw, kw, cos, sin, 1e-5, r)
    norm_rope_(qkv, qw, kw, cos, sin, 1e-5, r)
    _assert_within_one_rounding(qkv, ref, torch.bfloat16)
    after_tail = qkv.as_strided((s, 24), (qkv.stride(0), 1), qkv.storage_offset() + 3 * h * d)
    assert torch.equal(after_tail, tail), "bytes between rows (outside the view) were written"


def test_norm_rope_qkv_reference_conventions():
    """The reference itself, against the stated conventions (fp32, unit weights)."""
    s, h, d, r = 5, 2, 128, 96
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(s, 3 * h * d, generator=gen) * 4 + 1
    ones = torch.ones(d)
    cos, sin = _rope_tables(s, r, gen, device="cpu")
    out = norm_rope_qkv_reference(qkv, ones, ones, cos, sin, 0.0, r)
    heads = out[:, : 2 * h * d].view(s, 2 * h, d)
    # rotation by equal-half angles preserves each (i, i+R/2) pair's norm, so every head has RMS 1
    torch.testing.assert_close(heads.square().mean(-1), torch.ones(s, 2 * h), rtol=1e-5, atol=1e-5)
    # cos = 0, sin = 1 is a quarter turn: first half -> -second half, second half -> first half
    normed = norm_rope_qkv_reference(qkv, ones, ones, torch.ones(s, r), torch.zeros(s, r), 0.0, r)
    quarter = norm_rope_qkv_reference(qkv, ones, ones, torch.zeros(s, r), torch.ones(s, r), 0.0, r)
    n = normed[:, : 2 * h * d].view(s, 2 * h, d)
    qt = quarter[:, : 2 * h * d].view(s, 2 * h, d)
    torch.testing.assert_close(qt[..., : r // 2], -n[..., r // 2 : r], rtol=0, atol=0)
    torch.testing.assert_close(qt[..., r // 2 : r], n[..., : r // 2], rtol=0, atol=0)
    torch.testing.assert_close(qt[..., r:], n[..., r:], rtol=0, atol=0)
    x = qkv[:, : h * d].view(s, h, d)
    torch.testing.assert_close(n[:, :h], x / x.square().mean(-1, keepdim=True).sqrt(), rtol=1e-6, atol=1e-6)


def test_norm_rope_validation_messages():
    qkv, qw, kw, cos, sin = _inputs(4, 1, 32, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="cos must be \\[S, rope_dim\\]"):
        norm_rope_(qkv, qw, kw, cos[:, :8], sin, 1e-5, 16)
    with pytest.raises(ValueError, match="not a multiple of 3\\*D"):
        norm_rope_(qkv[:, :-1], qw, kw, cos, sin, 1e-5, 16)
    with pytest.raises(ValueError, match="rope_dim must be even"):
        norm_rope_(qkv, qw, kw, cos[:, :15], sin[:, :15], 1e-5, 15)
    with pytest.raises(ValueError, match="float32"):
        norm_rope_(qkv, qw, kw, cos.half(), sin, 1e-5, 16)


SEGMENTS = [(0, 5, 1), (5, 37, 0), (37, 40, 2)]  # boundaries inside 16-row tiles


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_gate_add_exact(x_dtype, g_dtype):
    gen = torch.Generator().manual_seed(11)
    s, n = 40, 300  # n not a multiple of the 256-column block
    x = (torch.randn(s, n, generator=gen) * 2).to(x_dtype).to(DEV)
    y = (torch.randn(s, n, generator=gen) * 3).to(x_dtype).to(DEV)
    g = (torch.randn(3, n, generator=gen) * 0.7).to(g_dtype).to(DEV)
    x0 = x.clone()
    ref = gate_add_reference(x, y, g, SEGMENTS)
    assert torch.equal(x, x0), "the reference must not write its input"
    out = gate_add_(x, y, g, SEGMENTS)
    assert out is x
    assert torch.equal(x, ref), f"{int((x != ref).sum())} elements differ"
    assert (x != x0).float().mean() > 0.9, "gate_add_ left x (nearly) unchanged"


def test_gate_add_changes_every_segment_and_uses_its_row():
    gen = torch.Generator().manual_seed(12)
    s, n = 40, 64
    x0 = torch.randn(s, n, generator=gen).to(torch.bfloat16).to(DEV)
    y = torch.randn(s, n, generator=gen).to(torch.bfloat16).to(DEV)
    g = (torch.rand(3, n, generator=gen) + 1.0).to(DEV)
    x = x0.clone()
    gate_add_(x, y, g, SEGMENTS)
    for a, b, row in SEGMENTS:
        expect = (x0[a:b].float() + g[row].float() * y[a:b].float()).to(torch.bfloat16)
        assert torch.equal(x[a:b], expect), f"segment [{a},{b}) did not use gate row {row}"


def test_gate_add_round_to_nearest_even_ties():
    # x = 1, g*y = k * 2^-8 lands exactly halfway between bf16 neighbours for odd k: RNE must pick even
    n = 32
    k = torch.arange(1, 2 * n, 2, dtype=torch.float32)[:n]
    x = torch.ones(4, n, dtype=torch.bfloat16, device=DEV)
    y = (k * 2.0**-8).expand(4, n).contiguous().to(torch.bfloat16).to(DEV)
    g = torch.ones(1, n, device=DEV)
    ref = gate_add_reference(x, y, g, [(0, 4, 0)])
    gate_add_(x, y, g, [(0, 4, 0)])
    assert torch.equal(x, ref)
    assert torch.equal(ref[0].float(), (1.0 + k * 2.0**-8).to(torch.bfloat16).float().to(DEV))


def test_gate_add_row_strided_views():
    gen = torch.Generator().manual_seed(13)
    s, n = 33, 96
    xb = torch.randn(s, n + 8, generator=gen).to(torch.bfloat16).to(DEV)
    yb = torch.randn(s, n + 16, generator=gen).to(torch.bfloat16).to(DEV)
    x, y = xb[:, :n], yb[:, 8 : 8 + n]
    g = torch.randn(2, n, generator=gen).to(DEV)
    segs = [(0, 30, 1), (30, 33, 0)]
    pad_before = xb[:, n:].clone()
    ref = gate_add_reference(x, y, g, segs)
    gate_add_(x, y, g, segs)
    assert torch.equal(x, ref)
    assert torch.equal(xb[:, n:], pad_before)


@pytest.mark.parametrize(
    "segs,msg",
    [
        ([(0, 10, 0), (12, 40, 1)], "without gaps"),
        ([(0, 10, 0), (8, 40, 1)], "without gaps"),
        ([(0, 10, 0), (10, 39, 1)], "segments end at row 39"),
        ([(0, 40, 3)], "gate row 3"),
        ([(0, 0, 0), (0, 40, 1)], "without gaps"),
    ],
)
def test_segments_validation(segs, msg):
    with pytest.raises(ValueError, match=msg):
        check_segments(segs, 40, 3)


def test_gate_add_long_table_in_chunks_is_exact():
    """A masked stream's runs make long segment tables: gate_add_ launches them in chunks of
    GATE_ADD_MAX_SEGMENTS on row slices; the result stays bit-equal to the reference."""
    from h3_blackwell.runtime.ops.elementwise import GATE_ADD_MAX_SEGMENTS

    gen = torch.Generator().manual_seed(13)
    cuts = sorted(set(torch.randint(1, 300, (3 * GATE_ADD_MAX_SEGMENTS,), generator=gen).tolist()))
    bounds = [0] + cuts + [300]
    segs = [(a, b, i % 5) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    assert len(segs) > 2 * GATE_ADD_MAX_SEGMENTS
    x = torch.randn(300, 64, generator=gen).to(torch.bfloat16).to(DEV)
    y = torch.randn(300, 64, generator=gen).to(torch.bfloat16).to(DEV)
    g = torch.randn(5, 64, generator=gen).to(DEV)
    ref = gate_add_reference(x, y, g, segs)
    gate_add_(x, y, g, segs)
    assert torch.equal(x, ref), f"{int((x != ref).sum())} elements differ"
