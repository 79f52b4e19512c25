"""NVFP4 Triton producers and consumers vs the torch references, byte for byte.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before the
kernels are first built), on small shapes that still cover every padding case (rows not a multiple of
128, K not a multiple of 16 or 64, several segments, calibrated scales that saturate). The full canonical
widths run on the GPU in tests/gpu/test_nvfp4_gpu.py.

Everything here is bit-exact (packed bytes, scale bytes, global scale): kernel and reference execute the
same correctly rounded fp32/fp64 operations in the same order, without FMA contraction. The one test
with a tolerance is the Triton GEMM (fp32 accumulation order differs): its bound is stated there.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4_producers as qk  # noqa: E402
from h3_blackwell.runtime.ops import reference as R  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0 ** -24  # fp32 unit roundoff


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _same(a: nv.NVFP4Tensor, b: nv.NVFP4Tensor):
    assert a.shape == b.shape
    assert torch.equal(a.global_scale, b.global_scale), (a.global_scale, b.global_scale)
    assert torch.equal(a.packed, b.packed), f"{(a.packed != b.packed).sum()} packed bytes differ"
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)), "scale bytes differ"


SHAPES = [(37, 96, torch.bfloat16), (130, 48, torch.float16), (5, 200, torch.float32)]


@pytest.mark.parametrize("s, k, dtype", SHAPES)
@pytest.mark.parametrize("calibrated", [False, True])
def test_quantize_kernel_bit_exact(s, k, dtype, calibrated):
    x = _rand((s, k), dtype, seed=s + k, scale=3.0)
    g = nv.global_scale(x) / 3 if calibrated else None  # a calibrated scale that saturates the largest blocks
    ref = qk.quantize(x, g, backend="reference")
    _same(qk.quantize(x, g, backend="triton"), ref)
    assert ref.packed.shape == (s, nv.roundup(k, 16) // 2)  # activations keep S rows
    want = nv.quantize(x, ref.global_scale, pad_rows=1)
    _same(ref, want)


SEGS = {37: [(0, 5, 2), (5, 20, 0), (20, 37, 5)], 130: [(0, 130, 1)], 5: [(0, 1, 3), (1, 5, 4)]}


@pytest.mark.parametrize("s, k, dtype", SHAPES)
@pytest.mark.parametrize("calibrated", [False, True])
def test_rms_modulate_quantize_bit_exact(s, k, dtype, calibrated):
    x = _rand((s, k), dtype, seed=2 * s + k, scale=2.0)
    tdt = torch.float32 if dtype == torch.float32 else torch.bfloat16
    weight = None if dtype == torch.float16 else _rand((k,), dtype, seed=3) + 1.0
    scale_rows = _rand((6, k), tdt, seed=4, scale=0.3)
    shift_rows = _rand((6, k), tdt, seed=5, scale=0.3)
    g = torch.tensor(0.004, device=DEV) if calibrated else None
    args = (x, weight, qk.Modulation(scale_rows, shift_rows, SEGS[s]), 1e-5, g)
    ref = qk.rms_modulate_quantize(*args, backend="reference")
    _same(qk.rms_modulate_quantize(*args, backend="triton"), ref)
    h = R.rms_modulate_reference(x, weight, scale_rows, shift_rows, SEGS[s], 1e-5)
    _same(ref, nv.quantize(h, ref.global_scale, pad_rows=1))


@pytest.mark.parametrize("s, f, dtype", [(37, 96, torch.bfloat16), (130, 40, torch.float32), (3, 64, torch.float16)])
@pytest.mark.parametrize("calibrated", [False, True])
def test_swiglu_quantize_bit_exact(s, f, dtype, calibrated):
    h = _rand((s, 2 * f), dtype, seed=s * f, scale=4.0)
    h[0, :8] = torch.tensor([-100.0, -85.0, -30.0, 30.0, 85.0, 100.0, 0.0, -0.0], dtype=dtype)  # exp clamps
    g = torch.tensor(0.01, device=DEV) if calibrated else None
    ref = qk.swiglu_quantize(h, g, backend="reference")
    _same(qk.swiglu_quantize(h, g, backend="triton"), ref)
    _same(ref, nv.quantize(R.swiglu_reference(h), ref.global_scale, pad_rows=1))


def test_exp_and_silu_reference_are_accurate():
    """Our fixed-sequence exp (shared by kernel and reference so they agree bit for bit) is a real exp:
    within 4 fp32 ulps of the float64 exp on [-80, 80]."""
    t = torch.cat([torch.linspace(-80, 80, 20001), torch.randn(5000) * 10]).clamp(-80, 80)
    ours = R.exp_reference(t).double()
    true = torch.exp(t.double())
    assert ((ours - true).abs() / true).max() < 4 * U
    a = torch.randn(4000) * 6
    silu = R.silu_reference(a).double()
    assert ((silu - torch.nn.functional.silu(a.double())).abs() <= 8 * U * a.double().abs() + 1e-30).all()


@pytest.mark.parametrize("shape", [(37, 96), (130, 200)])
def test_dequantize_bf16_kernel_bit_exact(shape):
    t = nv.quantize(_rand(shape, torch.bfloat16, seed=7))
    exact = qk.dequantize_bf16(t, backend="triton")
    assert torch.equal(exact, R.dequantize_bf16_reference(t))
    assert torch.equal(exact.double(), nv.dequantize_blocks(t, torch.float64))  # v*s is exact in bf16
    m = torch.tensor(0.0123, device=DEV)
    scratch = torch.empty(shape[0] * shape[1] + 100, dtype=torch.bfloat16, device=DEV)
    scaled = qk.dequantize_bf16(t, m, out=scratch, backend="triton")
    assert scaled.data_ptr() == scratch.data_ptr()  # written into the reusable scratch
    assert torch.equal(scaled, R.dequantize_bf16_reference(t, m))


@pytest.mark.parametrize("shape", [(37, 96), (130, 256)])
def test_fp8_rowwise_kernel_bit_exact_and_within_bound(shape):
    x = _rand(shape, torch.bfloat16, seed=8) * torch.logspace(-2, 1, shape[0], device=DEV).unsqueeze(1).bfloat16()
    x[3] = 0  # an all-zero row gets row scale 1
    t = nv.quantize(x)
    q, r = qk.to_fp8_rowwise(t, backend="triton")
    q_ref, r_ref = R.to_fp8_rowwise_reference(t)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(r, r_ref)
    assert r[3] == 1.0
    # stated numerics: e4m3 keeps 3 mantissa bits -> |error| <= 2^-4 |v*s| (normal range), or half
    # the subnormal step 2^-10 * r in e4m3's subnormal range
    vs = nv.dequantize_blocks(t, torch.float64)
    back = q.double() * r.double().unsqueeze(1)
    assert ((back - vs).abs() <= 2 ** -4 * vs.abs() + 2 ** -10 * r.double().unsqueeze(1)).all()


@pytest.mark.parametrize("m, n, k", [(37, 48, 96), (20, 33, 200)])
def test_triton_gemm_within_fp32_accumulation_bound(m, n, k):
    """The emulated GEMM: products of the decoded operands are exact, only the fp32 accumulation (and the
    final multiply by ga*gw, two roundings) differ from the fp64 reference, so
    |out - ref| <= ((K + 2) * u) * sum_k |a_k w_k| * ga * gw  (Higham's gamma_K bound, u = 2^-24)."""
    a = qk.quantize(_rand((m, k), torch.bfloat16, seed=m), backend="reference")
    w = nv.quantize(_rand((n, k), torch.bfloat16, seed=n))
    out = qk.nvfp4_gemm(a, w, torch.float32)
    a64, w64 = nv.dequantize(a, torch.float64), nv.dequantize(w, torch.float64)
    ref = a64 @ w64.T
    bound = (k + 2) * U * (a64.abs() @ w64.abs().T)
    assert out.shape == (m, n)
    assert ((out.double() - ref).abs() <= bound).all()
    out16 = qk.nvfp4_gemm(a, w, torch.bfloat16)  # plus one bf16 rounding of the output
    assert ((out16.double() - ref).abs() <= bound + 2 ** -8 * ref.abs()).all()


def test_segments_and_inputs_are_validated():
    x = _rand((10, 32), torch.bfloat16, seed=1)
    tab = _rand((2, 32), torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="without gaps"):
        qk.rms_modulate_quantize(x, None, qk.Modulation(tab, tab, [(0, 4, 0), (5, 10, 1)]), 1e-5)
    with pytest.raises(ValueError, match="gate_rows has 2 rows"):
        qk.rms_modulate_quantize(x, None, qk.Modulation(tab, tab, [(0, 10, 2)]), 1e-5)
    with pytest.raises(ValueError, match=r"must be \[rows, K=32\]"):
        qk.rms_modulate_quantize(x, None, qk.Modulation(tab[:, :16], tab, [(0, 10, 0)]), 1e-5)
    with pytest.raises(ValueError, match="odd width"):
        qk.swiglu_quantize(x[:, :31])
    with pytest.raises(ValueError, match="backend='fast'"):
        qk.quantize(x, backend="fast")


def test_activation_scale_policy():
    assert qk.activation_global_scale("dynamic", torch.tensor(0.5)) == (None, "dynamic: amax(|input|) / 2688 per call")
    g, why = qk.activation_global_scale("calibrated", torch.tensor([0.5]))
    assert g.shape == () and g == 0.5 and why.startswith("calibrated")
    g, why = qk.activation_global_scale("calibrated", None)
    assert g is None and "no input_scale" in why
    with pytest.raises(ValueError, match="expected dynamic or calibrated"):
        qk.activation_global_scale("static", None)
