"""BlockOps: the operations one DiT block is made of, resolved once at load into bound callables.

``DiTBlock.forward`` (runtime.model.h3) is the one block; it calls, per block (x [S, hidden] residual,
updated in place, DESIGN.md section 3):

  a+b  qkv(i, blk, x, shift, scale, segs)   RMSNorm(x) -> per-segment modulate -> [quantize] -> QKV GEMM
  c    norm_rope_(blk, qkv, cos, sin)       per-head RMSNorm(q, k) + split-half RoPE, in place
  d    attention(qkv)                       attention on strided views of the qkv buffer -> [S, H*D]
  e    out_proj(i, blk, o)                  [quantize] -> out_proj GEMM
  f    gate_add_(x, y, gate, segs)          x += gate * y, per segment
  g+h  fc1(i, blk, x, shift, scale, segs)   RMSNorm -> modulate -> [quantize] -> FC1 GEMM -> [gate | up]
  i+j  fc2(i, blk, h)                       silu(gate) * up -> [quantize] -> FC2 (guarded cuBLASLt path for
                                            NVFP4 bytes, the fallback GEMM on the same bytes otherwise)
  k    gate_add_(x, m, gate, segs)

Three implementations, chosen by the load plan:

- ``ReferenceOps`` (runtime.ops.reference): the dense reference (torch modules, fp32-math norms, exact attention unless the plan
  bound a faster dense backend). The oracle every other path is tested against.
- ``Nvfp4Ops`` (W4A4): NVFP4 activations written by the fused producers (``nvfp4_producers``), NVFP4 GEMMs,
  FC2 through the guarded dispatcher on the SwiGLU producer's bytes (padded to 16 rows).
- ``W4A8Ops``: e4m3 activations with one fp32 scale per row from the fused producers (``fp8_producers``),
  NVFP4 weights expanded per layer to rowwise e4m3; FC2 runs its layer directly (the pinned cuBLASLt FC2
  takes NVFP4 bytes, so it is not applicable).

On the CPU every quantized step runs its torch reference (the producers' references write the same bytes),
so the whole stack is testable without a GPU. A LoRA side path on a block linear is a BlockOps wrapper
(``runtime.lora.ops.LoraOps``) around any of these: it adds the side terms to qkv / out_proj / fc1 / fc2 and
tells ``fc2(..., lora_active=True)`` so the FC2 guard refuses its pinned path. Every BlockOps also has
``name``, ``attends_exactly`` (exact reference attention, the oracle) and ``with_attention(fn)`` (the same ops
with another bound attention: the sequence-parallel wrapper).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from .reference import ReferenceOps
from . import elementwise, fp8_producers, nvfp4_producers, reference
from .fc2_operands import Fc2Operands
from .interface import OpsState
from .linear import Nvfp4Linear
from .producer_tiles import ProducerTiles

LINEARS = (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))
FC2_PRODUCER = nvfp4_producers.SWIGLU_PRODUCER  # the producer that wrote FC2's input (FC2 table entries name it)


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


class _QuantizedOps(OpsState):
    """What the NVFP4 and W4A8 ops share: fused norm+RoPE and gate/add on CUDA (references on the CPU), the
    bound attention, and qkv / fc1 (RMSNorm -> modulate -> quantize -> GEMM in the producer)."""

    name = "quantized"
    attends_exactly = False  # attention is always a bound backend

    def __init__(self, cfg, attention: Callable[[torch.Tensor], torch.Tensor]):
        self.cfg = cfg
        self._attention = attention
        self.fc2_direct_calls = 0  # FC2 GEMMs run without the dispatcher

    def norm_rope_(self, blk, qkv, cos, sin):
        c = self.cfg
        if _on_cuda(qkv):
            return elementwise.norm_rope_(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, cos, sin, c.eps,
                                          c.rope_dim)
        qkv.copy_(reference.norm_rope_qkv_reference(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, cos, sin,
                                                  c.eps, c.rope_dim))
        return qkv

    def with_attention(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "_QuantizedOps":
        """A copy of these ops whose attention is ``fn`` (qkv [S, 3*H*D] -> [S, H*D]); everything else shared."""
        out = copy.copy(self)
        out._attention, out.sparse = fn, None
        out.clear_row_forms()  # the dense backend's row form does not compute fn: no query-row chunks
        return out

    def attention(self, qkv):
        with torch.profiler.record_function("h3.attention"):  # a named range for the profiler's copy count
            return self._attention(qkv)

    def gate_add_(self, x, y, gate, segs):
        if _on_cuda(x):
            return elementwise.gate_add_(x, y, gate, segs)
        x.copy_(reference.gate_add_reference(x, y, gate, segs))
        return x

    def qkv(self, i, blk, x, shift, scale, segs):
        return self._norm_linear(blk.attn.qkv_proj, x, blk.norm1, shift, scale, segs)

    def fc1(self, i, blk, x, shift, scale, segs):
        return self._norm_linear(blk.mlp.fc1, x, blk.norm2, shift, scale, segs)


class Nvfp4Ops(_QuantizedOps):
    """W4A4: NVFP4 activations from the fused producers; FC2 through the guarded dispatcher (``fc2``, an
    Fc2Dispatcher, or None for the fallback GEMM) on the SwiGLU producer's bytes. Each activation's global
    scale follows its layer's act_scale policy, bound when the layer was built (``Nvfp4Linear.act_global``;
    ``act_scale`` names that policy for the reports). ``amax_reduce``: what every dynamic activation scale of
    the four linears takes its amax through (``nvfp4_producers.AmaxReduce``; set on a copy by sequence
    parallelism, runtime.parallel.evaluate); None: the local amax."""

    name = "nvfp4"
    takes_amax_reduce = True

    def __init__(self, cfg, attention, fc2=None, act_scale: str = "dynamic"):
        super().__init__(cfg, attention)
        self.fc2_dispatcher = fc2
        self.act_scale = act_scale

    def _norm_linear(self, lin: Nvfp4Linear, x, norm, shift, scale, segs):
        mod = nvfp4_producers.Modulation(scale, shift, segs)
        a = nvfp4_producers.rms_modulate_quantize(x, norm.weight, mod, self.cfg.eps,
                                                  lin.act_global(), amax_reduce=self.amax_reduce)
        return lin.forward_quantized(a.packed, a.scales, a.global_scale)

    def out_proj(self, i, blk, o):
        if self.amax_reduce is None:
            return blk.attn.out_proj(o)  # a module call: pre_quant_scale, quantize, GEMM
        return blk.attn.out_proj(o, amax_reduce=self.amax_reduce)  # the same, the amax reduced

    def fc2(self, i, blk, h, lora_active: bool = False):
        """silu(gate) * up -> NVFP4 bytes padded to 16 rows (the packed M the pinned FC2 configuration needs)
        -> the guarded dispatcher, whose fallback runs the layer's GEMM on the same bytes. lora_active: a LoRA
        side path will be added to this fc2's output (the guard then refuses the pinned path)."""
        fc2: Nvfp4Linear = blk.mlp.fc2
        s_q = nvfp4_producers.swiglu_quantize(h, fc2.act_global(), pad_rows=16, amax_reduce=self.amax_reduce)
        rows = s_q.shape[0]

        def fallback(ops):
            return fc2.forward_quantized(s_q.packed, s_q.scales, s_q.global_scale)[:rows]

        if self.fc2_dispatcher is None:
            self.fc2_direct_calls += 1
            return fallback(None)
        w = fc2.weight
        ops = Fc2Operands(s_q.packed, w.packed, x_scale=s_q.scales, w_scale=w.scales,
                          alpha=(s_q.global_scale * w.global_scale).reshape(1), m_logical=rows, bias=fc2.bias)
        return self.fc2_dispatcher(ops, fallback, producer=FC2_PRODUCER, lora_active=lora_active)

    def status(self) -> dict:
        return {"lt_path": "dispatcher" if self.fc2_dispatcher is not None else "none (fallback GEMM)",
                "direct_calls": self.fc2_direct_calls}


