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

W4A8 (``act_format="fp8"``, and what ``"auto"``, the default, picks wherever the fp8 GEMM backend runs every
block linear, i.e. Hopper and Ada; RuntimeOptions.act_format / H3_ACT_FORMAT): the same block with the
activation producers of ``ops.fp8_producers`` (a: ``rms_modulate_fp8``, e: ``quantize_fp8``, g:
``rms_modulate_fp8``, i: ``swiglu_fp8``), each one launch writing e4m3 with one fp32 scale per row (row amax
/ 448, no global-amax pass), fed to ``Nvfp4Linear.forward_fp8`` (the NVFP4 weight expanded per layer to
rowwise e4m3 scratch, ``torch._scaled_mm`` rowwise). Activations are rounded once to e4m3 (<= 2^-4 relative
per element), strictly more accurate than NVFP4 activations. Only with the fp8 GEMM backend on every block
linear; otherwise the stack keeps nvfp4 and ``act_format_reason`` says why. ``act_scale`` is not used (the
scales are row-local). FC2 calls the layer directly: the guarded cuBLASLt FC2 path takes NVFP4 bytes, so it
is not applicable (``fc2_status()`` says "not applicable (act_format fp8)"; the dispatcher is not called, so
its counters record no attempt). Two numerics trades, measured in bench/ and on by default in RuntimeOptions
(this class's own defaults are the exact ones): ``fp8_fast_accum`` (Hopper's fast fp8 accumulation in the
GEMMs) and ``silu="fast"`` (the SwiGLU producer's hardware exp2 and approximate division).

``sage_v_pad="buffer"`` (RuntimeOptions.sage_v_pad / H3_SAGE_V_PAD; only with the sage2 backend on sm_90,
otherwise a no-op): step a pads its output to roundup(S, 128) rows of zero codes, so step b writes a qkv
buffer of roundup(S, 128) rows whose rows >= S are zero (zero activation rows, no bias); c and the LoRA
side path run on its first S rows (a view), and d hands the whole buffer with ``seq_len=S`` to
``attention``, whose V is then a view of it: no ``torch.cat`` copy of V inside SageAttention2's sm_90 wrapper.
``sage_v_pad="fused"``: no padded buffer; ``attention`` builds V's fp8 operands for the sm_90 kernel straight
from the strided V view (``fp8_producers.sage_v_fp8``), so neither the pad copy nor the library's transpose
copy of V is made.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .ops import elementwise as el
from .ops import fp8_producers as f8
from .ops import quant_kernels as qk
from .ops.attention import attention
from .ops.linear import Nvfp4Linear, Scratch

LINEARS = (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))
ACT_FORMATS = ("nvfp4", "fp8")
FC2_NOT_APPLICABLE = "not applicable (act_format fp8)"
SAGE_V_PADS = ("library", "buffer", "fused")


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


