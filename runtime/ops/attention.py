"""Full (unmasked) attention reading q, k, v as strided NHD views of the fused qkv buffer.

``qkv`` is the QKV projection output ``[S, 3*H*D]``, row-major thirds ``[q_all | k_all | v_all]``;
head ``h`` of q is columns ``[h*D, (h+1)*D)``. :func:`qkv_views` turns it into three ``[1, S, H, D]``
views with strides ``(S*3HD, 3HD, D, 1)`` — no copies (``H3_SAGE_QKV_LAYOUT=strided_nhd``). The result
is ``[S, H*D]`` in q's dtype, head-major columns like q; softmax scale ``1/sqrt(D)`` unless given.

Backends (one name each; :func:`choose_attention_backend` picks one at load and says why):

============== ===========================================================================================
reference      fp32 math (IEEE, no TF32), chunked over queries so S = 37,810 fits; the oracle
sdpa           torch ``scaled_dot_product_attention``, torch picks the kernel
sdpa_cudnn     ... restricted to cuDNN (fastest bf16 SDPA on sm_90); also sdpa_flash, sdpa_efficient,
               sdpa_math. A restricted kernel that cannot run raises; it never falls back inside torch.
sage2          SageAttention2 (built from source), per-architecture function, called directly:
               sm_90 -> ``sageattn_qk_int8_pv_fp8_cuda_sm90`` (fp32+fp32 PV accumulation); sm_89, sm_100,
               sm_120, sm_121 -> ``sageattn_qk_int8_pv_fp8_cuda`` (fp32+fp16). Its ``sageattn()`` raises
               on sm_100, hence the direct calls. SA2 does not modify its inputs.
sage1          sageattention 1.0.6 (PyPI, Triton). It subtracts K's mean IN PLACE (``k -= km``), so it
               gets a private contiguous copy of K; q and v stay views. One [S, H*D] copy per call.
============== ===========================================================================================

V padding on sm_90 (``sage_v_pad``, RuntimeOptions.sage_v_pad / H3_SAGE_V_PAD). SA2's sm_90 wrapper pads V to
a multiple of 128 rows with ``torch.cat`` when ``S % 128 != 0`` (one copy of V per call; at S = 37,810 always).
``"library"`` (default) calls the wrapper as above. ``"buffer"`` (sm_90 sage2, head_dim 64 or 128, strided
layout; a no-op elsewhere) has the caller pass a qkv buffer of at least ``roundup(S, 128)`` rows whose rows
``>= S`` are ZERO plus the logical ``seq_len=S``; the wrapper then runs the wrapper's own stages itself
(:func:`_sage2_sm90_buffer`: K mean, per-warp int8 q/k, ``per_channel_fp8`` of V, the sm_90 kernel) with V a
``roundup(S, 128)``-row view of the buffer: the same inputs the library builds with its copy, so no copy.
``"fused"`` (same conditions; no padded buffer needed) runs the same stages but builds V's fp8 operands with
``fp8_producers.sage_v_fp8``: two Triton passes over the strided V view (per-channel amax; quantize, transpose
and the kernel's 16-token permutation in one pass, zero past S) in place of the library's pad copy, its
transpose-and-pad copy and its quantize pass. Its rounding is this project's (scale = amax / 448 and the
reciprocal correctly rounded, the hardware e4m3 conversion) rather than the library's fast-math division, so
the codes may differ from the library's by one step in rare ties; the GPU tests bound the difference.

SageAttention 1 and 2 are both the Python package ``sageattention``; they cannot share a
site-packages. Install SA2 normally; load SA1 from its wheel or an unpacked folder with
:func:`use_sage1_from` (it is imported under a private module name).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import zipfile
from typing import Any, Callable, Optional

import torch
import torch.nn.attention

from ..errors import describe
from .fp8_producers import sage_v_fp8

__all__ = [
    "BACKENDS",
    "TOLERANCE",
    "attention",
    "exact_attention_reference",
    "attention_flops",
    "backend_table",
    "choose_attention_backend",
    "padded_rows",
    "qkv_views",
    "rel_l2",
    "use_sage1_from",
]

BACKENDS = ("sage2", "sage1", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "reference")
LAYOUTS = ("strided_nhd", "contiguous")
SAGE_V_PADS = ("library", "buffer", "fused")
SAGE2_SM90_FN = "sageattn_qk_int8_pv_fp8_cuda_sm90"
SAGE2_V_ROWS = 128  # the sm_90 wrapper pads V's sequence dimension to a multiple of this

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
}

_SAGE2_PLANS = {
    # compute capability -> (function, kwargs, extension flag in sageattention.core)
    (9, 0): (SAGE2_SM90_FN, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp32"}, "SM90_ENABLED"),
    (8, 9): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
    (10, 0): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
    (12, 0): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
    (12, 1): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
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
# SageAttention modules (imported lazily, feature-detected)
# ----------------------------------------------------------------------------------------------

_SAGE1: dict[str, Any] = {"module": None, "source": None}


def _is_sage2(mod) -> bool:
    return hasattr(mod, "sageattn_qk_int8_pv_fp8_cuda") or hasattr(mod, "sageattn_qk_int8_pv_fp8_cuda_sm90")


def _dist_version(default: str = "unknown") -> str:
    try:
        from importlib.metadata import version

        return version("sageattention")
    except Exception:
        return default


@functools.lru_cache(maxsize=None)
def _sage2_module() -> tuple[Any, str]:
    """(module, version) or (None, reason)."""
    try:
        mod = importlib.import_module("sageattention")
    except Exception as e:  # ImportError, or a compiled extension that fails to load
        return None, (
            f"sage2 not installed ({type(e).__name__}: {e}); build it from source with "
            f"scripts/device_build_sage2.sh"
        )
    if not _is_sage2(mod):
        return None, (
            f"the installed sageattention ({_dist_version()}) is SageAttention 1 (no per-arch fp8 kernels); "
            f"sage2 needs sageattention>=2 built from source"
        )
    return mod, _dist_version("2.x")


def _load_sage1_from(path: str):
    path = os.path.abspath(path)
    if path.endswith(".whl"):
        # a pure-Python wheel: unpack it once (Triton needs real source files), keyed by its content
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        dest = os.path.join(tempfile.gettempdir(), f"h3_sage1_{os.path.basename(path)[:-4]}_{digest}")
        if not os.path.isfile(os.path.join(dest, "sageattention", "__init__.py")):
            tmp = tempfile.mkdtemp(prefix="h3_sage1_", dir=tempfile.gettempdir())
            with zipfile.ZipFile(path) as zf:
                zf.extractall(tmp)
            try:
                os.replace(tmp, dest)
            except OSError:  # another process got there first
                shutil.rmtree(tmp, ignore_errors=True)
        path = dest
    pkg = path if os.path.isfile(os.path.join(path, "__init__.py")) else os.path.join(path, "sageattention")
    init = os.path.join(pkg, "__init__.py")
    if not os.path.isfile(init):
        raise FileNotFoundError(f"no sageattention package at {path} (expected {init} or a .whl)")
    version = "unknown"
    parent = os.path.dirname(pkg)
    for name in sorted(os.listdir(parent)):
        if name.startswith("sageattention-") and name.endswith((".dist-info", ".egg-info")):
            version = name[len("sageattention-") :].rsplit(".", 1)[0].split("-")[0]
    name = "_h3_sage1_sageattention"
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]  # a previous load's submodules would otherwise be reused
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception:
        sys.modules.pop(name, None)
        raise
    return mod, version, pkg


def use_sage1_from(path: str) -> str:
    """Use sageattention 1.x from a wheel (``.whl``) or a folder holding the ``sageattention`` package,
    imported under a private name so that an installed SageAttention2 keeps the name ``sageattention``.
    Returns the version found. Raises if the package there is not SageAttention 1."""
    mod, version, pkg = _load_sage1_from(path)
    if _is_sage2(mod) or not hasattr(mod, "sageattn"):
        raise ValueError(f"{pkg} is not SageAttention 1 (version {version}); sage1 wants sageattention 1.0.x")
    _SAGE1.update(module=mod, source=f"{pkg} ({version})")
    _PROBES.clear()
    return version


def _sage1_module() -> tuple[Any, str]:
    """(module, description) or (None, reason)."""
    if _SAGE1["module"] is not None:
        return _SAGE1["module"], _SAGE1["source"]
    try:
        mod = importlib.import_module("sageattention")
    except Exception as e:
        return None, (
            f"sage1 not installed ({type(e).__name__}: {e}); pip install sageattention==1.0.6 or "
            f"use_sage1_from('<dir>/sageattention-1.0.6-py3-none-any.whl')"
        )
    if _is_sage2(mod):
        return None, (
            f"the installed sageattention ({_dist_version()}) is SageAttention 2; load 1.0.6 beside it with "
            f"use_sage1_from('<wheel or folder>')"
        )
    return mod, f"sageattention {_dist_version()} (installed)"


def _capability(device: torch.device) -> Optional[tuple[int, int]]:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _sage2_plan(cc: Optional[tuple[int, int]]):
    """(function name, kwargs, extension flag) or raises with the reason."""
    if cc is None:
        raise RuntimeError("sage2 needs a CUDA device")
    plan = _SAGE2_PLANS.get(tuple(cc))
    if plan is None:
        archs = ", ".join(f"sm_{a}{b}" for a, b in _SAGE2_PLANS)
        raise RuntimeError(f"sage2 has no kernel path wired for sm_{cc[0]}{cc[1]} (wired: {archs})")
    return plan


# ----------------------------------------------------------------------------------------------
# the one entry point
# ----------------------------------------------------------------------------------------------


def attention(
    qkv: torch.Tensor,
    heads: int,
    head_dim: int,
    backend: str,
    *,
    scale: Optional[float] = None,
    layout: str = "strided_nhd",
    seq_len: Optional[int] = None,
    sage_v_pad: str = "library",
) -> torch.Tensor:
    """Full unmasked attention over ``qkv [S, 3*H*D]`` -> ``[S, H*D]`` in qkv's dtype.

    ``backend``: one of :data:`BACKENDS` (a concrete name; resolve ``auto`` with
    :func:`choose_attention_backend`). ``layout="strided_nhd"`` hands the backend views of qkv (no
    copies of q, k or v; sage1 alone gets a private copy of K). ``layout="contiguous"`` copies q, k, v
    first (diagnostics / A-B only). The caller's ``qkv`` is never modified.

    ``seq_len``: the logical S when ``qkv`` has more rows (a padded buffer); only its first S rows are
    attended and returned. ``sage_v_pad``: ``"library"`` | ``"buffer"`` | ``"fused"`` (module docstring): with
    ``"buffer"`` on sm_90 sage2, ``qkv`` must have at least ``roundup(S, 128)`` rows and rows ``>= S``
    must be zero (not checked: that would cost a pass and a sync); elsewhere it changes nothing.
    """
    s = _check_qkv(qkv, heads, head_dim)
    if sage_v_pad not in SAGE_V_PADS:
        raise ValueError(f"sage_v_pad {sage_v_pad!r}: expected one of {', '.join(SAGE_V_PADS)}")
    buf = qkv
    if seq_len is not None:
        if not 0 < int(seq_len) <= s:
            raise ValueError(f"seq_len={seq_len}: expected 1..{s} (the rows of qkv)")
        if int(seq_len) != s:
            s = int(seq_len)
            qkv = qkv[:s]  # a view: the logical rows
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    q, k, v = qkv_views(qkv, heads, head_dim)
    if layout == "contiguous":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    hd = heads * head_dim

    if backend == "reference":
        return exact_attention_reference(q, k, v, scale=scale).to(qkv.dtype)

    if backend.startswith("sdpa"):
        import torch.nn.functional as F

        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [1, H, S, D] views
        if backend == "sdpa":
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, _SDPA_KERNELS[backend])]):
                o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        return o.transpose(1, 2).reshape(s, hd)

    if qkv.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{backend} needs fp16 or bf16 inputs; found {qkv.dtype}")

    if backend == "sage2":
        mod, why = _sage2_module()
        if mod is None:
            raise RuntimeError(why)
        fn_name, kwargs, _ = _sage2_plan(_capability(qkv.device))
        if sage_v_pad != "library" and fn_name == SAGE2_SM90_FN and layout == "strided_nhd" and head_dim in (64, 128):
            if sage_v_pad == "buffer":
                return _sage2_sm90_buffer(mod, buf, s, heads, head_dim, scale).reshape(s, hd)
            return _sage2_sm90_fused_v(mod, q, k, v, scale).reshape(s, hd)
        o = getattr(mod, fn_name)(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=True, **kwargs)
        return o.reshape(s, hd)

    # sage1: `k -= k.mean(seq)` runs in place inside sageattn; it must never see a view of qkv.
    mod, why = _sage1_module()
    if mod is None:
        raise RuntimeError(why)
    k_own = k.clone(memory_format=torch.contiguous_format)
    o = mod.sageattn(q, k_own, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=True)
    return o.reshape(s, hd)


def sage_v_pad_status(mode: str, device: torch.device, head_dim: int) -> tuple[str, str]:
    """The V handling ``attention(..., "sage2", sage_v_pad=mode)`` will really use on ``device`` -> (choice,
    reason). ``buffer`` and ``fused`` act on SageAttention2's sm_90 kernel (head_dim 64 or 128) only and call
    its stages, so an installed SageAttention2 without them gives ``library`` with the reason (the default
    never turns into an error)."""
    if mode not in SAGE_V_PADS:
        raise ValueError(f"sage_v_pad {mode!r}: expected one of {', '.join(SAGE_V_PADS)}")
    if mode == "library":
        return "library", "library: SageAttention2's own wrapper (one torch.cat copy of V when S % 128 != 0)"
    try:
        fn = _sage2_plan(_capability(torch.device(device)))[0]
    except RuntimeError as e:
        return "library", f"{mode} not applicable: {e}"
    if fn != SAGE2_SM90_FN or head_dim not in (64, 128):
        return "library", (f"{mode} not applicable: it acts on {SAGE2_SM90_FN} with head_dim 64 or 128 "
                           f"(this device runs {fn}, head_dim {head_dim})")
    mod, why = _sage2_module()
    if mod is None:
        return "library", f"{mode} not applicable: {why}"
    missing = _missing_stages(mod, mode)
    if missing:
        return "library", (f"{mode} unavailable: sageattention.core lacks {', '.join(missing)} "
                           f"(installed {_dist_version()}); the library wrapper runs instead")
    return mode, ("fused: V's fp8 operands built from the strided V view by fp8_producers.sage_v_fp8 (no pad "
                  "or transpose copy of V)" if mode == "fused" else
                  "buffer: the QKV buffer padded to 128 rows, Sage2's stages on a view of it (no copy of V)")


def _missing_stages(mod, mode: str) -> list[str]:
    """The sm_90 wrapper stages ``sage_v_pad=mode`` calls that ``mod.core`` lacks ("buffer" also needs the
    library's ``per_channel_fp8``; "fused" builds V's operands itself)."""
    need = ("per_warp_int8_cuda", "sm90_compile") + (("per_channel_fp8",) if mode == "buffer" else ())
    return [n for n in need if not hasattr(getattr(mod, "core", None), n)]


def _sm90_core(mod, mode: str):
    """``mod.core`` with the stages ``sage_v_pad=mode`` calls, or RuntimeError naming the missing ones."""
    missing = _missing_stages(mod, mode)
    if missing:
        raise RuntimeError(f"sage_v_pad={mode!r}: sageattention.core lacks {', '.join(missing)} "
                           f"(installed {_dist_version()}); use sage_v_pad='library'")
    return mod.core


def padded_rows(seq: int) -> int:
    """roundup(seq, 128): the rows of V that SageAttention2's sm_90 kernel reads."""
    return -(-seq // SAGE2_V_ROWS) * SAGE2_V_ROWS


def _sage2_sm90_buffer(mod, buf: torch.Tensor, s: int, heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """The stages of ``sageattn_qk_int8_pv_fp8_cuda_sm90`` for our one configuration (NHD, non-causal,
    per_warp q/k, fp32+fp32 PV, smooth_k, no lse, head_dim 64 or 128 so no head padding), called in its
    order with its arguments, except that V is a ``[1, roundup(S,128), H, D]`` view of the caller's
    zero-tailed buffer instead of ``torch.cat([v, zeros])``: the same values, so the same outputs, and no
    copy. Returns o ``[1, S, H, D]``."""
    rows = padded_rows(s)
    if buf.shape[0] < rows:
        raise ValueError(
            f"sage_v_pad='buffer' needs a qkv buffer of at least roundup(S, 128) = {rows} rows (rows >= S zero) "
            f"for S={s}; found {buf.shape[0]} rows")
    core = _sm90_core(mod, "buffer")
    q, k, _ = qkv_views(buf[:s], heads, head_dim)
    v = qkv_views(buf[:rows], heads, head_dim)[2]  # rows >= s are zero: the library's padding, in place
    return _sage2_sm90_stages(core, q, k, lambda: core.per_channel_fp8(v, tensor_layout="NHD", smooth_v=False)[:2],
                              scale)


def _sage2_sm90_stages(core, q: torch.Tensor, k: torch.Tensor, v_operands, scale: float) -> torch.Tensor:
    """K mean, per-warp int8 q/k, V's (fp8 codes, scales) from ``v_operands()``, then the sm_90 kernel."""
    if q.is_cuda:
        torch.cuda.set_device(q.device)  # as the library wrapper does
    km = k.mean(dim=1, keepdim=True)  # smooth_k; NHD: sequence dim 1; H_q == H_kv so no repeat
    q_int8, q_scale, k_int8, k_scale = core.per_warp_int8_cuda(q, k, km, tensor_layout="NHD", BLKQ=64, WARPQ=16,
                                                               BLKK=128)
    o = torch.empty(q.size(), dtype=q.dtype, device=q.device)
    v_fp8, v_scale = v_operands()
    # (q_int8, k_int8, v_fp8, o, q_scale, k_scale, v_scale, layout NHD=0, causal=0, per_warp=2, sm_scale, lse=0)
    core.sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
        q_int8, k_int8, v_fp8, o, q_scale, k_scale, v_scale, 0, 0, 2, scale, 0)
    return o


def _sage2_sm90_fused_v(mod, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The sm_90 stages with V's operands from ``fp8_producers.sage_v_fp8``: two Triton passes over the strided
    V view (channel amax; quantize + transpose + the kernel's token permutation, zero past S) instead of the
    library's pad copy, transpose copy and quantize pass. No padded qkv buffer is needed."""
    return _sage2_sm90_stages(_sm90_core(mod, "fused"), q, k, lambda: sage_v_fp8(v), scale)


# ----------------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------------

_PROBES: dict = {}
_PROBE_SHAPE = (200, 2)  # rows (not a multiple of 128: exercises the padding paths), heads


def _probe(backend: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Run ``backend`` once on a small random qkv buffer on ``device`` and check it against the fp32
    reference (TOLERANCE) and that the buffer is unchanged. Cached per (backend, device, D, dtype)."""
    key = (backend, str(device), head_dim, dtype)
    if key in _PROBES:
        return _PROBES[key]
    s, h = _PROBE_SHAPE
    try:
        g = torch.Generator(device=device).manual_seed(1234)  # private RNG: the caller's stream is untouched
        qkv = torch.randn(s, 3 * h * head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
        before = qkv.clone()
        out = attention(qkv, h, head_dim, backend)
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


def _available(backend: str, device: torch.device, head_dim: int, dtype: torch.dtype, probe: bool) -> tuple[bool, str]:
    if backend == "reference":
        return True, "fp32 reference (chunked)"
    if backend in ("sdpa", "sdpa_math"):
        return True, f"torch {torch.__version__} scaled_dot_product_attention" + (" (math kernel)" if backend == "sdpa_math" else "")
    cc = _capability(device)
    if cc is None:
        return False, f"{backend} needs a CUDA device (found {device})"
    if backend in ("sage1", "sage2") and dtype not in (torch.float16, torch.bfloat16):
        return False, f"{backend} needs fp16/bf16 activations (compute dtype is {dtype})"
    detail = f"sm_{cc[0]}{cc[1]}"
    if backend == "sage2":
        mod, ver = _sage2_module()
        if mod is None:
            return False, ver
        try:
            fn_name, _, flag = _sage2_plan(cc)
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
        mod, src = _sage1_module()
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

    if _capability(device) is None:
        return "reference", f"{device.type}: no CUDA device, fp32 reference attention"
    ok, why2 = _available("sage2", device, head_dim, dtype, probe)
    if ok:
        return "sage2", why2
    cc = _capability(device)
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


def bind_attention(backend: str, heads: int, head_dim: int, *, v_handling: str = "none",
                   scale: Optional[float] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Resolve ``backend`` once (module, kernel, V handling, softmax scale) into ``fn(qkv [S, 3*H*D]) ->
    [S, H*D]`` in qkv's dtype, reading q, k and v as strided views of the buffer (sage1 alone gets a private
    copy of K). ``v_handling``: "fused" (Sage2's sm_90 kernel with V's fp8 operands built from the strided
    view), else the library's own wrapper. Nothing is re-validated per call: the load plan checked it."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    sm_scale = head_dim ** -0.5 if scale is None else float(scale)
    hd = heads * head_dim

    def views(qkv):
        return qkv_views(qkv, heads, head_dim)

    if backend == "reference":
        return lambda qkv: exact_attention_reference(*views(qkv), scale=sm_scale).to(qkv.dtype)
    if backend.startswith("sdpa"):
        kernel = None if backend == "sdpa" else getattr(torch.nn.attention.SDPBackend, _SDPA_KERNELS[backend])

        def sdpa(qkv):
            qh, kh, vh = (t.transpose(1, 2) for t in views(qkv))
            if kernel is None:
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=sm_scale)
            else:
                with torch.nn.attention.sdpa_kernel([kernel]):
                    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=sm_scale)
            return o.transpose(1, 2).reshape(qkv.shape[0], hd)
        return sdpa
    if backend == "sage1":
        mod, why = _sage1_module()
        if mod is None:
            raise RuntimeError(why)

        def sage1(qkv):
            q, k, v = views(qkv)
            k_own = k.clone(memory_format=torch.contiguous_format)  # sageattn subtracts K's mean in place
            return mod.sageattn(q, k_own, v, tensor_layout="NHD", is_causal=False, sm_scale=sm_scale,
                                smooth_k=True).reshape(qkv.shape[0], hd)
        return sage1
    mod, why = _sage2_module()
    if mod is None:
        raise RuntimeError(why)
    if v_handling == "fused":
        return lambda qkv: _sage2_sm90_fused_v(mod, *views(qkv), sm_scale).reshape(qkv.shape[0], hd)
    fn_name, kwargs, _ = _sage2_plan(_capability(torch.device("cuda", torch.cuda.current_device())))
    fn = getattr(mod, fn_name)

    def sage2(qkv):
        q, k, v = views(qkv)
        return fn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=sm_scale, smooth_k=True,
                  **kwargs).reshape(qkv.shape[0], hd)
    return sage2
