"""LoRA on the tiny H3: every key form, merge (dense and NVFP4, bit for bit), side path (bounded), stacking,
remove/replace, one clear error per bad LoRA, curve-form AdaLN skips, the FC2 guard, the node and the CLI.

The LoRAs come from ``runtime.tiny_lora``: one random ground truth (bf16 tensors, never zero) written in
each key form; ``expected_merge`` evaluates the merge contract from that truth, not from the loader.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from h3_blackwell.runtime import RuntimeOptions, load_model
from fixtures.sampling import sample
from h3_blackwell.runtime.lora import apply as L
from h3_blackwell.runtime.model.config import FULL, TINY
from h3_blackwell.runtime.load import StateDictSource
from h3_blackwell.runtime.lora.key_forms import LoraError, match_lora, read_lora_file
from h3_blackwell.runtime.lora.ops import BLOCK_LINEAR, LoraOps
from h3_blackwell.runtime.lora.side import SIDE_ATTR
from refblock import reference_block  # the float64 block from the formulas (tests/refblock.py)
from h3_blackwell.runtime.ops import nvfp4 as nv
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict
from fixtures.tiny_lora import FORMS, expected_merge, save_tiny_lora, tiny_lora_truth

CPU = dict(device="cpu", dtype="float32")
U_BF16 = 2.0 ** -8  # bf16 unit roundoff
U_FP32 = 2.0 ** -24
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


# ---------------------------------------------------------------------------------------------
# fixtures: models are loaded once per module and every test leaves them without LoRA
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """form -> (path, truth): the same random truth (seed 1) in every key form; 'comfy+diffs' adds a norm
    .diff and an AdaLN .diff_b; 'noalpha' has no alpha anywhere (alpha = rank)."""
    d = tmp_path_factory.mktemp("loras")
    truth = tiny_lora_truth(TINY, seed=1)
    out = {f: (save_tiny_lora(d / f"{f}.safetensors", truth, f), truth) for f in FORMS}
    t2 = tiny_lora_truth(TINY, seed=2, diffs=True)
    out["comfy+diffs"] = (save_tiny_lora(d / "diffs.safetensors", t2, "comfy"), t2)
    t3 = tiny_lora_truth(TINY, seed=3, alpha=None, rank=3)
    out["noalpha"] = (save_tiny_lora(d / "noalpha.safetensors", t3, "lora_unet"), t3)
    return out


def _clean(rt):
    L.apply_loras(rt, [])
    return rt


@pytest.fixture(scope="module")
def dense32():
    return load_model(None, RuntimeOptions(**CPU, quantize=False))


@pytest.fixture(scope="module")
def dense16():
    return load_model(None, RuntimeOptions(device="cpu", dtype="bfloat16", quantize=False))


@pytest.fixture(scope="module")
def nvfp4_rt():
    return load_model(None, RuntimeOptions(**CPU, gemm="reference"))


@pytest.fixture(scope="module")
def tiny_src():
    """The embedded tiny model's source weights (seed 0, fp32): what NVFP4 merges start from."""
    return tiny_state_dict(TINY, 0, torch.float32)


@pytest.fixture
def d32(dense32):
    yield _clean(dense32)
    _clean(dense32)


@pytest.fixture
def d16(dense16):
    yield _clean(dense16)
    _clean(dense16)


@pytest.fixture
def fp4(nvfp4_rt):
    yield _clean(nvfp4_rt)
    _clean(nvfp4_rt)


def _sd(rt):
    return {k: v.clone() for k, v in rt.model.state_dict().items()}


def _nv_bytes(q):
    return q.packed, q.scales.view(torch.uint8), q.global_scale


def _layer_bytes(model, layer):
    m = dict(model.named_modules())[layer]
    return m.packed, m.scales.view(torch.uint8), m.global_scale


def _equal_bytes(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _inputs(seed=1, tokens=7):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g),
            torch.randn(1, tokens, 5120, generator=g), 0.6)


# ---------------------------------------------------------------------------------------------
# key forms
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", list(FORMS) + ["comfy+diffs", "noalpha"])
def test_every_key_form_reads_as_the_truth(files, dense32, form):
    """Each form maps onto ComfyUI module names with the truth's update, exactly (float64): q/k/v thirds
    (diffusers) and the fused block-diagonal qkv (comfy forms) alike, fc1 halves swapped back, alpha from
    tensors, adapter metadata or the rank."""
    path, truth = files[form]
    m = match_lora(read_lora_file(path), dense32.model, dense32.config)
    mods = dict(dense32.model.named_modules())
    got: dict[str, torch.Tensor] = {}
    for u in m.updates:
        t = f"{u.module}.{u.param}"
        shape = tuple(getattr(mods[u.module], u.param).shape)
        d = got.setdefault(t, torch.zeros(shape, dtype=torch.float64))
        if u.kind == "lowrank":
            d[u.rows[0]:u.rows[1]] += (u.up.double() @ u.down.double()) * u.unit_scale
        else:
            d[u.rows[0]:u.rows[1]] += u.delta.double()
    assert set(got) == truth.tensors()
    for t, d in got.items():
        assert torch.equal(d, truth.delta(t, d.shape)), t
    assert not m.skipped
    want_form = {"comfy+diffs": "comfy", "noalpha": "lora_unet"}.get(form, form)
    assert m.forms == [want_form]
    if form == "peft":
        assert "lora_adapter_metadata" in m.alpha_source
    if form == "noalpha":
        assert "alpha = rank" in m.alpha_source


