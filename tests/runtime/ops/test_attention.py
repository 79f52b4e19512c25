"""Attention over strided views of the fused qkv buffer: CPU tests.

Real kernels (sage1/sage2/cuDNN/flash) need a GPU: tests/gpu/test_attention_gpu.py. Here:
* the fp32 reference against an fp64 computation of the same formula (tolerance: TOLERANCE["reference"]);
* torch SDPA (math kernel on CPU) against the reference (fp32 inputs 1e-5: summation order only;
  bf16 inputs TOLERANCE["sdpa"]: bf16 output rounding);
* the bound functions' contract (``bind_attention``: what a load binds and every caller runs) with stand-in
  SageAttention modules that record what they are handed: the per-architecture dispatch, that q/k/v reach the
  backend as views of qkv (no copies), and that a sage1 that subtracts K's mean IN PLACE (as 1.0.6 does)
  cannot change the caller's buffer; one bound function serves any head count (sequence parallelism);
* choose_attention_backend: explicit reasons, never a silent downgrade; the probe runs the bound function.
"""

import os
from pathlib import Path
import sys
import types
import zipfile

import pytest
import torch

import h3_blackwell.runtime.ops.attention as A
import h3_blackwell.runtime.ops.sage as S
from h3_blackwell.runtime.ops.attention import (
    TOLERANCE,
    bind_attention,
    exact_attention_reference,
    choose_attention_backend,
    qkv_views,
    rel_l2,
)
from h3_blackwell.runtime.ops.sage import use_sage1_from

CUDA0 = torch.device("cuda", 0)  # the stand-in Sage modules never touch it: capability is patched


def attend(qkv, h, d, backend, **kw):
    """One call of the bound function (h: the head count the buffer holds; the function reads it from the width)."""
    assert qkv.shape[1] == 3 * h * d
    if backend.startswith("sage"):
        kw.setdefault("device", CUDA0)
    return bind_attention(backend, d, **kw)(qkv)


def _qkv(s, h, d, dtype=torch.float32, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(s, 3 * h * d + row_pad, generator=g).to(dtype)
    return base[:, : 3 * h * d]


def _fp64_attention(qkv, h, d):
    """Straight fp64 softmax(q k^T / sqrt(D)) v, written independently of the module."""
    s = qkv.shape[0]
    x = qkv.double().reshape(s, 3, h, d)
    q, k, v = x[:, 0].transpose(0, 1), x[:, 1].transpose(0, 1), x[:, 2].transpose(0, 1)  # [H, S, D]
    p = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1)
    return (p @ v).transpose(0, 1).reshape(s, h * d)


# ---------------------------------------------------------------------------------------------- views


def test_qkv_views_are_views_with_the_model_layout():
    s, h, d = 6, 3, 8
    qkv = _qkv(s, h, d, row_pad=5)
    q, k, v = qkv_views(qkv, h, d)
    row = qkv.stride(0)
    for i, t in enumerate((q, k, v)):
        assert t.shape == (1, s, h, d)
        assert t.stride() == (s * row, row, d, 1)
        assert t.data_ptr() == qkv.data_ptr() + i * h * d * qkv.element_size()
    # head 2 of k is columns [H*D + 2*D, H*D + 3*D) of the buffer
    assert torch.equal(k[0, :, 2], qkv[:, h * d + 2 * d : h * d + 3 * d])


def test_shape_errors_say_expected_and_found():
    with pytest.raises(ValueError, match="3\\*H\\*D = 48"):
        qkv_views(torch.randn(4, 40), 2, 8)
    with pytest.raises(ValueError, match="expected one of"):
        bind_attention("flash3", 8)


def test_one_bound_function_serves_every_head_count():
    """Sequence parallelism hands the load's bound function a rank's heads: H is read from the buffer's width."""
    d = 16
    for backend in ("reference", "sdpa"):
        fn = bind_attention(backend, d)
        for h in (1, 2, 4):
            qkv = _qkv(37, h, d, seed=h)
            assert rel_l2(fn(qkv), _fp64_attention(qkv, h, d)) <= 1e-5


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("s", [1, 7, 130, 257])
def test_reference_vs_fp64(s):
    h, d = 3, 16
    qkv = _qkv(s, h, d, seed=s)
    ref64 = _fp64_attention(qkv, h, d)
    # max_elems small: the query loop runs in many chunks
    out = exact_attention_reference(*qkv_views(qkv, h, d), max_elems=h * s * 5)
    assert out.dtype == torch.float32 and out.shape == (s, h * d)
    assert rel_l2(out, ref64) <= TOLERANCE["reference"][0]


