"""The Hopper W4A8 path on the CPU: e4m3-rowwise producers (Triton under TRITON_INTERPRET=1 vs the torch
references, byte for byte), ``Nvfp4Linear.forward_fp8``, and the W4A8 block of the stack against an explicit
float64 block written here; W4A8 is no less accurate than W4A4 on the tiny model.

Bit-exactness covers both tilings (``loop``: several K tiles per row, K not a multiple of the tile, rows not a
multiple of the row block; ``row``: one padded tile per row), rows of very different magnitudes, all-zero and
all-(-0) rows (row scale 1, codes +-0), rows too small for a normal scale, and exact e4m3 rounding ties. The
full canonical widths run on the GPU in tests/gpu/test_fp8_producers_gpu.py.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from h3_blackwell.runtime import RuntimeOptions, load_model  # noqa: E402
from h3_blackwell.runtime.lora.ops import LoraOps  # noqa: E402
from h3_blackwell.runtime.lora.side import LoraSide  # noqa: E402
from h3_blackwell.runtime.ops import fp8_producers as f8  # noqa: E402
from h3_blackwell.runtime.ops import linear as L  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4_producers as qk  # noqa: E402
from h3_blackwell.runtime.ops import reference as R  # noqa: E402
from refblock import reference_block  # noqa: E402  (tests/refblock.py)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU = dict(device="cpu", dtype="float32")
SCHEMES = ["loop", "row"]


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _magnitudes(x, seed):
    """Rows spread over ~2^-60 .. 2^40 (fp16: 2^-20 .. 2^10), one all-zero row, one all -0 row, one row below a normal scale."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-20, 10) if x.dtype == torch.float16 else (-60, 40)  # finite inputs (fp16 tops out at 65504)
    e = torch.randint(lo, hi, (x.shape[0], 1), generator=g).float()
    y = (x.float().cpu() * torch.exp2(e)).to(x.dtype)
    y[1] = 0.0
    if x.shape[0] > 2:
        y[2] = -0.0
    if x.shape[0] > 3 and x.dtype != torch.float16:  # amax / 448 subnormal in fp32 -> row scale 1, codes 0
        y[3] = (x[3].float().cpu().sign() * 1e-37).to(x.dtype)
    return y.to(x.device)


def _same(got, ref):
    (q, r), (q0, r0) = got, ref
    assert q.dtype == torch.float8_e4m3fn and q.shape == q0.shape and r.shape == r0.shape == (q.shape[0],)
    assert torch.equal(r, r0), f"row scales differ in {(r != r0).sum()} rows"
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), \
        f"{(q.view(torch.uint8) != q0.view(torch.uint8)).sum()} e4m3 codes differ"


def _check_definition(y, q, r):
    """Properties the reference promises: scale > 0 and normal; each element rounded once, to nearest."""
    y = y.double().cpu()
    q, r = q.cpu(), r.cpu().double()
    assert (r > 0).all() and torch.isfinite(r).all() and (r >= 2.0 ** -126).all()
    amax = y.abs().amax(1)
    small = amax < 448 * 2.0 ** -126
    assert (r[small] == 1).all() and (q[small].view(torch.uint8) & 0x7F == 0).all()
    deq = q.double() * r[:, None]
    err = (deq - y).abs()
    # one rounding of y / r (itself within 2^-24 relative) to e4m3: half an ulp, 2^-4 relative in the
    # normal range, 2^-10 * r absolute below 2^-6 * r
    bound = torch.maximum(2.0 ** -4 * y.abs(), 2.0 ** -10 * r[:, None]) * (1 + 2.0 ** -20)
    assert (err <= bound).all(), float((err - bound).max())
    big = ~small & (amax > 0)
    assert (q.double().abs().amax(1)[big] == 448).all()  # each row's largest element lands on 448


QSHAPES = [(37, 200, torch.bfloat16), (130, 48, torch.float16), (5, 96, torch.float32), (9, 17, torch.bfloat16)]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("s, k, dtype", QSHAPES)
def test_quantize_fp8_bit_exact(s, k, dtype, scheme):
    x = _magnitudes(_rand((s, k), dtype, seed=s + k, scale=3.0), seed=k)
    ref = f8.quantize_fp8(x, backend="reference")
    _same(f8.quantize_fp8(x, backend="triton", scheme=scheme), ref)
    _check_definition(x.float(), *ref)