# ---------------------------------------------------------------------------------------------
# merge: bit for bit
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", list(FORMS) + ["comfy+diffs"])
def test_merge_dense_stack_is_the_merged_weights(files, d32, form):
    """Dense reference stack (no NVFP4): merge mode merges into the dense weights, bit for bit
    fp32(W0 + s * (alpha/r) * B@A) in float64; nothing else changes; removal restores every bit."""
    path, truth = files[form]
    before = _sd(d32)
    rep = L.apply_loras(d32, [(path, 0.7, "merge")])
    assert rep["stack"].startswith("dense reference stack") and not rep["merged_nvfp4"]
    after = d32.model.state_dict()
    for k, v in after.items():
        if k in truth.tensors():
            assert torch.equal(v, expected_merge(before[k], [(truth, 0.7)], k).to(v.dtype)), k
        else:
            assert torch.equal(v, before[k]), k
    L.remove_loras(d32)
    assert all(torch.equal(v, before[k]) for k, v in d32.model.state_dict().items())
    assert rep["originals"]["host_copies"] == 0  # the embedded tiny weights are reproduced from the seed


@pytest.mark.parametrize("form", FORMS)
def test_merge_nvfp4_equals_quantizing_the_merged_weights(files, fp4, tiny_src, form):
    """NVFP4 block linears hold exactly nvfp4.quantize(merged source weights); dense layers (refiner, AdaLN,
    condition_proj) the merged dense weights; removal restores the resident bytes."""
    path, truth = files[form]
    src = tiny_src
    before = _sd(fp4)
    rep = L.apply_loras(fp4, [(path, 0.7, "merge")])
    assert len(rep["merged_nvfp4"]) == 4 * TINY.num_layers
    assert list(rep["base_weights"]) == ["embedded tiny weights (from the seed) (float32)"]
    sd = fp4.model.state_dict()
    for t in truth.tensors():
        layer = t[: -len(".weight")]
        if layer + ".packed" in sd:
            want = nv.quantize(expected_merge(src[t], [(truth, 0.7)], t))
            assert _equal_bytes(_layer_bytes(fp4.model, layer), _nv_bytes(want)), t
        else:
            assert torch.equal(sd[t], expected_merge(before[t], [(truth, 0.7)], t).to(sd[t].dtype)), t
    L.remove_loras(fp4)
    assert all(torch.equal(v, before[k]) for k, v in fp4.model.state_dict().items())


def test_merge_stack_from_a_checkpoint_file_and_without_a_source(files, tmp_path):
    """A bf16 checkpoint file is the source of W0 (not the resident NVFP4); two LoRAs stack in order with
    their strengths; replacing the stack equals applying the new one fresh. Without any source the resident
    NVFP4 weights are the base (dequantized exactly) and the originals are kept as host copies."""
    ck = save_tiny(tmp_path / "tiny.safetensors", seed=5, dtype=torch.bfloat16)
    rt = load_model(ck, RuntimeOptions(**CPU))
    src = tiny_state_dict(TINY, 5, torch.bfloat16)
    (pa, ta), (pb, tb) = files["diffusers"], files["comfy+diffs"]
    before = _sd(rt)
    rep = L.apply_loras(rt, [(pa, 0.6, "merge"), (pb, -1.25, "merge")])
    assert list(rep["base_weights"]) == ["checkpoint (bfloat16)"]
    assert rep["originals"]["host_copies"] == 0
    layer = "blocks.1.mlp.fc1"
    want = nv.quantize(expected_merge(src[layer + ".weight"], [(ta, 0.6), (tb, -1.25)], layer + ".weight"))
    assert _equal_bytes(_layer_bytes(rt.model, layer), _nv_bytes(want))
    t = "blocks.1.adaln_proj.linear.bias"  # a diff_b from the second LoRA only
    assert torch.equal(rt.model.state_dict()[t], expected_merge(before[t], [(ta, 0.6), (tb, -1.25)], t))
    L.apply_loras(rt, [(pb, 0.5, "merge")])  # replace
    want = nv.quantize(expected_merge(src[layer + ".weight"], [(tb, 0.5)], layer + ".weight"))
    assert _equal_bytes(_layer_bytes(rt.model, layer), _nv_bytes(want))
    L.apply_loras(rt, [])
    assert all(torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())

    rt.source = "a checkpoint that is no longer on disk"
    rep = L.apply_loras(rt, [(pa, 0.6, "merge")])
    assert list(rep["base_weights"]) == ["resident NVFP4 (no source weights to read)"]
    assert rep["originals"]["host_copies"] > 0
    resident = nv.NVFP4Tensor(*(before[f"{layer}.{k}"] for k in ("packed", "scales", "global_scale")),
                              shape=(2 * TINY.ffn_hidden_size, TINY.hidden_size))
    want = nv.quantize(expected_merge(nv.dequantize(resident, torch.float64), [(ta, 0.6)], layer + ".weight"))
    assert _equal_bytes(_layer_bytes(rt.model, layer), _nv_bytes(want))
    L.remove_loras(rt)
    assert all(torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())