def test_reference_row_subset_equals_full_rows():
    s, h, d = 97, 2, 16
    qkv = _qkv(s, h, d, seed=5)
    rows = torch.tensor([0, 13, 50, 96])
    full = exact_attention_reference(*qkv_views(qkv, h, d))
    sub = exact_attention_reference(*qkv_views(qkv, h, d), rows=rows)
    # The same fp32 math on 4 query rows instead of 97: the score and PV GEMMs have another M, so the BLAS may sum
    # in another order (MKL's AVX2 and CNR-compatible kernels do; AVX-512 gives the same bytes). Bound of that
    # reordering for o = sum_j p_j v_j (sum_j p_j = 1): the PV sum moves by <= 2 S u max|v|; the scores by
    # <= 2 D u A with A = max_ij scale * sum_k |q_ik||k_jk|, which moves each p_j by <= p_j (4 D u A + 2 S u).
    # So |d o| <= 4 (S + D A) u max|v| per element (u = 2^-24). A wrong row or key set is off by O(max|v|).
    q, k, v = (t[0].transpose(0, 1).double() for t in qkv_views(qkv, h, d))  # [H, S, D]
    a = float((q.abs() @ k.abs().transpose(1, 2)).max()) * d ** -0.5
    bound = 4 * (s + d * a) * 2.0 ** -24 * float(v.abs().max())
    err = float((sub - full[rows]).abs().max())
    assert err <= bound, (err, bound)


def test_reference_backend_returns_input_dtype():
    qkv = _qkv(33, 2, 16, dtype=torch.bfloat16)
    out = attend(qkv, 2, 16, "reference")
    assert out.dtype == torch.bfloat16 and out.shape == (33, 32)
    assert rel_l2(out.float(), _fp64_attention(qkv, 2, 16)) <= TOLERANCE["sdpa"][0]