def test_e4m3_ties_round_to_even():
    """Row amax 448 gives row scale exactly 1, so these values are the quotients themselves: exact midpoints
    between neighbouring e4m3 values, normal and subnormal, must round to the even code."""
    vals = [448.0, 1.0625, 1.1875, 232.0, 208.0, 0.017578125, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10,
            -1.0625, -3 * 2.0 ** -10, -(2.0 ** -10), 0.0, 2.0 ** -6 - 2.0 ** -10, 15 * 2.0 ** -10]
    want = [448.0, 1.0, 1.25, 224.0, 208.0, 0.017578125, 0.0, 2.0 ** -8, 2.0 ** -8, -1.0, -(2.0 ** -8), -0.0, 0.0,
            2.0 ** -6, 2.0 ** -6]
    x = torch.tensor([vals, [v / 2 for v in vals]], dtype=torch.float32, device=DEV)  # row 2: scale 0.5
    for scheme in SCHEMES:
        q, r = f8.quantize_fp8(x, backend="triton", scheme=scheme)
        assert r.tolist() == [1.0, 0.5]
        assert q.float()[0].tolist() == want and q.float()[1].tolist() == want
        assert (q.view(torch.uint8)[0, 11] == 0x80).item()  # -2^-10 rounds to -0
        _same((q, r), f8.quantize_fp8(x, backend="reference"))


SEGS = {37: [(0, 5, 2), (5, 20, 0), (20, 37, 5)], 130: [(0, 130, 1)], 5: [(0, 1, 3), (1, 5, 4)],
        9: [(0, 2, 0), (2, 3, 3), (3, 9, 1)]}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("s, k, dtype", QSHAPES)
def test_rms_modulate_fp8_bit_exact(s, k, dtype, scheme):
    x = _rand((s, k), dtype, seed=2 * s + k, scale=2.0)
    x[1] = 0.0  # with a zero shift row below: an all-zero h row
    tdt = torch.float32 if dtype == torch.float32 else torch.bfloat16
    weight = None if dtype == torch.float16 else _rand((k,), dtype, seed=3) + 1.0
    scale_rows = _rand((6, k), tdt, seed=4, scale=0.3)
    shift_rows = _rand((6, k), tdt, seed=5, scale=0.3)
    shift_rows[3] = 0.0
    shift_rows[2] *= 1e4  # very different magnitudes per segment
    scale_rows[2] *= 50
    segs = [(0, 1, 2), (1, 2, 3), (2, s, 0)] if s in (37, 9) else SEGS[s]
    args = (x, weight, f8.Modulation(scale_rows, shift_rows, segs), 1e-5)
    ref = f8.rms_modulate_fp8(*args, backend="reference")
    _same(f8.rms_modulate_fp8(*args, backend="triton", scheme=scheme), ref)
    h = R.rms_modulate_reference(x, weight, scale_rows, shift_rows, segs, 1e-5)
    _check_definition(h, *ref)
    if len(segs) > 1 and segs[1] == (1, 2, 3):
        assert ref[1][1].item() == 1.0 and (ref[0][1].view(torch.uint8) == 0).all()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("s, f, dtype", [(37, 96, torch.bfloat16), (130, 40, torch.float32), (3, 64, torch.float16),
                                         (5, 33, torch.float32)])
def test_swiglu_fp8_bit_exact(s, f, dtype, scheme):
    h = _rand((s, 2 * f), dtype, seed=s * f, scale=4.0)
    h[0, :8] = torch.tensor([-100.0, -85.0, -30.0, 30.0, 85.0, 100.0, 0.0, -0.0], dtype=dtype)  # exp clamps
    h[1, :f] = 0.0  # silu(0) = 0: an all-zero row
    if s > 2:
        h[2, f:] *= 1e-3 if dtype == torch.float16 else 1e-20  # a row far below the others
    ref = f8.swiglu_fp8(h, backend="reference")
    _same(f8.swiglu_fp8(h, backend="triton", scheme=scheme), ref)
    _check_definition(R.swiglu_reference(h), *ref)
    assert ref[1][1].item() == 1.0


def test_producers_reject_bad_inputs():
    with pytest.raises(ValueError):
        f8.swiglu_fp8(torch.zeros(3, 5))
    with pytest.raises(ValueError):
        f8.quantize_fp8(torch.zeros(3, 8), scheme="tiles")
    q, r = f8.quantize_fp8(torch.zeros(0, 16, device=DEV), backend="triton")
    assert q.shape == (0, 16) and r.shape == (0,)