def test_merge_into_nvfp4_adopted_from_the_file_reads_nothing_and_gives_the_stored_bases_bytes(files, tmp_path,
                                                                                              monkeypatch):
    """A checkpoint stored as NVFP4: the load adopts its bytes, so a merge starts from the resident bytes without
    reading the file (the same bytes as dequantizing the stored tensors), and a dense tensor stored unquantized is
    recorded without reading it to compare; once the file changes on disk (its mtime),
    the merge reads and compares again and gives the same bytes. Removal restores the stored bytes either way."""
    from h3_blackwell.runtime.io.checkpoint import Checkpoint, open_checkpoint
    from h3_blackwell.runtime.io.convert import quantize_checkpoint
    import os

    ck = tmp_path / "tiny_nvfp4.safetensors"
    quantize_checkpoint(save_tiny(tmp_path / "tiny.safetensors", seed=6), ck)
    rt = load_model(ck, RuntimeOptions(**CPU))
    layer = "blocks.0.attn.qkv_proj"
    assert layer in rt.plan.stored_nvfp4 and rt.source_stamp
    stored = open_checkpoint(ck)
    shape = (rt.model.get_submodule(layer).out_features, rt.model.get_submodule(layer).in_features)
    from h3_blackwell.runtime.io.comfy_quant import from_comfy_quant
    q = from_comfy_quant(*(stored.tensor(layer + s) for s in (".weight", ".weight_scale", ".weight_scale_2")),
                         shape=shape)
    (pa, ta) = files["comfy"]
    want = nv.quantize(expected_merge(nv.dequantize(q, torch.float64), [(ta, 0.6)], layer + ".weight"), pad_rows=16
                       if rt.model.get_submodule(layer).packed.shape[0] != shape[0] else 1)
    before = _sd(rt)
    reads = []
    real = Checkpoint.tensor
    monkeypatch.setattr(Checkpoint, "tensor", lambda self, name, device="cpu": (reads.append(name),
                                                                               real(self, name, device))[1])
    rep = L.apply_loras(rt, [(pa, 0.6, "merge")])
    assert not [n for n in reads if n.startswith(layer)] and len(rep["merged_nvfp4"]) == 4 * TINY.num_layers
    adaln = "blocks.0.adaln_proj.linear.weight"  # a dense tensor stored unquantized: the load's bytes, not reread
    assert adaln in rep["merged_dense"] and adaln not in reads
    assert list(rep["base_weights"]) == ["checkpoint NVFP4 (dequantized exactly)"]
    assert rep["originals"]["host_copies"] == 0
    assert _equal_bytes(_layer_bytes(rt.model, layer), _nv_bytes(want))
    L.remove_loras(rt)
    assert all(torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())

    os.utime(ck, ns=(os.stat(ck).st_atime_ns, os.stat(ck).st_mtime_ns + 10 ** 9))  # same bytes, a newer file
    reads.clear()
    L.apply_loras(rt, [(pa, 0.6, "merge")])
    assert [n for n in reads if n.startswith(layer)] and adaln in reads  # read and compared, then the same merge
    assert _equal_bytes(_layer_bytes(rt.model, layer), _nv_bytes(want))
    L.remove_loras(rt)
    assert all(torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())


# ---------------------------------------------------------------------------------------------
# side path: bounded against the merged reference
# ---------------------------------------------------------------------------------------------

def _side_bound_terms(truth, tname, x64, strength):
    """|x| |A|^T |B|^T |s alpha / r| per output element (float64): the magnitude the side term is built from."""
    mods = [p for p in truth.parts if p.module + ".weight" == tname]
    n = max(p.rows[1] for p in mods)
    m = torch.zeros(x64.shape[0], n, dtype=torch.float64)
    for p in mods:
        m[:, p.rows[0]:p.rows[1]] += (x64.abs() @ p.down.double().abs().T) @ p.up.double().abs().T * abs(
            strength * p.alpha / p.rank)
    return m


@pytest.mark.parametrize("form", FORMS)
def test_side_path_equals_bf16_merged_reference(files, d16, form):
    """bf16 dense stack, side mode: every targeted layer's output equals x (W0 + s*Delta)^T within the bf16
    bound. Bound (u = 2^-8): the base GEMM and x A^T are each rounded once to bf16 after fp32 accumulation,
    the update y + s*(xA^T)B^T is written with one bf16 rounding, so
    |y - x(W0 + s Delta)^T - b| <= 3u (|x||W0|^T + |b| + |s||x||A|^T|B|^T) (+ K 2^-24 terms, inside the 3).
    The bf16 reference with the delta merged, x @ bf16(W0 + s Delta)^T, meets the same bound."""
    path, truth = files[form]
    s = 0.7
    rep = L.apply_loras(d16, [(path, s, "side")])
    assert sorted(rep["side"]) == sorted(truth.modules()) and not rep["merged_dense"]
    mods = dict(d16.model.named_modules())
    g = torch.Generator().manual_seed(7)
    sides = L.lora_sides(d16)
    for name in sorted(truth.modules()):
        mod = mods[name]
        w0, b = mod.weight.detach(), mod.bias
        b64 = torch.zeros(mod.out_features, dtype=torch.float64) if b is None else b.double()
        x = torch.randn(5, mod.in_features, generator=g).to(torch.bfloat16)
        x64 = x.double()
        w_merged = w0.double() + s * truth.delta(name + ".weight", tuple(w0.shape))
        exact = x64 @ w_merged.T + b64
        bound = 3 * U_BF16 * (x64.abs() @ w0.double().abs().T + b64.abs()
                              + _side_bound_terms(truth, name + ".weight", x64, s))
        y = mod(x)
        if BLOCK_LINEAR.match(name):  # no hook on a block linear: its side path is in the LoraOps (rt.ops)
            assert not L.side_active(mod) and d16.ops.sides[name] is sides[name]
            sides[name].add_(x, y)
        assert y.dtype == torch.bfloat16
        assert bool(((y.double() - exact).abs() <= bound).all()), name
        merged = torch.nn.functional.linear(x, w_merged.to(torch.bfloat16), b)
        assert bool(((merged.double() - exact).abs() <= bound).all()), name
    L.remove_loras(d16)
    assert not any(L.side_active(m) for m in mods.values())


