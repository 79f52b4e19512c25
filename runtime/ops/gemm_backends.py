"""The NVFP4 GEMM backends of the block linears: what each computes, where it runs, the one choice per load, and
the bound product a layer calls.

Each backend states its numerics against the exact NVFP4 product ``P = ga * gw * sum_k (va*sa)[m,k] *
(vw*sw)[n,k]`` of the quantized activation and weight:

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

``choose_gemm_backend`` (called once per load, by the plan through ``ops.registry.resolve``): ``auto`` picks
native where it runs, else on CUDA fp8 (cc >= 8.9) or bf16, on CPU emulated; a backend is only available when
every block linear's K is a multiple of what it needs (``K_MULTIPLE``). ``gemm_capability_table(device)``
lists every backend with the reason it is or is not available, e.g. ``native: refused, compute capability 9.0
< 10.0``. On CUDA, native and fp8 must also pass a probe, once per device: one small GEMM against the float64
product (``probe_backend``), so a torch build whose kernel for this GPU is missing or wrong is refused at load
with its error. A requested backend that cannot run is never swapped silently: ``strict=True`` raises,
otherwise the reason starts ``requested <name> unavailable: ...``.

``bind_gemm(name)`` turns the chosen name into the product ``fn(a, w, out_dtype, scratch) -> [M, N]`` a layer
keeps (``ops.linear.Nvfp4Linear``): nothing is looked up per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..errors import describe
from . import nvfp4, nvfp4_producers
from .blackwell_table import BY_NAME as _BLACKWELL

__all__ = ["BACKENDS", "K_MULTIPLE", "Capability", "gemm_capability_table", "choose_gemm_backend", "probe_backend",
           "Scratch", "DEFAULT_SCRATCH", "bind_gemm", "scaled_mm_rowwise"]

BACKENDS = ("native", "emulated", "fp8", "bf16", "reference")
_NATIVE_MIN_CC = min(_BLACKWELL["native"].archs)  # the Blackwell table's (ops.blackwell_table)
K_MULTIPLE = {"native": 32, "fp8": 16}  # what K a backend's kernel needs (others take any K)


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
    if cc < _NATIVE_MIN_CC:
        return False, (f"native: refused, compute capability {cc[0]}.{cc[1]} < {_NATIVE_MIN_CC[0]}.{_NATIVE_MIN_CC[1]} "
                       "(no FP4 tensor cores)")
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
        outs = {"": bind_gemm(backend)(a, w, torch.float32, DEFAULT_SCRATCH)}
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


def _fits_k(c: Capability, k_dims: tuple[int, ...]) -> Capability:
    """``c`` refused when a block linear's K is not a multiple of what its kernel needs."""
    need = K_MULTIPLE.get(c.backend, 1)
    bad = [k for k in k_dims if k % need]
    if not c.available or not bad:
        return c
    return Capability(c.backend, False, f"{c.backend}: refused, K={bad[0]} is not a multiple of {need}")


def choose_gemm_backend(device: torch.device | str, requested: str = "auto", *, strict: bool = False,
                        k_dims: Iterable[int] = ()) -> tuple[str, str]:
    """Pick the NVFP4 GEMM backend for ``device`` -> (name, reason); see the module docstring. ``k_dims``: the
    block linears' K (in_features); a backend that cannot take one of them is not available."""
    k_dims = tuple(k_dims)
    table = {c.backend: _fits_k(c, k_dims) for c in gemm_capability_table(device)}
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"gemm backend {requested!r}: expected auto or one of {', '.join(BACKENDS)}")
    if requested != "auto":
        c = table[requested]
        if c.available:
            return requested, c.reason
        if strict:
            raise RuntimeError(f"gemm backend {requested!r} unavailable: {c.reason}")
        name, why = choose_gemm_backend(device, "auto", k_dims=k_dims)
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

    def clear(self) -> None:
        """Drop every buffer (they are allocated again, at the size asked, by the next ``get``)."""
        self._bufs.clear()


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
         fast_accum: bool = False, tiles: tuple | None = None) -> torch.Tensor:
    (m, k), (n, _) = a.shape, w.shape
    a8, ra = nvfp4_producers.to_fp8_rowwise(a, out=scratch.get("a", m * k, torch.float8_e4m3fn, a.device),
                                            tiles=tiles)
    w8, rw = nvfp4_producers.to_fp8_rowwise(w, out=scratch.get("w", n * k, torch.float8_e4m3fn, a.device),
                                            tiles=tiles)
    # rowwise-scaled fp8 cuBLASLt GEMMs produce bf16 (the one output type every torch version accepts)
    out = scaled_mm_rowwise(a8, w8, (ra * a.global_scale).unsqueeze(1), (rw * w.global_scale).unsqueeze(0),
                            torch.bfloat16, fast_accum)
    return out.to(out_dtype)


def _reference(a: nvfp4.NVFP4Tensor, w: nvfp4.NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (nvfp4.dequantize(a, torch.float64) @ nvfp4.dequantize(w, torch.float64).t()).to(out_dtype)


# (a, w, out_dtype, scratch) -> [M, N]: one GEMM of an NVFP4 activation [M, K] and weight [N, K]
Gemm = Callable[[nvfp4.NVFP4Tensor, nvfp4.NVFP4Tensor, torch.dtype, Scratch], torch.Tensor]


def bind_gemm(backend: str, *, fp8_tiles: tuple | None = None) -> Gemm:
    """The product of ``backend`` as ``fn(a [M, K], w [N, K], out_dtype, scratch) -> [M, N]`` (the first N
    columns; K must match, not checked per call). Bound once per layer at load; ``fp8_tiles``: the fp8
    backend's ``to_fp8_rowwise`` tiles from the plan's tile table (None: built in)."""
    if backend == "native":
        return lambda a, w, out_dtype, scratch: _native(a, w, out_dtype)[:, : w.shape[0]]
    if backend == "emulated":
        return lambda a, w, out_dtype, scratch: _emulated(a, w, out_dtype)[:, : w.shape[0]]
    if backend == "bf16":
        return lambda a, w, out_dtype, scratch: _bf16(a, w, out_dtype, scratch)[:, : w.shape[0]]
    if backend == "fp8":
        return lambda a, w, out_dtype, scratch: _fp8(a, w, out_dtype, scratch, tiles=fp8_tiles)[:, : w.shape[0]]
    if backend == "reference":
        return lambda a, w, out_dtype, scratch: _reference(a, w, out_dtype)[:, : w.shape[0]]
    raise ValueError(f"gemm backend {backend!r}: expected one of {', '.join(BACKENDS)}")
