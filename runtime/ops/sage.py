"""SageAttention 1 and 2: finding the installed modules, the kernel each GPU architecture runs, and the kernels
bound over ``[1, S, H, D]`` NHD views (``ops.attention`` hands them strided views of the qkv buffer).

sage2          SageAttention2 (built from source), per-architecture function, called directly:
               sm_90 -> ``sageattn_qk_int8_pv_fp8_cuda_sm90`` (fp32+fp32 PV accumulation); sm_89, sm_100,
               sm_120, sm_121 -> ``sageattn_qk_int8_pv_fp8_cuda`` (fp32+fp16). Its ``sageattn()`` raises
               on sm_100, hence the direct calls. SA2 does not modify its inputs.
sage1          sageattention 1.0.6 (PyPI, Triton). It subtracts K's mean IN PLACE (``k -= km``), so it
               gets a private contiguous copy of K; q and v stay views. One [S, H*D] copy per call.

V on sm_90 (the plan's ``v_handling``, :func:`v_handling_status`). SA2's sm_90 wrapper pads V to a multiple of
128 rows with ``torch.cat`` when ``S % 128 != 0`` (one copy of V per call; at S = 37,810 always).
``library`` calls the wrapper as it is. ``fused`` (sm_90, head_dim 64 or 128, the wrapper's stages present in
``sageattention.core``) runs the wrapper's own stages (K mean, per-warp int8 q/k, the sm_90 kernel) itself with
V's fp8 operands built by ``fp8_producers.sage_v_fp8``: two Triton passes over the strided V view (per-channel
amax; quantize, transpose and the kernel's 16-token permutation in one pass, zero past S) in place of the
library's pad copy, its transpose-and-pad copy and its quantize pass. Its rounding is this project's (scale =
amax / 448 and the reciprocal correctly rounded, the hardware e4m3 conversion) rather than the library's
fast-math division, so the codes may differ from the library's by one step in rare ties; the GPU tests bound
the difference.

SageAttention 1 and 2 are both the Python package ``sageattention``; they cannot share a site-packages.
Install SA2 normally; load SA1 from its wheel or an unpacked folder with :func:`use_sage1_from` (it is
imported under a private module name).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile
from typing import Any, Callable, Optional

import torch

from .fp8_producers import sage_v_fp8
from .sage_kv import SageKVKernels, sm90_attention, sm90_kernels

SAGE2_SM90_FN = "sageattn_qk_int8_pv_fp8_cuda_sm90"
SAGE2_V_ROWS = 128  # the sm_90 wrapper pads V's sequence dimension to a multiple of this
V_HANDLINGS = ("library", "fused")

SAGE2_PLANS = {
    # compute capability -> (function, kwargs, extension flag in sageattention.core)
    (9, 0): (SAGE2_SM90_FN, {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp32"}, "SM90_ENABLED"),
    (8, 9): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
    (10, 0): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
    (12, 0): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
    (12, 1): ("sageattn_qk_int8_pv_fp8_cuda", {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}, "SM89_ENABLED"),
}

SAGE1: dict[str, Any] = {"module": None, "source": None}


def _is_sage2(mod) -> bool:
    return hasattr(mod, "sageattn_qk_int8_pv_fp8_cuda") or hasattr(mod, "sageattn_qk_int8_pv_fp8_cuda_sm90")


def dist_version(default: str = "unknown") -> str:
    try:
        from importlib.metadata import version

        return version("sageattention")
    except Exception:
        return default


@functools.lru_cache(maxsize=None)
def sage2_module() -> tuple[Any, str]:
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
            f"the installed sageattention ({dist_version()}) is SageAttention 1 (no per-arch fp8 kernels); "
            f"sage2 needs sageattention>=2 built from source"
        )
    return mod, dist_version("2.x")


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
    SAGE1.update(module=mod, source=f"{pkg} ({version})")  # part of the attention probes' cache key
    return version


def sage1_module() -> tuple[Any, str]:
    """(module, description) or (None, reason)."""
    if SAGE1["module"] is not None:
        return SAGE1["module"], SAGE1["source"]
    try:
        mod = importlib.import_module("sageattention")
    except Exception as e:
        return None, (
            f"sage1 not installed ({type(e).__name__}: {e}); pip install sageattention==1.0.6 or "
            f"use_sage1_from('<dir>/sageattention-1.0.6-py3-none-any.whl')"
        )
    if _is_sage2(mod):
        return None, (
            f"the installed sageattention ({dist_version()}) is SageAttention 2; load 1.0.6 beside it with "
            f"use_sage1_from('<wheel or folder>')"
        )
    return mod, f"sageattention {dist_version()} (installed)"


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def sage2_plan(cc: Optional[tuple[int, int]]):
    """(function name, kwargs, extension flag) or raises with the reason."""
    if cc is None:
        raise RuntimeError("sage2 needs a CUDA device")
    plan = SAGE2_PLANS.get(tuple(cc))
    if plan is None:
        archs = ", ".join(f"sm_{a}{b}" for a, b in SAGE2_PLANS)
        raise RuntimeError(f"sage2 has no kernel path wired for sm_{cc[0]}{cc[1]} (wired: {archs})")
    return plan


def v_handling_status(mode: str, device: torch.device, head_dim: int) -> tuple[str, str]:
    """The V handling Sage2 will really use on ``device`` when ``mode`` is asked for -> (choice, reason).
    ``fused`` acts on SageAttention2's sm_90 kernel (head_dim 64 or 128) only and calls its stages, so an
    installed SageAttention2 without them gives ``library`` with the reason (the default never turns into an
    error)."""
    if mode not in V_HANDLINGS:
        raise ValueError(f"v_handling {mode!r}: expected one of {', '.join(V_HANDLINGS)}")
    if mode == "library":
        return "library", "library: SageAttention2's own wrapper (one torch.cat copy of V when S % 128 != 0)"
    try:
        fn = sage2_plan(capability(torch.device(device)))[0]
    except RuntimeError as e:
        return "library", f"{mode} not applicable: {e}"
    if fn != SAGE2_SM90_FN or head_dim not in (64, 128):
        return "library", (f"{mode} not applicable: it acts on {SAGE2_SM90_FN} with head_dim 64 or 128 "
                           f"(this device runs {fn}, head_dim {head_dim})")
    mod, why = sage2_module()
    if mod is None:
        return "library", f"{mode} not applicable: {why}"
    missing = _missing_stages(mod)
    if missing:
        return "library", (f"{mode} unavailable: sageattention.core lacks {', '.join(missing)} "
                           f"(installed {dist_version()}); the library wrapper runs instead")
    return mode, ("fused: V's fp8 operands built from the strided V view by fp8_producers.sage_v_fp8 (no pad "
                  "or transpose copy of V)")


def _missing_stages(mod) -> list[str]:
    """The sm_90 wrapper stages the fused V handling calls that ``mod.core`` lacks."""
    return [n for n in ("per_warp_int8_cuda", "sm90_compile") if not hasattr(getattr(mod, "core", None), n)]


def padded_rows(seq: int) -> int:
    """roundup(seq, 128): the rows of V that SageAttention2's sm_90 kernel reads."""
    return -(-seq // SAGE2_V_ROWS) * SAGE2_V_ROWS


def _sm90_stages(core, q: torch.Tensor, k: torch.Tensor, v_operands, scale: float) -> torch.Tensor:
    """The stages of ``sageattn_qk_int8_pv_fp8_cuda_sm90`` for our one configuration (NHD, non-causal, per_warp
    q/k, fp32+fp32 PV, smooth_k, no lse, head_dim 64 or 128 so no head padding), called in its order with its
    arguments: K mean, per-warp int8 q/k, V's (fp8 codes, scales) from ``v_operands()``, then the sm_90 kernel.
    Returns o ``[1, S, H, D]``."""
    if q.is_cuda:
        torch.cuda.set_device(q.device)  # as the library wrapper does
    km = k.mean(dim=1, keepdim=True)  # smooth_k; NHD: sequence dim 1; H_q == H_kv so no repeat
    q_int8, q_scale, k_int8, k_scale = core.per_warp_int8_cuda(q, k, km, tensor_layout="NHD", BLKQ=64, WARPQ=16,
                                                               BLKK=128)
    return sm90_attention(core.sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf, (q_int8, q_scale),
                          (k_int8, k_scale), v_operands(), scale, q.dtype)


# q, k, v [1, S, H, D] NHD views (any strides, unit stride in D) -> o [1, S, H, D] in q's dtype
NhdAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bind_sage2(device: torch.device, scale: float, v_handling: str = "library") -> NhdAttention:
    """SageAttention2's kernel for ``device``'s architecture, bound once. ``v_handling="fused"``: the sm_90
    stages with V's operands from ``fp8_producers.sage_v_fp8`` (module docstring; the plan chose it only where
    :func:`v_handling_status` says it runs); else the library's wrapper. RuntimeError when SA2 is missing or
    has no kernel for this architecture."""
    mod, why = sage2_module()
    if mod is None:
        raise RuntimeError(why)
    fn_name, kwargs, _ = sage2_plan(capability(torch.device(device)))
    if v_handling == "fused":
        missing = _missing_stages(mod)
        if fn_name != SAGE2_SM90_FN or missing:
            raise RuntimeError(f"v_handling fused needs {SAGE2_SM90_FN} and its stages in sageattention.core "
                               f"(this device runs {fn_name}; missing: {', '.join(missing) or 'none'}); "
                               "the load plan resolves v_handling with v_handling_status")
        core = mod.core
        return lambda q, k, v: _sm90_stages(core, q, k, lambda: sage_v_fp8(v), scale)
    fn = getattr(mod, fn_name)
    return lambda q, k, v: fn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=True, **kwargs)


def bind_sage_kv(attention: str, v_handling: str) -> SageKVKernels | None:
    """Sage2's sm_90 kernels for K and V held in Sage's operands (``ops.sage_kv``; the memory plan's "sage" K/V
    form), where the dense attention is Sage2 on its sm_90 stages (``v_handling`` resolved to "fused" by
    :func:`v_handling_status`); None elsewhere."""
    if attention != "sage2" or v_handling != "fused":
        return None
    mod, _ = sage2_module()
    try:
        return None if mod is None else sm90_kernels(mod)
    except (ImportError, AttributeError):  # a build without the quantizers: set_attn_chunk_rows refuses the form
        return None


def bind_sage1(scale: float) -> NhdAttention:
    """sageattention 1.x (installed, or loaded with :func:`use_sage1_from`), bound once. It subtracts K's mean
    in place inside ``sageattn``, so it gets a private contiguous copy of K, never a view of the caller's
    buffer. RuntimeError when SA1 is missing."""
    mod, why = sage1_module()
    if mod is None:
        raise RuntimeError(why)

    def sage1(q, k, v):
        k_own = k.clone(memory_format=torch.contiguous_format)
        return mod.sageattn(q, k_own, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=True)
    return sage1
