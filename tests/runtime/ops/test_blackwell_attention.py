"""Blackwell attention entries (``ops.blackwell_attention``: sage3 = SageAttention3, fa4 = FlashAttention-4):
CPU tests.

The real kernels need sm_120/sm_121 and sm_100/sm_103 (tests/gpu/test_blackwell_guards.py). Here:
* the FP4 quantizer of the sage3 emulation on hand-checked values (e2m1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 with
  ties to even, e4m3 block scales amax/6 with saturation and underflow);
* each emulation against the fp32 reference on random N(0,1) data: within TOLERANCE and measurably lossy, K/Q
  smoothing doing its job, a softmax scale other than D**-0.5;
* the guards: exact refusals on CPU and on faked capabilities, nothing imported before the architecture passes,
  the package reason once it does, head_dim/dtype limits; bind raising the check's reason;
* the bound functions' plumbing with stand-in packages (layouts handed over, the caller's buffer untouched).
"""

import sys
import types

import pytest
import torch

from h3_blackwell.runtime.ops import blackwell_attention as B
from h3_blackwell.runtime.ops.attention import exact_attention_reference, qkv_views, rel_l2

CUDA0 = torch.device("cuda", 0)  # never touched: the capability is faked


def _qkv(s, h, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, 3 * h * d, generator=g).to(dtype)


def _err(out, q, k, v, scale=None):
    s = q.shape[1]
    return rel_l2(out.reshape(s, -1).float(), exact_attention_reference(q, k, v, scale=scale))


def _fake_cc(monkeypatch, cc):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)


def _no_import(monkeypatch):
    def refuse(name):
        raise AssertionError(f"{name} was imported before the architecture passed")
    monkeypatch.setattr(B, "_import", refuse)


# ----------------------------------------------------------------------------------------------
# the FP4 quantizer
# ----------------------------------------------------------------------------------------------


def test_fp4_quantizer_hand_checked_codes():
    b1 = [6.0, 3.0, 1.5, 0.75, 0.25, -2.5, 5.0, -0.1, 1.25, 1.75, 3.5, 0.3, -6.0, 0.5, 2.0, 4.0]  # amax 6: scale 1
    b2 = [6.6, -3.0, 0.9] + [0.0] * 13  # amax/6 = 1.1 -> e4m3 1.125
    b3 = [1e-4, -5e-5] + [0.0] * 14  # amax/6 below e4m3's smallest subnormal (2^-9): scale 0, codes 0
    b4 = [6000.0, 2000.0, -300.0] + [0.0] * 13  # amax/6 = 1000 saturates at 448
    x = torch.tensor([b1, b2, b3, b4], dtype=torch.float32)
    codes, scales = B.fp4_block_quantize(x)
    assert codes.shape == (4, 16) and scales.shape == (4, 1)
    assert scales.flatten().tolist() == [1.0, 1.125, 0.0, 448.0]
    # ties: 0.75 -> 1 (code 2), 0.25 -> 0, -2.5 -> -2, 5 -> 4, 1.25 -> 1, 1.75 -> 2, 3.5 -> 4; -0.1 -> -0 (code 8)
    assert codes[0].tolist() == [7, 5, 3, 2, 0, 12, 6, 8, 2, 4, 6, 1, 15, 1, 4, 6]
    # 6.6/1.125 = 5.87 -> 6; -3/1.125 = -2.67 -> -3; 0.9/1.125 = 0.8 -> 1
    assert codes[1, :3].tolist() == [7, 13, 2] and codes[1, 3:].eq(0).all()
    assert codes[2].eq(0).all()
    # 6000/448 = 13.4 saturates at 6; 2000/448 = 4.46 -> 4; -300/448 = -0.67 -> -0.5
    assert codes[3, :3].tolist() == [7, 6, 9]
    deq = B.fp4_block_dequantize(codes, scales)
    assert deq[0].tolist() == [6, 3, 1.5, 1, 0, -2, 4, 0, 1, 2, 4, 0.5, -6, 0.5, 2, 4]
    assert deq[1, :3].tolist() == [6.75, -3.375, 1.125]
    assert deq[3, :3].tolist() == [2688.0, 1792.0, -224.0]


