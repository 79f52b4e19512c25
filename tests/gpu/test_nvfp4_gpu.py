"""NVFP4 on a real GPU (run: python3 -m pytest -m gpu tests/gpu/test_nvfp4_gpu.py).

* Producers at the full canonical widths (quantize 5376 and 7168, RMSNorm->modulate->quantize 5376,
  SwiGLU->quantize 2x14336) for S in {1, 127, 37810}: Triton bytes == reference-quantizer bytes
  (packed, scales, global scale), dynamic and calibrated global scale. The torch reference runs on the
  same GPU; one test checks it equals the CPU reference byte for byte (no CUDA-specific rounding).
* Every GEMM backend this GPU can run, at the four canonical layer shapes (M = 1024 rows), vs the fp64
  dequant reference within the bounds stated in tests/runtime/ops/test_nvfp4_linear.py.
* On compute capability < 10 (the H200), native is refused with a reason naming the capability.
"""

import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]



from h3_blackwell.runtime.ops import gemm_backends as G  # noqa: E402
from h3_blackwell.runtime.ops import linear as L  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4_producers as qk  # noqa: E402
from h3_blackwell.runtime.ops import reference as R  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else None
S_VALUES = [1, 127, 37810]
HIDDEN, INNER, FFN = 5376, 7168, 14336
U = 2.0 ** -24
LAYERS = {"qkv": (HIDDEN, 3 * INNER), "out_proj": (INNER, HIDDEN), "fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}


def _rand(shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


def _segments(s):
    """The canonical packed order: 100 text rows (tag 1), 414 audio rows (tag 2), the rest video (tag 0)."""
    cuts = [(0, min(s, 100), 1), (min(s, 100), min(s, 514), 2), (min(s, 514), s, 0)]
    return [c for c in cuts if c[1] > c[0]]


def _same(a, b):
    assert a.shape == b.shape
    assert torch.equal(a.global_scale, b.global_scale)
    diff = (a.packed != b.packed).sum().item()
    assert diff == 0, f"{diff} of {a.packed.numel()} packed bytes differ"
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)), "scale bytes differ"


@pytest.mark.parametrize("k", [HIDDEN, INNER])
@pytest.mark.parametrize("s", S_VALUES)
@pytest.mark.parametrize("calibrated", [False, True])
def test_quantize_bit_exact_full_width(s, k, calibrated):
    x = _rand((s, k), seed=s + k, scale=2.0)
    g = nv.global_scale(x) / 2 if calibrated else None
    _same(qk.quantize(x, g, backend="triton"), qk.quantize(x, g, backend="reference"))


@pytest.mark.parametrize("s", S_VALUES)
@pytest.mark.parametrize("calibrated", [False, True])
def test_rms_modulate_quantize_bit_exact_full_width(s, calibrated):
    x = _rand((s, HIDDEN), seed=s, scale=3.0)
    weight = _rand((HIDDEN,), seed=1) * 0.1 + 1.0
    scale_rows = _rand((36, HIDDEN), seed=2, scale=0.2)  # 12 t-rows x 3 modality tags
    shift_rows = _rand((36, HIDDEN), seed=3, scale=0.2)
    segs = [(a, b, 3 * 4 + r) for a, b, r in _segments(s)]
    g = torch.tensor(0.003, device=DEV) if calibrated else None
    args = (x, weight, qk.Modulation(scale_rows, shift_rows, segs), 1e-5, g)
    _same(qk.rms_modulate_quantize(*args, backend="triton"), qk.rms_modulate_quantize(*args, backend="reference"))


@pytest.mark.parametrize("s", S_VALUES)
@pytest.mark.parametrize("calibrated", [False, True])
def test_swiglu_quantize_bit_exact_full_width(s, calibrated):
    h = _rand((s, 2 * FFN), seed=s + 7, scale=3.0)
    g = torch.tensor(0.01, device=DEV) if calibrated else None
    _same(qk.swiglu_quantize(h, g, backend="triton"), qk.swiglu_quantize(h, g, backend="reference"))


def test_cuda_reference_equals_cpu_reference():
    x = _rand((127, HIDDEN), seed=11, scale=2.0)
    _same(qk.quantize(x, backend="reference").to("cpu"), qk.quantize(x.cpu(), backend="reference"))
    h = _rand((127, 2 * FFN), seed=12, scale=3.0)
    _same(qk.swiglu_quantize(h, backend="reference").to("cpu"), qk.swiglu_quantize(h.cpu(), backend="reference"))
    tab = _rand((6, HIDDEN), seed=13, scale=0.2)
    segs = _segments(127)
    a = qk.rms_modulate_quantize(x, None, qk.Modulation(tab, tab, segs), 1e-5, backend="reference")
    _same(a.to("cpu"), qk.rms_modulate_quantize(x.cpu(), None, qk.Modulation(tab.cpu(), tab.cpu(), segs), 1e-5,
                                                backend="reference"))


