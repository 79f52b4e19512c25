"""``ops.sage_kv.SageKV``: K and V held once as Sage2's sm_90 operands for query-row chunks, on the CPU with the
emulated kernels (the plain PyTorch reference of the quantizers and a dequantized fp32 attention). Random data,
S not a multiple of 128 (the last chunk is partial, as at 73,486 or 144,840 rows)."""

import pytest
import torch

from h3_blackwell.runtime.ops.attention import exact_attention_reference, rel_l2
from h3_blackwell.runtime.ops.fp8_producers import sage_v_fp8_reference
from h3_blackwell.runtime.ops.sage_kv import EMULATED, K_BLOCK, SageKV, SageKVKernels

S, H, D = 700, 4, 128


def _qkv(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, 3 * H * D, generator=g)
    x[:, H * D:2 * H * D] += 3.0 * torch.randn(1, H * D, generator=g)   # K with a per-channel offset (smooth_k's case)
    return x.to(dtype).unflatten(1, (3, -1)).unbind(1)


def _held(k, v, chunk):
    kv = SageKV(S, H, D, k.dtype, "cpu", EMULATED, D ** -0.5)
    spans = [(a, min(S, a + chunk)) for a in range(0, S, chunk)]
    for a, b in spans:
        kv.observe(k[a:b], v[a:b])
    kv.seal()
    for a, b in spans:
        kv.store(a, k[a:b], v[a:b])
    return kv