# ---------------------------------------------------------------------------------------------- sdpa


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math"])
@pytest.mark.parametrize("s", [5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_vs_reference(backend, s, dtype):
    h, d = 4, 32
    qkv = _qkv(s, h, d, dtype=dtype, seed=s + 1)
    before = qkv.clone()
    out = attend(qkv, h, d, backend)
    assert out.dtype == dtype and out.shape == (s, h * d)
    ref = exact_attention_reference(*qkv_views(qkv, h, d))
    tol = 1e-5 if dtype == torch.float32 else TOLERANCE[backend][0]
    assert rel_l2(out.float(), ref) <= tol
    assert torch.equal(qkv, before)


def test_strided_path_hands_views_to_sdpa(monkeypatch):
    import torch.nn.functional as F

    s, h, d = 16, 2, 8
    qkv = _qkv(s, h, d, seed=3)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr(), q.untyped_storage().data_ptr()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    attend(qkv, h, d, "sdpa")
    es = qkv.element_size()
    base = qkv.data_ptr()
    assert seen[-1] == (base, base + h * d * es, base + 2 * h * d * es, qkv.untyped_storage().data_ptr())
    # control: a copied buffer lives elsewhere, so the check above tells views from copies
    attend(qkv.clone(), h, d, "sdpa")
    assert seen[-1][3] != qkv.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------- stand-in SageAttention


def _math_nhd(q, k, v, sm_scale):
    """[1, S, H, D] in -> [1, S, H, D] out (q dtype), fp32 math: what a Sage kernel computes, minus quantization."""
    o = exact_attention_reference(q, k, v, scale=sm_scale).to(q.dtype)
    return o.view(1, q.shape[1], q.shape[2], q.shape[3])


def _fake_sage2(calls, sm90=True, sm89=True):
    mod = types.ModuleType("sageattention")

    def make(name):
        def fn(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread", sm_scale=None,
               pv_accum_dtype="fp32", smooth_k=True, **kw):
            calls.append(dict(fn=name, q=q, k=k, v=v, tensor_layout=tensor_layout, is_causal=is_causal,
                              qk_quant_gran=qk_quant_gran, pv_accum_dtype=pv_accum_dtype, sm_scale=sm_scale))
            return _math_nhd(q, k, v, sm_scale)

        return fn

    mod.sageattn_qk_int8_pv_fp8_cuda_sm90 = make("sm90")
    mod.sageattn_qk_int8_pv_fp8_cuda = make("fp8")
    mod.sageattn = make("dispatch")
    mod.core = types.SimpleNamespace(SM90_ENABLED=sm90, SM89_ENABLED=sm89)
    return mod


def _sage1_source():
    # what sageattention 1.0.6 does to K before quantizing (core.py: `k -= km`), then exact attention
    return (
        "import torch\n"
        "from h3_blackwell.runtime.ops.attention import exact_attention_reference\n"
        "calls = []\n"
        "def sageattn(q, k, v, tensor_layout='HND', is_causal=False, sm_scale=None, smooth_k=True, **kw):\n"
        "    assert tensor_layout == 'NHD' and not is_causal\n"
        "    calls.append(dict(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), k_storage=k.untyped_storage().data_ptr()))\n"
        "    if smooth_k:\n"
        "        k -= k.mean(dim=1, keepdim=True)\n"
        "    o = exact_attention_reference(q, k, v, scale=sm_scale).to(q.dtype)\n"
        "    return o.view(q.shape)\n"
    )


@pytest.fixture
def clean_sage(monkeypatch):
    """Isolate the module caches and sys.modules['sageattention'] per test."""
    S.sage2_module.cache_clear()
    monkeypatch.setitem(S.SAGE1, "module", None)
    monkeypatch.setitem(S.SAGE1, "source", None)
    monkeypatch.setattr(A, "_PROBES", {})
    monkeypatch.delitem(sys.modules, "sageattention", raising=False)
    yield monkeypatch
    S.sage2_module.cache_clear()


@pytest.fixture
def fake_sage1(tmp_path, clean_sage):
    pkg = tmp_path / "site" / "sageattention"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_sage1_source())
    (tmp_path / "site" / "sageattention-1.0.6.dist-info").mkdir()
    return tmp_path / "site"


@pytest.mark.parametrize(
    "cc,fn,gran,accum",
    [
        ((9, 0), "sm90", "per_warp", "fp32+fp32"),
        ((8, 9), "fp8", "per_warp", "fp32+fp16"),
        ((10, 0), "fp8", "per_warp", "fp32+fp16"),  # sageattn() raises here; the fp8 kernel is built for 100a
        ((12, 0), "fp8", "per_warp", "fp32+fp16"),
        ((12, 1), "fp8", "per_warp", "fp32+fp16"),
    ],
)
def test_sage2_dispatch_and_views(clean_sage, cc, fn, gran, accum):
    calls = []
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2(calls))
    clean_sage.setattr(S, "capability", lambda device: cc)
    s, h, d = 50, 2, 16
    qkv = _qkv(s, h, d, dtype=torch.bfloat16, seed=9)
    before = qkv.clone()
    out = attend(qkv, h, d, "sage2")
    assert len(calls) == 1
    c = calls[0]
    assert (c["fn"], c["qk_quant_gran"], c["pv_accum_dtype"], c["tensor_layout"], c["is_causal"]) == (
        fn, gran, accum, "NHD", False)
    assert c["sm_scale"] == pytest.approx(d**-0.5)
    es = qkv.element_size()
    for i, name in enumerate("qkv"):
        t = c[name]
        assert t.data_ptr() == qkv.data_ptr() + i * h * d * es, f"{name} is not a view of qkv"
        assert t.stride() == (s * 3 * h * d, 3 * h * d, d, 1)
    assert out.shape == (s, h * d) and out.dtype == torch.bfloat16
    assert rel_l2(out.float(), exact_attention_reference(*qkv_views(qkv, h, d))) <= TOLERANCE["sdpa"][0]
    assert torch.equal(qkv, before)


def test_sage2_unwired_arch_and_fp32_are_refused(clean_sage):
    """Refused when the plan is made (availability) and when binding: never at the first call."""
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2([]))
    clean_sage.setattr(S, "capability", lambda device: (8, 0))
    ok, why = A._available("sage2", CUDA0, 16, torch.bfloat16, probe=False)
    assert not ok and "no kernel path wired for sm_80" in why
    with pytest.raises(RuntimeError, match="no kernel path wired for sm_80"):
        bind_attention("sage2", 16, device=CUDA0)
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    ok, why = A._available("sage2", CUDA0, 16, torch.float32, probe=False)
    assert not ok and "fp16/bf16" in why