@pytest.mark.parametrize("shape", [(21504, HIDDEN), (HIDDEN, FFN)])
def test_consumers_bit_exact(shape):
    t = nv.quantize(_rand(shape, seed=21))
    assert torch.equal(qk.dequantize_bf16(t, backend="triton"), qk.dequantize_bf16(t, backend="reference"))
    m = torch.tensor(0.0071, device=DEV)
    assert torch.equal(qk.dequantize_bf16(t, m, backend="triton"), qk.dequantize_bf16(t, m, backend="reference"))
    q, r = qk.to_fp8_rowwise(t, backend="triton")
    q2, r2 = qk.to_fp8_rowwise(t, backend="reference")
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(r, r2)


def test_native_refused_below_cc10_with_reason():
    cc = torch.cuda.get_device_capability(DEV)
    table = {c.backend: c for c in G.gemm_capability_table(DEV)}
    if cc < (10, 0):
        assert not table["native"].available
        assert f"compute capability {cc[0]}.{cc[1]} < 10.0" in table["native"].reason
        name, why = G.choose_gemm_backend(DEV, "native")
        assert name != "native" and f"compute capability {cc[0]}.{cc[1]} < 10.0" in why
    else:
        assert table["native"].available, table["native"].reason


def test_load_time_probes_on_this_gpu():
    """The probes run the real kernels of this GPU: fp8 (cc >= 8.9) passes with its measured error, plain and
    with fast accumulation, and is recorded in the reason; native is probed only where the capability allows."""
    cc = torch.cuda.get_device_capability(DEV)
    table = {c.backend: c for c in G.gemm_capability_table(DEV)}
    if cc >= (8, 9):
        ok, why = G.probe_backend("fp8", DEV)
        print(f"\nfp8 probe: {why}")
        assert ok and "(fast accumulation)" in why and table["fp8"].available and why in table["fp8"].reason
    if cc >= (10, 0):
        assert "probe ok" in table["native"].reason or "probe failed" in table["native"].reason
    else:
        assert "probe" not in table["native"].reason


def _gpu_backends():
    if not torch.cuda.is_available():
        return []
    return [c.backend for c in G.gemm_capability_table(DEV) if c.available and c.backend != "reference"]


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("backend", _gpu_backends() or ["none"])
def test_backend_vs_fp64_reference(layer, backend):
    k, n = LAYERS[layer]
    m = 1024
    lin = L.Nvfp4Linear.from_float(_rand((n, k), seed=31), backend=backend, out_dtype=torch.float32)
    x = _rand((m, k), seed=32, scale=2.0)
    a = qk.quantize(x)
    y = lin.forward_quantized(a.packed, a.scales, a.global_scale)
    if backend == "fp8":
        a8, ra = R.to_fp8_rowwise_reference(a)
        w8, rw = R.to_fp8_rowwise_reference(lin.weight)
        a64 = a8.double() * (ra.double() * a.global_scale.double()).unsqueeze(1)
        w64 = w8.double() * (rw.double() * lin.global_scale.double()).unsqueeze(1)
    else:
        a64, w64 = nv.dequantize(a, torch.float64), nv.dequantize(lin.weight, torch.float64)
    ref, absprod = a64 @ w64.T, a64.abs() @ w64.abs().T
    bound = (k + 2) * U * absprod  # exact products, fp32 accumulation (tests/runtime/ops/test_nvfp4_linear.py)
    if backend == "bf16":  # weight rounded once to bf16; bf16 result
        bound = bound + 2 ** -9 * absprod + 2 ** -8 * ref.abs()
    elif backend == "fp8":  # given its e4m3 operands; bf16 result
        bound = bound + 2 ** -8 * ref.abs()
    err = (y.double() - ref).abs()
    excess = (err - bound).max().item()
    assert excess <= 0, f"{backend} {layer}: error exceeds the bound by {excess:.3g} (max |ref| {ref.abs().max():.3g})"


def test_fused_swiglu_forward_matches_unfused():
    lin = L.Nvfp4Linear.from_float(_rand((HIDDEN, FFN), seed=41), backend="emulated", out_dtype=torch.float32)
    h = _rand((300, 2 * FFN), seed=42, scale=2.0)
    a = qk.swiglu_quantize(h, backend="reference")
    assert torch.equal(lin.forward_swiglu(h), lin.forward_quantized(a.packed, a.scales, a.global_scale))
