"""Every Triton kernel of ours compiled ahead of time for a GPU target that is not here (``bench/blackwell_build.py``).

* :func:`jit_functions` finds every ``@triton.jit`` function in this package's source (an AST scan, so nothing is
  missed by hand); :func:`entry_kernels` are those launched from Python, each other one is a device helper that
  an entry kernel inlines (:func:`helper_callers`; ``tests/test_triton_aot.py`` checks both).
* :func:`canonical_launches` writes down, for each entry kernel, the launch the canonical job makes (37,810 rows,
  hidden 5,376, 56 heads x 128, FFN 14,336, 3 segments, bf16 activations) with the CUDA tile choices of its
  wrapper (``ops.elementwise``, ``ops.fp8_producers``, ``ops.nvfp4_producers``, ``ops.flash_attention``);
  kernels with two modes get one launch per mode.
* :func:`compile_launch` compiles one launch for ``GPUTarget("cuda", arch)`` through the kernel's own
  ``warmup`` (Triton's argument specialization, a stand-in driver that only names the target, nothing launched)
  and reads registers and spills from the ptxas log Triton prints, shared memory from the compiled metadata.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..fp8_producers import _tiles as _fp8_wrapper_tiles  # the wrappers' own CUDA tile choices
from ..nvfp4 import BLOCK, roundup, scale_shape
from ..nvfp4_producers import _tiles as _nvfp4_wrapper_tiles

HERE = Path(__file__).resolve().parent
KERNEL_MODULES = ("common", "elementwise_kernels", "fa3_kernels", "fp8_kernels", "nvfp4_kernels")

# the canonical job (H3 defaults; 1344x768, 124 frames): rows, widths and segments its kernels see
S, HIDDEN, HEADS, HEAD_DIM, FFN, ROPE = 37810, 5376, 56, 128, 14336, 96
INNER = HEADS * HEAD_DIM
SEGMENTS = 3  # text, audio, video rows (one modulation row each)
BF16, F32, F64, U8, I32 = torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int32


def _is_jit(dec: ast.expr) -> bool:
    d = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(d, ast.Attribute) and d.attr == "jit" and getattr(d.value, "id", "") == "triton"


def _called_names(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return out


def _params(fn: ast.FunctionDef) -> tuple[tuple[str, bool], ...]:
    """(name, is constexpr) of each parameter, in order."""
    return tuple((a.arg, a.annotation is not None and "constexpr" in ast.unparse(a.annotation)) for a in fn.args.args)


def kernel_params(name: str) -> tuple[tuple[str, bool], ...]:
    """The parameters of ``@triton.jit`` function ``name`` as its source declares them."""
    module = jit_functions()[name][0]
    for node in ast.parse((HERE / f"{module}.py").read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _params(node)
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def jit_functions() -> dict[str, tuple[str, frozenset[str]]]:
    """``{name: (module, names it calls)}`` of every ``@triton.jit`` function in this package's ``*.py``."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for path in sorted(HERE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                if node.name in found:
                    raise ValueError(f"@triton.jit {node.name} defined in {found[node.name][0]} and {path.stem}: "
                                     "expected unique names (the AOT table is keyed by name)")
                found[node.name] = (path.stem, frozenset(_called_names(node)))
    return found


def entry_kernels() -> list[str]:
    """The launched kernels: the ``@triton.jit`` functions no other one calls."""
    fns = jit_functions()
    called = frozenset().union(*(c for _, c in fns.values()))
    return sorted(n for n in fns if n not in called)


def helper_callers() -> dict[str, list[str]]:
    """``{helper: [entry kernels that inline it, directly or through other helpers]}``."""
    fns = jit_functions()
    out: dict[str, set[str]] = {n: set() for n in fns if n not in entry_kernels()}
    for entry in entry_kernels():
        todo, seen = [entry], set()
        while todo:
            for callee in fns[todo.pop()][1] & set(fns):
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
                    out[callee].add(entry)
    return {k: sorted(v) for k, v in out.items()}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _nvfp4_geometry(rows: int, k: int) -> dict[str, int]:
    rs, cp = scale_shape(rows, k)
    return dict(R_PACK=rows, R_SCALE=rs, KP=roundup(k, BLOCK), CP=cp)


