"""The NVFP4 block stack against an explicit W4A4 reference block written here, and against the dense
reference model; NVFP4 files load without re-quantization."""

import pytest
import torch
from safetensors.torch import save_file

from h3_blackwell.runtime import RuntimeOptions, load_model
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.io import comfy_quant as cq
from h3_blackwell.runtime.ops import nvfp4 as nv
from h3_blackwell.runtime.model.tiny import tiny_state_dict
from refblock import reference_block  # the float64 block from the formulas (tests/refblock.py)

CPU = dict(device="cpu", dtype="float32")


def _q(x):
    """The W4A4 activation path: dynamic global scale, reference quantizer, dequantized (exact values)."""
    return nv.dequantize(nv.quantize(x.float(), nv.global_scale(x.float()), pad_rows=1), torch.float64)


def test_stack_block_equals_w4a4_reference():
    rt = load_model(None, RuntimeOptions(**CPU, gemm="reference"), tiny_seed=3)
    m = rt.model
    assert rt.ops.name == "nvfp4"
    g = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g)
    text = torch.randn(1, 7, 5120, generator=g)
    plan = m.plan(text, tuple(video.shape), tuple(audio.shape), [0.7], token_tags=torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    x = m.pack(plan, video, audio)
    blk = m.blocks[0]
    wq = {n: nv.dequantize(getattr(getattr(blk, p), n).weight, torch.float64)
          for p, n in (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))}
    expect = reference_block(blk, x, plan.mods[0][0], plan.times[0].mod_segments, plan.cos, plan.sin, m.cfg, wq, _q)
    got = blk(x.clone(), plan.mods[0][0], plan.times[0].mod_segments, plan.cos, plan.sin, rt.ops, 0)
    # The same NVFP4 codes on both sides; the differences are fp32 (stack) vs fp64 (here) arithmetic in
    # norms, attention and the fp32 GEMM accumulation (measured: 4e-8 on the output, 8e-7 on the update).
    # A code flip (an activation landing on a rounding boundary) would show as ~1e-3 on the update.
    rel = float((got.double() - expect).norm() / expect.norm())
    assert rel < 1e-6, rel
    upd = float(((got.double() - x.double()) - (expect - x.double())).norm() / (expect - x.double()).norm())
    assert upd < 1e-5, upd  # the block's own update (attention + MLP), relative


def test_stack_forward_close_to_dense_reference():
    """W4A4 NVFP4 vs the dense fp32 model on the same (unquantized) weights: close, not equal."""
    dense = load_model(None, RuntimeOptions(**CPU, quantize=False), tiny_seed=2).model
    fp4 = load_model(None, RuntimeOptions(**CPU), tiny_seed=2)
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g),
            torch.randn(1, 7, 5120, generator=g), 0.6)
    dv, da = dense(*args)
    qv, qa = fp4.model(*args, ops=fp4.ops)
    rel = float((qv - dv).norm() / dv.norm())
    assert 1e-4 < rel < 0.2, rel  # NVFP4 W4A4 on a 3-block model: a few percent