def test_sage1_fake_really_mutates_a_view(fake_sage1):
    """Control: the stand-in reproduces 1.0.6's trap, so the next test means something."""
    use_sage1_from(str(fake_sage1))
    qkv = _qkv(40, 2, 16, dtype=torch.bfloat16, seed=4) + 0.5  # non-zero K mean
    before = qkv.clone()
    q, k, v = qkv_views(qkv, 2, 16)
    S.SAGE1["module"].sageattn(q, k, v, tensor_layout="NHD", sm_scale=0.25)
    assert not torch.equal(qkv, before), "stand-in sage1 should have written K through the view"


@pytest.mark.parametrize("s", [1, 40, 129])
def test_sage1_never_changes_the_callers_buffer(fake_sage1, s):
    version = use_sage1_from(str(fake_sage1))
    assert version == "1.0.6"
    h, d = 2, 16
    qkv = _qkv(s, h, d, dtype=torch.bfloat16, seed=s) + 0.5
    before = qkv.clone()
    out = attend(qkv, h, d, "sage1")
    assert torch.equal(qkv, before), "sage1 changed the caller's qkv buffer"
    c = S.SAGE1["module"].calls[-1]
    es = qkv.element_size()
    assert c["q"] == qkv.data_ptr() and c["v"] == qkv.data_ptr() + 2 * h * d * es, "q and v should stay views"
    assert c["k_storage"] != qkv.untyped_storage().data_ptr(), "K must be a private copy"
    # K's mean subtraction does not change softmax(q k^T): the output is still the attention of the buffer
    assert rel_l2(out.float(), exact_attention_reference(*qkv_views(qkv, h, d))) <= TOLERANCE["sdpa"][0]


def test_use_sage1_from_wheel(tmp_path, clean_sage):
    whl = tmp_path / "sageattention-1.0.6-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:  # fixed dates: the same bytes every run, so the content-keyed unpack
        for name, text in (("sageattention/__init__.py", _sage1_source()),  # under /tmp is reused, not added to
                           ("sageattention-1.0.6.dist-info/METADATA", "Name: sageattention\nVersion: 1.0.6\n")):
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
    assert use_sage1_from(str(whl)) == "1.0.6"
    qkv = _qkv(20, 1, 16, dtype=torch.bfloat16) + 0.5
    before = qkv.clone()
    attend(qkv, 1, 16, "sage1")
    assert torch.equal(qkv, before)


def test_use_sage1_from_refuses_sage2(tmp_path, clean_sage):
    pkg = tmp_path / "sageattention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def sageattn(*a, **k): pass\ndef sageattn_qk_int8_pv_fp8_cuda(*a, **k): pass\n")
    with pytest.raises(ValueError, match="not SageAttention 1"):
        use_sage1_from(str(tmp_path))


def test_real_sage1_wheel_loads_if_present(clean_sage):
    """The PyPI 1.0.6 wheel (not committed; scripts/test.sh downloads it into .whl/ as a file, never installed)."""
    root = str(Path(__file__).resolve().parents[3])
    whl = os.path.join(root, ".whl", "sageattention-1.0.6-py3-none-any.whl")
    if not os.path.isfile(whl):
        pytest.skip(f"{whl} not present")
    pytest.importorskip("triton")
    assert use_sage1_from(whl) == "1.0.6"
    assert callable(S.SAGE1["module"].sageattn)


# ---------------------------------------------------------------------------------------------- selection


def test_choose_cpu_and_unknown():
    assert choose_attention_backend("cpu")[0] == "reference"
    with pytest.raises(ValueError, match="expected auto or one of"):
        choose_attention_backend("cpu", "flash3")


def test_choose_never_downgrades_silently(clean_sage):
    name, why = choose_attention_backend("cpu", "sdpa_cudnn")
    assert name == "reference" and why.startswith("requested sdpa_cudnn unavailable: ") and "CUDA" in why
    with pytest.raises(RuntimeError, match="sdpa_cudnn.*unavailable"):
        choose_attention_backend("cpu", "sdpa_cudnn", strict=True)
    assert choose_attention_backend("cpu", "sdpa_math") == (
        "sdpa_math", f"torch {torch.__version__} scaled_dot_product_attention (math kernel)")


