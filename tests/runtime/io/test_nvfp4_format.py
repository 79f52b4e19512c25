"""NVFP4 reference format vs comfy-kitchen (the on-disk oracle): bytes, scales, swizzle, nibble order, I/O."""

import json
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (comfy_kitchen does, at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import comfy_kitchen as ck  # noqa: E402
import pytest  # noqa: E402
from comfy_kitchen.float_utils import _f32_to_floatx_unpacked  # noqa: E402

from h3_blackwell.runtime.io import comfy_quant as cq  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402


def _weights(shape, dtype=torch.bfloat16, seed=0):
    """Random weights with per-row magnitudes over 4 decades, so block scales span the e4m3 range."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, shape[0]).unsqueeze(1)
    x = torch.randn(shape, generator=g) * rows[torch.randperm(shape[0], generator=g)]
    return x.to(dtype)


def _ck_quantize(x, g, hi_first=True):
    pad = x.shape[0] % 16 != 0 or x.shape[1] % 16 != 0
    with ck.use_backend("eager"):
        return ck.quantize_nvfp4(x, g, pad_16x=pad, hi_first=hi_first)


def _u8(t):
    return t.view(torch.uint8)


# shapes include every padding case: rows not a multiple of 16 / 128, K not a multiple of 16 / 64
SHAPES = [(32, 64), (37, 50), (130, 200), (17, 16), (1, 33), (256, 1344), (300, 1000)]


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_equals_comfy_kitchen_bytes(shape):
    x = _weights(shape, seed=shape[0] * 7 + shape[1])
    t = nv.quantize(x)
    q_ck, s_ck = _ck_quantize(x, t.global_scale)
    disk = cq.to_comfy_quant(t, "l")
    assert disk["l.weight"].shape == q_ck.shape == nv.packed_shape(*shape)
    assert torch.equal(disk["l.weight"], q_ck)
    assert disk["l.weight_scale"].dtype == torch.float8_e4m3fn
    assert disk["l.weight_scale"].shape == s_ck.shape == nv.scale_shape(nv.roundup(shape[0], 16), shape[1])
    assert torch.equal(_u8(disk["l.weight_scale"]), _u8(s_ck))
    assert disk["l.weight_scale_2"].shape == () and disk["l.weight_scale_2"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_equals_comfy_kitchen_other_dtypes(dtype):
    x = _weights((70, 96), dtype=dtype, seed=3)
    t = nv.quantize(x)
    q_ck, s_ck = _ck_quantize(x, t.global_scale)
    assert torch.equal(nv.swap_nibbles(t.packed), q_ck)
    assert torch.equal(_u8(t.scales), _u8(s_ck))


def test_edge_cases_equal_comfy_kitchen():
    """Exact E2M1 midpoints (ties to even), blocks whose scale rounds to e4m3 subnormals and to zero,
    negative zero, saturation under a calibrated (too small) global scale."""
    g = torch.tensor(1.0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0, 6.0])
    rows = [mids * 1.0, mids * 0.5, mids * 2.0 ** -8, mids * 2.0 ** -12, mids * 2.0 ** -14, mids * 448 * 1.5]
    x = torch.stack(rows).to(torch.float32)  # a block amax of 6 * s gives s exactly: the quotients are the midpoints
    t = nv.quantize(x, g)
    q_ck, s_ck = _ck_quantize(x, g)
    assert torch.equal(nv.swap_nibbles(t.packed), q_ck)
    assert torch.equal(_u8(t.scales), _u8(s_ck))
    lin = nv.unswizzle_scales(t.scales, x.shape[0], 1).float().flatten()
    assert lin[2] == 2 ** -8  # an e4m3 subnormal scale
    assert lin[3] == 0 and lin[4] == 0  # below 2^-10: rounds to zero and the whole block encodes +0
    assert (nv.unpack_codes(t.packed)[3:5] == 0).all()
    assert lin[5] == 448  # clamped: the block saturates
    x2 = _weights((40, 64), torch.bfloat16, seed=5)
    g_small = nv.global_scale(x2) / 4  # a calibrated scale below amax / 2688 saturates the large blocks
    t2 = nv.quantize(x2, g_small)
    q2, s2 = _ck_quantize(x2, g_small)
    assert torch.equal(nv.swap_nibbles(t2.packed), q2) and torch.equal(_u8(t2.scales), _u8(s2))


def test_e2m1_encode_equals_torchao_rounding():
    base = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    near = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(9.0))])
    vals = torch.cat([near, -near, torch.rand(20000) * 7 - 3.5, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    ours = nv.e2m1_encode(vals)
    theirs = _f32_to_floatx_unpacked(torch.clamp(vals, -6, 6), 2, 1)
    assert torch.equal(ours, theirs)
    assert torch.equal(nv.e2m1_decode(ours), torch.tensor(nv.E2M1_VALUES)[ours.long()])


@pytest.mark.parametrize("rows, cols", [(128, 4), (130, 13), (1, 1), (300, 84), (256, 336)])
def test_swizzle_equals_comfy_kitchen_to_blocked(rows, cols):
    lin = torch.randint(1, 127, (rows, cols), dtype=torch.uint8)
    sw = nv.swizzle_scales(lin)
    assert torch.equal(sw, ck.to_blocked(lin, flatten=False))
    assert torch.equal(nv.unswizzle_scales(sw, rows, cols), lin)
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    assert torch.equal(sw.reshape(-1)[nv.swizzled_offset(r, c, sw.shape[1])], lin)
    pad = torch.ones(sw.numel(), dtype=torch.bool)
    pad[nv.swizzled_offset(r, c, sw.shape[1]).reshape(-1)] = False
    assert (sw.reshape(-1)[pad] == 0).all()  # the padding is zero


def test_dequantize_equals_comfy_kitchen_and_is_exact_in_fp64():
    x = _weights((100, 160), seed=11)
    t = nv.quantize(x)
    disk = cq.to_comfy_quant(t, "l")
    with ck.use_backend("eager"):
        d_ck = ck.dequantize_nvfp4(disk["l.weight"], disk["l.weight_scale_2"], disk["l.weight_scale"],
                                   output_type=torch.float32)
    assert torch.equal(d_ck[:100, :160], nv.dequantize(t, torch.float32))
    # fp64 is exact: value = e2m1 * s * g with exact integer arithmetic on the codes
    v = nv.e2m1_decode(nv.unpack_codes(t.packed[:100]), torch.float64).reshape(100, 10, 16)
    s = nv.unswizzle_scales(t.scales, 100, 10).double().unsqueeze(-1)
    assert torch.equal(nv.dequantize(t, torch.float64), (v * s * t.global_scale.double()).reshape(100, 160))
    assert torch.equal(nv.dequantize_blocks(t, torch.bfloat16).double(), (v * s).reshape(100, 160))  # exact in bf16


def test_nibble_order_trap_with_asymmetric_data():
    """Even elements +6 (code 7), odd elements -0.5 (code 9): the byte is 0x97 low-nibble-first (ours,
    torch, ModelOpt) and 0x79 high-nibble-first (comfy-kitchen's on-disk default). Reading with the wrong
    order silently swaps every pair; the edges convert exactly once."""
    x = torch.tensor([6.0, -0.5] * 16).repeat(16, 1)
    g = torch.tensor(1.0)
    t = nv.quantize(x, g)
    assert (t.packed[:16] == 0x97).all()
    disk = cq.to_comfy_quant(t, "l")
    assert (disk["l.weight"] == 0x79).all()
    q_ck, _ = _ck_quantize(x, g)
    assert (q_ck == 0x79).all()
    q_lo, _ = _ck_quantize(x, g, hi_first=False)
    assert torch.equal(q_lo, t.packed)
    back = cq.from_comfy_quant(disk["l.weight"], disk["l.weight_scale"], disk["l.weight_scale_2"], shape=(16, 32))
    assert torch.equal(nv.dequantize(back), x)
    wrong = cq.from_comfy_quant(disk["l.weight"], disk["l.weight_scale"], disk["l.weight_scale_2"], shape=(16, 32),
                                hi_first=False)
    assert torch.equal(nv.dequantize(wrong), x.flip(-1))  # every pair swapped: (-0.5, 6)
    mo = cq.from_modelopt(disk["l.weight"], nv.unswizzle_scales(disk["l.weight_scale"], 16, 2), disk["l.weight_scale_2"])
    assert torch.equal(nv.dequantize(mo), x.flip(-1))  # ModelOpt reads low nibble first: the same trap


def test_comfy_quant_round_trip_marker_and_extras():
    x = _weights((37, 50), seed=2)
    t = nv.quantize(x)
    ins, pqs = torch.tensor(0.0123), torch.rand(50) + 0.5
    sd = cq.to_comfy_quant(t, "blocks.0.mlp.fc2", input_scale=ins, pre_quant_scale=pqs)
    assert set(sd) == {f"blocks.0.mlp.fc2.{s}" for s in
                       ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")}
    marker = sd["blocks.0.mlp.fc2.comfy_quant"]
    assert marker.dtype == torch.uint8 and json.loads(bytes(marker.tolist())) == {"format": "nvfp4"}
    layer = cq.from_comfy_quant_tensors(sd, "blocks.0.mlp.fc2", shape=(37, 50))
    assert torch.equal(nv.dequantize(layer.weight), nv.dequantize(t))
    assert torch.equal(layer.input_scale, ins) and torch.equal(layer.pre_quant_scale, pqs)
    # the safetensors-metadata alternative to the marker tensor
    del sd["blocks.0.mlp.fc2.comfy_quant"]
    meta = {"_quantization_metadata": cq.quantization_metadata({"blocks.0.mlp.fc2": {"format": "nvfp4"}})}
    layer2 = cq.from_comfy_quant_tensors(sd, "blocks.0.mlp.fc2", shape=(37, 50), metadata=meta)
    assert torch.equal(layer2.weight.packed, t.packed)
    # markers nesting their keys under "params" are accepted, as ComfyUI accepts them
    nested = torch.tensor(list(b'{"params": {"format": "nvfp4"}}'), dtype=torch.uint8)
    assert cq.parse_comfy_quant_marker(nested) == {"format": "nvfp4"}


def test_comfy_quant_errors_say_what_to_do():
    t = nv.quantize(_weights((32, 64)))
    sd = cq.to_comfy_quant(t, "l")
    with pytest.raises(ValueError, match="no l.comfy_quant marker"):
        cq.from_comfy_quant_tensors({k: v for k, v in sd.items() if not k.endswith("comfy_quant")}, "l")
    bad = dict(sd, **{"l.comfy_quant": cq.comfy_quant_marker({"format": "int8_tensorwise"})})
    with pytest.raises(ValueError, match="expected 'nvfp4'"):
        cq.from_comfy_quant_tensors(bad, "l")
    with pytest.raises(ValueError, match="lacks l.weight_scale_2"):
        cq.from_comfy_quant_tensors({k: v for k, v in sd.items() if not k.endswith("scale_2")}, "l")
    linear = nv.unswizzle_scales(sd["l.weight_scale"], 32, 4)
    with pytest.raises(ValueError, match="ModelOpt layout: use from_modelopt"):
        cq.from_comfy_quant(sd["l.weight"], linear, sd["l.weight_scale_2"])
    with pytest.raises(ValueError, match=r"must be \[32, 32\]"):
        cq.from_comfy_quant(sd["l.weight"][:, :30], sd["l.weight_scale"], sd["l.weight_scale_2"], shape=(32, 64))
    with pytest.raises(TypeError, match="dequantize it first"):
        nv.quantize(torch.zeros(4, 16, dtype=torch.int8))


def test_from_modelopt_layout():
    x = _weights((48, 96), seed=9)
    t = nv.quantize(x, pad_rows=1)
    w = t.packed  # ModelOpt: low nibble first, [N, K/2]
    ws = nv.unswizzle_scales(t.scales, 48, 6)  # linear [N, K/16]
    mo = cq.from_modelopt(w, ws, t.global_scale)
    assert torch.equal(nv.dequantize(mo), nv.dequantize(t))
    with pytest.raises(ValueError, match=r"linear e4m3 \[48, 6\]"):
        cq.from_modelopt(w, t.scales, t.global_scale)


def test_global_scale_policy_and_zero_tensor():
    x = _weights((16, 32))
    assert nv.global_scale(x) == x.abs().amax().float() / 2688
    z = nv.quantize(torch.zeros(16, 32))
    assert z.global_scale == 1.0 and (z.packed == 0).all() and (_u8(z.scales) == 0).all()
    assert (nv.dequantize(z) == 0).all()


def test_chunked_quantize_equals_whole(monkeypatch):
    x = _weights((700, 80), seed=4)
    whole = nv.quantize(x)
    monkeypatch.setattr(nv, "ROW_CHUNK", 128)
    chunked = nv.quantize(x)
    assert torch.equal(whole.packed, chunked.packed) and torch.equal(_u8(whole.scales), _u8(chunked.scales))
