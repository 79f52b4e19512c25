"""Full (unmasked) attention reading q, k, v as strided NHD views of the fused qkv buffer, bound once per load.

``qkv`` is the QKV projection output ``[S, 3*H*D]``, row-major thirds ``[q_all | k_all | v_all]``; head ``h``
of q is columns ``[h*D, (h+1)*D)``. :func:`qkv_views` turns it into three ``[1, S, H, D]`` views with strides
``(S*3HD, 3HD, D, 1)`` -- no copies. The result is ``[S, H*D]`` in q's dtype, head-major columns like q;
softmax scale ``1/sqrt(D)`` unless given.

Backends (one name each; :func:`choose_attention_backend` picks one at load and says why; the load plan records
it and :func:`bind_attention` turns it into the one function every caller runs -- the block ops, sequence
parallelism, the load-time probe, the tests and the benches):

============== ===========================================================================================
reference      fp32 math (IEEE, no TF32), chunked over queries so S = 37,810 fits; the oracle
sdpa           torch ``scaled_dot_product_attention``, torch picks the kernel
sdpa_cudnn     ... restricted to cuDNN (fastest bf16 SDPA on sm_90); also sdpa_flash, sdpa_efficient,
               sdpa_math. A restricted kernel that cannot run raises; it never falls back inside torch.
sage2, sage1   SageAttention 2 (per-architecture kernels, V handling on sm_90) and 1 (a private copy of K):
               ``ops.sage``
fa3, fa3_fp8   FlashAttention-3 on sm_90: bf16 views as they are, or e4m3 operands with per-head descales and
               K/V smoothing built by our producers: ``ops.flash_attention``
sage3, fa4     Blackwell: SageAttention3 (FP4, sm_120/121) and FlashAttention-4 (sm_100/103), guarded by
               capability before any import, each with a CPU emulation of its numerics:
               ``ops.blackwell_attention``. Explicit requests only: ``auto`` never picks them (no Blackwell
               measurement was made; sage3 is lossy by design)
============== ===========================================================================================
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch
import torch.nn.attention

from ..errors import describe
from . import blackwell_attention, flash_attention, sage
from .interface import AttentionFn, RowsAttentionFn

__all__ = [
    "BACKENDS",
    "TOLERANCE",
    "AttentionFn",
    "exact_attention_reference",
    "attention_flops",
    "backend_table",
    "bind_attention",
    "choose_attention_backend",
    "qkv_views",
    "rel_l2",
    "RowsAttentionFn",
    "bind_attention_qkv",
    "row_exactness",
]

BACKENDS = ("sage2", "fa3_fp8", "fa3", "sage3", "fa4", "sage1", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "reference")

# rel-L2 of each backend's output against the fp32 reference on random N(0,1) q, k, v (bf16), with the
# reason. Random Gaussian inputs are the worst case for the quantized kernels: the softmax is nearly flat,
# so the output is an average of ~S values of v with magnitude ~S^-1/2, and per-element quantization
# noise of V (fp8) and of q.k (int8) does not average away relative to it. The error is then roughly
# independent of S. Used by the tests and by the load-time probe.
TOLERANCE: dict[str, tuple[float, str]] = {
    "reference": (1e-5, "fp32 vs fp64 math: only summation order differs"),
    "sdpa": (1e-2, "bf16 output rounding (~2^-9 per element) plus P rounded to bf16 before PV"),
    "sdpa_cudnn": (1e-2, "as sdpa: bf16 P and output rounding"),
    "sdpa_flash": (1e-2, "as sdpa: bf16 P and output rounding"),
    "sdpa_efficient": (1e-2, "as sdpa: bf16 output rounding"),
    "sdpa_math": (1e-2, "as sdpa: bf16 inputs/outputs, fp32 inside"),
    "sage1": (3e-2, "INT8 per-block q and k (step ~max/127) with K smoothing, fp16 P and V: ~1.4e-2 expected"),
    "sage2": (6e-2, "INT8 q,k plus FP8 e4m3 V (3 mantissa bits, per-channel scale): ~2^-4 per V element"),
    "fa3": (1e-2, "as sdpa: fp32 softmax, P rounded to bf16 before PV, bf16 output"),
    "fa3_fp8": (8e-2, "e4m3 q, k', v' (2^-4 relative per element, per-head scales) and P rounded to e4m3 inside "
                      "the kernel: on random data every q.k term and every P.v term carries ~2^-4 noise"),
    **blackwell_attention.TOLERANCE,
}

_SDPA_KERNELS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


# ----------------------------------------------------------------------------------------------
# layout helpers
# ----------------------------------------------------------------------------------------------


def _check_qkv(qkv: torch.Tensor, heads: int, head_dim: int) -> int:
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [S, 3*H*D]; found shape {tuple(qkv.shape)}")
    if qkv.shape[1] != 3 * heads * head_dim:
        raise ValueError(
            f"qkv has {qkv.shape[1]} columns; heads={heads} x head_dim={head_dim} needs 3*H*D = {3 * heads * head_dim}"
        )
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv needs unit column stride (row-major); found strides {qkv.stride()}")
    if not qkv.is_floating_point():
        raise ValueError(f"qkv must be a float tensor; found {qkv.dtype}")
    return qkv.shape[0]


def qkv_views(qkv: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as ``[1, S, H, D]`` (NHD, batch 1) views of ``qkv [S, 3*H*D]``: strides
    ``(S*row, row, D, 1)`` with ``row = qkv.stride(0)``. They share qkv's storage (no copies)."""
    _check_qkv(qkv, heads, head_dim)
    t = qkv.unflatten(1, (3, heads, head_dim))  # [S, 3, H, D] view
    return tuple(t[:, i].unsqueeze(0) for i in range(3))  # type: ignore[return-value]