# ----------------------------------------------------------------------------------------------
# measured tile tables (bench/producers_h200.py --tiles-out -> H3_PRODUCER_TILES)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cand", [("row", 2, 128, 1, 4), ("loop", 4, 32, 3, 2), ("loop", 1, 16, 5, 1)])
def test_any_tile_configuration_writes_the_same_bytes(monkeypatch, cand):
    """A tile table only changes speed: other row blocks / tile widths (including ones the bench sweeps)
    give the reference's bytes (K=70: not a multiple of any tile)."""
    monkeypatch.setattr(f8, "_tiles", lambda op, k, device, scheme, tiles: cand)
    x = _magnitudes(_rand((9, 70), torch.bfloat16, 11), 12)
    _same(f8.quantize_fp8(x, backend="triton"), f8.quantize_fp8(x, backend="reference"))
    h = _rand((9, 140), torch.bfloat16, 13, 3.0)
    _same(f8.swiglu_fp8(h, backend="triton"), f8.swiglu_fp8(h, backend="reference"))


def test_tile_table_is_used_for_auto_on_cuda_only(tmp_path):
    """The load plan reads a table once (ProducerTiles.load); the producers take it as their ``tiles`` argument:
    nothing global, so a table reaches exactly the ops bound with it."""
    from h3_blackwell.runtime.errors import H3Error
    from h3_blackwell.runtime.ops.producer_tiles import ProducerTiles

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    builtin = f8._tiles("rms", 5376, cuda, "auto", None)
    builtin_fp8 = qk._tiles(cuda)["fp8"]
    assert builtin == ("row", 1, 8192, 1, 4)  # the H200 sweep's choice (bench/results/producers-h200.json)
    p = tmp_path / "tiles.json"
    p.write_text('{"device": "NVIDIA H200", "rms": ["row", 1, 8192, 16], "swiglu": ["loop", 8, 512, 4], '
                 '"to_fp8_rowwise": [8, 512, 4]}')
    t = ProducerTiles.load(p)
    assert t.device == "NVIDIA H200" and t.source == str(p)
    assert t.entries() == {"rms": ["row", 1, 8192, 16], "swiglu": ["loop", 8, 512, 4], "to_fp8_rowwise": [8, 512, 4]}
    assert f8._tiles("rms", 5376, cuda, "auto", t) == ("row", 1, 8192, 1, 16)
    assert f8._tiles("swiglu", 14336, cuda, "auto", t) == ("loop", 8, 512, 28, 4)
    assert f8._tiles("rms", 5376, cuda, "loop", t) != ("row", 1, 8192, 1, 16)  # an explicit scheme wins
    assert f8._tiles("rms", 5376, cpu, "auto", t)[0] == "loop"  # CPU keeps its own tiles
    assert qk._tiles(cuda, t.to_fp8_rowwise)["fp8"] == (8, 512, 4)
    for bad, word in (('{"rms": ["row", 1, 8000, 16]}', "powers of two"), ('[1, 2]', "JSON object"),
                      ('{"to_fp8_rowwise": [8, 32, 4]}', "BK >= 64"), ("{", "Expecting")):
        p.write_text(bad)
        with pytest.raises(H3Error, match=word):
            ProducerTiles.load(p)
    with pytest.raises(H3Error, match="(?i)no such file.*--tiles-out"):
        ProducerTiles.load(tmp_path / "missing.json")
    assert f8._tiles("rms", 5376, cuda, "auto", None) == builtin and qk._tiles(cuda)["fp8"] == builtin_fp8


# ----------------------------------------------------------------------------------------------
# the GEMM
# ----------------------------------------------------------------------------------------------