class Nvfp4Stack:
    """Runs the block stack of an H3Model whose block linears are Nvfp4Linear.

    attention: backend name for ``attention()``; fc2: an Fc2Dispatcher or None; lora_on_fc2: callable
    telling whether a side-path LoRA is active on a block's fc2 (the guard refuses the Lt path then);
    act_format: "auto" (fp8 when every block linear runs the fp8 GEMM backend, else nvfp4), "nvfp4" (W4A4)
    or "fp8" (W4A8, see the module docstring; strict raises when it cannot run). sage_v_pad: the V handling
    already resolved for the device (``attention.sage_v_pad_status``); silu / fp8_fast_accum: the W4A8
    SwiGLU producer's silu and the W4A8 GEMMs' accumulation (RuntimeOptions.silu / fp8_accum).
    """

    def __init__(self, model, attention_backend: str, fc2=None, act_scale: str = "dynamic",
                 lora_on_fc2: Callable[[int], bool] | None = None, act_format: str = "nvfp4",
                 strict: bool = False, sage_v_pad: str = "library", silu: str = "exact", fp8_fast_accum: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.attention_backend = attention_backend
        self.fc2 = fc2
        self.act_scale = act_scale
        self.lora_on_fc2 = lora_on_fc2 or (lambda i: False)
        self.fc2_direct_calls = 0  # FC2 GEMMs run without the dispatcher (act_format fp8)
        self.silu = silu  # the W4A8 SwiGLU producer's silu (RuntimeOptions.silu)
        self.fp8_fast_accum = fp8_fast_accum  # the W4A8 GEMMs' accumulation (RuntimeOptions.fp8_accum)
        if sage_v_pad not in SAGE_V_PADS:
            raise ValueError(f"sage_v_pad={sage_v_pad!r}: expected one of {', '.join(SAGE_V_PADS)}")
        self.sage_v_pad = sage_v_pad
        self._pad_cache: dict = {}
        self.set_act_format(act_format, strict=strict)

    # -- activation format ---------------------------------------------------------------------------
    def set_act_format(self, requested: str, *, strict: bool = False) -> dict:
        """Choose the activation format -> {"choice", "reason"} (also kept as act_format /
        act_format_reason). fp8 needs the fp8 GEMM backend on every block linear; otherwise nvfp4 is
        kept with the reason (strict: raise instead)."""
        if requested not in ACT_FORMATS + ("auto",):
            raise ValueError(f"act_format={requested!r}: expected auto or one of {', '.join(ACT_FORMATS)}")
        if requested == "auto":
            # fp8 (W4A8) wherever every block linear runs the fp8 GEMM backend (Hopper / Ada: no FP4 tensor
            # cores, so the weights are expanded to e4m3 anyway and e4m3 activations are both faster and more
            # accurate than NVFP4 ones); NVFP4 activations everywhere else (native FP4 GEMMs, the emulation)
            got = self.set_act_format("fp8")
            if got["choice"] != "fp8":
                self.act_format_reason = "auto: " + self.act_format_reason.replace(
                    "requested fp8 unavailable: ", "fp8 not applicable: ")
            else:
                self.act_format_reason = "auto: " + self.act_format_reason
            return {"choice": self.act_format, "reason": self.act_format_reason}
        if requested == "nvfp4":
            self.act_format, self.act_format_reason = "nvfp4", "nvfp4: NVFP4 activations (W4A4)"
        else:
            bad = [f"blocks.{i}.{p}.{n} runs {getattr(getattr(getattr(b, p), n), 'backend', 'a dense linear')}"
                   for i, b in enumerate(self.model.blocks) for p, n in LINEARS
                   if getattr(getattr(getattr(b, p), n), "backend", None) != "fp8"]
            if bad:
                why = (f"requested fp8 unavailable: W4A8 needs the fp8 GEMM backend on every block linear "
                       f"({bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})")
                if strict:
                    raise RuntimeError(why)
                self.act_format, self.act_format_reason = "nvfp4", why + "; using nvfp4"
            else:
                self.act_format, self.act_format_reason = "fp8", (
                    "fp8 (W4A8): e4m3 activations, one fp32 scale per row (row amax / 448), written by the fused "
                    "producers; NVFP4 weights expanded per layer to rowwise e4m3; act_scale not used")
        return {"choice": self.act_format, "reason": self.act_format_reason}

    def fc2_status(self) -> dict:
        """How this stack runs FC2 (for the run report, next to the dispatcher's own counters)."""
        if self.act_format == "fp8":
            return {"lt_path": FC2_NOT_APPLICABLE, "direct_calls": self.fc2_direct_calls,
                    "reason": "the pinned cuBLASLt FC2 takes NVFP4 bytes; with e4m3 rowwise activations FC2 runs "
                              "Nvfp4Linear.forward_fp8 directly and the dispatcher is not called (no attempts)"}
        return {"lt_path": "dispatcher" if self.fc2 is not None else "none (fallback GEMM)",
                "direct_calls": self.fc2_direct_calls}

    # -- sage_v_pad ----------------------------------------------------------------------------------
    def qkv_pad_rows(self, device: torch.device) -> int:
        """Rows the QKV buffer is padded to a multiple of: 128 when sage_v_pad="buffer" and attention runs
        SageAttention2's sm_90 kernel (head_dim 64/128) on ``device``; else 1 (today's path)."""
        if self.sage_v_pad != "buffer" or self.attention_backend != "sage2" or device.type != "cuda" \
                or self.cfg.head_dim not in (64, 128):
            return 1
        key = str(device)
        if key not in self._pad_cache:
            from .ops import attention as A

            try:
                fn = A._sage2_plan(A._capability(device))[0]
            except RuntimeError:
                fn = None
            self._pad_cache[key] = A.SAGE2_V_ROWS if fn == A.SAGE2_SM90_FN else 1
        return self._pad_cache[key]

    def _attention(self, qkv_buf: torch.Tensor, s: int, pad: int) -> torch.Tensor:
        c = self.cfg
        with torch.profiler.record_function("h3.attention"):  # a named range for the profiler's copy count
            if pad > 1:
                return attention(qkv_buf, c.num_heads, c.head_dim, self.attention_backend, seq_len=s,
                                 sage_v_pad="buffer")
            return attention(qkv_buf, c.num_heads, c.head_dim, self.attention_backend, sage_v_pad=self.sage_v_pad)

    @staticmethod
    def _logical(qkv_buf: torch.Tensor, s: int, pad: int, lin) -> torch.Tensor:
        """The first S rows of the (padded) QKV output, as a view; a bias would make the tail nonzero."""
        if pad == 1:
            return qkv_buf
        if getattr(lin, "bias", None) is not None:
            qkv_buf[s:].zero_()
        return qkv_buf[:s]

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
        from .fc2.table import PRODUCER_SWIGLU_NVFP4

        w = fc2.weight
        return self.fc2(s_q.packed, w.packed, x_scale=s_q.scales, w_scale=w.scales,
                        alpha=(s_q.global_scale * w.global_scale).reshape(1), m_logical=s_q.shape[0],
                        producer=PRODUCER_SWIGLU_NVFP4, lora_active=self.lora_on_fc2(i), bias=fc2.bias,
                        fallback=fallback)

    # -- LoRA side paths (runtime.lora installs them on the layers) ----------------------------------
    @staticmethod
    def _sides(blk) -> tuple:
        """The side paths active on this block's qkv_proj, fc1 and fc2 (None where there is none). These
        three GEMMs get the producers' bytes, never a bf16 activation, so the stack adds their terms itself;
        out_proj is called as a module and its side path is the module's forward hook."""
        from .lora.apply import lora_side

        return (lora_side(blk.attn.qkv_proj), lora_side(blk.mlp.fc1), lora_side(blk.mlp.fc2))

    @staticmethod
    def _modulated(x, norm, shift, scale, segs) -> torch.Tensor:
        """The side path's input for qkv/fc1: the reference block's ``modulate(norm(x))`` at x's dtype."""
        from .model.h3 import modulate_, rms_norm

        return modulate_(rms_norm(x, norm.weight, norm.eps), shift, scale, segs)

    # -- the three steps that depend on the activation format ---------------------------------------
    def _norm_linear(self, lin: Nvfp4Linear, x, norm, shift, scale, segs, pad_rows: int = 1) -> torch.Tensor:
        """a/g + b/h: RMSNorm(x) -> modulate -> quantize (NVFP4, or e4m3 rowwise for act_format fp8) in one
        producer, then the layer's GEMM on those bytes. pad_rows > 1: zero activation rows past S, so the
        GEMM output has zero rows there too (no bias)."""
        if self.act_format == "fp8":
            a8, ra = f8.rms_modulate_fp8(x, norm.weight, scale, shift, segs, self.cfg.eps, pad_rows=pad_rows)
            return lin.forward_fp8(a8, ra, fast_accum=self.fp8_fast_accum)
        a = qk.rms_modulate_quantize(x, norm.weight, scale, shift, segs, self.cfg.eps, self._input_scale(lin),
                                     pad_rows=pad_rows)
        return lin.forward_quantized(a.packed, a.scales, a.global_scale)

    def _out_proj(self, lin: Nvfp4Linear, o: torch.Tensor) -> torch.Tensor:
        """e: quantize(o) -> out_proj (called as a module for NVFP4 activations, so its hooks run)."""
        return self._out_proj_fp8(lin, o) if self.act_format == "fp8" else lin(o)

    def _mlp_out(self, i: int, blk, h: torch.Tensor) -> torch.Tensor:
        """i + j: silu(gate) * up -> quantize -> FC2. NVFP4: through the guarded dispatcher on the producer's
        bytes (padded to 16 rows); fp8: the layer directly (the pinned FC2 takes NVFP4 bytes only)."""
        if self.act_format == "fp8":
            s8, rs = f8.swiglu_fp8(h, silu=self.silu)
            self.fc2_direct_calls += 1
            return blk.mlp.fc2.forward_fp8(s8, rs, fast_accum=self.fp8_fast_accum)
        s_q = qk.swiglu_quantize(h, self._input_scale(blk.mlp.fc2), pad_rows=16)
        return self._fc2(i, blk, s_q)

    def _out_proj_fp8(self, lin: Nvfp4Linear, o: torch.Tensor) -> torch.Tensor:
        """e: quantize_fp8(o) -> out_proj, plus what calling the module would add: pre_quant_scale and a
        LoRA side path (which lora.py installs as the module's forward hook)."""
        src = o
        if lin.pre_quant_scale is not None:
            o = o * lin.pre_quant_scale.to(o.dtype)
        o8, ro = f8.quantize_fp8(o if o.stride(-1) == 1 else o.contiguous())
        y = lin.forward_fp8(o8, ro, fast_accum=self.fp8_fast_accum)
        del o8, ro
        from .lora.apply import lora_side

        side = lora_side(lin)
        if side is not None:
            side.add_(src, y)
        return y

    # -- one block -----------------------------------------------------------------------------------
    def block(self, i: int, blk, x: torch.Tensor, mod: torch.Tensor, segs, cos, sin) -> torch.Tensor:
        """One block, in place on x (module docstring); the activation format picks the producers and GEMMs."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        s_qkv, s_fc1, s_fc2 = self._sides(blk)
        pad = self.qkv_pad_rows(x.device)
        qkv_buf = self._norm_linear(blk.attn.qkv_proj, x, blk.norm1, shift_msa, scale_msa, segs, pad)
        qkv = self._logical(qkv_buf, x.shape[0], pad, blk.attn.qkv_proj)
        if s_qkv is not None:
            s_qkv.add_(self._modulated(x, blk.norm1, shift_msa, scale_msa, segs), qkv)
        self._norm_rope(blk, qkv, cos, sin)
        o = self._attention(qkv_buf, x.shape[0], pad)
        del qkv, qkv_buf
        y = self._out_proj(blk.attn.out_proj, o)
        del o
        self._gate_add(x, y, gate_msa, segs)
        del y
        h = self._norm_linear(blk.mlp.fc1, x, blk.norm2, shift_mlp, scale_mlp, segs)
        if s_fc1 is not None:
            s_fc1.add_(self._modulated(x, blk.norm2, shift_mlp, scale_mlp, segs), h)
        m = self._mlp_out(i, blk, h)
        if s_fc2 is not None:
            gate, up = h.chunk(2, dim=-1)
            s_fc2.add_(F.silu(gate) * up, m)
        del h
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
