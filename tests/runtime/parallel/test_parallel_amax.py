"""W4A4's dynamic activation scales under sequence parallelism: the NVFP4 producers take the amax through an
optional reduction, the ranks all-reduce it (MAX, runtime.parallel.amax), and a rank's rows then quantize to the
single-process bytes. Producers and Nvfp4Ops on 2 gloo ranks against one process; the binding in sharded_ops
(no processes). The whole runs are in tests/runtime/parallel/test_parallel_generate.py."""

import types

import pytest
import torch
import torch.distributed as dist

from h3_blackwell.runtime.lora.ops import LoraOps
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.ops import nvfp4, nvfp4_producers, reference
from h3_blackwell.runtime.ops.block_ops import Nvfp4Ops, W4A8Ops
from h3_blackwell.runtime.ops.linear import Nvfp4Linear
from h3_blackwell.runtime.ops.nvfp4_producers import Modulation
from h3_blackwell.runtime.ops.reference import ReferenceOps
from h3_blackwell.runtime.ops.stream_ops import StreamOps
from h3_blackwell.runtime.parallel import AmaxAllReduce, CommStats, RowShard, launch
from h3_blackwell.runtime.parallel.evaluate import numerics, sharded_ops

S, K, F = 37, 64, 48  # 37 rows over 2 ranks: 19 + 18
SEGS = [(0, 9, 0), (9, 25, 1), (25, 37, 2)]  # the middle segment straddles the rank boundary at 19


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs():
    """Random rows whose amax sits on different ranks per tensor: rows of x grow towards the tail and the last
    segment's modulation scale is the largest (rank 1's amax, also after the RMSNorm), rows of h shrink (rank
    0's), so a rank-local amax changes the bytes of the other rank's rows."""
    grow = torch.linspace(0.5, 4.0, S).unsqueeze(1)
    x = _randn(1, S, K) * grow
    h = _randn(2, S, 2 * F) * grow.flip(0)
    scale, shift = _randn(3, 3, K) * 0.1, _randn(4, 3, K) * 0.1
    scale[2] += 2.0
    return x, h, _randn(5, K).abs() + 0.5, scale, shift


def _deq(q):
    return nvfp4.dequantize(q, torch.float64)  # exact v * s * g, [rows, K]


def _producers_on_ranks(ctx):
    x, h, w, scale, shift = _inputs()
    shard = RowShard(S, ctx.world_size, ctx.rank)
    a, b = shard.start, shard.stop
    stats = CommStats()
    red = AmaxAllReduce(None, stats)
    eps = TINY.eps
    cases = {
        "quantize": (nvfp4_producers.quantize(x), lambda r: nvfp4_producers.quantize(x[a:b], amax_reduce=r)),
        "rms_modulate_quantize": (
            nvfp4_producers.rms_modulate_quantize(x, w, Modulation(scale, shift, SEGS), eps),
            lambda r: nvfp4_producers.rms_modulate_quantize(x[a:b], w,
                                                            Modulation(scale, shift, shard.local_segments(SEGS)), eps,
                                                            amax_reduce=r)),
        "swiglu_quantize": (nvfp4_producers.swiglu_quantize(h, pad_rows=16),
                            lambda r: nvfp4_producers.swiglu_quantize(h[a:b], pad_rows=16, amax_reduce=r)),
    }
    mine = {}
    for name, (single, local) in cases.items():
        reduced, alone = local(red), local(None)
        mine[name] = {
            # the reduced rows are the single-process rows: the same scale, the same codes and block scales
            "scale_equal": torch.equal(reduced.global_scale, single.global_scale),
            "codes_equal": torch.equal(reduced.packed[: b - a], single.packed[a:b]),
            "values_equal": torch.equal(_deq(reduced), _deq(single)[a:b]),
            # the local amax quantizes this rank's rows otherwise (unless it holds the amax)
            "local_differs": not torch.equal(_deq(alone), _deq(single)[a:b]),
        }
    mine["calls"], mine["steps"] = stats.calls, stats.per_step_calls(1)
    out = [None] * ctx.world_size
    dist.all_gather_object(out, mine)
    return out


