"""``Nvfp4Linear``: a linear layer whose weight stays NVFP4, with one GEMM backend chosen at construction.

Backends (``RuntimeOptions.gemm``), each stating its numerics against the exact NVFP4 product
``P = ga * gw * sum_k (va*sa)[m,k] * (vw*sw)[n,k]`` of the quantized activation and weight:

============ ============================= ==================================================================
backend      where                          numerics
============ ============================= ==================================================================
native       CUDA, compute capability >= 10 cuBLASLt block-scaled FP4 through ``torch.nn.functional.scaled_mm``
                                            (``torch._scaled_mm`` on older torch): exact products, fp32
                                            accumulation (the library's order), one rounding to the output dtype
emulated     CUDA: Triton kernel;           exact: both operands decoded to ``v*s`` (exact in bf16), exact
             CPU: torch fp32                products, fp32 accumulation (bf16 tensor-core MMA on CUDA), times
                                            ``ga*gw``, one rounding to the output dtype
bf16         any (the Hopper fast path)     activation ``v*s`` exact in bf16; weight expanded per call into a
                                            reusable bf16 scratch as ``bf16(v*s*ga*gw)`` (one rounding,
                                            <= 2^-9 relative per element); cuBLAS bf16 GEMM, fp32 accumulation,
                                            bf16 result (converted if another output dtype is asked for)
fp8          CUDA cc >= 8.9, CPU            both operands re-expressed per call, in reusable scratch, as e4m3 with
             (the faster Hopper path)       one fp32 scale per row: ``e4m3_rne(v*s / r)``, ``r = 6 * max block
                                            scale / 448`` (<= 2^-4 relative per element, or 2^-10 * r absolute
                                            in e4m3's subnormal range); ``torch._scaled_mm`` rowwise, fp32
                                            accumulation (no fast accumulation), bf16 result
reference    any                            float64: ``dequantize(a, fp64) @ dequantize(w, fp64).T`` (exact
                                            operands, fp64 accumulation); the oracle of the tests
============ ============================= ==================================================================

``auto`` picks native where it runs, else on CUDA fp8 (cc >= 8.9) or bf16, on CPU emulated.
``gemm_capability_table(device)`` lists every backend with the reason it is or is not available, e.g.
``native: refused, compute capability 9.0 < 10.0``. On CUDA, native and fp8 must also pass a probe, once per
device: one small GEMM against the float64 product (``probe_backend``), so a torch build whose kernel for this
GPU is missing or wrong is refused at load with its error. The choice is made once, printed in ``extra_repr``
and kept in ``backend`` / ``backend_reason``. A requested backend that cannot run is never swapped
silently: ``strict=True`` raises, otherwise the reason starts ``requested <name> unavailable: ...``.

The activation is quantized by the producers of ``nvfp4_producers`` (Triton on CUDA, the reference on
CPU) with the ``act_scale`` policy: ``dynamic`` (amax per call) or ``calibrated`` (the checkpoint's
``input_scale``; layers without one fall back to dynamic, see ``act_scale_reason``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import describe
from . import nvfp4, nvfp4_producers, reference

__all__ = ["BACKENDS", "Capability", "gemm_capability_table", "choose_gemm_backend", "probe_backend", "Scratch",
           "Nvfp4Linear", "nvfp4_matmul"]

BACKENDS = ("native", "emulated", "fp8", "bf16", "reference")


@dataclass(frozen=True)
class Capability:
    backend: str
    available: bool
    reason: str


def _cc(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _native_status(device: torch.device) -> tuple[bool, str]:
    cc = _cc(device)
    if cc is None:
        return False, f"native: refused, needs a CUDA device with compute capability >= 10.0 (found {device.type})"
    if cc < (10, 0):
        return False, f"native: refused, compute capability {cc[0]}.{cc[1]} < 10.0 (no FP4 tensor cores)"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return False, f"native: refused, torch {torch.__version__} has no float4_e2m1fn_x2 (needs torch >= 2.7)"
    api = "torch.nn.functional.scaled_mm" if hasattr(F, "scaled_mm") else "torch._scaled_mm"
    return True, f"native: cuBLASLt block-scaled FP4 via {api} on compute capability {cc[0]}.{cc[1]}"


# the load-time probe of the CUDA backends that depend on torch's scaled GEMM kernels for this GPU
PROBE_SHAPE = (128, 64, 256)  # M, N, K
# rel-L2 against the float64 product of the same NVFP4 operands. native: exact products, fp32 accumulation,
# one bf16 rounding (~2^-9): 2e-2 leaves room for any accumulation order. fp8: each operand element re-expressed
# in e4m3 (<= 2^-4 relative, ~0.02-0.03 in rel-L2, also with fast accumulation): 0.1. A wrong layout, scale
# order or swizzle measures ~1.
PROBE_TOL = {"native": 2e-2, "fp8": 0.1}
_PROBED: dict[tuple[str, str], tuple[bool, str]] = {}


def probe_backend(backend: str, device: torch.device | str) -> tuple[bool, str]:
    """(ok, reason) of one small GEMM through ``backend`` on ``device`` against the float64 reference; for fp8
    also the rowwise product with fast accumulation (what the W4A8 stack calls). A torch build without a working
    kernel for this GPU is refused at load with its error instead of failing at the first forward, and a wrong
    result is refused with its error. Measured once per backend and device (``_PROBED``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (backend, str(dev))
    if key not in _PROBED:
        _PROBED[key] = _run_probe(backend, dev)
    return _PROBED[key]


def _run_probe(backend: str, dev: torch.device) -> tuple[bool, str]:
    m, n, k = PROBE_SHAPE
    g = torch.Generator().manual_seed(20261129)
    try:
        a = nvfp4.quantize(torch.randn(m, k, generator=g).to(dev), pad_rows=1)
        w = nvfp4.quantize((torch.randn(n, k, generator=g) * k ** -0.5).to(dev))
        outs = {"": nvfp4_matmul(a, w, backend, torch.float32)}
        if backend == "fp8":
            outs[" (fast accumulation)"] = _fp8(a, w, torch.float32, DEFAULT_SCRATCH, fast_accum=True)[:, :n]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - whatever the kernel raises is the reason to refuse
        return False, f"probe failed: {describe(e)}"
    ref = _reference(a, w, torch.float64)[:m]
    errs = {}
    for tag, y in outs.items():
        y = y[:m].double()
        errs[tag] = float((y - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("inf")
    worst = max(errs, key=errs.get)
    shape = f"{m}x{n}x{k}"
    tol = PROBE_TOL.get(backend, PROBE_TOL["native"])
    if errs[worst] > tol:
        return False, (f"probe failed: rel_l2 {errs[worst]:.3g}{worst} against the float64 product on {shape} "
                       f"(tolerance {tol})")
    return True, "probe ok (rel_l2 " + ", ".join(f"{v:.2g}{t}" for t, v in errs.items()) + f" on {shape})"


def _probed(backend: str, dev: torch.device, ok: bool, why: str) -> Capability:
    """A statically available CUDA backend stays available only if its probe passes."""
    if not ok or dev.type != "cuda":
        return Capability(backend, ok, why)
    pok, pwhy = probe_backend(backend, dev)
    return Capability(backend, True, f"{why}; {pwhy}") if pok else Capability(
        backend, False, f"{backend}: refused, {pwhy}")


def gemm_capability_table(device: torch.device | str) -> list[Capability]:
    """Every NVFP4 GEMM backend for ``device``, available or not, with the reason. On CUDA the native and fp8
    backends are also probed once per device (``probe_backend``)."""
    dev = torch.device(device)
    rows = [_probed("native", dev, *_native_status(dev))]
    if dev.type == "cuda":
        ok, why = nvfp4_producers.triton_status(dev)
        rows.append(Capability("emulated", ok, f"emulated: Triton exact-product kernel (bf16 MMA, fp32 "
                                               f"accumulation); {why}" if ok else f"emulated: refused, {why}"))
        cc = _cc(dev)
        if cc is not None and cc >= (8, 9):
            rows.append(_probed("fp8", dev, True, f"fp8: rowwise e4m3 scratch + torch._scaled_mm on compute "
                                                  f"capability {cc[0]}.{cc[1]}"))
        else:
            have = "no CUDA device" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
            rows.append(Capability("fp8", False, f"fp8: refused, fp8 tensor cores need compute capability >= 8.9 ({have})"))
        rows.append(Capability("bf16", True, "bf16: bf16 weight scratch + cuBLAS bf16 GEMM"))
    else:
        rows.append(Capability("emulated", True, "emulated: torch fp32 dequantize + fp32 matmul (CPU)"))
        rows.append(Capability("fp8", True, "fp8: rowwise e4m3 operands, exact products with fp32 accumulation on "
                                            "CPU (slow; for tests)"))
        rows.append(Capability("bf16", True, "bf16: bf16 dequantize + torch bf16 matmul on CPU (slow; for tests)"))
    rows.append(Capability("reference", True, "reference: float64 dequantized matmul"))
    return rows


def choose_gemm_backend(device: torch.device | str, requested: str = "auto", *, strict: bool = False
                        ) -> tuple[str, str]:
    """Pick the NVFP4 GEMM backend for ``device`` -> (name, reason); see the module docstring."""
    table = {c.backend: c for c in gemm_capability_table(device)}
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"gemm backend {requested!r}: expected auto or one of {', '.join(BACKENDS)}")
    if requested != "auto":
        c = table[requested]
        if c.available:
            return requested, c.reason
        if strict:
            raise RuntimeError(f"gemm backend {requested!r} unavailable: {c.reason}")
        name, why = choose_gemm_backend(device, "auto")
        return name, f"requested {requested} unavailable: {c.reason}; using {name}: {why}"
    refused = []
    order = ("native", "fp8", "bf16") if torch.device(device).type == "cuda" else ("native", "emulated")
    for name in order:
        c = table[name]
        if c.available:
            return name, c.reason + (f" ({'; '.join(refused)})" if refused else "")
        refused.append(c.reason)
    return "reference", "reference: no faster backend (" + "; ".join(refused) + ")"


class Scratch:
    """Reusable device buffers for the bf16/fp8 backends: each slot grows to the largest layer seen and is
    reused by every layer, so only one layer's expanded operands exist at a time."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, dtype, torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            self._bufs.pop(key, None)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


DEFAULT_SCRATCH = Scratch()


# ----------------------------------------------------------------------------------------------
# the product, per backend
# ----------------------------------------------------------------------------------------------

def _native(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    fp4 = torch.float4_e2m1fn_x2  # low nibble first: our internal order, no conversion
    mat_a, mat_b = a.packed.view(fp4), w.packed.view(fp4).t()
    if hasattr(F, "scaled_mm"):
        st, sw = F.ScalingType, F.SwizzleType
        return F.scaled_mm(mat_a, mat_b, scale_a=[a.scales.reshape(-1), a.global_scale],
                           scale_recipe_a=[st.BlockWise1x16, st.TensorWise],
                           scale_b=[w.scales.reshape(-1), w.global_scale],
                           scale_recipe_b=[st.BlockWise1x16, st.TensorWise],
                           swizzle_a=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE], swizzle_b=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
                           output_dtype=out_dtype, use_fast_accum=False)
    out = torch._scaled_mm(mat_a, mat_b, a.scales.reshape(-1), w.scales.reshape(-1), out_dtype=torch.float32)
    return (out * (a.global_scale * w.global_scale)).to(out_dtype)


def _emulated(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.device.type == "cuda":
        return nvfp4_producers.nvfp4_gemm(a, w, out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
                             ).to(out_dtype)
    acc = nvfp4.dequantize_blocks(a, torch.float32) @ nvfp4.dequantize_blocks(w, torch.float32).t()
    return (acc * (a.global_scale * w.global_scale)).to(out_dtype)


def _bf16(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
    (m, k), (n, _) = a.shape, w.shape
    sa = scratch.get("a", m * k, torch.bfloat16, a.device)
    sw = scratch.get("w", n * k, torch.bfloat16, a.device)
    a16 = nvfp4_producers.dequantize_bf16(a, None, out=sa)
    w16 = nvfp4_producers.dequantize_bf16(w, a.global_scale * w.global_scale, out=sw)
    return (a16 @ w16.t()).to(out_dtype)


def scaled_mm_rowwise(a8: torch.Tensor, w8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a8 [M, K] e4m3 * scale_a [M, 1]) @ (w8 [N, K] e4m3 * scale_b [1, N]).T -> [M, N] in out_dtype.

    CUDA: ``torch._scaled_mm`` rowwise (cuBLASLt; bf16 output; ``fast_accum`` = Hopper's reduced-precision
    fp8 accumulation, off unless asked). CPU (tests): the same math written out -- e4m3 values are exact in
    fp32 and so are their products, fp32 accumulation, the scales applied to the fp32 sums, one rounding to
    out_dtype -- because torch's CPU ``_scaled_mm`` takes per-tensor scales only in some releases (2.11)."""
    if a8.device.type == "cuda":
        return torch._scaled_mm(a8, w8.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    y = (a8.float() @ w8.float().t()) * scale_a.float() * scale_b.float()
    return y.to(out_dtype)


def _fp8(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, out_dtype: torch.dtype, scratch: Scratch,
         fast_accum: bool = False) -> torch.Tensor:
    (m, k), (n, _) = a.shape, w.shape
    a8, ra = nvfp4_producers.to_fp8_rowwise(a, out=scratch.get("a", m * k, torch.float8_e4m3fn, a.device))
    w8, rw = nvfp4_producers.to_fp8_rowwise(w, out=scratch.get("w", n * k, torch.float8_e4m3fn, a.device))
    # rowwise-scaled fp8 cuBLASLt GEMMs produce bf16 (the one output type every torch version accepts)
    out = scaled_mm_rowwise(a8, w8, (ra * a.global_scale).unsqueeze(1), (rw * w.global_scale).unsqueeze(0),
                            torch.bfloat16, fast_accum)
    return out.to(out_dtype)


def _reference(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (nvfp4.dequantize(a, torch.float64) @ nvfp4.dequantize(w, torch.float64).t()).to(out_dtype)


def nvfp4_matmul(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, backend: str, out_dtype: torch.dtype = torch.bfloat16,
                 scratch: Scratch | None = None) -> torch.Tensor:
    """[M, K] x [N, K]^T -> [M, N] with ``backend`` (no availability check; see Nvfp4Linear)."""
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"activation is [M, {a.shape[1]}] but the weight is [N, {w.shape[1]}]; K must match")
    scratch = scratch if scratch is not None else DEFAULT_SCRATCH
    if backend == "native":
        out = _native(a, w, out_dtype)
    elif backend == "emulated":
        out = _emulated(a, w, out_dtype)
    elif backend == "bf16":
        out = _bf16(a, w, out_dtype, scratch)
    elif backend == "fp8":
        out = _fp8(a, w, out_dtype, scratch)
    elif backend == "reference":
        out = _reference(a, w, out_dtype)
    else:
        raise ValueError(f"gemm backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    return out[:, : w.shape[0]]


# ----------------------------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------------------------

class Nvfp4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W [N, K] resident as NVFP4 (``weight`` returns the NVFP4Tensor).

    forward(x [S, K] or [..., K]) -> [S, N]: quantize x (producer, act_scale policy), then GEMM.
    forward_swiglu(h [S, 2F] = [gate | up]) -> [S, N] with K = F: fused silu(gate)*up -> quantize, GEMM.
    forward_quantized(packed uint8 [S, Kp/2] low nibble first, scales e4m3 swizzled [roundup(S,128), Cp],
    global_scale fp32 []) -> [S, N]: for callers whose producer already wrote the bytes.
    forward_fp8(a8 e4m3 [S, K], row_scale fp32 [S]) -> [S, N]: W4A8 on Hopper (fp8 backend only), for
    the rowwise e4m3 activations of ``fp8_producers``.
    The output dtype is ``out_dtype`` if given, else x's dtype (bf16 for forward_quantized).
    """

    def __init__(self, weight: nvfp4.NVFP4Tensor, *, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, pre_quant_scale: torch.Tensor | None = None,
                 backend: str = "auto", act_scale: str = "dynamic", out_dtype: torch.dtype | None = None,
                 strict: bool = False, scratch: Scratch | None = None):
        super().__init__()
        if not isinstance(weight, nvfp4.NVFP4Tensor):
            raise TypeError(f"Nvfp4Linear needs an NVFP4Tensor weight; found {type(weight).__name__} "
                            "(use Nvfp4Linear.from_float, or runtime.io.comfy_quant to decode a stored layer)")
        self.out_features, self.in_features = weight.shape
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
        self.requested_backend, self.strict = backend, strict
        self.scratch = scratch
        self.act_scale = act_scale
        self._choose()

    def _choose(self) -> None:
        self.backend, self.backend_reason = choose_gemm_backend(self.packed.device, self.requested_backend,
                                                                strict=self.strict)
        k, need = self.in_features, {"native": 32, "fp8": 16}.get(self.backend, 1)
        if k % need:
            why = f"{self.backend}: refused, K={k} is not a multiple of {need}"
            if self.strict and self.requested_backend == self.backend:
                raise RuntimeError(why)
            self.backend, self.backend_reason = "emulated" if self.packed.is_cuda else "reference", why
        _, self.act_scale_reason = nvfp4_producers.activation_global_scale(self.act_scale, self.input_scale)

    def _apply(self, fn, recurse=True):
        before = self.packed.device
        out = super()._apply(fn, recurse)
        if self.packed.device.type != before.type:
            self._choose()
        return out

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> "Nvfp4Linear":
        """Quantize a float weight [N, K] (global scale amax / 2688): the Triton quantizer on CUDA, the
        reference elsewhere; both write the reference's bytes."""
        if weight.is_cuda:
            return cls(nvfp4_producers.quantize(weight.contiguous()), bias=bias, **kw)
        return cls(nvfp4.quantize(weight), bias=bias, **kw)

    @property
    def weight(self) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(self.packed, self.scales, self.global_scale, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend} "
                f"({self.backend_reason}), act_scale={self.act_scale_reason}")

    # -- forward -----------------------------------------------------------------------------------
    def _act_global(self) -> torch.Tensor | None:
        g, _ = nvfp4_producers.activation_global_scale(self.act_scale, self.input_scale)
        return g

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
        a = nvfp4_producers.quantize(x2.contiguous() if x2.stride(-1) != 1 else x2, self._act_global(),
                                     amax_reduce=amax_reduce)
        y = nvfp4_matmul(a, self.weight, self.backend, self.out_dtype or x.dtype, self.scratch)
        return self._finish(y, prefix)

    def forward_swiglu(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != 2 * self.in_features:
            raise ValueError(f"forward_swiglu expects [S, 2F] = [gate | up] with F = {self.in_features}; "
                             f"found last dim {h.shape[-1]}")
        prefix = tuple(h.shape[:-1])
        h2 = h.reshape(-1, h.shape[-1])
        if self.pre_quant_scale is not None:  # the smoothing sits between the activation and the quantizer
            y = (reference.swiglu_reference(h2) * self.pre_quant_scale.float()).to(h.dtype)
            a = nvfp4_producers.quantize(y, self._act_global())
        else:
            a = nvfp4_producers.swiglu_quantize(h2, self._act_global())
        y = nvfp4_matmul(a, self.weight, self.backend, self.out_dtype or h.dtype, self.scratch)
        return self._finish(y, prefix)

    def forward_quantized(self, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor
                          ) -> torch.Tensor:
        a = nvfp4.NVFP4Tensor(packed, scales, global_scale, (packed.shape[0], self.in_features))
        y = nvfp4_matmul(a, self.weight, self.backend, self.out_dtype or torch.bfloat16, self.scratch)
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
        scratch = self.scratch if self.scratch is not None else DEFAULT_SCRATCH
        n, k = self.out_features, self.in_features
        w8, rw = nvfp4_producers.to_fp8_rowwise(self.weight, out=scratch.get("w", n * k, torch.float8_e4m3fn, a8.device))
        mm_dtype = torch.float32 if a8.device.type != "cuda" and out_dtype == torch.float32 else torch.bfloat16
        y = scaled_mm_rowwise(a8, w8, row_scale.unsqueeze(1), (rw * self.global_scale).unsqueeze(0), mm_dtype,
                              fast_accum=fast_accum)
        return self._finish(y.to(out_dtype), (s,))
