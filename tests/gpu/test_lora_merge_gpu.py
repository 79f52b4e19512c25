"""A LoRA merge's re-quantization on CUDA (runtime.lora.source.quantize_like: the Triton quantizer) against the
reference quantizer on the CPU, byte for byte, for the fp32 merged weights a merge gives: H3's block shapes and an
odd row count whose packed buffer is padded to 16 rows (run: python3 -m pytest -m gpu tests/gpu/test_lora_merge_gpu.py)."""

import types

import pytest
import torch

from h3_blackwell.runtime.lora.source import quantize_like
from h3_blackwell.runtime.ops import nvfp4 as nv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("n,k,pad", [(3 * 7168, 5376, 16), (5376, 7168, 16), (2 * 14336, 5376, 16), (100, 64, 16),
                                     (100, 64, 1)])
def test_quantize_like_on_cuda_writes_the_reference_bytes(n, k, pad):
    g = torch.Generator().manual_seed(n + k + pad)
    w = torch.randn((n, k), generator=g) * 0.02  # a merged weight: fp32, weight-like spread
    w[0, :16] *= 40.0  # one block far larger than the rest (the global scale's amax)
    module = types.SimpleNamespace(out_features=n, in_features=k,
                                   packed=torch.empty((nv.roundup(n, pad), k // 2), dtype=torch.uint8))
    ref = nv.quantize(w, pad_rows=pad)
    got = quantize_like(w.cuda(), module)
    assert got.packed.shape == ref.packed.shape == module.packed.shape
    assert torch.equal(got.global_scale.cpu(), ref.global_scale)
    diff = int((got.packed.cpu() != ref.packed).sum())
    assert diff == 0, f"{diff} of {ref.packed.numel()} packed bytes differ"
    assert torch.equal(got.scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8)), "scale bytes differ"


@pytest.mark.parametrize("kind", ["lowrank", "diff"])
def test_a_merge_on_cuda_does_not_wait_for_the_work_queued_before_it(kind):
    """A merge at a block's gate runs in the middle of a step: its factors cross from (pageable) host memory on a
    stream of their own (``merge._upload``), so the host returns while the kernels queued before the merge still
    run, and the merged bytes equal the same merge made with nothing queued. The queued work is a spin kernel of
    about a second (``torch.cuda._sleep``); the factor copies and the merge's own math take milliseconds."""
    from h3_blackwell.runtime.lora.key_forms import LoraUpdate
    from h3_blackwell.runtime.lora.merge import merged_weight

    g = torch.Generator().manual_seed(11)
    n, k, r = 3000, 512, 16
    w0 = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).cuda()
    if kind == "lowrank":
        up = LoraUpdate("m", "lowrank", (5, n), (), down=torch.randn(r, k, generator=g),
                        up=torch.randn(n - 5, r, generator=g), alpha=8.0)
    else:
        up = LoraUpdate("m", "diff", (100, 2200), (), delta=torch.randn(2100, k, generator=g) * 0.01)
    entries = [(0.6, up)]
    want = merged_weight(w0.clone(), entries)
    torch.cuda.synchronize()
    w = w0.clone()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # ~1 s on the current stream at the H100's clocks
    merged_weight(w, entries, into=w)
    still_running = not stream.query()
    torch.cuda.synchronize()
    assert still_running, "the merge made the host wait for the kernels queued before it"
    assert torch.equal(w, want.to(torch.bfloat16)) and not torch.equal(w, w0)