def test_producers_with_the_all_reduced_amax_write_the_single_process_bytes():
    ranks = launch(_producers_on_ranks, (), world_size=2, timeout_s=60, join_timeout_s=120)
    for r, res in enumerate(ranks):
        assert res.pop("calls") == 3 and res.pop("steps") == [3], (r, res)  # one all-reduce per producer call
        for name, c in res.items():
            assert c["scale_equal"] and c["codes_equal"] and c["values_equal"], (r, name, c)
    # rank 0 lacks x's amax, rank 1 lacks h's: without the reduction their bytes would differ
    assert ranks[0]["quantize"]["local_differs"] and ranks[0]["rms_modulate_quantize"]["local_differs"]
    assert ranks[1]["swiglu_quantize"]["local_differs"]
    assert not ranks[1]["quantize"]["local_differs"]  # the rank that holds the amax needs no reduction


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_amax_reduce_hook_on_both_producer_backends(backend):
    # no processes: the reduction is a closure that returns the whole tensor's amax (what the all-reduce MAX
    # over the ranks returns); each producer calls it once with its part's fp32 amax and quantizes with the
    # result, on the Triton kernels (the interpreter on the CPU) as on the reference, to the whole tensor's rows
    if backend == "triton":
        pytest.importorskip("triton")
    x, h, w, scale, shift = _inputs()
    lo, hi = slice(0, 19), slice(19, S)  # the two ranks' rows: x's amax (also modulated) in hi, h's in lo
    segs = RowShard(S, 2, 0).local_segments(SEGS)
    cases = {
        "quantize": (nvfp4_producers.quantize(x), nvfp4.amax(x), lo,
                     lambda r: nvfp4_producers.quantize(x[lo], amax_reduce=r, backend=backend)),
        "rms_modulate_quantize": (
            nvfp4_producers.rms_modulate_quantize(x, w, Modulation(scale, shift, SEGS), TINY.eps),
            nvfp4.amax(reference.rms_modulate_reference(x, w, scale, shift, SEGS, TINY.eps)), lo,
            lambda r: nvfp4_producers.rms_modulate_quantize(x[lo], w, Modulation(scale, shift, segs), TINY.eps,
                                                            amax_reduce=r, backend=backend)),
        "swiglu_quantize": (nvfp4_producers.swiglu_quantize(h, pad_rows=16), nvfp4.amax(reference.swiglu_reference(h)),
                            hi, lambda r: nvfp4_producers.swiglu_quantize(h[hi], pad_rows=16, amax_reduce=r,
                                                                          backend=backend)),
    }
    for name, (single, whole_amax, rows, part) in cases.items():
        seen = []

        def reduce(amax):
            seen.append(amax)
            return torch.maximum(amax, whole_amax.float())

        got = part(reduce)
        assert len(seen) == 1 and seen[0].dtype == torch.float32 and seen[0].shape == (), (name, seen)
        assert torch.equal(got.global_scale, single.global_scale), name
        assert torch.equal(_deq(got), _deq(single)[rows]), name
        assert not torch.equal(_deq(part(None)), _deq(single)[rows]), name  # the part's own amax: other bytes


def _block(seed=7, pre_quant=True):
    """A block with the four NVFP4 linears of Nvfp4Ops (hidden K, ffn F, one head of K); out_proj with an AWQ
    pre_quant_scale, which the sharded out_proj must apply before the quantizer as the module does."""
    def lin(n, k, s, **kw):
        return Nvfp4Linear.from_float(_randn(s, n, k) * 0.1, backend="emulated", out_dtype=torch.float32, **kw)

    pqs = (_randn(seed + 9, K).abs() + 0.5) if pre_quant else None
    attn = types.SimpleNamespace(qkv_proj=lin(3 * K, K, seed), out_proj=lin(K, K, seed + 1, pre_quant_scale=pqs))
    mlp = types.SimpleNamespace(fc1=lin(2 * F, K, seed + 2), fc2=lin(K, F, seed + 3))
    norm = types.SimpleNamespace(weight=_randn(seed + 4, K).abs() + 0.5)
    return types.SimpleNamespace(attn=attn, mlp=mlp, norm1=norm, norm2=norm)


