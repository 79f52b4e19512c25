"""The NVFP4 block stack: the hot path of DESIGN.md §3, with the reference DiTBlock kept as the oracle.

One block (x [S, hidden] bf16 residual, updated in place):

  a  RMSNorm(x) -> per-segment modulate -> NVFP4 quantize        quant_kernels.rms_modulate_quantize
  b  QKV GEMM on those bytes, [S, 3*H*D] contiguous thirds        Nvfp4Linear.forward_quantized
  c  per-head RMSNorm(q, k) + split-half RoPE, in place           elementwise.norm_rope_
  d  attention on strided NHD views of the qkv buffer             attention.attention
  e  quantize(o) -> out_proj GEMM                                  Nvfp4Linear.forward
  f  x += gate_msa * attn, per segment                             elementwise.gate_add_
  g  RMSNorm -> modulate -> quantize; h FC1 GEMM -> [gate | up]
  i  silu(gate) * up -> NVFP4 quantize                             quant_kernels.swiglu_quantize
  j  FC2 through the guarded cuBLASLt dispatcher on those bytes, else the fallback on the SAME bytes
  k  x += gate_mlp * mlp

On the CPU every step runs its torch reference (the producers' references write the same bytes), so the
whole stack is testable without a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from .ops import elementwise as el
from .ops import quant_kernels as qk
from .ops.attention import attention
from .ops.linear import Nvfp4Linear, Scratch

LINEARS = (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


class Nvfp4Stack:
    """Runs the block stack of an H3Model whose block linears are Nvfp4Linear.

    attention: backend name for ``attention()``; fc2: an Fc2Dispatcher or None; lora_on_fc2: callable
    telling whether a side-path LoRA is active on a block's fc2 (the guard refuses the Lt path then).
    """

    def __init__(self, model, attention_backend: str, fc2=None, act_scale: str = "dynamic",
                 lora_on_fc2: Callable[[int], bool] | None = None):
        self.model = model
        self.cfg = model.cfg
        self.attention_backend = attention_backend
        self.fc2 = fc2
        self.act_scale = act_scale
        self.lora_on_fc2 = lora_on_fc2 or (lambda i: False)

    # -- pieces (each with a reference on the CPU) ---------------------------------------------------
    def _norm_rope(self, blk, qkv, cos, sin):
        c = self.cfg
        if _on_cuda(qkv):
            return el.norm_rope_(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, cos, sin, c.eps, c.rope_dim)
        qkv.copy_(el.norm_rope_reference(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, cos, sin, c.eps,
                                         c.rope_dim))
        return qkv

    def _gate_add(self, x, y, gate, segs):
        if _on_cuda(x):
            return el.gate_add_(x, y, gate, segs)
        x.copy_(el.gate_add_reference(x, y, gate, segs))
        return x

    def _input_scale(self, lin: Nvfp4Linear):
        g, _ = qk.activation_global_scale(self.act_scale, lin.input_scale)
        return g

    def _fc2(self, i: int, blk, s_q) -> torch.Tensor:
        """FC2 on the SwiGLU producer's bytes: the guarded cuBLASLt dispatcher, whose fallback runs the
        layer's GEMM backend on the same bytes. s_q.packed has roundup(S, 16) rows (zero padding), the
        packed M the seed's pinned configuration requires; results are cut back to S rows."""
        fc2: Nvfp4Linear = blk.mlp.fc2
        rows = s_q.shape[0]

        def fallback(ops):
            return fc2.forward_quantized(s_q.packed, s_q.scales, s_q.global_scale)[:rows]

        if self.fc2 is None:
            return fallback(None)
        from .fc2_lt import PRODUCER_SWIGLU_NVFP4

        w = fc2.weight
        return self.fc2(s_q.packed, w.packed, x_scale=s_q.scales, w_scale=w.scales,
                        alpha=(s_q.global_scale * w.global_scale).reshape(1), m_logical=s_q.shape[0],
                        producer=PRODUCER_SWIGLU_NVFP4, lora_active=self.lora_on_fc2(i), bias=fc2.bias,
                        fallback=fallback)

    # -- one block -----------------------------------------------------------------------------------
    def block(self, i: int, blk, x: torch.Tensor, mod: torch.Tensor, segs, cos, sin) -> torch.Tensor:
        c = self.cfg
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        a = qk.rms_modulate_quantize(x, blk.norm1.weight, scale_msa, shift_msa, segs, c.eps,
                                     self._input_scale(blk.attn.qkv_proj))
        qkv = blk.attn.qkv_proj.forward_quantized(a.packed, a.scales, a.global_scale)
        del a
        self._norm_rope(blk, qkv, cos, sin)
        with torch.profiler.record_function("h3.attention"):  # a named range for the profiler's copy count
            o = attention(qkv, c.num_heads, c.head_dim, self.attention_backend)
        del qkv
        y = blk.attn.out_proj(o)
        del o
        self._gate_add(x, y, gate_msa, segs)
        del y
        a = qk.rms_modulate_quantize(x, blk.norm2.weight, scale_mlp, shift_mlp, segs, c.eps,
                                     self._input_scale(blk.mlp.fc1))
        h = blk.mlp.fc1.forward_quantized(a.packed, a.scales, a.global_scale)
        del a
        s_q = qk.swiglu_quantize(h, self._input_scale(blk.mlp.fc2), pad_rows=16)
        del h
        m = self._fc2(i, blk, s_q)
        del s_q
        self._gate_add(x, m, gate_mlp, segs)
        return x

    def run(self, x: torch.Tensor, plan, step: int) -> torch.Tensor:
        segs = plan.times[step].mod_segments
        for i, (blk, mod) in enumerate(zip(self.model.blocks, plan.mods[step])):
            x = self.block(i, blk, x, mod, segs, plan.cos, plan.sin)
        return x


def quantize_block_linears(model, backend: str = "auto", act_scale: str = "dynamic", strict: bool = False,
                           stored: dict | None = None, progress=None) -> list[str]:
    """Replace every block's qkv_proj / out_proj / fc1 / fc2 with an Nvfp4Linear, one layer at a time on
    the model's device. ``stored`` maps layer names to comfy_quant tensors already in NVFP4 (loaded
    as-is, no re-quantization). Returns the per-layer backend reasons (one line per distinct reason)."""
    scratch = Scratch()
    reasons = set()
    n = len(model.blocks) * len(LINEARS)
    k = 0
    for bi, blk in enumerate(model.blocks):
        for parent, name in LINEARS:
            layer = f"blocks.{bi}.{parent}.{name}"
            owner = getattr(blk, parent)
            old = getattr(owner, name)
            kw = dict(backend=backend, act_scale=act_scale, strict=strict, scratch=scratch,
                      out_dtype=model.dtype)
            if stored and layer in stored:
                new = Nvfp4Linear.from_comfy_quant(stored[layer], layer, shape=(old.out_features, old.in_features),
                                                   **kw)
            elif isinstance(old, Nvfp4Linear):
                continue
            else:
                w = old.weight
                if w.is_meta:
                    raise RuntimeError(f"{layer}: no weight loaded")
                new = Nvfp4Linear.from_float(w.detach(), **kw)
            setattr(owner, name, new)
            del old
            reasons.add(new.backend_reason)
            k += 1
            if progress:
                progress(k, n, layer)
    return sorted(reasons)