def test_choose_hopper_without_sage2_says_why(clean_sage):
    clean_sage.setitem(sys.modules, "sageattention", None)  # import raises ImportError
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    name, why = choose_attention_backend("cuda:0", probe=False)
    assert name == "sdpa_cudnn"
    assert "sage2 not installed" in why and "cuDNN" in why
    name, why = choose_attention_backend("cuda:0", "sage2", probe=False)
    assert name == "sdpa_cudnn" and why.startswith("requested sage2 unavailable: sage2 not installed")


def test_choose_sage2_when_present_and_built(clean_sage):
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2([]))
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    name, why = choose_attention_backend("cuda:0", probe=False)
    assert name == "sage2" and "sageattn_qk_int8_pv_fp8_cuda_sm90" in why


def test_choose_sage2_built_without_this_arch(clean_sage):
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2([], sm90=False))
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    name, why = choose_attention_backend("cuda:0", probe=False)
    assert name == "sdpa_cudnn" and "SM90_ENABLED is False" in why and "TORCH_CUDA_ARCH_LIST=9.0" in why


def test_choose_sees_sage1_installed_under_the_sage2_name(clean_sage):
    sa1 = types.ModuleType("sageattention")
    sa1.sageattn = lambda *a, **k: None
    clean_sage.setitem(sys.modules, "sageattention", sa1)
    clean_sage.setattr(S, "capability", lambda device: (12, 1))
    name, why = choose_attention_backend("cuda:0", probe=False)
    assert name == "sdpa" and "is SageAttention 1" in why


def test_choose_blackwell_sage2_and_unwired_arch(clean_sage):
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2([]))
    clean_sage.setattr(S, "capability", lambda device: (12, 1))
    assert choose_attention_backend("cuda:0", probe=False)[0] == "sage2"
    clean_sage.setattr(S, "capability", lambda device: (7, 5))
    name, why = choose_attention_backend("cuda:0", probe=False)
    assert name == "sdpa" and "no kernel path wired for sm_75" in why


def test_use_sage1_from_reloads_submodules(tmp_path, clean_sage):
    """Loading a second SA1 copy must not reuse the first copy's cached submodules."""
    for tag in ("one", "two"):
        pkg = tmp_path / tag / "sageattention"
        pkg.mkdir(parents=True)
        (pkg / "core.py").write_text(f"TAG = {tag!r}\ndef sageattn(*a, **k): return TAG\n")
        (pkg / "__init__.py").write_text("from .core import sageattn, TAG\n")
        use_sage1_from(str(tmp_path / tag))
        assert S.SAGE1["module"].TAG == tag


# ---------------------------------------------------------------------------------------------- V handling on sm_90


def _fake_sage2_stages(calls):
    """A stand-in SageAttention2 whose ``core`` exposes the sm90 wrapper's stages; each records its call.
    The 'quantizer' passes values through; the 'kernel' attends over the first kv_len (= K's rows) of V."""
    mod = _fake_sage2(calls)

    def per_warp_int8_cuda(q, k, km, tensor_layout="HND", BLKQ=128, WARPQ=32, BLKK=64):
        calls.append(dict(fn="per_warp_int8", q=q, k=k, km=km, tensor_layout=tensor_layout, BLKQ=BLKQ, WARPQ=WARPQ,
                          BLKK=BLKK))
        return q, "q_scale", k - km, "k_scale"

    def per_channel_fp8(v, tensor_layout="HND", scale_max=448.0, smooth_v=True):
        calls.append(dict(fn="per_channel_fp8", v=v, tensor_layout=tensor_layout, smooth_v=smooth_v))
        return v, "v_scale", None

    def kernel(q8, k8, v8, o, qs, ks, vs, layout, causal, gran, sm_scale, lse):
        calls.append(dict(fn="sm90_kernel", scales=(qs, ks, vs), args=(layout, causal, gran, sm_scale, lse), o=o,
                          v8=v8, kv_len=k8.shape[1]))
        o.copy_(_math_nhd(q8, k8, v8[:, : k8.shape[1]], sm_scale))
        return None

    mod.core = types.SimpleNamespace(SM90_ENABLED=True, SM89_ENABLED=True, per_warp_int8_cuda=per_warp_int8_cuda,
                                     per_channel_fp8=per_channel_fp8,
                                     sm90_compile=types.SimpleNamespace(
                                         qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf=kernel))
    return mod