def _ops_on_ranks(ctx):
    x, h, _, scale, shift = _inputs()
    blk = _block()
    single = Nvfp4Ops(TINY, None)
    shard = RowShard(S, ctx.world_size, ctx.rank)
    a, b = shard.start, shard.stop
    stats = CommStats()
    ops = sharded_ops(single, None, AmaxAllReduce(None, stats))
    local_segs = shard.local_segments(SEGS)
    res = {}
    for name, full, part in (
            ("qkv", lambda o: o.qkv(0, blk, x, shift, scale, SEGS),
             lambda o: o.qkv(0, blk, x[a:b], shift, scale, local_segs)),
            ("out_proj", lambda o: o.out_proj(0, blk, x), lambda o: o.out_proj(0, blk, x[a:b])),
            ("fc1", lambda o: o.fc1(0, blk, x, shift, scale, SEGS),
             lambda o: o.fc1(0, blk, x[a:b], shift, scale, local_segs)),
            ("fc2", lambda o: o.fc2(0, blk, h), lambda o: o.fc2(0, blk, h[a:b]))):
        ref = full(single)[a:b].double()
        res[name] = (float((part(ops).double() - ref).norm() / ref.norm()),
                     float((part(single).double() - ref).norm() / ref.norm()))
    res["calls"] = stats.calls
    out = [None] * ctx.world_size
    dist.all_gather_object(out, res)
    return out


def test_nvfp4_ops_with_the_all_reduce_match_one_process_on_every_linear():
    # qkv / fc1 (rms_modulate_quantize), out_proj (the module's quantize after its pre_quant_scale), fc2
    # (swiglu_quantize): the same activation bytes per row as one process; the GEMM of the CPU emulation sums
    # exact products in fp32 over the same K, so only its blocking over fewer rows could move a last bit
    ranks = launch(_ops_on_ranks, (), world_size=2, timeout_s=60, join_timeout_s=120)
    for r, res in enumerate(ranks):
        assert res.pop("calls") == 4, (r, res)  # one all-reduce per linear
        for name, (reduced, alone) in res.items():
            assert reduced <= 1e-6, (r, name, reduced)
    # without the reduction the rank that lacks the amax computes another quantization (~1e-2 apart)
    assert min(ranks[0][n][1] for n in ("qkv", "out_proj", "fc1")) > 1e-3, ranks[0]
    assert ranks[1]["fc2"][1] > 1e-3, ranks[1]


def test_sharded_ops_binds_the_reduction_on_a_copy_through_the_wrappers():
    red = AmaxAllReduce(None, CommStats())
    base = Nvfp4Ops(TINY, None)
    wrapped = LoraOps(StreamOps(base, None), {})
    out = sharded_ops(wrapped, "ulysses", red)
    assert out.base.amax_reduce is red and out.inner.inner._attention == "ulysses"
    assert base.amax_reduce is None and wrapped.base.amax_reduce is None  # the load's ops keep the local amax
    # a world of one binds nothing: the plain path's ops, attention aside
    assert sharded_ops(base, "ulysses", None).amax_reduce is None
    # row-local stacks have no dynamic per-tensor scale: nothing to bind
    for ops in (ReferenceOps(TINY), W4A8Ops(TINY, None)):
        assert not ops.takes_amax_reduce and sharded_ops(ops, "ulysses", red).base.amax_reduce is None
        with pytest.raises(TypeError, match="take no dynamic amax"):
            ops.set_amax_reduce(red)
    assert numerics(base).startswith("W4A4 with a dynamic activation scale: each per-tensor amax is all-reduced")
    assert numerics(W4A8Ops(TINY, None)).startswith("row-local")


@pytest.mark.parametrize("pre_quant", [False, True])
def test_nvfp4_ops_without_a_reduction_are_the_module_path(pre_quant):
    # amax_reduce None (one process, a world of one): out_proj is the module call, byte for byte
    blk = _block(pre_quant=pre_quant)
    o = _inputs()[0]
    ops = Nvfp4Ops(TINY, None)
    assert torch.equal(ops.out_proj(0, blk, o), blk.attn.out_proj(o))
    same = sharded_ops(ops, None, lambda amax: amax)  # the identity reduction: exactly the local path
    assert torch.equal(same.out_proj(0, blk, o), blk.attn.out_proj(o))