def test_e2m1_round_trip_and_e4m3_rounding():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = B.e2m1_values(codes)
    assert vals.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    back = B.e2m1_codes(vals)
    assert back.tolist() == list(range(8)) + [0] + list(range(9, 16))  # -0.0 reads as code 0: the same value
    assert B.e2m1_codes(torch.tensor([7.0, -100.0])).tolist() == [7, 15]  # saturating
    # e4m3 near 0.3: step 2^-5 -> 0.3125; 1.1 -> 1.125; 500 saturates at 448
    assert B.e4m3_round(torch.tensor([0.3, 1.1, 500.0, 2.0 ** -9])).tolist() == [0.3125, 1.125, 448.0, 2.0 ** -9]


# ----------------------------------------------------------------------------------------------
# emulations against the fp32 reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s,h,d", [(300, 2, 128), (1000, 2, 64)])
def test_sage3_emulation_within_tolerance_and_lossy(s, h, d):
    """S not a multiple of 128: the padding rows, the masked key tile and the last Q block's mean are exercised."""
    qkv = _qkv(s, h, d, seed=s)
    before = qkv.clone()
    q, k, v = qkv_views(qkv, h, d)
    out = B.sage3_emulated(q, k, v)
    assert out.shape == (1, s, h, d) and out.dtype == torch.bfloat16
    assert torch.equal(qkv, before)
    err = _err(out, q, k, v)
    tol, why = B.TOLERANCE["sage3"]
    print(f"\nsage3 emulation S={s} H={h} D={d}: rel_l2 {err:.4f} (tol {tol}: {why})")
    assert 0.1 < err <= tol  # FP4 on q, k, P and V: never close to exact on random data


def test_sage3_smoothing_takes_out_q_and_k_offsets():
    """A common offset on q and k is removed before FP4 (K's token mean; Q's per-block mean, added back exactly as
    delta_s): the emulation stays within tolerance, where plain FP4 of the same q and k is far off."""
    s, h, d = 256, 2, 128
    qkv = _qkv(s, h, d, seed=7).float()
    qkv[:, : h * d] += 2.0
    qkv[:, h * d: 2 * h * d] += 3.0
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv_views(qkv, h, d)
    err = _err(B.sage3_emulated(q, k, v), q, k, v)

    def fp4(x):  # per-row blocks along D, no smoothing
        return B.fp4_block_dequantize(*B.fp4_block_quantize(x.float())).to(x.dtype)
    plain = _err(exact_attention_reference(fp4(q), fp4(k), v), q, k, v)
    print(f"\noffset q+2, k+3: sage3 emulation {err:.4f}, unsmoothed FP4 q/k {plain:.4f}")
    assert err <= B.TOLERANCE["sage3"][0]
    assert plain > 2 * err