def test_nvfp4_file_loads_without_requantization(tmp_path, monkeypatch):
    sd = tiny_state_dict(TINY, seed=4)
    ref = {}
    for k in list(sd):
        if any(k.endswith(s) for s in ("attn.qkv_proj.weight", "attn.out_proj.weight", "mlp.fc1.weight",
                                       "mlp.fc2.weight")) and k.startswith("blocks."):
            layer = k[: -len(".weight")]
            q = nv.quantize(sd.pop(k))
            ref[layer] = q
            sd.update(cq.to_comfy_quant(q, layer))
    p = tmp_path / "nvfp4.safetensors"
    save_file(sd, str(p))
    calls = []
    real = nv.quantize
    monkeypatch.setattr(nv, "quantize", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    rt = load_model(p, RuntimeOptions(**CPU))
    assert calls == []  # no weight was quantized again
    for layer, q in ref.items():
        bi, parent, name = layer.split(".")[1], layer.split(".")[2], layer.split(".")[3]
        lin = getattr(getattr(rt.model.blocks[int(bi)], parent), name)
        assert torch.equal(lin.packed[: q.packed.shape[0]], q.packed)
        assert torch.equal(lin.global_scale, q.global_scale)


def test_fc2_gets_producer_bytes_padded_to_16_rows():
    """The stack hands the FC2 dispatcher the SwiGLU producer's own bytes with packed M = roundup(S, 16)
    (the seed's guard needs packed 37824 for logical 37810) and m_logical = S; the fallback result equals
    the plain NVFP4 GEMM of those bytes, cut to S rows."""
    rt = load_model(None, RuntimeOptions(**CPU))
    m = rt.model
    calls = []

    class FakeDispatcher:
        def __call__(self, ops, fallback, **kw):
            calls.append((tuple(ops.x.shape), ops.m_logical, kw["producer"], kw["lora_active"]))
            return fallback(None)

    rt.ops.base.fc2_dispatcher = FakeDispatcher()
    g = torch.Generator().manual_seed(2)
    out_fake = m(torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g),
                 torch.randn(1, 7, 5120, generator=g), 0.5, ops=rt.ops)
    s = 7 + 2 * 5 + 2 * 3 * 4
    assert len(calls) == len(m.blocks)
    assert all(c == ((48, TINY.ffn_hidden_size // 2), s, "swiglu_nvfp4", False) for c in calls), calls[0]
    rt.ops.base.fc2_dispatcher = None
    g = torch.Generator().manual_seed(2)
    out_plain = m(torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g),
                  torch.randn(1, 7, 5120, generator=g), 0.5, ops=rt.ops)
    assert torch.equal(out_fake[0], out_plain[0]) and torch.equal(out_fake[1], out_plain[1])


def test_qkv_producers_pad_rows_zero_tail():
    from h3_blackwell.runtime.ops import fp8_producers as f8
    from h3_blackwell.runtime.ops import nvfp4_producers as qk

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(50, 64, generator=g), torch.randn(64, generator=g)
    sc, sh = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    segs = [(0, 50, 0)]
    a1 = qk.rms_modulate_quantize(x, w, qk.Modulation(sc, sh, segs), 1e-6)
    a128 = qk.rms_modulate_quantize(x, w, qk.Modulation(sc, sh, segs), 1e-6, pad_rows=128)
    assert a128.packed.shape[0] == 128 and torch.equal(a128.packed[:50], a1.packed) and not a128.packed[50:].any()
    o1, r1 = f8.rms_modulate_fp8(x, w, f8.Modulation(sc, sh, segs), 1e-6)
    o128, r128 = f8.rms_modulate_fp8(x, w, f8.Modulation(sc, sh, segs), 1e-6, pad_rows=128)
    assert o128.shape == (128, 64) and r128.shape == (128,)
    assert torch.equal(o128[:50].view(torch.uint8), o1.view(torch.uint8)) and torch.equal(r128[:50], r1)
    assert not o128[50:].view(torch.uint8).any() and torch.equal(r128[50:], torch.ones(78))


def test_backends_report_v_handling():
    rt = load_model(None, RuntimeOptions(**CPU), tiny_seed=5)
    got = rt.backends["v_handling"]
    assert got["choice"] == "none" and got["reason"].startswith("no effect: attention runs reference")


def test_w4a8_ops_block_close_to_nvfp4_ops_and_dense():
    """The same DiTBlock over W4A8Ops (e4m3 activations) stays close to the dense reference, closer than W4A4."""
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g),
            torch.randn(1, 7, 5120, generator=g), 0.6)
    dense = load_model(None, RuntimeOptions(**CPU, quantize=False), tiny_seed=2)
    w4a8 = load_model(None, RuntimeOptions(**CPU, gemm="fp8"), tiny_seed=2)
    w4a4 = load_model(None, RuntimeOptions(**CPU), tiny_seed=2)
    assert (w4a8.ops.name, w4a4.ops.name, dense.ops.name) == ("w4a8", "nvfp4", "reference")
    dv, _ = dense.model(*args, ops=dense.ops)
    e8 = float((w4a8.model(*args, ops=w4a8.ops)[0] - dv).norm() / dv.norm())
    e4 = float((w4a4.model(*args, ops=w4a4.ops)[0] - dv).norm() / dv.norm())
    assert 0 < e8 < e4 < 0.2, (e8, e4)  # both quantize the weights the same way; e4m3 activations are finer


def test_every_block_ops_meets_the_interface_and_wrappers_do_not_pass_writes_on():
    """BlockOps is a declared interface (runtime.ops.interface): the plain ops and both wrappers meet it, a
    capability is read as a declared attribute, and a wrapper refuses a write that is not its own (the state
    belongs to ``ops.base``, or to a declared setter) instead of passing it to what it wraps."""
    from h3_blackwell.runtime.lora.ops import LoraOps
    from h3_blackwell.runtime.ops.block_ops import Nvfp4Ops, W4A8Ops
    from h3_blackwell.runtime.ops.interface import BlockOps
    from h3_blackwell.runtime.ops.reference import ReferenceOps
    from h3_blackwell.runtime.ops.stream_ops import StreamOps

    base = Nvfp4Ops(TINY, None)
    wrapped = LoraOps(StreamOps(base, None, ffn_chunk_rows=32), {})
    for ops in (ReferenceOps(TINY), W4A8Ops(TINY, None), base, StreamOps(base, None), wrapped):
        assert isinstance(ops, BlockOps), type(ops).__name__
    assert wrapped.base is base and wrapped.name == "nvfp4" and wrapped.takes_amax_reduce
    assert wrapped.ffn_chunk_rows == 32 and base.ffn_chunk_rows is None  # the streaming wrapper's own
    assert not ReferenceOps(TINY).takes_amax_reduce and ReferenceOps(TINY).fc2_dispatcher is None
    with pytest.raises(AttributeError, match="does not pass writes on"):
        wrapped.fc2_dispatcher = object()
    with pytest.raises(AttributeError, match="does not pass writes on"):
        wrapped.ffn_chunk_rows = 8
    assert base.fc2_dispatcher is None and wrapped.ffn_chunk_rows == 32  # nothing was written anywhere
    wrapped.set_ffn_chunk_rows(8)  # the declared setter reaches the ops that own the state
    assert wrapped.ffn_chunk_rows == 8 and base.ffn_chunk_rows is None
    wrapped.base.fc2_dispatcher = "d"
    assert wrapped.fc2_dispatcher == "d"