def test_side_path_whole_model_fp32_equals_merged(files, d32):
    """The wiring: the whole fp32 forward (AdaLN at plan time, refiner, blocks over ``rt.ops``) with the side
    path equals the forward with the same LoRA merged, to fp32 rounding (rel < 1e-6; measured ~2e-7)."""
    path, _ = files["diffusers"]
    args = _inputs()
    v0, a0 = d32.model(*args, ops=d32.ops)
    L.apply_loras(d32, [(path, 0.8, "side")])
    vs, as_ = d32.model(*args, ops=d32.ops)
    L.apply_loras(d32, [(path, 0.8, "merge")])
    vm, am = d32.model(*args, ops=d32.ops)
    L.remove_loras(d32)
    v1, a1 = d32.model(*args, ops=d32.ops)
    assert float((vs - vm).norm() / (vm - v0).norm()) < 1e-4  # relative to the LoRA's own effect
    assert float((vs - vm).norm() / vm.norm()) < 1e-6 and float((as_ - am).norm() / am.norm()) < 1e-6
    assert torch.equal(v1, v0) and torch.equal(a1, a0)  # unhooked: bit-identical to before


def test_block_side_paths_are_an_ops_wrapper(files, d32):
    """Side mode: the four block linears get no forward hook and no attribute; ``rt.ops`` becomes a LoraOps
    around the base ops (the refiner's layers keep their hook); the whole forward equals the merged LoRA to fp32
    rounding (rel < 1e-6, as the wiring test above); the sequence-parallel ``with_attention`` keeps the side
    paths; removing restores the very base ops object and bit-identical outputs."""
    path, truth = files["diffusers"]
    args = _inputs(seed=5)
    base = d32.ops
    v0, a0 = d32.model(*args, ops=base)
    rep = L.apply_loras(d32, [(path, 0.8, "side")])
    mods = dict(d32.model.named_modules())
    block = sorted(n for n in rep["side"] if BLOCK_LINEAR.match(n))
    assert len(block) == 4 * TINY.num_layers and any(not BLOCK_LINEAR.match(n) for n in rep["side"])
    for name, mod in mods.items():
        if BLOCK_LINEAR.match(name):
            assert "forward" not in mod.__dict__ and SIDE_ATTR not in mod.__dict__, name
    assert all("forward" in mods[n].__dict__ for n in rep["side"] if not BLOCK_LINEAR.match(n))
    ops = d32.ops
    assert isinstance(ops, LoraOps) and ops.inner is base and sorted(ops.sides) == block
    assert ops.name == base.name and ops.attends_exactly == base.attends_exactly and ops.status() == base.status()
    assert rep["side_bytes"] == sum(s.nbytes() for s in L.lora_sides(d32).values()) > 0
    vs, as_ = d32.model(*args, ops=ops)
    swapped = ops.with_attention(lambda qkv: torch.zeros(qkv.shape[0], qkv.shape[1] // 3))
    assert isinstance(swapped, LoraOps) and swapped.sides == ops.sides and swapped.inner is not base
    assert not swapped.attends_exactly and base.attends_exactly  # the original ops are left as they were
    L.apply_loras(d32, [(path, 0.8, "merge")])
    assert d32.ops is base
    vm, am = d32.model(*args, ops=d32.ops)
    assert float((vs - vm).norm() / (vm - v0).norm()) < 1e-4
    assert float((vs - vm).norm() / vm.norm()) < 1e-6 and float((as_ - am).norm() / am.norm()) < 1e-6
    L.apply_loras(d32, [(path, 0.8, "side")])
    L.remove_loras(d32)
    assert d32.ops is base and L.lora_sides(d32) == {}
    assert not any("forward" in m.__dict__ or SIDE_ATTR in m.__dict__ for m in d32.model.modules())
    v1, a1 = d32.model(*args, ops=d32.ops)
    assert torch.equal(v1, v0) and torch.equal(a1, a0)


def _q(x):
    """The W4A4 activation path: dynamic global scale, reference quantizer, exact dequantized values."""
    return nv.dequantize(nv.quantize(x.float(), nv.global_scale(x.float()), pad_rows=1), torch.float64)


def _sides(rt, i=0):
    """The side paths on block i's qkv_proj, fc1, fc2 (carried by the LoraOps around the runtime's ops)."""
    sides = L.lora_sides(rt)
    return tuple(sides.get(f"blocks.{i}.{n}") for n in ("attn.qkv_proj", "mlp.fc1", "mlp.fc2"))


def test_side_path_in_the_nvfp4_stack_equals_the_w4a4_oracle(files, fp4):
    """NVFP4 block stack + side path on all four block linears, every block: equals the float64 W4A4 oracle
    with the exact LoRA term on the unquantized activations. Same NVFP4 codes on both sides, so only fp32 vs
    float64 arithmetic differs (rel < 1e-6 on the output, < 1e-5 on the blocks' update; a code flip would
    show as ~1e-3)."""
    path, truth = files["peft"]
    s = -0.9
    m = fp4.model
    plan = m.plan(torch.randn(1, 7, 5120, generator=torch.Generator().manual_seed(3)), (1, 24, 2, 6, 8),
                  (1, 32, 2, 5), [0.7], token_tags=torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    g = torch.Generator().manual_seed(4)
    x = m.pack(plan, torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g))
    for i in range(len(m.blocks)):  # the modulation rows without the LoRA (a run computes a block's rows when it
        plan.mods[0][i]             # first reaches it): this checks the block linears' side paths alone
    L.apply_loras(fp4, [(path, s, "side")])
    assert all(side is not None for side in _sides(fp4))
    got = m.run_blocks(x.clone(), plan, 0, fp4.ops)
    expect = x.double()
    for i, blk in enumerate(m.blocks):
        wq = {n.split(".")[1]: nv.dequantize(getattr(getattr(blk, n.split(".")[0]), n.split(".")[1]).weight,
                                             torch.float64) for n in BLOCK_LINEARS}
        side = {n.split(".")[1]: s * truth.delta(f"blocks.{i}.{n}.weight", tuple(wq[n.split(".")[1]].shape))
                for n in BLOCK_LINEARS}
        expect = reference_block(blk, expect, plan.mods[0][i], plan.times[0].mod_segments, plan.cos, plan.sin,
                                 m.cfg, wq, _q, side)
    rel = float((got.double() - expect).norm() / expect.norm())
    upd = float(((got.double() - x.double()) - (expect - x.double())).norm() / (expect - x.double()).norm())
    assert rel < 1e-6 and upd < 1e-5, (rel, upd)
    L.remove_loras(fp4)
    assert _sides(fp4) == (None, None, None)


def test_side_on_an_nvfp4_layer_adds_the_exact_term(files, fp4):
    """On an Nvfp4Linear run as a module by the NVFP4 ops (out_proj) the LoraOps adds s*(alpha/r)*(x A^T) B^T to
    the unchanged NVFP4 GEMM output: fp32 side math, |err| <= (K + r + 2) 2^-24 (|y0| + |s||x||A|^T|B|^T)."""
    path, truth = files["comfy"]
    name = "blocks.2.attn.out_proj"
    blk = fp4.model.blocks[2]
    mod = blk.attn.out_proj
    x = torch.randn(6, mod.in_features, generator=torch.Generator().manual_seed(9))
    y0 = fp4.ops.out_proj(2, blk, x)
    assert torch.equal(y0, mod(x))
    L.apply_loras(fp4, [(path, 1.3, "side")])
    y = fp4.ops.out_proj(2, blk, x)
    x64 = x.double()
    term = x64 @ (1.3 * truth.delta(name + ".weight", (mod.out_features, mod.in_features))).T
    bound = (mod.in_features + 8) * U_FP32 * (y0.double().abs() + _side_bound_terms(truth, name + ".weight", x64, 1.3))
    assert bool((((y.double() - y0.double()) - term).abs() <= bound).all())
    assert L.lora_sides(fp4)[name].dtype == torch.float32 and not L.side_active(mod)
    assert torch.equal(mod(x), y0)  # the module itself is unchanged: the term is the ops wrapper's


def test_mixed_modes_stack_on_one_layer(files, d32):
    """merge and side LoRAs on the same layers: the weights hold the merged ones, the side path adds the
    other; the layer computes x (W0 + s1 D1 + s2 D2)^T (fp32 bound)."""
    (pa, ta), (pb, tb) = files["lora_unet"], files["noalpha"]
    name = "token_refiner.blocks.1.mlp.fc2"
    mod = dict(d32.model.named_modules())[name]
    w0 = mod.weight.detach().clone()
    rep = L.apply_loras(d32, [(pa, 0.4, "merge"), (pb, -0.6, "side")])
    assert name + ".weight" in rep["merged_dense"] and name in rep["side"]
    assert torch.equal(mod.weight, expected_merge(w0, [(ta, 0.4)], name + ".weight"))
    x = torch.randn(4, mod.in_features, generator=torch.Generator().manual_seed(2))
    shape = tuple(w0.shape)
    exact = x.double() @ (w0.double() + 0.4 * ta.delta(name + ".weight", shape)
                          - 0.6 * tb.delta(name + ".weight", shape)).T
    err = (mod(x).double() - exact).abs().max()
    assert float(err) < 1e-5 * float(exact.abs().max())


def test_side_mode_merges_layers_computed_outside_their_module(files, d32, monkeypatch):
    """AdaLN weights offloaded to host memory (CUDA, adaln_cache) are applied by ``plan`` with F.linear, outside
    the module, where no hook runs: side-mode updates on such layers are merged, and the report says so."""
    path, truth = files["comfy"]
    off = {"blocks.1.adaln_proj.linear", "final_layer.adaln_proj.linear"}
    mods = dict(d32.model.named_modules())
    real = L.module_device
    monkeypatch.setattr(L, "module_device", lambda m: torch.device("meta") if any(m is mods[n] for n in off)
                        else real(m))
    before = _sd(d32)
    rep = L.apply_loras(d32, [(path, 0.3, "side")])
    assert not off & set(rep["side"]) and {n + ".weight" for n in off} <= set(rep["merged_dense"])
    assert any("live off the device" in n for n in rep["notes"])
    for n in off:
        t = n + ".weight"
        assert torch.equal(d32.model.state_dict()[t], expected_merge(before[t], [(truth, 0.3)], t))
    assert L.side_active(mods["blocks.0.adaln_proj.linear"])


def test_sync_restores_the_stack_each_runtime_owns(files, d32):
    """apply_loras records the stack on the runtime; a view records its own. sync_loras(rt) makes the shared
    model carry the caller's stack: the CLI's stays, a graph without LoRA nodes gets none."""
    (pa, _), (pb, _) = files["comfy"], files["diffusers"]
    L.apply_loras(d32, [(pa, 0.5, "merge")])  # e.g. the CLI
    view = L.with_lora(d32, str(pb), 0.2, "side")
    assert [s.path for s in view.lora_stack] == [str(pa), str(pb)]
    assert len(L.lora_report(d32)["loras"]) == 1  # a view changes nothing until it is synced
    view.model, view.ops  # reading is not syncing
    assert len(L.lora_report(d32)["loras"]) == 1
    view.sync()
    assert len(L.lora_report(d32)["loras"]) == 2 and len(d32.lora_stack) == 1
    L.sync_loras(d32)
    assert [e["file"] for e in L.lora_report(d32)["loras"]] == ["comfy.safetensors"]
    rep = L.sync_loras(d32)  # already there: nothing is redone
    assert rep is L.lora_report(d32)


def test_a_view_is_a_runtime_as_python_3_12_checks_it(files, d32):
    """isinstance(view, Runtime) finds every protocol member on the LoraView class itself: from Python 3.12 the
    check looks members up statically (inspect.getattr_static), past __getattr__, so a view passed to
    tensor_job (the sampler nodes, bench/sparse_methods.py) was refused there. Checked statically here on every
    Python; the values are the base runtime's."""
    import inspect
    import typing

    from h3_blackwell.runtime.interface import Runtime
    from h3_blackwell.runtime.job import _check_model

    view = L.with_lora(d32, str(files["comfy"][0]), 0.5)
    members = getattr(Runtime, "__protocol_attrs__", None) or typing._get_protocol_attrs(Runtime)
    for name in sorted(members):
        inspect.getattr_static(view, name)  # raises AttributeError where only __getattr__ would find it
    assert isinstance(view, Runtime)
    _check_model(view)
    assert view.config is d32.config and view.device == d32.device and view.describe() == d32.describe()
    assert view.device_bytes() == d32.device_bytes() and view.backends == d32.backends


# ---------------------------------------------------------------------------------------------
# errors: one clear message, nothing changed
# ---------------------------------------------------------------------------------------------

def _bad(tmp_path, name, tensors, meta=None):
    p = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(p), metadata=meta)
    return p


def test_bad_loras_give_one_clear_message_and_change_nothing(files, d32, tmp_path):
    """Keys that match nothing (a Flux LoRA), wrong ranks, a LoRA for another model (full-size H3 shapes),
    a model checkpoint passed as a LoRA: each raises exactly one LoraError naming the problem; the LoRA
    applied before stays applied, bit for bit."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    flux = _bad(tmp_path, "flux.safetensors", {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": r(4, 3072),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": r(9216, 4),
        "diffusion_model.single_blocks.3.linear1.lora_A.weight": r(4, 3072),
        "diffusion_model.single_blocks.3.linear1.lora_B.weight": r(21504, 4)})
    rank = _bad(tmp_path, "rank.safetensors", {
        "blocks.0.mlp.fc2.lora_A.weight": r(4, TINY.ffn_hidden_size),
        "blocks.0.mlp.fc2.lora_B.weight": r(TINY.hidden_size, 3),
        "blocks.1.attn.out_proj.lora_A.weight": r(4, TINY.inner_dim),
        "blocks.1.attn.out_proj.lora_B.weight": r(TINY.hidden_size, 4)})
    big_truth = tiny_lora_truth(FULL, seed=0, rank=2, modules=("blocks.0.attn.qkv_proj", "blocks.0.mlp.fc2"))
    other = save_tiny_lora(tmp_path / "full_size.safetensors", big_truth, "diffusers")
    ckpt = _bad(tmp_path, "model.safetensors", {"blocks.0.attn.qkv_proj.weight": r(384, 96),
                                                "video_patch_proj.weight": r(96, 96)})
    path, truth = files["comfy"]
    L.apply_loras(d32, [(path, 0.5, "merge")])
    before = _sd(d32)
    cases = [
        (flux, ["4 keys match no module", "Flux", "double_blocks"]),
        (rank, ["mismatched ranks", "blocks.0.mlp.fc2", "rank 4", "rank 3"]),
        (other, ["2 of 2 target layers have the wrong shape", "another model", "down [2, 5376]", "[384, 96]"]),
        (ckpt, ["no LoRA tensors", "model checkpoint"]),
    ]
    for p, needles in cases:
        with pytest.raises(LoraError) as ei:
            L.apply_loras(d32, [(p, 1.0, "merge")])
        msg = str(ei.value)
        assert "\n" not in msg and all(n in msg for n in needles), msg
        assert all(torch.equal(v, before[k]) for k, v in d32.model.state_dict().items())
    # several bad files in one stack: still one error, each file named once
    with pytest.raises(LoraError) as ei:
        L.apply_loras(d32, [(flux, 1.0, "side"), (rank, 1.0, "merge")])
    assert "flux.safetensors" in str(ei.value) and "rank.safetensors" in str(ei.value)
    assert L.lora_report(d32)["loras"][0]["file"] == "comfy.safetensors"  # the previous stack is intact
    with pytest.raises(LoraError, match="expected one of merge, side"):
        L.apply_loras(d32, [(path, 1.0, "fused")])


def test_parse_lora_arg(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(b"x")
    assert L.parse_lora_arg(f"{p}:0.8") == L.LoraSpec(str(p), 0.8, "merge")
    assert L.parse_lora_arg(f"{p}:-1.5:side") == L.LoraSpec(str(p), -1.5, "side")
    for bad, msg in ((f"{p}", "FILE:STRENGTH"), (f"{p}:x", "not a number"), (f"{tmp_path}/no.safetensors:1",
                                                                              "not found")):
        with pytest.raises(LoraError, match=msg):
            L.parse_lora_arg(bad)


# ---------------------------------------------------------------------------------------------
# curve-form checkpoints: AdaLN LoRAs skipped with the reason
# ---------------------------------------------------------------------------------------------

def test_curve_form_skips_adaln_loras_and_says_why(files):
    """A LoRA made for the full-form AdaLN (width 48 here, 2688 in H3) on a curve-form checkpoint (AdaLN
    input = the 8-wide table row): every AdaLN tensor is skipped and listed with the reason; the rest merges."""
    cfg = TINY.replace(adaln_curve_grid=33, time_embed_dim=8)
    rt = load_model(StateDictSource(tiny_state_dict(cfg, 0), "curve-form test model", cfg),
                    RuntimeOptions(**CPU, quantize=False))
    path, truth = files["comfy+diffs"]
    before = _sd(rt)
    rep = L.apply_loras(rt, [(path, 1.0, "merge")])
    skipped = {s["key"]: s["reason"] for s in rep["skipped"]}
    adaln = [f"blocks.{i}.adaln_proj.linear" for i in range(cfg.num_layers)] + ["final_layer.adaln_proj.linear"]
    want = {f"{m}.{s}" for m in adaln for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    want.add("blocks.1.adaln_proj.linear.diff_b")
    assert set(skipped) == want
    assert all("curve-form" in why and "8-wide" in why and "48-wide" in why for k, why in skipped.items()
               if not k.endswith("diff_b"))
    assert f"{len(want)} tensors skipped (curve-form" in rt.backends["lora"]["reason"]
    sd = rt.model.state_dict()
    for m in adaln:
        assert torch.equal(sd[m + ".weight"], before[m + ".weight"])
        assert torch.equal(sd[m + ".bias"], before[m + ".bias"])
    assert not torch.equal(sd["blocks.0.mlp.fc2.weight"], before["blocks.0.mlp.fc2.weight"])
    assert rep["originals"]["host_copies"] > 0  # no source for this model: host copies restore it
    L.remove_loras(rt)
    assert all(torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())


# ---------------------------------------------------------------------------------------------
# the FC2 guard
# ---------------------------------------------------------------------------------------------

def _dispatcher(tmp_path):
    from h3_blackwell.runtime.fc2.ext import ExtStatus
    from h3_blackwell.runtime.fc2.dispatcher import Fc2Dispatcher
    from h3_blackwell.runtime.fc2.lt_plans import LtPlanLayer
    from h3_blackwell.runtime.fc2.table import Fc2Table, GB10_CANONICAL

    cache = str(tmp_path / "cache")
    layer = LtPlanLayer(cache, ExtStatus(ok=False, reason="extension not built in this CPU test"))
    return Fc2Dispatcher(cache, table=Fc2Table([GB10_CANONICAL]), plan_layer=layer, compat=False)


def test_fc2_guard_refuses_while_a_side_lora_is_on_fc2(files, fp4, tmp_path):
    """With a side-path LoRA on fc2 the guarded dispatcher refuses the cuBLASLt path on every FC2 call
    (blocks x steps) with the reason 'lora: LoRA side-path active on fc2', falls back, and the run report's
    counters show it; merged or removed, the refusal is no longer the LoRA's."""
    path, truth = files["comfy"]
    ops = fp4.ops.base
    d = _dispatcher(tmp_path)
    fp4.fc2, ops.fc2_dispatcher = d, d
    try:
        text, video, audio = torch.randn(1, 6, 5120), torch.zeros(1, 24, 2, 4, 4), torch.zeros(1, 32, 2, 4)
        rep = L.apply_loras(fp4, [(path, 1.0, "side")])
        assert rep["fc2_side"] == [f"blocks.{i}.mlp.fc2" for i in range(TINY.num_layers)]
        assert "lora: LoRA side-path active on fc2" in rep["fc2_guard"]
        res = sample(fp4, text, None, video, audio, seed=3, steps=2)
        f = res.report["fc2_dispatch"]
        n = TINY.num_layers * 2
        assert f["required_per_run"] == n and f["runs"] == [{"attempts": n, "successes": 0, "fallbacks": n,
                                                                   "direct_calls": 0}]
        assert f["consistent_with_configuration"] is True  # every call attempted, each one a fallback
        reasons = f["lifetime"]["reasons"]
        assert sum(reasons.values()) == n and all(r.startswith("lora: LoRA side-path active on fc2") for r in reasons)
        assert "FC2 cuBLASLt path refused" in res.report["backends"]["lora"]["reason"]
        L.apply_loras(fp4, [(path, 1.0, "merge")])  # merged: no side path, the guard goes on to other checks
        sample(fp4, text, None, video, audio, seed=3, steps=1)
        new = {k: v for k, v in d.total["reasons"].items() if not k.startswith("lora:")}
        assert sum(new.values()) == TINY.num_layers and d.total["reasons"] != reasons
    finally:
        L.remove_loras(fp4)
        fp4.fc2, ops.fc2_dispatcher = None, None
    assert _sides(fp4)[2] is None  # removed: no side path left on fc2


# ---------------------------------------------------------------------------------------------
# the node and the CLI
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def fake_folder_paths(monkeypatch, files):
    fp = types.ModuleType("folder_paths")
    names = {f"{k}.safetensors": str(v[0]) for k, v in files.items()}
    fp.get_filename_list = lambda key: sorted(names) if key == "loras" else []
    fp.get_full_path = lambda key, name: names.get(name) if key == "loras" else None
    fp.get_folder_paths = lambda key: ["/models/loras"]
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    return names


def test_lora_node_stacks_and_syncs_the_resident_model(fake_folder_paths, files, d32):
    from h3_blackwell.nodes import NODE_CLASS_MAPPINGS
    from h3_blackwell.nodes._common import H3NodeError
    from h3_blackwell.nodes.lora import H3LoRA

    assert NODE_CLASS_MAPPINGS["H3B_LoRA"] is H3LoRA
    spec = H3LoRA.INPUT_TYPES()["required"]
    assert spec["model"][0] == "H3_MODEL" and spec["mode"][0] == ["merge", "side"]
    assert "comfy.safetensors" in spec["lora_name"][0] and H3LoRA.RETURN_TYPES == ("H3_MODEL",)
    node = H3LoRA()
    before = _sd(d32)
    (one,) = node.apply(d32, "comfy.safetensors", 0.5, "merge")
    (two,) = node.apply(one, "diffusers.safetensors", 0.25, "side")
    assert [s.mode for s in two.lora_stack] == ["merge", "side"] and two.config is d32.config
    assert [e["file"] for e in L.lora_report(d32)["loras"]] == ["comfy.safetensors", "diffusers.safetensors"]
    one.sync()  # another graph's output is used: the resident model now carries only its LoRA ...
    res = sample(two, torch.randn(1, 5, 5120), None, torch.zeros(1, 24, 2, 4, 4), torch.zeros(1, 32, 2, 4), seed=1,
                 steps=1)  # ... and the sampler, given the chained output, gets both again
    assert res.report["backends"]["lora"]["choice"] == "merge+side" and "H3 model" in two.describe()
    one.sync()  # the first node's output is used again: the resident model carries only its LoRA
    assert [e["file"] for e in L.lora_report(d32)["loras"]] == ["comfy.safetensors"]
    assert not any(L.side_active(m) for m in d32.model.modules())
    with pytest.raises(H3NodeError, match="H3 LoRA: .*not found in loras"):
        node.apply(d32, "missing.safetensors", 1.0, "merge")
    L.sync_loras(d32)  # the plain loader output: no LoRA
    assert L.lora_report(d32) is None
    assert all(torch.equal(v, before[k]) for k, v in d32.model.state_dict().items())


def test_cli_generate_with_lora(files, tmp_path, capsys):
    from h3_blackwell.cli import main as cli

    path, _ = files["diffusers"]
    out = tmp_path / "run"
    args = ["generate", "--output", str(out), "--steps", "1", "--width", "64", "--height", "64", "--frames", "5",
            "--device", "cpu", "--lora", f"{path}:0.8:side", "--lora", f"{files['comfy'][0]}:0.5"]
    assert cli.main(args) == 0
    rep = json.loads((out / "report.json").read_text())
    lo = rep["backends"]["lora"]
    assert lo["choice"] == "merge+side" and [e["mode"] for e in lo["report"]["loras"]] == ["side", "merge"]
    assert "lora" in capsys.readouterr().err
    assert cli.main(["generate", "--output", str(tmp_path / "x"), "--lora", "nope.safetensors:1"]) == 2
    assert "LoRA file not found" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merged_weight_into_equals_the_cast_of_the_fp32_merge(dtype):
    """``merged_weight(..., into=w)`` (in place, each chunk cast where the math runs) gives the bytes of the fp32
    merge cast to w's dtype, across row chunks and with a low-rank and a diff update on overlapping rows."""
    from h3_blackwell.runtime.lora.key_forms import LoraUpdate
    from h3_blackwell.runtime.lora.merge import _ROW_CHUNK, merged_weight

    g = torch.Generator().manual_seed(4)
    n, k, r = _ROW_CHUNK * 2 + 37, 48, 5
    w0 = torch.randn(n, k, generator=g).to(dtype)
    low = LoraUpdate("m", "lowrank", (3, n - 2), (), down=torch.randn(r, k, generator=g),
                     up=torch.randn(n - 5, r, generator=g), alpha=2.0)
    diff = LoraUpdate("m", "diff", (_ROW_CHUNK - 4, _ROW_CHUNK + 9), (), delta=torch.randn(13, k, generator=g))
    entries = [(0.7, low), (-0.3, diff)]
    # the contract's reference, whole-tensor in float64 (rank 5: each entry's product is one short dot, summed in the
    # same order whatever rows a chunk holds, so the rounded results are equal)
    ref = w0.double()
    ref[3:n - 2] += (low.up.double() @ low.down.double()) * (0.7 * low.unit_scale)
    ref[_ROW_CHUNK - 4:_ROW_CHUNK + 9] += diff.delta.double() * -0.3
    assert torch.equal(merged_weight(w0, entries), ref.float())
    want = merged_weight(w0, entries).to(dtype)
    w = w0.clone()
    assert merged_weight(w, entries, into=w) is w
    assert torch.equal(w, want) and not torch.equal(w, w0)