def test_v_codes_are_those_of_all_of_v_and_k_is_quantized_per_block():
    """Stored chunk by chunk, V's codes and scales equal ``sage_v_fp8_reference`` of the whole V (the library's
    operand, byte for byte: per-channel amax is order-free); K's int8 codes reconstruct K - mean within half a
    step of its 128-row block's scale."""
    q, k, v = _qkv()
    kv = _held(k, v, 256)
    codes, scale = sage_v_fp8_reference(v.unflatten(1, (H, D)).unsqueeze(0))
    assert torch.equal(kv.v_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(kv.v_scale, scale)
    centred = k.unflatten(1, (H, D)).float() - kv.mean[0].float()
    step = kv.k_scale[0].t().repeat_interleave(K_BLOCK, 0)[:S, :, None]
    assert (kv.k_codes[0].float() * step - centred).abs().max() <= 0.5 * step.max() * 1.0001
    assert kv.mean.dtype == k.dtype and kv.k_codes.abs().max() == 127


@pytest.mark.parametrize("chunk", [128, 256, 384])
def test_chunks_attend_like_the_exact_attention_to_the_quantization(chunk):
    """Query chunks over the held operands give the one-call output of the same operands bit for bit (each
    output row sees its own query row and all of K and V); against exact fp32 attention on the bf16 inputs the int8 q/k and e4m3 v cost a rel-L2 below 4e-2: e4m3 keeps 3 mantissa bits, a rounding error of up to
    1/16 of each V element (about 2.5 % rms), and the softmax averages the errors as it averages the outputs, so
    the output's relative error stays near V's (2.9e-2 on this data)."""
    q, k, v = _qkv(1)
    kv = _held(k, v, chunk)
    one = kv.attend(q)
    got = torch.cat([kv.attend(q[a:a + chunk]) for a in range(0, S, chunk)])
    assert torch.equal(got, one)
    ref = exact_attention_reference(*(t.unflatten(1, (H, D)).unsqueeze(0) for t in (q, k, v)),
                                    scale=D ** -0.5).reshape(S, -1)
    err = rel_l2(got.float(), ref.float())
    assert 1e-4 < err < 4e-2, err


def test_the_emulation_can_fail():
    """A chunk attending over its own keys only is far from the whole: the comparisons above can fail."""
    q, k, v = _qkv(2)
    ref = exact_attention_reference(*(t.unflatten(1, (H, D)).unsqueeze(0) for t in (q, k, v)),
                                    scale=D ** -0.5).reshape(S, -1)
    kv = SageKV(256, H, D, k.dtype, "cpu", EMULATED, D ** -0.5)
    kv.observe(k[:256], v[:256])
    kv.seal()
    kv.store(0, k[:256], v[:256])
    assert rel_l2(kv.attend(q[:256]).float(), ref[:256].float()) > 0.1


def test_misuse_says_what_to_do():
    q, k, v = _qkv(3)
    kv = SageKV(S, H, D, k.dtype, "cpu", EMULATED, D ** -0.5)
    with pytest.raises(RuntimeError, match="before seal"):
        kv.store(0, k[:128], v[:128])
    kv.observe(k, v)
    kv.seal()
    with pytest.raises(ValueError, match="128-row boundaries; found row 64"):
        kv.store(64, k[64:128], v[64:128])
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        SageKV(S, H, 96, k.dtype, "cpu", SageKVKernels("sm90", None, None), 1.0)


def test_sm90_kernels_hand_the_held_operands_to_the_kernel():
    """``sm90_kernels`` over a stand-in sageattention (its ``_fused`` quantizers and sm_90 kernel record their
    arguments; the emulated quantizers fill the buffers): K goes through quant_per_block_int8_fuse_sub_mean_cuda
    with the held mean and 128-row blocks, each Q chunk through quant_per_warp_int8_cuda (64-row blocks, 16-row
    warps), and the kernel gets the chunk's int8 Q and the held K and V operands with our configuration's
    arguments (NHD, non-causal, per-warp, the scale, no lse); the kernel's output is what ``attend`` returns."""
    import sys
    import types

    from h3_blackwell.runtime.ops.sage_kv import sm90_kernels

    calls = []
    fused = types.ModuleType("fakesage._fused")

    def quant_k(k, mean, codes, scale, blk, layout):
        calls.append(("k", mean, blk, layout))
        c, s = EMULATED.quant_k(k, mean)
        codes.copy_(c), scale.copy_(s)

    def quant_q(q, codes, scale, blkq, warpq, layout):
        calls.append(("q", blkq, warpq, layout))
        codes.copy_(torch.ones_like(codes))

    def kernel(qc, kc, vc, o, qs, ks, vs, layout, causal, gran, sm_scale, lse):
        calls.append(("kernel", qc, kc, vc, qs, ks, vs, layout, causal, gran, sm_scale, lse))
        o.fill_(0.5)

    fused.quant_per_block_int8_fuse_sub_mean_cuda, fused.quant_per_warp_int8_cuda = quant_k, quant_q
    mod = types.ModuleType("fakesage")
    mod.core = types.SimpleNamespace(sm90_compile=types.SimpleNamespace(
        qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf=kernel))
    sys.modules["fakesage._fused"] = fused
    try:
        kern = sm90_kernels(mod)
    finally:
        del sys.modules["fakesage._fused"]
    assert kern.name == "sm90"
    q, k, v = _qkv(3)
    kv = SageKV(S, H, D, k.dtype, "cpu", kern, D ** -0.5)
    kv.observe(k, v)
    kv.seal()
    kv.store(0, k, v)
    assert calls[0][0] == "k" and calls[0][1] is kv.mean and calls[0][2:] == (K_BLOCK, 0)
    o = kv.attend(q[:100])
    assert calls[1] == ("q", 64, 16, 0)
    name, qc, kc, vc, qs, ks, vs, *rest = calls[2]
    assert name == "kernel" and qc.shape == (1, 100, H, D) and qc.dtype == torch.int8 and bool((qc == 1).all())
    assert kc is kv.k_codes and vc is kv.v_codes and ks is kv.k_scale and vs is kv.v_scale
    assert qs.shape == (1, H, 2 * 4) and rest == [0, 0, 2, D ** -0.5, 0]
    assert o.shape == (100, H * D) and o.dtype == q.dtype and bool((o == 0.5).all())