def test_forward_fp8_is_the_rowwise_product():
    m, n, k = 33, 48, 160
    lin = L.Nvfp4Linear.from_float(_rand((n, k), torch.float32, seed=1), backend="fp8", out_dtype=torch.float32,
                                   bias=_rand((n,), torch.float32, seed=9))
    x = _magnitudes(_rand((m, k), torch.float32, seed=2, scale=3.0), seed=5)
    a8, ra = f8.quantize_fp8(x)
    y = lin.forward_fp8(a8, ra)
    w8, rw = R.to_fp8_rowwise_reference(lin.weight)
    a64 = a8.double() * ra.double()[:, None]
    w64 = w8.double() * (rw.double() * lin.global_scale.double())[:, None]
    ref = a64 @ w64.T + lin.bias.double()
    bound = (k + 4) * 2.0 ** -24 * (a64.abs() @ w64.abs().T + lin.bias.double().abs())
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="fp8 GEMM backend"):
        L.Nvfp4Linear.from_float(_rand((n, k), torch.float32, seed=1), backend="reference").forward_fp8(a8, ra)
    with pytest.raises(ValueError):
        lin.forward_fp8(a8, ra[:-1])


# ----------------------------------------------------------------------------------------------
# the W4A8 block
# ----------------------------------------------------------------------------------------------

class _Act:
    """The reference's activation path, checked against the codes the stack actually fed each GEMM.

    For the fp64 activation y of the formulas and the stack's (a8, row_scale) of the same GEMM input:
    row_scale must be amax(|y|) / 448 up to fp32 noise, and every code must be e4m3_rne(y / row_scale)
    computed here -- except where y / row_scale lies within the fp32 error of y (below) of a rounding midpoint
    (the stack's fp32 value and this fp64 value may then legitimately round to the two neighbours) or the
    value is zero (its sign). Those ambiguous codes must be few and one step apart. The dequantized
    activation is then a8 * row_scale: the block's remaining differences are fp32 vs fp64 arithmetic only.
    """

    def __init__(self):
        self.fed = []
        self.used = 0
        self.ambiguous = 0

    def record(self, lin, a8, ra):
        self.fed.append((a8.clone(), ra.clone()))

    def __call__(self, y):
        a8, ra = self.fed[self.used]
        self.used += 1
        y = y.double()
        r64 = y.abs().amax(1) / 448
        assert ((ra.double() - r64).abs() <= 2e-6 * r64).all()
        qd = y / ra.double()[:, None]
        want = qd.clamp(-448, 448).to(torch.float8_e4m3fn)  # one rounding (fp64 -> e4m3) of the fp64 quotient
        got = a8
        diff = want.view(torch.uint8) != got.view(torch.uint8)
        if diff.any():
            g, w, v = got.double()[diff], want.double()[diff], qd[diff]
            zero = (g == 0) & (w == 0)
            step = (g - w).abs()
            # How far the stack's fp32 quotient may sit from this fp64 one: y comes out of fp32 GEMMs, norms and
            # attention (K <= 160 products, softmax sums), whose rounding is ~K u of the row's magnitudes, and
            # the row's amax is 448 here. That depends on the BLAS's summation order (MKL's AVX2 kernels put a
            # code 1.1 % of a spacing from a midpoint, AVX-512 within 1 %), so the window is a stated bound,
            # not one machine's error: 1 % of the spacing or 256 u * 448 (~7e-3), whichever is larger.
            near_mid = (v - (g + w) / 2).abs() <= torch.clamp(0.01 * step, min=256 * 2.0 ** -24 * 448)
            adjacent = (got.view(torch.uint8)[diff].int() - want.view(torch.uint8)[diff].int()).abs() == 1
            assert (zero | (near_mid & adjacent)).all(), list(zip(v[~(zero | near_mid)].tolist(),
                                                                  g[~(zero | near_mid)].tolist()))
            assert int(diff.sum()) <= max(2, diff.numel() // 500), int(diff.sum())
            self.ambiguous += int(diff.sum())
        return got.double() * ra.double()[:, None]


def _inputs(m, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g),
            torch.randn(1, 7, 5120, generator=g))


def _w4a8(seed):
    rt = load_model(None, RuntimeOptions(**CPU, gemm="fp8", act_format="fp8"), tiny_seed=seed)
    assert rt.ops.name == "w4a8" and rt.plan.act_format == "fp8"
    return rt