def _fake_sage2_fused(calls):
    """The stand-in stages with a 'kernel' that reads V's fp8 operands as the sm_90 kernel does (fused V)."""
    from h3_blackwell.runtime.ops import fp8_producers as f8

    mod = _fake_sage2_stages(calls)

    def kernel(q8, k8, v8, o, qs, ks, vs, layout, causal, gran, sm_scale, lse):
        # decode V as the sm90 kernel reads it: [1, D, H, rows] e4m3 codes x per-channel scale, permuted tokens
        rows = v8.shape[-1]
        perm = (torch.arange(rows) // 16) * 16 + torch.tensor(f8.SAGE_V_PERM).repeat(rows // 16)
        deq = v8[0].float().permute(2, 1, 0) * vs[0]  # [rows (stored order), H, D]
        v = torch.empty_like(deq)
        v[perm] = deq
        calls.append(dict(fn="sm90_kernel", v8=v8, vs=vs, v=v, kv_len=k8.shape[1]))
        o.copy_(_math_nhd(q8, k8, v[: k8.shape[1]].unsqueeze(0).to(q8.dtype), sm_scale))

    mod.core.sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf = kernel
    return mod


def test_sage2_sm90_library_v_handling_calls_the_wrapper_once(clean_sage):
    """The default V handling: SageAttention2's own sm_90 wrapper, one call, V of S rows (no stages run)."""
    calls = []
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2_stages(calls))
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    h, d, s = 2, 128, 200
    attend(_qkv(s, h, d, dtype=torch.bfloat16, seed=6), h, d, "sage2")
    assert [c["fn"] for c in calls] == ["sm90"] and calls[0]["v"].shape[1] == s


@pytest.mark.parametrize("cc", [(8, 9), (10, 0), (12, 0)])
def test_sage2_fused_v_handling_is_refused_at_bind_off_sm90(clean_sage, cc):
    """The plan picks fused only where v_handling_status says it runs; a bind that asks anyway is refused at
    once (never at the first call, never a silent switch)."""
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2_stages([]))
    clean_sage.setattr(S, "capability", lambda device: cc)
    assert S.v_handling_status("fused", CUDA0, 128)[0] == "library"
    with pytest.raises(RuntimeError, match="v_handling fused needs"):
        bind_attention("sage2", 128, device=CUDA0, v_handling="fused")