def test_emulations_honour_a_scale_other_than_the_default():
    s, h, d = 200, 2, 128
    q, k, v = qkv_views(_qkv(s, h, d, seed=3), h, d)
    scale = 0.6 * d ** -0.5
    assert _err(B.sage3_emulated(q, k, v, scale=scale), q, k, v, scale=scale) <= B.TOLERANCE["sage3"][0]
    assert _err(B.fa4_emulated(q, k, v, scale=scale), q, k, v, scale=scale) <= B.TOLERANCE["fa4"][0]
    # the scale really acts: against the default-scale reference the flash emulation is far off
    assert _err(B.fa4_emulated(q, k, v, scale=scale), q, k, v) > 10 * B.TOLERANCE["fa4"][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa4_emulation_within_tolerance_and_not_exact(dtype):
    s, h, d = 300, 2, 128
    q, k, v = qkv_views(_qkv(s, h, d, seed=11, dtype=dtype), h, d)
    out = B.fa4_emulated(q, k, v)
    assert out.shape == (1, s, h, d) and out.dtype == dtype
    err = _err(out, q, k, v)
    ref = exact_attention_reference(q, k, v)
    rounding_only = rel_l2(ref.to(dtype).float(), ref)  # the exact result, rounded to the output dtype
    tol, why = B.TOLERANCE["fa4"]
    print(f"\nfa4 emulation {dtype}: rel_l2 {err:.2e}, output rounding alone {rounding_only:.2e} (tol {tol}: {why})")
    assert err <= tol
    assert err > 1.2 * rounding_only  # P's rounding before PV adds its own share (~1.33x on this data)


# ----------------------------------------------------------------------------------------------
# guards
# ----------------------------------------------------------------------------------------------

SAGE3_ARCH = "sage3: needs sm_120/sm_121 (SageAttention3 FP4 kernels); this device is sm_{}"
FA4_ARCH = "fa4: needs sm_100/sm_103 (FlashAttention-4 SM100 kernels); this device is sm_{}"


def test_checks_refuse_on_cpu(monkeypatch):
    _no_import(monkeypatch)
    assert B.sage3_check("cpu", 128, torch.bfloat16) == (
        False, "sage3: needs a CUDA device of sm_120/sm_121 (SageAttention3 FP4 kernels); found cpu")
    assert B.fa4_check(torch.device("cpu"), 128, torch.bfloat16) == (
        False, "fa4: needs a CUDA device of sm_100/sm_103 (FlashAttention-4 SM100 kernels); found cpu")


def test_checks_never_raise_when_the_capability_cannot_be_read(monkeypatch):
    _no_import(monkeypatch)

    def broken(device=None):
        raise RuntimeError("no CUDA driver")
    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    ok, why = B.sage3_check(CUDA0, 128, torch.bfloat16)
    assert not ok and why == ("sage3: needs sm_120/sm_121 (SageAttention3 FP4 kernels); the capability of cuda:0 "
                              "is unknown (RuntimeError: no CUDA driver)")
    ok, why = B.fa4_check(CUDA0, 128, torch.bfloat16)
    assert not ok and why.startswith("fa4: needs sm_100/sm_103") and "RuntimeError: no CUDA driver" in why


@pytest.mark.parametrize("backend,cc", [("sage3", cc) for cc in [(9, 0), (8, 9), (10, 0), (10, 3), (11, 0)]]
                         + [("fa4", cc) for cc in [(9, 0), (8, 9), (12, 0), (12, 1), (11, 0)]])
def test_refuses_other_architectures_without_importing(monkeypatch, backend, cc):
    check, bind, _ = B.BLACKWELL_BACKENDS[backend]
    want = (SAGE3_ARCH if backend == "sage3" else FA4_ARCH).format(f"{cc[0]}{cc[1]}")
    _fake_cc(monkeypatch, cc)
    _no_import(monkeypatch)
    assert check(CUDA0, 128, torch.bfloat16) == (False, want)
    with pytest.raises(RuntimeError) as e:
        bind(CUDA0, 128)
    assert str(e.value) == want


@pytest.mark.parametrize("cc", [(12, 0), (12, 1)])
def test_sage3_target_arch_then_missing_package_says_how_to_build_it(monkeypatch, cc):
    _fake_cc(monkeypatch, cc)
    monkeypatch.setitem(sys.modules, "sageattn3", None)  # an import of it fails here, installed or not
    ok, why = B.sage3_check(CUDA0, 128, torch.bfloat16)
    assert not ok
    assert why.startswith("sage3: SageAttention3 not installed (ModuleNotFoundError: ")
    assert "sageattention3_blackwell/ folder (python setup.py install" in why and "network access" in why
    with pytest.raises(RuntimeError) as e:
        B.bind_sage3(CUDA0, 128)
    assert str(e.value) == why


@pytest.mark.parametrize("cc", [(10, 0), (10, 3)])
def test_fa4_target_arch_then_missing_package_says_how_to_install_it(monkeypatch, cc):
    _fake_cc(monkeypatch, cc)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    ok, why = B.fa4_check(CUDA0, 128, torch.bfloat16)
    assert not ok
    assert why.startswith("fa4: FlashAttention-4 not installed (ModuleNotFoundError: ")
    assert "pip install flash-attn-4" in why and "flash-attn-4[cu13]" in why
    with pytest.raises(RuntimeError) as e:
        B.bind_fa4(CUDA0, 128, 0.1)
    assert str(e.value) == why


# ----------------------------------------------------------------------------------------------
# stand-in packages: the limits after the import, and the bound functions' plumbing
# ----------------------------------------------------------------------------------------------


def _sage3_standin(calls):
    """Behaves as sageattn3.sageattn3_blackwell at its interface: HND in, K's mean subtracted IN PLACE, softmax
    scale fixed at D**-0.5, contiguous HND out (exact math in place of FP4)."""
    def sageattn3_blackwell(q, k, v, attn_mask=None, is_causal=False, per_block_mean=True, **kw):
        calls.append({"q": q, "k": k, "v": v, "is_causal": is_causal, "per_block_mean": per_block_mean})
        k -= k.mean(dim=-2, keepdim=True)
        o = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5, -1) @ v.float()
        return o.to(q.dtype).contiguous()
    return types.SimpleNamespace(sageattn3_blackwell=sageattn3_blackwell, __file__="standin")


