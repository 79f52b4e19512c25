"""FlashAttention-3 backends (ops.flash_attention): the fp8 operands (Triton vs the torch definition, bit for
bit), the exactness of the K/V smoothing, the emulation against the fp32 reference, and the guards. The kernel
itself needs an H200: tests/gpu/test_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch

from h3_blackwell.runtime.ops import attention as A
from h3_blackwell.runtime.ops import flash_attention as F
from h3_blackwell.runtime.ops import registry


def _qkv(s, h, d, seed, dtype=torch.bfloat16, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, 3 * h * d, generator=g)
    x[:, h * d:] += offset * torch.randn(1, 2 * h * d, generator=g)  # k and v: a per-channel common offset
    return x.to(dtype)


@pytest.mark.parametrize("s,h,d,dtype", [(200, 2, 128, torch.bfloat16), (37, 3, 64, torch.float16),
                                         (1100, 1, 128, torch.bfloat16)])
def test_operands_triton_equal_reference(s, h, d, dtype):
    """The Triton launches write the reference's bytes (codes, descales, means) for row counts that are and are
    not multiples of the tiles, with k/v offsets so the smoothing matters."""
    buf = _qkv(s, h, d, seed=s, dtype=dtype, offset=3.0)
    before = buf.clone()
    q, k, v = A.qkv_views(buf, h, d)
    got = F.fa3_fp8_operands(q, k, v, backend="triton")
    want = F.fa3_fp8_operands_reference(q, k, v)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[0].shape == (3, 1, s, h, d) and got[1].shape == (3, 1, h)
    assert torch.equal(buf, before)  # the caller's buffer is read only


def test_operands_definition():
    """Means, per-head scales and codes as the docstring defines them, checked with independent arithmetic."""
    s, h, d = 300, 2, 64
    buf = _qkv(s, h, d, seed=5, offset=4.0)
    q, k, v = A.qkv_views(buf, h, d)
    codes, sc, means = F.fa3_fp8_operands_reference(q, k, v)
    torch.testing.assert_close(means[0], k[0].double().mean(0).float(), rtol=0, atol=1e-6)
    ks = k[0].float() - means[0]
    assert torch.allclose(sc[1, 0], ks.abs().amax(dim=(0, 2)) / 448)
    deq = codes[1, 0].float() * sc[1, 0].view(1, h, 1)
    # e4m3: 3 mantissa bits -> |error| <= 2^-4 |x| (normal range) or half a subnormal step
    err = (deq - ks).abs()
    bound = ks.abs() * 2 ** -4 + sc[1, 0].view(1, h, 1) * 2 ** -10
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # the codes really are rounded (not a copy)
    assert codes.dtype == torch.float8_e4m3fn and float(codes[1].float().abs().max()) == 448.0


def test_smoothing_is_exact_in_exact_arithmetic():
    """Subtracting K's and V's channel means and adding V's back leaves attention unchanged (fp64, no rounding);
    the emulation (exact attention on the rounded operands) then differs from the reference only by e4m3
    rounding, and with large common offsets the smoothing keeps that error small."""
    s, h, d = 256, 2, 64
    buf = _qkv(s, h, d, seed=9, dtype=torch.float32, offset=6.0)
    q, k, v = (t.double() for t in A.qkv_views(buf, h, d))
    ref = A.exact_attention_reference(q, k, v, compute_dtype=torch.float64)
    km, vm = k.mean(1, keepdim=True), v.mean(1, keepdim=True)
    smoothed = A.exact_attention_reference(q, k - km, v - vm, compute_dtype=torch.float64) + vm.reshape(1, -1)
    assert A.rel_l2(smoothed, ref) < 1e-12

    qb, kb, vb = A.qkv_views(buf.bfloat16(), h, d)
    exact = A.exact_attention_reference(qb, kb, vb)
    *deq, vm = F.fa3_fp8_dequantized(qb, kb, vb)
    emu = A.exact_attention_reference(*deq) + vm
    err = A.rel_l2(emu, exact)
    assert 1e-4 < err < 2e-2, err
    # the same rounding without smoothing (per-head scales of the raw k, v) is clearly worse here
    raw = []
    for t in (qb, kb, vb):
        x = t[0].float()
        sc = x.abs().amax(dim=(0, 2)).view(1, h, 1) / 448
        raw.append((x / sc).to(torch.float8_e4m3fn).float() * sc)
    err_raw = A.rel_l2(A.exact_attention_reference(*raw), exact)
    assert err_raw > 2 * err, (err_raw, err)


def test_guards_refuse_with_reasons(monkeypatch):
    ok, why = F.fa3_check("fa3_fp8", torch.device("cpu"), 128, torch.bfloat16)
    assert not ok and "needs a CUDA device" in why
    def no_driver(*a):
        raise RuntimeError("no CUDA driver")
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_driver)
    ok, why = F.fa3_check("fa3", torch.device("cuda", 0), 128, torch.bfloat16)
    assert not ok and "capability of cuda:0 is unknown" in why and "no CUDA driver" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (12, 1))
    ok, why = F.fa3_check("fa3", torch.device("cuda", 0), 128, torch.bfloat16)
    assert not ok and "sm_90" in why and "sm_121" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    F.fa3_module.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "flash_attn_interface", None)  # import fails
    try:
        ok, why = F.fa3_check("fa3_fp8", torch.device("cuda", 0), 128, torch.bfloat16)
        assert not ok and "FlashAttention-3 not installed" in why and "flash_attn_interface" in why
        with pytest.raises(RuntimeError, match="not installed"):
            F.bind_fa3("fa3_fp8", 0.1)
        ok, why = F.fa3_check("fa3", torch.device("cuda", 0), 128, torch.float32)
        assert not ok and "fp16/bf16" in why
    finally:
        F.fa3_module.cache_clear()


def test_registered_and_never_auto_on_cpu():
    names = [b.name for b in registry.REGISTRY["attention"]]
    assert "fa3" in names and "fa3_fp8" in names
    table = registry.capability_table("cpu")["attention"]
    rows = {r["backend"]: r for r in table}
    assert not rows["fa3_fp8"]["available"] and "CUDA" in rows["fa3_fp8"]["reason"]
    assert rows["fa3_fp8"]["reference"] == "reference"
    name, why = A.choose_attention_backend("cpu", "fa3_fp8")
    assert name == "reference" and why.startswith("requested fa3_fp8 unavailable")