def _fp8_tiles(op: str, k: int) -> dict[str, int]:
    _, bm, bk, nkt, nw = _fp8_wrapper_tiles(op, k, torch.device("cuda"), "auto", None)
    return dict(BM=bm, BK=bk, NKT=nkt, num_warps=nw)


def _elementwise_launches() -> dict[str, dict[str, Any]]:
    qkv_row = 3 * INNER
    return {
        # elementwise.norm_rope_ (block_ops: defaults block_s 8, heads_per_program 2, num_warps 2)
        "norm_rope_kernel": dict(
            qkv_ptr=BF16, qw_ptr=BF16, kw_ptr=BF16, cos_ptr=F32, sin_ptr=F32, S=S, stride_row=qkv_row,
            stride_cos=ROPE, stride_sin=ROPE, eps=1e-5, H=HEADS, D=HEAD_DIM, HALF=ROPE // 2, HALF_P=64,
            PASS=HEAD_DIM - ROPE, PASS_P=32, HEADS_PER_PROG=2, BLOCK_S=8, OUT_KIND=1, W_KIND=1, num_warps=2),
        # elementwise.gate_add_ (block_s 16, block_n 256, num_warps 4)
        "gate_add_kernel": dict(
            x_ptr=BF16, y_ptr=BF16, g_ptr=BF16, seg_ptr=I32, S=S, N=HIDDEN, stride_x=HIDDEN, stride_y=HIDDEN,
            stride_g=HIDDEN, N_SEG=SEGMENTS, BLOCK_S=16, BLOCK_N=256, OUT_KIND=1, Y_KIND=1, G_KIND=1, num_warps=4,
            enable_fp_fusion=False),
        # flash_attention.fa3_fp8_operands (fa3_fp8, on request): BT 64 on CUDA, 512 statistics rows a program
        "qkv_stats_kernel": dict(qkv_ptr=BF16, p32_ptr=F32, p64_ptr=F64, S=S, stride_s=qkv_row, H=HEADS, KIND=1,
                                 D=HEAD_DIM, BT=64, NT=512 // 64, num_warps=4, enable_fp_fusion=False),
        "qkv_fp8_kernel": dict(qkv_ptr=BF16, mean_ptr=F32, inv_ptr=F32, out_ptr=U8, S=S, stride_s=qkv_row, H=HEADS,
                               plane=S * INNER, KIND=1, D=HEAD_DIM, BT=64, HW=True, num_warps=4,
                               enable_fp_fusion=False),
    }


def _fp8_launches() -> dict[str, dict[str, Any]]:
    nseg = 1 << (SEGMENTS - 1).bit_length()
    rows = _cdiv(S, 128) * 128
    v = dict(v_ptr=BF16, S=S, stride_s=3 * INNER, stride_h=HEAD_DIM, H=HEADS, V_KIND=1, D=HEAD_DIM, BT=64,
             HW=True, num_warps=4)
    return {
        # fp8_producers (W4A8, the Hopper default; tiles: the built-in CUDA choice, scheme "auto")
        "quantize_fp8_kernel": dict(x_ptr=BF16, out_ptr=U8, rs_ptr=F32, S=S, K=INNER, stride_x=INNER, stride_o=INNER,
                                    X_KIND=1, HW=True, enable_fp_fusion=False, **_fp8_tiles("quantize", INNER)),
        "rms_fp8_kernel": dict(x_ptr=BF16, w_ptr=BF16, sc_ptr=BF16, sh_ptr=BF16, seg_ptr=I32, eps_ptr=F64, out_ptr=U8,
                               rs_ptr=F32, S=S, K=HIDDEN, stride_x=HIDDEN, stride_sc=HIDDEN, stride_sh=HIDDEN,
                               stride_o=HIDDEN, HAS_W=True, X_KIND=1, W_KIND=1, T_KIND=1, NSEG=nseg, HW=True,
                               enable_fp_fusion=False, **_fp8_tiles("rms", HIDDEN)),
        "swiglu_fp8_kernel": dict(h_ptr=BF16, out_ptr=U8, rs_ptr=F32, S=S, F=FFN, stride_h=2 * FFN, stride_o=FFN,
                                  H_KIND=1, HW=True, FAST=True, enable_fp_fusion=False, **_fp8_tiles("swiglu", FFN)),
        # fp8_producers.sage_v_fp8 (Sage2 sm_90 fused V)
        "v_amax_kernel": dict(part_ptr=F32, enable_fp_fusion=False, **v),
        "v_quant_kernel": dict(inv_ptr=F32, out_ptr=U8, ROWS=rows, enable_fp_fusion=False, **v),
    }


def _nvfp4_launches() -> dict[str, dict[str, Any]]:
    t = _nvfp4_wrapper_tiles(torch.device("cuda"))
    nseg = 1 << (SEGMENTS - 1).bit_length()
    g_in, g_ffn, g_w = _nvfp4_geometry(S, INNER), _nvfp4_geometry(S, FFN), _nvfp4_geometry(HIDDEN, FFN)
    (qm, qk, qw), (nm, nk, nw), (gm, gk, gw) = t["q"], t["norm"], t["glu"]
    (dm, dk, dw), (fm, fk, fw) = t["deq"], t["fp8"]
    bm, bn, bk, group, gw_, gs = t["gemm"]
    g_h = _nvfp4_geometry(S, HIDDEN)
    rms = dict(x_ptr=BF16, w_ptr=BF16, sc_ptr=BF16, sh_ptr=BF16, seg_ptr=I32, eps_ptr=F64, packed_ptr=U8,
               scales_ptr=U8, S=S, K=HIDDEN, stride_x=HIDDEN, stride_sc=HIDDEN, stride_sh=HIDDEN,
               stride_p=g_h["KP"] // 2, HAS_W=True, X_KIND=1, W_KIND=1, T_KIND=1, BM=nm, BK=nk,
               NKT=_cdiv(HIDDEN, nk), NSEG=nseg, num_warps=nw, enable_fp_fusion=False, **g_h)
    glu = dict(h_ptr=BF16, packed_ptr=U8, scales_ptr=U8, S=S, F=FFN, stride_h=2 * FFN, stride_p=g_ffn["KP"] // 2,
               H_KIND=1, BM=gm, BK=gk, num_warps=gw, enable_fp_fusion=False, **g_ffn)
    return {
        # nvfp4_producers (NVFP4 activations, the Blackwell path; dynamic global scale: MODE 0 amax, MODE 1 write)
        "quantize_kernel": dict(x_ptr=BF16, g_ptr=F32, packed_ptr=U8, scales_ptr=U8, S=S, K=INNER, stride_x=INNER,
                                stride_p=g_in["KP"] // 2, X_KIND=1, BM=qm, BK=qk, num_warps=qw,
                                enable_fp_fusion=False, **g_in),
        "rms_modulate_kernel[MODE=0]": dict(g_ptr=F64, amax_ptr=F32, MODE=0, NKT_OUT=_cdiv(HIDDEN, nk), **rms),
        "rms_modulate_kernel[MODE=1]": dict(g_ptr=F32, amax_ptr=F32, MODE=1, NKT_OUT=_cdiv(g_h["CP"] * 16, nk),
                                            **rms),
        "swiglu_kernel[MODE=0]": dict(g_ptr=F32, amax_ptr=F32, MODE=0, **glu),
        "swiglu_kernel[MODE=1]": dict(g_ptr=F32, amax_ptr=F32, MODE=1, **glu),
        # consumers of the FC2 weight [5376, 14336]: bf16 dequantize, fp8 rowwise expansion, the Triton GEMM
        "dequant_kernel": dict(p_ptr=U8, s_ptr=U8, gm_ptr=F32, out_ptr=BF16, R=HIDDEN, K=FFN, KP=g_w["KP"],
                               CP=g_w["CP"], stride_p=g_w["KP"] // 2, stride_o=FFN, HAS_G=False, OUT_KIND=1,
                               BM=dm, BK=dk, num_warps=dw, enable_fp_fusion=False),
        "fp8_rowwise_kernel": dict(p_ptr=U8, s_ptr=U8, out_ptr=U8, rs_ptr=F32, R=HIDDEN, K=FFN, KP=g_w["KP"],
                                   CP=g_w["CP"], stride_p=g_w["KP"] // 2, stride_o=FFN, BM=fm, BK=fk,
                                   NKT=_cdiv(g_w["KP"], fk), HW=True, num_warps=fw, enable_fp_fusion=False),
        "gemm_kernel": dict(a_ptr=U8, as_ptr=U8, b_ptr=U8, bs_ptr=U8, ga_ptr=F32, gb_ptr=F32, o_ptr=BF16, M=S,
                            N=HIDDEN, KP=g_ffn["KP"], A_CP=g_ffn["CP"], B_CP=g_w["CP"], stride_a=g_ffn["KP"] // 2,
                            stride_b=g_w["KP"] // 2, stride_o=HIDDEN, OUT_KIND=1, BM=bm, BN=bn, BK=bk,
                            GROUP_M=group, NKT=_cdiv(g_ffn["KP"], bk), DOT_BF16=True, num_warps=gw_,
                            num_stages=gs, enable_fp_fusion=False),
    }


def canonical_launches() -> dict[str, dict[str, Any]]:
    """``{launch name: {parameter: dtype (pointer) or value, option: value}}``; the name is the kernel's, with
    ``[MODE=m]`` where one kernel is launched in two modes."""
    return {**_elementwise_launches(), **_fp8_launches(), **_nvfp4_launches()}


def kernel_of(launch: str) -> str:
    return launch.split("[", 1)[0]


_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def split_launch(launch_name: str, launch: dict[str, Any]) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """(positional arguments, constexpr keywords, options) of ``launch`` in its kernel's parameter order; raises
    ValueError naming what is missing or unknown."""
    params = kernel_params(kernel_of(launch_name))
    names = [n for n, _ in params]
    unknown = set(launch) - set(names) - set(_OPTIONS)
    missing = [n for n in names if n not in launch]
    if unknown or missing:
        raise ValueError(f"{launch_name}: launch table has unknown {sorted(unknown)} and lacks {missing}; "
                         "expected exactly its parameters (update runtime/ops/triton/aot.py with the kernel)")
    pos = [launch[n] for n, const in params if not const]
    const = {n: launch[n] for n, c in params if c}
    return pos, const, {k: launch[k] for k in _OPTIONS if k in launch}


class _TargetDriver:
    """The few calls ``JITFunction.warmup`` makes of the active driver, answering a fixed target; no GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _ptxas_figures(log: str) -> tuple[int | None, int | None]:
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return (int(regs[-1]) if regs else None), (int(spills[-1]) if spills else None)


def compile_launch(launch_name: str, launch: dict[str, Any], arch: int) -> dict[str, Any]:
    """``{"ok", "registers", "shared_bytes", "spills", "error"}`` of one launch compiled for ``sm_<arch>``."""
    # triton is optional for the package (ops.triton.MISSING): imported where a compile is asked for
    from triton import knobs
    from triton.runtime import driver

    from . import common, elementwise_kernels, fa3_kernels, fp8_kernels, nvfp4_kernels  # noqa: F401
    mods = {m.__name__.rsplit(".", 1)[-1]: m for m in (common, elementwise_kernels, fa3_kernels, fp8_kernels,
                                                       nvfp4_kernels)}
    name = kernel_of(launch_name)
    kernel = getattr(mods[jit_functions()[name][0]], name)
    out: dict[str, Any] = {"ok": False, "registers": None, "shared_bytes": None, "spills": None, "error": None}
    buf = io.StringIO()
    before = driver._active  # restored as it was (reset_active would start the real driver: no GPU here)
    try:
        pos, const, opts = split_launch(launch_name, launch)
        driver.set_active(_TargetDriver(arch))
        kernel.device_caches.clear()  # the binder keeps the target it was made for
        with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
            knobs.cache.dir = cache  # a fresh cache: ptxas runs (and logs) every time
            knobs.nvidia.dump_ptxas_log = True
            with contextlib.redirect_stdout(buf):
                compiled = kernel.warmup(*pos, grid=(1,), **const, **opts)
        regs, spills = _ptxas_figures(buf.getvalue())
        target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        if f"'{target}'" not in buf.getvalue():
            raise RuntimeError(f"ptxas log does not name {target}: {buf.getvalue()[-300:]!r}")
        out.update(ok=regs is not None, registers=regs, spills=spills, shared_bytes=int(compiled.metadata.shared),
                   error=None if regs is not None else f"no register count in the ptxas log: {buf.getvalue()[-300:]!r}")
    except Exception as e:  # noqa: BLE001 - the compiler's error is the record
        out["error"] = f"{type(e).__name__}: {str(e).strip()[-1500:]}"
    finally:
        driver._active = before
        kernel.device_caches.clear()
    return out