def _fa4_standin(calls):
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kw):
        calls.append({"q": q, "k": k, "v": v, "scale": softmax_scale, "causal": causal})
        qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
        o = torch.softmax((qh @ kh.transpose(-1, -2)) * softmax_scale, -1) @ vh
        return o.transpose(1, 2).to(q.dtype), None
    return types.SimpleNamespace(flash_attn_func=flash_attn_func, __file__="standin")


def test_head_dim_and_dtype_limits_after_the_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "sageattn3", _sage3_standin([]))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fa4_standin([]))
    _fake_cc(monkeypatch, (12, 1))
    for d in (64, 128):
        ok, why = B.sage3_check(CUDA0, d, torch.bfloat16)
        assert ok and why.startswith("sm_121: SageAttention3 sageattn3_blackwell")
    assert B.sage3_check(CUDA0, 96, torch.bfloat16) == (
        False, "sage3: SageAttention3 runs head_dim 64 or 128 (found 96)")
    assert B.sage3_check(CUDA0, 128, torch.float32) == (
        False, "sage3: needs fp16/bf16 q, k, v (compute dtype is torch.float32)")
    _fake_cc(monkeypatch, (10, 0))
    for d in (8, 64, 96, 128, 256):
        assert B.fa4_check(CUDA0, d, torch.float16)[0], d
    for d in (100, 136, 192):
        assert B.fa4_check(CUDA0, d, torch.bfloat16) == (False, (
            "fa4: FlashAttention-4's SM100 forward runs head_dim 8..128 (multiple of 8) or 256 "
            f"(found {d})"))
    assert not B.fa4_check(CUDA0, 128, torch.float32)[0]


@pytest.mark.parametrize("scale", [None, 0.05])
def test_bound_sage3_hands_hnd_views_and_a_private_k(monkeypatch, scale):
    calls = []
    monkeypatch.setitem(sys.modules, "sageattn3", _sage3_standin(calls))
    _fake_cc(monkeypatch, (12, 0))
    s, h, d = 200, 3, 64
    qkv = (_qkv(s, h, d, seed=5).float() + 0.5).to(torch.bfloat16)  # K with a clear mean: in-place would show
    before = qkv.clone()
    q, k, v = qkv_views(qkv, h, d)
    out = B.bind_sage3(CUDA0, d, scale)(q, k, v)
    assert out.shape == (1, s, h, d) and out.dtype == torch.bfloat16
    assert torch.equal(qkv, before), "the bound sage3 function changed the caller's qkv buffer"
    (c,) = calls
    assert c["is_causal"] is False and c["per_block_mean"] is True
    assert c["k"].shape == (1, h, s, d) and c["k"].is_contiguous()
    assert c["k"].untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
    assert c["v"].data_ptr() == v.data_ptr() and c["v"].shape == (1, h, s, d)  # a view: no copy of V
    if scale is None:
        assert c["q"].data_ptr() == q.data_ptr()
    assert _err(out, q, k, v, scale=scale) < 1e-2  # the stand-in is exact: only bf16 rounding remains


def test_bound_fa4_hands_the_nhd_views_as_they_are(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fa4_standin(calls))
    _fake_cc(monkeypatch, (10, 3))
    s, h, d = 150, 2, 128
    qkv = _qkv(s, h, d, seed=9)
    before = qkv.clone()
    q, k, v = qkv_views(qkv, h, d)
    out = B.bind_fa4(CUDA0, d)(q, k, v)
    assert out.shape == (1, s, h, d) and out.dtype == torch.bfloat16
    assert torch.equal(qkv, before)
    (c,) = calls
    assert [c[n].data_ptr() for n in "qkv"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert c["scale"] == d ** -0.5 and c["causal"] is False
    assert _err(out, q, k, v) < 1e-2


def test_registry_of_this_module_names_both_backends():
    assert set(B.BLACKWELL_BACKENDS) == {"sage3", "fa4"} == set(B.TOLERANCE)
    assert B.BLACKWELL_BACKENDS["sage3"] == (B.sage3_check, B.bind_sage3, B.sage3_emulated)
    assert B.BLACKWELL_BACKENDS["fa4"] == (B.fa4_check, B.bind_fa4, B.fa4_emulated)
