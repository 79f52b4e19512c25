"""A LoRA merge's re-quantization (runtime.lora.source.quantize_like) through the Triton quantizer against the
reference quantizer, byte for byte, with the row padding of the layer's packed buffer (16 rows, or none). Without
CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), on small shapes;
tests/gpu/test_lora_merge_gpu.py runs H3's block shapes on the GPU."""

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from h3_blackwell.runtime.lora.source import quantize_like  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,pad", [(100, 64, 16), (100, 64, 1), (37, 96, 16), (128, 48, 16)])
def test_the_triton_requantization_writes_the_references_bytes(n, k, pad):
    g = torch.Generator().manual_seed(n * k + pad)
    w = torch.randn((n, k), generator=g) * 0.02  # fp32, as a merge gives it
    w[n // 2, :16] *= 40.0  # one block far larger than the rest: it sets the global scale
    module = types.SimpleNamespace(out_features=n, in_features=k,
                                   packed=torch.empty((nv.roundup(n, pad), k // 2), dtype=torch.uint8))
    ref = nv.quantize(w, pad_rows=pad)
    got = quantize_like(w.to(DEV), module, backend="triton")
    assert got.packed.shape == ref.packed.shape == module.packed.shape
    assert torch.equal(got.global_scale.cpu(), ref.global_scale)
    assert torch.equal(got.packed.cpu(), ref.packed), f"{int((got.packed.cpu() != ref.packed).sum())} bytes differ"
    assert torch.equal(got.scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8)), "scale bytes differ"
    assert torch.equal(quantize_like(w, module).packed, ref.packed)  # auto on the CPU: the reference itself