@pytest.mark.parametrize("seed", [3, 5, 7])
def test_w4a8_block_equals_float64_reference(monkeypatch, seed):
    act = _Act()
    real = L.Nvfp4Linear.forward_fp8
    monkeypatch.setattr(L.Nvfp4Linear, "forward_fp8", lambda self, a8, ra, **kw: act.record(self, a8, ra) or
                        real(self, a8, ra, **kw))
    rt = _w4a8(seed)
    m = rt.model
    video, audio, text = _inputs(m, 0)
    plan = m.plan(text, tuple(video.shape), tuple(audio.shape), [0.7], token_tags=torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    x = m.pack(plan, video, audio)
    segs = plan.times[0].mod_segments
    for i, blk in enumerate(m.blocks):
        wq = {}
        for p, n in (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2")):
            lin = getattr(getattr(blk, p), n)
            w8, rw = R.to_fp8_rowwise_reference(lin.weight)
            wq[n] = w8.double() * (rw.double() * lin.global_scale.double())[:, None]
        mod = plan.mods[0][i]
        got = blk(x.clone(), mod, segs, plan.cos, plan.sin, rt.ops, i)
        expect = reference_block(blk, x, mod, segs, plan.cos, plan.sin, m.cfg, wq, act)
        assert act.used == len(act.fed) == 4 * (i + 1)  # qkv, out_proj, fc1, fc2: each input checked
        # The same e4m3 codes on both sides (checked by act); what differs is fp32 (stack) vs fp64 (here)
        # arithmetic in norms, attention and the fp32 GEMM accumulation (measured ~1e-6 on the block's
        # update). A wrong code (not a boundary case) would show as >~1e-4 on the update.
        upd = float(((got.double() - x.double()) - (expect - x.double())).norm() / (expect - x.double()).norm())
        assert upd < 1e-5, (i, upd)
        x = got
    assert rt.ops.fc2_direct_calls == len(m.blocks)
    assert act.ambiguous <= 8  # boundary cases over the 12 GEMM inputs (measured: 0-2)


def test_w4a8_no_less_accurate_than_w4a4_and_fc2_lt_not_applicable():
    """Against the dense fp32 model on the same weights: W4A8 (e4m3 rowwise activations) <= W4A4 (NVFP4
    activations), both with NVFP4 weights through the same fp8 GEMM backend. FC2 in W4A8 never reaches the
    dispatcher (its counters stay honest) and the stack says why."""
    dense = load_model(None, RuntimeOptions(**CPU, quantize=False), tiny_seed=2).model
    w4a4 = load_model(None, RuntimeOptions(**CPU, gemm="fp8", act_format="nvfp4"), tiny_seed=2)
    w4a8 = _w4a8(2)
    assert w4a4.ops.name == "nvfp4"
    calls = []

    class Dispatcher:
        def __call__(self, ops, fallback, **kw):
            calls.append(1)
            return fallback(None)

    w4a4.ops.base.fc2_dispatcher = Dispatcher()  # W4A4 goes through it; W4A8 has none to call
    args = (*_inputs(None, 1), 0.6)
    dv, da = dense(*args)
    errs = {}
    for name, r in (("w4a4", w4a4), ("w4a8", w4a8)):
        qv, qa = r.model(*args, ops=r.ops)
        errs[name] = float(torch.cat([(qv - dv).flatten(), (qa - da).flatten()]).norm()
                           / torch.cat([dv.flatten(), da.flatten()]).norm())
    assert 0 < errs["w4a8"] <= errs["w4a4"], errs
    assert len(calls) == len(w4a4.model.blocks)  # W4A4 only
    st = w4a8.ops.status()
    assert st["lt_path"] == "not applicable (act_format fp8)" and st["direct_calls"] == len(w4a8.model.blocks)
    assert w4a8.plan.choices["fc2_lt"].choice == "not applicable (act_format fp8)"


def test_act_format_option_and_refusal():
    """The plan resolves the activation format once: fp8 where the block linears run the fp8 GEMM backend,
    nvfp4 elsewhere, never an error; an explicit fp8 that cannot run says why."""
    assert RuntimeOptions().act_format == "auto"
    auto8 = load_model(None, RuntimeOptions(**CPU, gemm="fp8"), tiny_seed=1)
    assert auto8.ops.name == "w4a8" and auto8.backends["act_format"]["reason"].startswith("auto: fp8 (W4A8)")
    auto4 = load_model(None, RuntimeOptions(**CPU), tiny_seed=1)  # CPU auto gemm: emulated
    assert auto4.ops.name == "nvfp4" and auto4.backends["act_format"]["reason"].startswith("nvfp4")
    assert "the block linears run emulated" in auto4.backends["act_format"]["reason"]
    assert RuntimeOptions.from_env({"H3_ACT_FORMAT": "fp8"}).act_format == "fp8"
    assert RuntimeOptions(act_format="fp8").as_env()["H3_ACT_FORMAT"] == "fp8"
    with pytest.raises(ValueError):
        RuntimeOptions(act_format="int8")
    asked = load_model(None, RuntimeOptions(**CPU, act_format="fp8"), tiny_seed=1)
    got = asked.backends["act_format"]
    assert got["choice"] == "nvfp4" and "needs the fp8 GEMM backend" in got["reason"]
    assert asked.ops.name == "nvfp4"


def test_w4a8_out_proj_side_path_is_added():
    """A LoRA side path on out_proj (the LoraOps wrapper around the W4A8 ops) reaches the W4A8 block, which calls
    forward_fp8 rather than the module, with o before any pre_quant_scale."""
    rt = _w4a8(4)
    m = rt.model
    seen = []

    class Spy(LoraSide):
        def add_(self, x, y):
            seen.append((tuple(x.shape), tuple(y.shape)))
            y.add_(1.0)
            return y

    blk = m.blocks[0]
    lin = blk.attn.out_proj
    side = Spy("blocks.0.attn.out_proj", lin.in_features, lin.out_features, torch.float32, torch.device("cpu"))
    side.terms.append(object())  # active
    video, audio, text = _inputs(m, 0)
    plan = m.plan(text, tuple(video.shape), tuple(audio.shape), [0.5])
    x = m.pack(plan, video, audio)
    segs = plan.times[0].mod_segments
    base = blk(x.clone(), plan.mods[0][0], segs, plan.cos, plan.sin, rt.ops, 0)
    ops = LoraOps(rt.ops, {"blocks.0.attn.out_proj": side})
    got = blk(x.clone(), plan.mods[0][0], segs, plan.cos, plan.sin, ops, 0)
    s = x.shape[0]
    assert seen == [((s, lin.in_features), (s, lin.out_features))]
    assert not torch.equal(got, base)


def test_fc2_counts_for_w4a8():
    """The run report's FC2 consistency for W4A8: FC2 runs its layer directly (n blocks x 2 evaluations per run),
    the dispatcher is never attempted. (bench/canonical.py's accuracy stage: bench/cpu_selfcheck.py.)"""
    from fixtures.sampling import sample

    rt = _w4a8(6)
    m = rt.model
    video, audio, text = _inputs(m, 0)
    f = sample(rt, text, None, video, audio, seed=1, steps=2, runs=2).report["fc2_dispatch"]
    n = len(m.blocks) * 2
    assert [x["direct_calls"] for x in f["runs"]] == [n, n] and {x["attempts"] for x in f["runs"]} == {0}
    assert f["consistent_with_configuration"] is True and "direct FC2 calls" in f["expected"]


# ----------------------------------------------------------------------------------------------
# V operands for SageAttention2's sm_90 kernel (the fused V handling)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("s,h,d", [(200, 2, 128), (37, 3, 64), (128, 1, 64), (1, 2, 128)])
def test_sage_v_fp8_bit_exact_and_layout(s, h, d):
    """Triton (interpreted) == torch reference byte for byte, on the strided V third of a qkv buffer with
    channels of very different magnitudes and one all-zero channel (scale 1, codes 0); and the layout is what
    the sm_90 kernel reads: [1, D, H, roundup(S, 128)], each 16 tokens in SAGE_V_PERM order, zero past S,
    every element within half an e4m3 step of its input."""
    g = torch.Generator().manual_seed(s + h)
    qkv = torch.randn(s, 3 * h * d, generator=g) * torch.exp2(torch.randint(-30, 30, (1, 3 * h * d), generator=g).float())
    qkv[:, 2 * h * d + 5] = 0.0  # channel (h=0, d=5) of V all zero
    qkv = qkv.bfloat16().to(DEV)
    v = qkv.unflatten(1, (3, h, d))[:, 2].unsqueeze(0)
    got = f8.sage_v_fp8(v, backend="triton")
    ref = f8.sage_v_fp8_reference(v)
    assert torch.equal(got[1], ref[1])
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
    rows = -(-s // 128) * 128
    assert got[0].shape == (1, d, h, rows) and got[1].shape == (1, h, d)
    assert got[1][0, 0, 5].item() == 1.0 and not got[0][0, 5, 0].float().any()
    perm = (torch.arange(rows) // 16) * 16 + torch.tensor(f8.SAGE_V_PERM).repeat(rows // 16)
    deq = got[0][0].float().cpu().permute(2, 1, 0) * got[1][0].cpu()
    back = torch.empty_like(deq)
    back[perm] = deq
    x = v[0].float().cpu()
    assert not back[s:].any()
    assert ((back[:s] - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, got[1][0].cpu() * 2.0 ** -9)).all()


def test_precision_option_reaches_the_w4a8_linears_and_the_silu():
    """RuntimeOptions.precision: "fast" (the default) asks every W4A8 GEMM for fast fp8 accumulation (forward_fp8
    passes it to cuBLAS on CUDA) and the SwiGLU producer for the fast silu; "exact" for neither; the backends
    say which."""
    from h3_blackwell.runtime.ops import linear as lin_mod
    from h3_blackwell.runtime.ops.gemm_backends import scaled_mm_rowwise

    assert RuntimeOptions().precision == "fast"
    real = lin_mod.scaled_mm_rowwise
    for mode in ("exact", "fast"):
        rt = load_model(None, RuntimeOptions(**CPU, gemm="fp8", precision=mode), tiny_seed=1)
        assert rt.ops.base.silu == mode and rt.ops.base.fast_accum == (mode == "fast")
        seen = []

        def spy(*a, fast_accum=False, **kw):
            seen.append(fast_accum)
            return real(*a, fast_accum=fast_accum, **kw)

        lin_mod.scaled_mm_rowwise = spy
        try:
            rt.model(*_inputs(None, 1), 0.6, ops=rt.ops)
        finally:
            lin_mod.scaled_mm_rowwise = real
        assert len(seen) == 4 * len(rt.model.blocks)  # qkv, out_proj, fc1, fc2 of every block
        assert set(seen) == {mode == "fast"} and rt.backends["precision"]["choice"] == mode
    # the CPU product: exact e4m3 products, fp32 accumulation, scales on the sums
    g = torch.Generator().manual_seed(0)
    a8 = (torch.randn(5, 48, generator=g) * 30).to(torch.float8_e4m3fn)
    w8 = (torch.randn(7, 48, generator=g) * 30).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(5, 1, generator=g) + 0.5, torch.rand(1, 7, generator=g) + 0.5
    want = (a8.double() @ w8.double().t()) * sa.double() * sb.double()
    got = scaled_mm_rowwise(a8, w8, sa, sb, torch.float32).double()
    assert ((got - want).abs() <= 48 * 2.0 ** -22 * ((a8.double().abs() @ w8.double().abs().t()) * sa * sb)).all()


def _within_one_step(got, ref, max_frac):
    """Row scales within a few fp32 ulp; codes equal except a few one step apart (or +-0)."""
    (q, r), (q0, r0) = got, ref
    assert ((r.double() - r0.double()).abs() <= 8 * 2.0 ** -23 * r0.double().abs()).all()
    a, b = q.view(torch.uint8).int(), q0.view(torch.uint8).int()
    diff = a != b
    zero = ((a & 0x7F) == 0) & ((b & 0x7F) == 0)
    step = ((a - b).abs() == 1) & ((a & 0x80) == (b & 0x80))
    assert (zero | step | ~diff).all()
    assert int(diff.sum()) <= max(2, int(max_frac * diff.numel())), int(diff.sum())
    return int(diff.sum())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_swiglu_fp8_fast_silu_within_one_step(scheme):
    """silu="fast" (hardware exp2, approximate division on the GPU; numpy's under the interpreter) is not the
    reference's bit pattern, but every code is the reference's or one e4m3 step from it, and only a few
    (values within a few ulp of a rounding midpoint) move; the exact path is unaffected."""
    h = _rand((37, 2 * 300), torch.bfloat16, 21, 4.0)
    ref = f8.swiglu_fp8(h, backend="reference")
    n = _within_one_step(f8.swiglu_fp8(h, backend="triton", scheme=scheme, silu="fast"), ref, 1e-3)
    _same(f8.swiglu_fp8(h, backend="triton", scheme=scheme, silu="exact"), ref)
    with pytest.raises(ValueError, match="silu"):
        f8.swiglu_fp8(h, silu="approx")
    assert n <= 11  # 1e-3 of 11100 codes