class W4A8Ops(_QuantizedOps):
    """W4A8: e4m3 activations, one fp32 scale per row (row amax / 448) from the fused producers; the NVFP4
    weights expanded per layer to rowwise e4m3. silu / fast_accum: the SwiGLU producer's silu ("exact" or
    "fast") and the GEMMs' fp8 accumulation (the plan's precision); tiles: the producers' tile table (the
    plan's ``tiles``; None: built in)."""

    name = "w4a8"

    def __init__(self, cfg, attention, silu: str = "exact", fast_accum: bool = False,
                 tiles: ProducerTiles | None = None):
        super().__init__(cfg, attention)
        self.silu = silu
        self.fast_accum = fast_accum
        self.tiles = tiles

    def _norm_linear(self, lin: Nvfp4Linear, x, norm, shift, scale, segs):
        mod = fp8_producers.Modulation(scale, shift, segs)
        a8, ra = fp8_producers.rms_modulate_fp8(x, norm.weight, mod, self.cfg.eps, tiles=self.tiles)
        return lin.forward_fp8(a8, ra, fast_accum=self.fast_accum)

    def out_proj(self, i, blk, o):
        """quantize_fp8(o) -> out_proj, plus what calling the module would add: pre_quant_scale."""
        lin: Nvfp4Linear = blk.attn.out_proj
        if lin.pre_quant_scale is not None:
            o = o * lin.pre_quant_scale.to(o.dtype)
        o8, ro = fp8_producers.quantize_fp8(o if o.stride(-1) == 1 else o.contiguous(), tiles=self.tiles)
        return lin.forward_fp8(o8, ro, fast_accum=self.fast_accum)

    def fc2(self, i, blk, h, lora_active: bool = False):
        """silu(gate) * up -> e4m3 rows -> the layer's GEMM (no dispatcher, so lora_active has nothing to refuse)."""
        s8, rs = fp8_producers.swiglu_fp8(h, silu=self.silu, tiles=self.tiles)
        self.fc2_direct_calls += 1
        return blk.mlp.fc2.forward_fp8(s8, rs, fast_accum=self.fast_accum)

    def status(self) -> dict:
        return {"lt_path": "not applicable (act_format fp8)", "direct_calls": self.fc2_direct_calls,
                "reason": "the pinned cuBLASLt FC2 takes NVFP4 bytes; with e4m3 rowwise activations FC2 runs "
                          "Nvfp4Linear.forward_fp8 directly and the dispatcher is not called (no attempts)"}


def build_ops(plan, attention, fc2=None):
    """The BlockOps for a load plan (runtime.plan.LoadPlan): reference for dense linears, else NVFP4 or W4A8 by
    the plan's activation format, with the plan's settings. ``attention``: the function the load bound for the
    plan's attention choice (``ops.registry.bind``; the sparse backend's step-aware one included); the dense
    reference ops keep their exact attention when the plan chose the reference backend. ``fc2``: the prepared
    FC2 dispatcher, where the plan applies it."""
    cfg = plan.config
    if plan.act_format == "dense":
        return ReferenceOps(cfg, None if plan.attention == "reference" else attention)
    if plan.act_format == "fp8":
        return W4A8Ops(cfg, attention, silu=plan.silu, fast_accum=plan.fp8_fast_accum, tiles=plan.tiles)
    return Nvfp4Ops(cfg, attention, fc2=fc2, act_scale=plan.act_scale)