def attention_flops(seq: int, heads: int, head_dim: int) -> float:
    """Matmul FLOPs of one full attention (QK^T and PV): ``4 * S^2 * D * H``."""
    return 4.0 * seq * seq * head_dim * heads


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """fp32 matmuls without TF32 inside (restores the caller's setting)."""
    m = torch.backends.cuda.matmul
    attr, value = ("fp32_precision", "ieee") if hasattr(m, "fp32_precision") else ("allow_tf32", False)
    old = getattr(m, attr)
    setattr(m, attr, value)
    try:
        yield
    finally:
        setattr(m, attr, old)


def exact_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    rows: Optional[torch.Tensor] = None,
    max_elems: int = 1 << 28,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """softmax(q k^T * scale) v in ``compute_dtype`` (fp32 by default; IEEE, no TF32).

    q, k, v: ``[S, H, D]`` or ``[1, S, H, D]`` (any strides). ``rows``: optional int64 indices of the
    query rows to compute (all keys are always used) — a cheap oracle at S = 37,810. The score matrix is
    built ``max_elems`` elements (1 GiB in fp32) at a time. Returns ``[len(rows) or S, H*D]`` in
    ``compute_dtype``.
    """
    if q.dim() == 4:
        q, k, v = q[0], k[0], v[0]
    sk, h, d = k.shape
    if v.shape != k.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q, k, v must be [S, H, D] alike; found {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    scale = d ** -0.5 if scale is None else scale
    if rows is not None:
        q = q.index_select(0, rows.to(q.device))
    sq = q.shape[0]
    out = torch.empty(sq, h * d, dtype=compute_dtype, device=q.device)
    chunk = max(1, max_elems // max(1, h * sk))
    with _ieee_fp32_matmul():
        kf = k.to(compute_dtype).transpose(0, 1).contiguous()  # [H, Sk, D]
        vf = v.to(compute_dtype).transpose(0, 1).contiguous()
        for i in range(0, sq, chunk):
            qc = q[i : i + chunk].to(compute_dtype).transpose(0, 1)  # [H, c, D]
            p = torch.softmax(torch.matmul(qc, kf.transpose(1, 2)) * scale, dim=-1)
            out[i : i + chunk] = torch.matmul(p, vf).transpose(0, 1).reshape(-1, h * d)
    return out



# ----------------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------------

_PROBES: dict = {}
_PROBE_SHAPE = (200, 2)  # rows (not a multiple of 128: exercises the padding paths), heads


def _probe(backend: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Run ``backend`` once, bound as a load binds it (Sage2 with the V handling the plan will pick), on a small
    random qkv buffer on ``device`` and check it against the fp32 reference (TOLERANCE) and that the buffer is
    unchanged. Cached per (backend, device, D, dtype; for sage1 also the loaded package)."""
    key = (backend, str(device), head_dim, dtype, sage.SAGE1["source"] if backend == "sage1" else None)
    if key in _PROBES:
        return _PROBES[key]
    s, h = _PROBE_SHAPE
    try:
        g = torch.Generator(device=device).manual_seed(1234)  # private RNG: the caller's stream is untouched
        qkv = torch.randn(s, 3 * h * head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
        before = qkv.clone()
        v = sage.v_handling_status("fused", device, head_dim)[0] if backend == "sage2" else "none"
        out = bind_attention(backend, head_dim, device=device, v_handling=v)(qkv)  # what a load binds
        ref = exact_attention_reference(*qkv_views(qkv, h, head_dim))
        err = rel_l2(out.float(), ref)
        tol = TOLERANCE[backend][0]
        if not torch.equal(qkv, before):
            res = (False, f"{backend} probe changed the caller's qkv buffer")
        elif not math.isfinite(err) or err > tol:
            res = (False, f"{backend} probe rel_l2 {err:.3g} > {tol:g} vs the fp32 reference")
        else:
            res = (True, f"probe ok (rel_l2 {err:.2g} on S={s}, H={h}, D={head_dim}, {str(dtype).split('.')[-1]})")
    except Exception as e:  # a kernel that cannot run here: record why
        res = (False, f"{backend} probe failed: {describe(e)}")
    _PROBES[key] = res
    return res


# (device, head_dim, dtype) -> (available, reason) of the backends whose own module holds the whole check
_OWN_CHECKS = {"fa3": functools.partial(flash_attention.fa3_check, "fa3"),
               "fa3_fp8": functools.partial(flash_attention.fa3_check, "fa3_fp8"),
               **{name: fns[0] for name, fns in blackwell_attention.BLACKWELL_BACKENDS.items()}}


def _available(backend: str, device: torch.device, head_dim: int, dtype: torch.dtype, probe: bool) -> tuple[bool, str]:
    if backend == "reference":
        return True, "fp32 reference (chunked)"
    if backend in ("sdpa", "sdpa_math"):
        return True, f"torch {torch.__version__} scaled_dot_product_attention" + (" (math kernel)" if backend == "sdpa_math" else "")
    cc = sage.capability(device)
    if cc is None:
        return False, f"{backend} needs a CUDA device (found {device})"
    detail = f"sm_{cc[0]}{cc[1]}"
    if backend in _OWN_CHECKS:  # their modules judge architecture, package, head size and dtype
        ok, detail = _OWN_CHECKS[backend](device, head_dim, dtype)
        if not ok:
            return False, detail
    elif backend in ("sage1", "sage2") and dtype not in (torch.float16, torch.bfloat16):
        return False, f"{backend} needs fp16/bf16 activations (compute dtype is {dtype})"
    elif backend == "sage2":
        mod, ver = sage.sage2_module()
        if mod is None:
            return False, ver
        try:
            fn_name, _, flag = sage.sage2_plan(cc)
        except RuntimeError as e:
            return False, str(e)
        core = getattr(mod, "core", None)
        if core is not None and getattr(core, flag, True) is False:
            return False, (
                f"sageattention {ver} was built without the extension this GPU needs "
                f"(sageattention.core.{flag} is False); rebuild with TORCH_CUDA_ARCH_LIST={cc[0]}.{cc[1]}"
            )
        if head_dim > 128:
            return False, f"sage2 supports head_dim <= 128 (found {head_dim})"
        detail = f"{detail}: SageAttention2 {ver} {fn_name}"
    elif backend == "sage1":
        mod, src = sage.sage1_module()
        if mod is None:
            return False, src
        if head_dim not in (64, 96, 128):
            return False, f"sage1 supports head_dim 64, 96, 128 (found {head_dim})"
        detail = f"{detail}: {src}, private copy of K per call"
    else:
        detail = f"{detail}: torch {torch.__version__} SDPA restricted to {_SDPA_KERNELS[backend]}"
    if probe:
        ok, why = _probe(backend, device, head_dim, dtype)
        return ok, f"{detail}; {why}" if ok else why
    return True, detail


def choose_attention_backend(
    device: "torch.device | str",
    requested: str = "auto",
    *,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    strict: bool = False,
    probe: bool = True,
) -> tuple[str, str]:
    """Pick the attention backend for ``device``; returns ``(name, reason)``.

    ``auto``: CPU -> reference; CUDA -> sage2 when it is installed, wired for this architecture and
    passes a small probe against the fp32 reference; otherwise on sm_90 cuDNN SDPA, elsewhere torch SDPA.
    The reason always says why a faster backend was not taken (e.g. "sage2 not installed ...").
    An explicit ``requested`` backend that cannot run is never swapped silently: with ``strict`` it
    raises; otherwise the automatic choice is returned with a reason that starts
    ``"requested <name> unavailable: <why>"``. ``probe=False`` skips the probe runs (availability is then
    judged from imports and the architecture only).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r}: expected auto or one of {', '.join(BACKENDS)}")
    if requested != "auto":
        ok, why = _available(requested, device, head_dim, dtype, probe)
        if ok:
            return requested, why
        if strict:
            raise RuntimeError(f"attention backend {requested!r} unavailable: {why}")
        name, auto_why = choose_attention_backend(device, "auto", head_dim=head_dim, dtype=dtype, probe=probe)
        return name, f"requested {requested} unavailable: {why}; using {name}: {auto_why}"

    if sage.capability(device) is None:
        return "reference", f"{device.type}: no CUDA device, fp32 reference attention"
    ok, why2 = _available("sage2", device, head_dim, dtype, probe)
    if ok:
        return "sage2", why2
    cc = sage.capability(device)
    if tuple(cc) == (9, 0):
        ok, why = _available("sdpa_cudnn", device, head_dim, dtype, probe)
        if ok:
            return "sdpa_cudnn", (
                f"{why2}; cuDNN SDPA is the fastest bf16 SDPA kernel on sm_90 (bench/NOTES.md)"
            )
        why2 = f"{why2}; {why}"
    return "sdpa", f"{why2}; torch SDPA picks its own kernel"


def backend_table(device: "torch.device | str", *, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                  probe: bool = False) -> dict[str, tuple[bool, str]]:
    """{backend: (available, reason)} for every backend on ``device`` (for the load-time printout)."""
    device = torch.device(device)
    return {b: _available(b, device, head_dim, dtype, probe) for b in BACKENDS}


# AttentionFn: qkv [S, 3*H*D] -> [S, H*D] in qkv's dtype (H = qkv.shape[1] // (3*D): any head count, e.g. a
# rank's heads); declared with the BlockOps interface (runtime.ops.interface)


# RowsAttentionFn (runtime.ops.interface): a query-row chunk over all of K and V (the plan's ``attn_chunk_rows``).
# Row-exact backends give the unchunked bits: output row i depends only on query row i and all of K and V. The fp32
# reference and SDPA's math kernel (one softmax per row; tests/runtime/ops/test_attention_rows.py); Sage1/Sage2: q
# quantized per block of <= 128 rows from the first row given, K's mean and V's scales over all of K and V, so on
# 128-row boundaries every operand is the unchunked call's (a GPU test to confirm). Fused SDPA kernels and FA3 pick
# tiles or splits from the query length, fa3_fp8 one q descale per head over the rows given: rounding-equal only.
ROW_EXACT = ("reference", "sdpa_math", "sage2", "sage1")
ROW_CHUNK_MULTIPLE = 128


def row_exactness(backend: str) -> tuple[bool, str]:
    """Whether attention over query-row chunks equals the unchunked call bit for bit on ``backend`` -> (exact, why)."""
    if backend in ROW_EXACT:
        return True, (f"{backend}: row-exact, each output row depends only on its query row and all of K and V "
                      f"(chunks on {ROW_CHUNK_MULTIPLE}-row boundaries)")
    return False, (f"{backend}: not row-exact (its tile, split or scale choices may depend on the query rows "
                   f"given), equal to the unchunked run to its rounding")


def _nhd(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t.unflatten(1, (-1, head_dim)).unsqueeze(0)  # [S, H*D] (unit column stride) -> a [1, S, H, D] view


def bind_attention_qkv(backend: str, head_dim: int, *, device: "torch.device | str | None" = None,
                       v_handling: str = "none", scale: Optional[float] = None) -> RowsAttentionFn:
    """Resolve ``backend`` once (module, kernel, V handling, softmax scale) into ``fn(q, k, v) -> [Sq, H*D]`` over
    ``[rows, H*D]`` views (q may hold fewer rows than k and v: a query-row chunk); see :func:`bind_attention`."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    sm_scale = head_dim ** -0.5 if scale is None else float(scale)
    if backend == "reference":
        return lambda q, k, v: exact_attention_reference(_nhd(q, head_dim), _nhd(k, head_dim), _nhd(v, head_dim),
                                                         scale=sm_scale).to(q.dtype)
    if backend.startswith("sdpa"):
        kernel = None if backend == "sdpa" else getattr(torch.nn.attention.SDPBackend, _SDPA_KERNELS[backend])

        def sdpa(q, k, v):
            qh, kh, vh = (_nhd(t, head_dim).transpose(1, 2) for t in (q, k, v))
            with contextlib.nullcontext() if kernel is None else torch.nn.attention.sdpa_kernel([kernel]):
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=sm_scale)
            return o.transpose(1, 2).reshape(q.shape[0], -1)
        return sdpa
    if backend == "sage1":
        fn = sage.bind_sage1(sm_scale)
    elif backend in ("fa3", "fa3_fp8"):
        fn = flash_attention.bind_fa3(backend, sm_scale)
    elif backend in blackwell_attention.BLACKWELL_BACKENDS:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        fn = blackwell_attention.BLACKWELL_BACKENDS[backend][1](dev, head_dim, sm_scale)
    else:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        fn = sage.bind_sage2(dev, sm_scale, "fused" if v_handling == "fused" else "library")
    return lambda q, k, v: fn(_nhd(q, head_dim), _nhd(k, head_dim), _nhd(v, head_dim)).reshape(q.shape[0], -1)


def bind_attention(backend: str, head_dim: int, *, device: "torch.device | str | None" = None,
                   v_handling: str = "none", scale: Optional[float] = None) -> AttentionFn:
    """Resolve ``backend`` once into ``fn(qkv [S, 3*H*D]) -> [S, H*D]`` in qkv's dtype, reading q, k and v as strided
    views of the buffer (sage1 alone gets a private copy of K); H = width / (3*head_dim), any head count (a rank's
    heads). ``device``: where Sage2 runs (default the current CUDA device); ``v_handling``: "fused" (Sage2's sm_90
    kernel, V's fp8 operands from the strided view), else the library's wrapper. Nothing is re-validated per call."""
    three = bind_attention_qkv(backend, head_dim, device=device, v_handling=v_handling, scale=scale)

    def attend(qkv):
        q, k, v = qkv.unflatten(1, (3, -1)).unbind(1)  # [S, H*D] column thirds, views
        return three(q, k, v)
    return attend