@pytest.mark.parametrize("s", [200, 37, 256])
def test_sage2_sm90_fused_v_builds_v_operands_from_the_view(clean_sage, s):
    """v_handling "fused": the stages run with V's fp8 operands from fp8_producers.sage_v_fp8 (the kernel's
    [1, D, H, roundup(S, 128)] layout, 16-token permutation, zero tail) built from the strided V view of an
    UNPADDED buffer: no per_channel_fp8, no torch.cat / F.pad, the caller's buffer unchanged."""
    from h3_blackwell.runtime.ops import fp8_producers as f8

    calls = []
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2_fused(calls))
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    h, d = 2, 128
    buf = _qkv(s, h, d, dtype=torch.bfloat16, seed=9)
    before = buf.clone()
    want = f8.sage_v_fp8_reference(qkv_views(buf, h, d)[2])

    def no_copy(*a, **k):
        raise AssertionError("torch.cat / F.pad called: V was copied")

    clean_sage.setattr(torch, "cat", no_copy)
    clean_sage.setattr(torch.nn.functional, "pad", no_copy)
    out = attend(buf, h, d, "sage2", v_handling="fused")
    clean_sage.undo()
    assert [c["fn"] for c in calls] == ["per_warp_int8", "sm90_kernel"]
    kc = calls[1]
    assert kc["v8"].shape == (1, d, h, S.padded_rows(s)) and kc["v8"].dtype == torch.float8_e4m3fn
    assert torch.equal(kc["v8"].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(kc["vs"], want[1])
    assert not kc["v"][s:].any()  # zero past S, as the library's padding
    v = qkv_views(buf, h, d)[2][0].float()
    # e4m3 with a per-channel scale: each element within half a step (2^-4 relative, or 2^-10 x the channel's
    # scale in e4m3's subnormal range) of the bf16 input
    err = (kc["v"][:s] - v).abs()
    assert (err <= torch.maximum(v.abs() * 2.0 ** -4, kc["vs"][0] * 2.0 ** -9)).all()
    ref = exact_attention_reference(*qkv_views(buf, h, d))
    assert rel_l2(out.float(), ref) <= TOLERANCE["sage2"][0]
    assert torch.equal(buf, before)


def test_v_handling_is_not_an_option_any_more():
    """V's handling is automatic (fused where Sage2's sm_90 stages exist, the library wrapper elsewhere): the
    old H3_SAGE_V_PAD is accepted, listed as ignored with the reason, and never reported as configuration."""
    from h3_blackwell.runtime.options import RuntimeOptions

    o = RuntimeOptions.from_env({"H3_SAGE_V_PAD": "buffer"})
    assert "H3_SAGE_V_PAD" in o.ignored and "automatic" in o.ignored["H3_SAGE_V_PAD"]
    assert "H3_SAGE_V_PAD" not in o.as_env()
    with pytest.raises(TypeError):
        RuntimeOptions(sage_v_pad="fused")


def test_v_handling_status_says_what_runs(clean_sage):
    """fused needs the sm_90 kernel and its stages in sageattention.core; otherwise the library wrapper runs
    and the reason says why (the default never becomes an error)."""
    calls = []
    mod = _fake_sage2_stages(calls)
    clean_sage.setitem(sys.modules, "sageattention", mod)
    cuda = torch.device("cuda", 0)
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    assert S.v_handling_status("fused", cuda, 128)[0] == "fused"
    assert S.v_handling_status("library", cuda, 128)[0] == "library"
    got = S.v_handling_status("fused", cuda, 96)
    assert got[0] == "library" and "head_dim 64 or 128" in got[1]
    del mod.core.per_warp_int8_cuda
    got = S.v_handling_status("fused", cuda, 128)
    assert got[0] == "library" and "lacks per_warp_int8_cuda" in got[1]
    clean_sage.setattr(S, "capability", lambda device: (12, 0))
    got = S.v_handling_status("fused", cuda, 128)
    assert got[0] == "library" and "not applicable" in got[1]
    assert S.v_handling_status("fused", torch.device("cpu"), 128)[0] == "library"
    with pytest.raises(ValueError, match="v_handling"):
        S.v_handling_status("buffer", cuda, 128)  # retired with the per-call attention()
    assert calls == []  # only inspected, never run


def test_probe_runs_the_bound_function(clean_sage):
    """The load-time probe runs what a load binds (bind_attention, Sage2 with the V handling the plan picks), not a
    second dispatch path; its result is cached."""
    calls = []
    clean_sage.setitem(sys.modules, "sageattention", _fake_sage2_fused(calls))
    clean_sage.setattr(S, "capability", lambda device: (9, 0))
    bound = []
    real = A.bind_attention
    clean_sage.setattr(A, "bind_attention", lambda *a, **k: bound.append((a, k)) or real(*a, **k))
    dev = torch.device("cpu")  # the stand-in kernels run on CPU tensors; capability is patched
    ok, why = A._probe("sage2", dev, 128, torch.bfloat16)
    assert ok and why.startswith("probe ok"), why
    assert bound == [(("sage2", 128), {"device": dev, "v_handling": "fused"})]
    assert [c["fn"] for c in calls] == ["per_warp_int8", "sm90_kernel"]
    assert A._probe("sage2", dev, 128, torch.bfloat16) == (ok, why) and len(bound) == 1


def test_auto_attention_is_chosen_for_the_compute_dtype(monkeypatch):
    """The load plan's dtype reaches the attention chooser: an fp32 stack on CUDA (``dense=True, dtype=float32``)
    is never handed Sage's fp16/bf16-only kernels (their checks refuse fp32, with the reason)."""
    from h3_blackwell.runtime.ops import attention as att, registry, sage

    seen = []
    real = att.choose_attention_backend

    def spy(device, requested="auto", **kw):
        seen.append(kw.get("dtype"))
        return real(device, requested, **kw)

    monkeypatch.setattr(att, "choose_attention_backend", spy)
    registry.resolve("attention", "cpu", "auto", head_dim=128, dtype=torch.float32)
    assert seen == [torch.float32]
    monkeypatch.setattr(sage, "capability", lambda device: (9, 0))
    ok, why = att._available("sage2", torch.device("cuda", 0), 128, torch.float32, probe=False)
    assert not ok and "fp16/bf16" in why
