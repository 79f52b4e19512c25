"""``Nvfp4Linear``: a linear layer whose weight stays NVFP4, with its GEMM bound at construction.

The load plan picks one GEMM backend for every block linear (``ops.gemm_backends``: what each computes and
where it runs) and the loader builds each layer with it: the layer binds the backend's product once
(``gemm_backends.bind_gemm``) and calls it on every forward; nothing is chosen per layer or per call. A layer
whose K the backend cannot take refuses at construction (the plan already excludes such backends).

The activation is quantized by the producers of ``nvfp4_producers`` (Triton on CUDA, the reference on
CPU) with the ``act_scale`` policy, also bound at construction: ``dynamic`` (amax per call) or
``calibrated`` (the checkpoint's ``input_scale``; a layer without one runs dynamic, see ``act_scale_reason``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import H3Error
from . import nvfp4, nvfp4_producers, reference
from .gemm_backends import BACKENDS, DEFAULT_SCRATCH, K_MULTIPLE, Scratch, bind_gemm, scaled_mm_rowwise

__all__ = ["Nvfp4Linear", "StoredParts"]


@dataclass(frozen=True)
class StoredParts:
    """What a checkpoint may store beside an NVFP4 linear's weight: the bias [N], the calibrated activation
    scale (``input_scale``, a scalar: the act_scale=calibrated global) and the AWQ/SmoothQuant
    ``pre_quant_scale`` [K]."""

    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None


class Nvfp4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W [N, K] resident as NVFP4 (``weight`` returns the NVFP4Tensor).

    forward(x [S, K] or [..., K]) -> [S, N]: quantize x (producer, act_scale policy), then GEMM.
    forward_swiglu(h [S, 2F] = [gate | up]) -> [S, N] with K = F: fused silu(gate)*up -> quantize, GEMM.
    forward_quantized(packed uint8 [S, Kp/2] low nibble first, scales e4m3 swizzled [roundup(S,128), Cp],
    global_scale fp32 []) -> [S, N]: for callers whose producer already wrote the bytes.
    forward_fp8(a8 e4m3 [S, K], row_scale fp32 [S]) -> [S, N]: W4A8 on Hopper (fp8 backend only), for
    the rowwise e4m3 activations of ``fp8_producers``.
    The output dtype is ``out_dtype`` if given, else x's dtype (bf16 for forward_quantized).

    backend: a concrete GEMM backend name (``gemm_backends.BACKENDS``; the plan resolved ``auto``), reason: why
    it runs (the plan's reason, shown in ``extra_repr``); fp8_tiles: ``to_fp8_rowwise``'s tiles from the plan's
    tile table (the fp8 backend and ``forward_fp8``), None for the built-in ones. ``bind_backend`` rebinds the
    GEMM (the benches' emulation pass); moving the layer to another device keeps it.
    """

    def __init__(self, weight: nvfp4.NVFP4Tensor, *, backend: str, reason: str = "",
                 stored: StoredParts = StoredParts(), act_scale: str = "dynamic",
                 out_dtype: torch.dtype | None = None, scratch: Scratch | None = None,
                 fp8_tiles: tuple | None = None):
        super().__init__()
        if not isinstance(weight, nvfp4.NVFP4Tensor):
            raise TypeError(f"Nvfp4Linear needs an NVFP4Tensor weight; found {type(weight).__name__} "
                            "(use Nvfp4Linear.from_float, or runtime.io.comfy_quant to decode a stored layer)")
        self.out_features, self.in_features = weight.shape
        bias, input_scale, pre_quant_scale = stored.bias, stored.input_scale, stored.pre_quant_scale
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("global_scale", weight.global_scale)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}]; found {list(bias.shape)}")
        if pre_quant_scale is not None and tuple(pre_quant_scale.reshape(-1).shape) != (self.in_features,):
            raise ValueError(f"pre_quant_scale must be [{self.in_features}]; found {list(pre_quant_scale.shape)}")
        self.register_buffer("bias", None if bias is None else bias.to(weight.device))
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.reshape(()).to(weight.device, torch.float32))
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None
                             else pre_quant_scale.reshape(-1).to(weight.device))
        self.out_dtype = out_dtype
        self.scratch = scratch if scratch is not None else DEFAULT_SCRATCH
        self.fp8_tiles = fp8_tiles
        self.act_scale = act_scale
        g, self.act_scale_reason = nvfp4_producers.activation_global_scale(act_scale, self.input_scale)
        self._calibrated = g is not None  # the act_scale policy, bound: input_scale, or dynamic (None)
        self.bind_backend(backend, reason)

    def bind_backend(self, backend: str, reason: str = "") -> None:
        """Bind ``backend``'s product (``gemm_backends.bind_gemm``); a K it cannot take raises ValueError."""
        if backend not in BACKENDS:
            raise ValueError(f"gemm backend {backend!r}: expected one of {', '.join(BACKENDS)} (resolve auto with "
                             "the load plan, ops.registry.resolve('gemm', ...))")
        need = K_MULTIPLE.get(backend, 1)
        if self.in_features % need:
            raise H3Error(f"gemm backend {backend} needs K a multiple of {need}; this layer has K={self.in_features} "
                          f"([{self.out_features}, {self.in_features}]). Choose --gemm emulated or reference for it "
                          "(the load plan picks a backend every block linear of the model can run)")
        self._backend, self.backend_reason = backend, reason or backend
        self._gemm = bind_gemm(backend, fp8_tiles=self.fp8_tiles)

    @property
    def backend(self) -> str:
        """The bound GEMM backend's name (read-only: ``bind_backend`` changes it)."""
        return self._backend

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   input_scale: torch.Tensor | None = None, pre_quant_scale: torch.Tensor | None = None,
                   **kw) -> "Nvfp4Linear":
        """Quantize a float weight [N, K] (global scale amax / 2688): the Triton quantizer on CUDA, the
        reference elsewhere; both write the reference's bytes. The other keywords: ``StoredParts`` and
        ``Nvfp4Linear``'s own."""
        stored = StoredParts(bias, input_scale, pre_quant_scale)
        if weight.is_cuda:
            return cls(nvfp4_producers.quantize(weight.contiguous()), stored=stored, **kw)
        return cls(nvfp4.quantize(weight), stored=stored, **kw)

    @property
    def weight(self) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(self.packed, self.scales, self.global_scale, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend} "
                f"({self.backend_reason}), act_scale={self.act_scale_reason}")

    # -- forward -----------------------------------------------------------------------------------
    def act_global(self) -> torch.Tensor | None:
        """The activation's NVFP4 global scale under the bound act_scale policy: input_scale, or None (dynamic)."""
        return self.input_scale.float() if self._calibrated else None

    def _finish(self, y: torch.Tensor, shape_prefix: tuple) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape_prefix, self.out_features)

    def forward(self, x: torch.Tensor, amax_reduce: nvfp4_producers.AmaxReduce | None = None) -> torch.Tensor:
        """amax_reduce: with a dynamic activation scale, maps the activation's amax to the one the scale is taken
        from (sequence parallelism: the all-reduce over the ranks; see ``nvfp4_producers``); None: local."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; this layer expects {self.in_features}")
        prefix = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.in_features)
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        a = nvfp4_producers.quantize(x2.contiguous() if x2.stride(-1) != 1 else x2, self.act_global(),
                                     amax_reduce=amax_reduce)
        y = self._gemm(a, self.weight, self.out_dtype or x.dtype, self.scratch)
        return self._finish(y, prefix)

    def forward_swiglu(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != 2 * self.in_features:
            raise ValueError(f"forward_swiglu expects [S, 2F] = [gate | up] with F = {self.in_features}; "
                             f"found last dim {h.shape[-1]}")
        prefix = tuple(h.shape[:-1])
        h2 = h.reshape(-1, h.shape[-1])
        if self.pre_quant_scale is not None:  # the smoothing sits between the activation and the quantizer
            y = (reference.swiglu_reference(h2) * self.pre_quant_scale.float()).to(h.dtype)
            a = nvfp4_producers.quantize(y, self.act_global())
        else:
            a = nvfp4_producers.swiglu_quantize(h2, self.act_global())
        y = self._gemm(a, self.weight, self.out_dtype or h.dtype, self.scratch)
        return self._finish(y, prefix)

    def forward_quantized(self, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor
                          ) -> torch.Tensor:
        a = nvfp4.NVFP4Tensor(packed, scales, global_scale, (packed.shape[0], self.in_features))
        y = self._gemm(a, self.weight, self.out_dtype or torch.bfloat16, self.scratch)
        return self._finish(y, (packed.shape[0],))

    def forward_fp8(self, a8: torch.Tensor, row_scale: torch.Tensor, *, fast_accum: bool = False) -> torch.Tensor:
        """W4A8 (Hopper): a8 float8_e4m3fn [S, K] with one fp32 scale per row (activation = a8 *
        row_scale[:, None], as ``fp8_producers`` write it) -> [S, N]. The NVFP4 weight is re-expressed as
        rowwise e4m3 in the reusable scratch exactly as the fp8 backend does (``to_fp8_rowwise``), then
        ``torch._scaled_mm`` rowwise: scale_a = row_scale[:, None], scale_b = (weight row scale *
        weight global scale)[None, :], fp32 accumulation (``fast_accum``: Hopper's fast fp8 accumulation, CUDA only). Its result is bf16 on
        CUDA (the rowwise cuBLASLt output type) and, on CPU, fp32 when this layer's output is fp32;
        then converted to the output dtype (``out_dtype``, else bf16). Needs the fp8 GEMM backend."""
        if self.backend != "fp8":
            raise RuntimeError(f"forward_fp8 needs the fp8 GEMM backend; this layer runs {self.backend} "
                               f"({self.backend_reason})")
        s = a8.shape[0] if a8.dim() == 2 else -1
        if a8.dtype != torch.float8_e4m3fn or a8.dim() != 2 or a8.shape[1] != self.in_features \
                or not a8.is_contiguous():
            raise ValueError(f"forward_fp8 expects a contiguous float8_e4m3fn [S, {self.in_features}]; found "
                             f"{a8.dtype} {tuple(a8.shape)} strides {a8.stride()}")
        if row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (s,) or row_scale.device != a8.device:
            raise ValueError(f"row_scale must be float32 [{s}] on {a8.device}; found {row_scale.dtype} "
                             f"{tuple(row_scale.shape)} on {row_scale.device}")
        out_dtype = self.out_dtype or torch.bfloat16
        n, k = self.out_features, self.in_features
        w8, rw = nvfp4_producers.to_fp8_rowwise(self.weight, tiles=self.fp8_tiles,
                                                out=self.scratch.get("w", n * k, torch.float8_e4m3fn, a8.device))
        mm_dtype = torch.float32 if a8.device.type != "cuda" and out_dtype == torch.float32 else torch.bfloat16
        y = scaled_mm_rowwise(a8, w8, row_scale.unsqueeze(1), (rw * self.global_scale).unsqueeze(0), mm_dtype,
                              fast_accum=fast_accum)
        return self._finish(y.to(out_dtype), (s,))
