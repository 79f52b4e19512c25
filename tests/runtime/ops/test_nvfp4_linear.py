"""Nvfp4Linear: the backend capability table, and every GEMM backend vs an fp64 dequant reference.

The reference is the exact NVFP4 product P = ga*gw * sum_k (va*sa)(vw*sw), computed in float64 from the
same quantized activation the layer produced. Tolerances (u = 2^-24, A = sum_k |a_k||w_k| * ga*gw):

* emulated / reference: exact products, fp32 (resp. fp64) accumulation: |y - P| <= (K + 2) u A
  (Higham's gamma_K plus the two roundings of the global-scale multiply), plus one rounding of the
  output dtype (2^-8 |P| for bf16 outputs).
* bf16: the weight is rounded once to bf16 after the global scales are folded in (<= 2^-9 relative per
  element) and the GEMM output is rounded to bf16 before leaving torch.mm: |y - P| <= (K + 2) u A
  + 2^-9 A + 2^-8 |P|.
* fp8: both operands re-expressed as rowwise e4m3 (bounded per element in test_quant_kernels); given
  those operands the GEMM is exact products + fp32 accumulation + a bf16 result, so the test rebuilds
  the e4m3 operands with the reference conversion and applies the emulated bound (with the bf16
  rounding) to them.
"""

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (comfy_kitchen does, at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from h3_blackwell.runtime.ops import gemm_backends as G  # noqa: E402
from h3_blackwell.runtime.ops import linear as L  # noqa: E402
from h3_blackwell.runtime.io import comfy_quant as cq  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4_producers as qk  # noqa: E402
from h3_blackwell.runtime.ops import reference as R  # noqa: E402

U = 2.0 ** -24


def _rand(shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _exact(a: nv.NVFP4Tensor, w: nv.NVFP4Tensor):
    a64, w64 = nv.dequantize(a, torch.float64), nv.dequantize(w, torch.float64)
    return a64 @ w64.T, a64.abs() @ w64.abs().T


def test_capability_table_on_cpu_says_why():
    table = {c.backend: c for c in G.gemm_capability_table("cpu")}
    assert set(table) == set(G.BACKENDS)
    assert not table["native"].available and "refused" in table["native"].reason
    assert G.choose_gemm_backend("cpu")[0] == "emulated"
    name, why = G.choose_gemm_backend("cpu", "native")
    assert name == "emulated" and why.startswith("requested native unavailable: native: refused")
    with pytest.raises(RuntimeError, match="unavailable: native: refused"):
        G.choose_gemm_backend("cpu", "native", strict=True)
    with pytest.raises(ValueError, match="expected auto or one of"):
        G.choose_gemm_backend("cpu", "int4")


@pytest.mark.parametrize("cc, auto, native_reason", [
    ((9, 0), "fp8", "native: refused, compute capability 9.0 < 10.0"),
    ((8, 6), "bf16", "native: refused, compute capability 8.6 < 10.0"),
    ((12, 1), "native", "native: cuBLASLt block-scaled FP4"),
])
def test_capability_table_per_compute_capability(monkeypatch, cc, auto, native_reason):
    """The table's decisions for the GPUs we target, without one: the H200 (9.0) refuses native with the
    reason naming its compute capability; GB10 (12.1) takes it."""
    monkeypatch.setattr(G, "_cc", lambda device: cc)
    monkeypatch.setattr(G, "probe_backend", lambda backend, device: (True, "probe ok (stand-in)"))
    dev = torch.device("cuda", 0)
    table = {c.backend: c for c in G.gemm_capability_table(dev)}
    assert table["native"].reason.startswith(native_reason)
    assert table["fp8"].available == (cc >= (8, 9))
    name, why = G.choose_gemm_backend(dev)
    assert name == auto
    if auto != "native":
        assert native_reason in why  # the choice records why native was not taken


def test_a_failing_probe_refuses_the_backend_with_its_error(monkeypatch):
    """A GPU whose torch build has no working rowwise fp8 kernel (or FP4 kernel): the backend is refused at load
    with the probe's error and auto moves on, instead of the first forward failing."""
    monkeypatch.setattr(G, "_cc", lambda device: (8, 9))
    failed = "probe failed: RuntimeError: f8f8bf16_rowwise is sm_90 specific."
    monkeypatch.setattr(G, "probe_backend", lambda backend, device: (False, failed))
    dev = torch.device("cuda", 0)
    table = {c.backend: c for c in G.gemm_capability_table(dev)}
    assert not table["fp8"].available and table["fp8"].reason == "fp8: refused, " + failed
    name, why = G.choose_gemm_backend(dev)
    assert name == "bf16" and failed in why
    with pytest.raises(RuntimeError, match="sm_90 specific"):
        G.choose_gemm_backend(dev, "fp8", strict=True)


def test_probe_measures_the_real_paths(monkeypatch):
    """The probe itself on the CPU: the fp8 path (plain and fast accumulation) passes with its measured error;
    the native path raises on the CPU and is refused with that error; a wrong product is refused by its rel-L2;
    results are cached per backend and device."""
    cpu = torch.device("cpu")
    ok, why = G._run_probe("fp8", cpu)
    assert ok and why.startswith("probe ok (rel_l2 ") and "(fast accumulation)" in why
    errs = [float(t.split()[0]) for t in why[len("probe ok (rel_l2 "):].split(", ")]
    assert all(0 < e <= G.PROBE_TOL["fp8"] for e in errs), why  # e4m3 re-expression: ~0.04, never 0
    ok, why = G._run_probe("native", cpu)
    assert not ok and why.startswith("probe failed: ") and "Error" in why

    real = G.scaled_mm_rowwise
    monkeypatch.setattr(G, "scaled_mm_rowwise", lambda a8, w8, sa, sb, dt, fast_accum=False:
                        real(a8, w8, sa, sb.flip(-1), dt, fast_accum))  # column scales in the wrong order
    ok, why = G._run_probe("fp8", cpu)
    assert not ok and "rel_l2" in why and "tolerance 0.1" in why

    calls = []
    monkeypatch.setattr(G, "_run_probe", lambda b, d: calls.append((b, d)) or (True, "probe ok (counted)"))
    monkeypatch.setattr(G, "_PROBED", {})
    for _ in range(3):
        assert G.probe_backend("fp8", "cpu") == (True, "probe ok (counted)")
    assert calls == [("fp8", cpu)]


@pytest.mark.parametrize("backend", ["emulated", "bf16", "fp8", "reference"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_backend_forward_within_stated_bound(backend, out_dtype):
    m, n, k = 45, 72, 160
    w = _rand((n, k), seed=1)
    x = _rand((m, k), seed=2, scale=3.0)
    lin = L.Nvfp4Linear.from_float(w, backend=backend, out_dtype=out_dtype)
    assert lin.backend == backend
    y = lin(x)
    assert y.shape == (m, n) and y.dtype == out_dtype
    a = qk.quantize(x)
    ref, absprod = _exact(a, lin.weight)
    out_round = 0.0 if out_dtype == torch.float32 else 2 ** -8
    if backend == "fp8":
        a8, ra = R.to_fp8_rowwise_reference(a)
        w8, rw = R.to_fp8_rowwise_reference(lin.weight)
        a64 = a8.double() * (ra.double() * a.global_scale.double()).unsqueeze(1)
        w64 = w8.double() * (rw.double() * lin.global_scale.double()).unsqueeze(1)
        ref, absprod = a64 @ w64.T, a64.abs() @ w64.abs().T
        bound = (k + 2) * U * absprod + 2 ** -8 * ref.abs()  # the fp8 GEMM's result is bf16
    elif backend == "bf16":
        bound = (k + 2) * U * absprod + 2 ** -9 * absprod + 2 ** -8 * ref.abs()
    else:
        bound = (k + 2) * U * absprod + out_round * ref.abs()
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def test_forward_swiglu_and_forward_quantized():
    f, n, s = 96, 40, 33
    lin = L.Nvfp4Linear.from_float(_rand((n, f), seed=3), backend="reference", out_dtype=torch.float32)
    h = _rand((s, 2 * f), seed=4, scale=2.0)
    a = qk.swiglu_quantize(h)
    ref, _ = _exact(a, lin.weight)
    assert torch.equal(lin.forward_swiglu(h), ref.float())
    assert torch.equal(lin.forward_quantized(a.packed, a.scales, a.global_scale), ref.float())
    x = _rand((s, f), seed=5)
    assert torch.equal(lin(x), lin.forward_quantized(*(lambda t: (t.packed, t.scales, t.global_scale))(qk.quantize(x))))


def test_from_comfy_quant_calibrated_scale_pre_quant_scale_and_bias():
    n, k = 48, 64
    w = nv.quantize(_rand((n, k), seed=6))
    ins = torch.tensor(0.002)
    pqs = torch.rand(k) + 0.5
    sd = cq.to_comfy_quant(w, "blocks.0.attn.out_proj", input_scale=ins, pre_quant_scale=pqs)
    sd["blocks.0.attn.out_proj.bias"] = _rand((n,), seed=7, dtype=torch.float32)
    q = cq.from_comfy_quant_tensors(sd, "blocks.0.attn.out_proj", shape=(n, k))
    lin = L.Nvfp4Linear(q.weight, stored=L.StoredParts(sd["blocks.0.attn.out_proj.bias"], q.input_scale,
                                                       q.pre_quant_scale), backend="reference", act_scale="calibrated",
                        out_dtype=torch.float32)
    assert torch.equal(lin.packed, w.packed) and lin.act_scale_reason.startswith("calibrated")
    x = _rand((2, 5, k), seed=8)  # any leading dims
    y = lin(x)
    assert y.shape == (2, 5, n)
    a = qk.quantize((x.reshape(10, k) * pqs.to(x.dtype)), ins)  # smoothing first, then the calibrated scale
    assert torch.equal(a.global_scale, ins)
    ref, _ = _exact(a, w)
    assert torch.equal(y.reshape(10, n), (ref.float() + sd["blocks.0.attn.out_proj.bias"]))
    back = cq.to_comfy_quant(lin.weight, "blocks.0.attn.out_proj", input_scale=lin.input_scale,
                             pre_quant_scale=lin.pre_quant_scale)
    back["blocks.0.attn.out_proj.bias"] = lin.bias
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)  # round trip to disk form
    dyn = L.Nvfp4Linear(w, act_scale="calibrated", backend="reference")
    assert "no input_scale" in dyn.act_scale_reason  # falls back to dynamic and says so


def test_validation_messages():
    lin = L.Nvfp4Linear.from_float(_rand((16, 32), seed=9), backend="reference")
    with pytest.raises(ValueError, match="input has 31 features; this layer expects 32"):
        lin(torch.randn(4, 31))
    with pytest.raises(ValueError, match=r"\[S, 2F\] = \[gate \| up\] with F = 32"):
        lin.forward_swiglu(torch.randn(4, 32))
    with pytest.raises(TypeError, match="needs an NVFP4Tensor"):
        L.Nvfp4Linear(torch.randn(4, 4), backend="reference")
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        L.Nvfp4Linear(lin.weight, stored=L.StoredParts(bias=torch.zeros(3)), backend="reference")
    assert "backend=reference" in repr(lin)


def test_scratch_is_reused_across_layers():
    scratch = G.Scratch()
    big = L.Nvfp4Linear.from_float(_rand((64, 96), seed=10), backend="bf16", scratch=scratch)
    small = L.Nvfp4Linear.from_float(_rand((32, 96), seed=11), backend="bf16", scratch=scratch)
    x = _rand((8, 96), seed=12)
    big(x)
    held = scratch.nbytes()
    small(x)
    assert scratch.nbytes() == held  # the smaller layer expands into the same buffers


def test_the_layer_binds_the_plans_backend_once():
    """A layer runs the concrete backend it was built with (the plan resolved auto) and never re-chooses: not per
    call, not when moved; a K the backend cannot take refuses at construction (never a silent switch to another
    backend); the plan's chooser excludes such a backend with the reason."""
    from h3_blackwell.runtime.errors import H3Error

    w = _rand((16, 48), seed=13)  # K = 48: a multiple of 16 (fp8), not of 32 (native)
    with pytest.raises(ValueError, match="resolve auto"):
        L.Nvfp4Linear.from_float(w, backend="auto")
    with pytest.raises(H3Error, match="needs K a multiple of 32; this layer has K=48"):
        L.Nvfp4Linear.from_float(w, backend="native")
    lin = L.Nvfp4Linear.from_float(w, backend="fp8", reason="the plan's reason", out_dtype=torch.float32)
    assert lin.backend == "fp8" and "the plan's reason" in repr(lin)
    with pytest.raises(AttributeError):
        lin.backend = "emulated"  # read-only: bind_backend rebinds the product as well as the name
    x = _rand((5, 48), seed=14)
    y = lin(x)
    lin.to(torch.device("cpu"))
    assert lin.backend == "fp8" and torch.equal(lin(x), y)
    lin.bind_backend("reference")
    assert lin.backend == "reference" and not torch.equal(lin(x), y)  # the product really changed
    name, why = G.choose_gemm_backend("cpu", "fp8", k_dims=(48, 40))
    assert name == "emulated" and "K=40 is not a multiple of 16" in why
