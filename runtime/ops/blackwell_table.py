"""What the Blackwell entries' guards promise, in one table: the capability, dtypes, head-dim and shape limits and
the torch/toolkit each entry needs, with where each limit comes from and which build shows it compiles.

Read by the guards (``ops.blackwell_attention`` takes SageAttention3's and FlashAttention-4's architectures and
head dims from here, ``ops.gemm_backends`` the native FP4 GEMM's minimum capability), by the README's "What runs
where" Blackwell rows (:func:`readme_rows`, between the ``blackwell-table`` markers) and by
``bench/blackwell_first_run.py``. ``tests/test_blackwell_table.py`` runs every guard at every capability, head
dim and dtype of :data:`CAPABILITIES` and checks its verdict against this table, and checks the README block.

Nothing here was run on a Blackwell GPU: the limits are read from the libraries' sources and documents (``basis``)
and the compile of each entry for sm_100a / sm_120a / sm_121a is recorded in ``bench/results/blackwell-build.json``
(``build`` names its key there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

CC = tuple[int, int]

# every compute capability the guard tests loop over (Ampere .. Blackwell; sm_110 is Thor, formerly sm_101)
CAPABILITIES: tuple[CC, ...] = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1))
# the Blackwell build targets of bench/blackwell_build.py ("a": the architecture-specific feature set)
TARGETS: dict[str, CC] = {"sm_100a": (10, 0), "sm_120a": (12, 0), "sm_121a": (12, 1)}


def _sage_head_dim(d: int) -> bool:
    return d in (64, 128)


def _sage2_head_dim(d: int) -> bool:
    return 1 <= d <= 128  # the library pads q/k/v to 64 or 128 itself


def _fa4_head_dim(d: int) -> bool:
    return (8 <= d <= 128 and d % 8 == 0) or d == 256


def _any_head_dim(d: int) -> bool:
    return True


@dataclass(frozen=True)
class BlackwellEntry:
    name: str  # the backend name (registry / report)
    what: str
    archs: tuple[CC, ...]  # the capabilities of CAPABILITIES where the guard lets it run
    dtypes: tuple[str, ...]  # operand dtypes it takes
    head_dims: str  # in words; head_dim_ok decides
    head_dim_ok: Callable[[int], bool]
    shapes: str
    torch: str  # the torch (and toolkit) it needs
    basis: str  # where the limits come from
    build: str  # its key in bench/results/blackwell-build.json (or why it has none)

    def runs_on(self, cc: CC) -> bool:
        return tuple(cc) in self.archs

    def arch_names(self) -> str:
        return ", ".join(f"sm_{a}{b}" for a, b in self.archs)


_CC10_UP = tuple(c for c in CAPABILITIES if c >= (10, 0))

ENTRIES: tuple[BlackwellEntry, ...] = (
    BlackwellEntry(
        "native", "NVFP4 GEMM: cuBLASLt block-scaled FP4 through torch's scaled_mm", _CC10_UP,
        ("float4_e2m1fn_x2 + float8_e4m3fn scales per 16 -> bf16",), "n/a", _any_head_dim,
        "K a multiple of 32 (gemm_backends.K_MULTIPLE); swizzled 128x4 scale tiles",
        "torch >= 2.7 (torch.float4_e2m1fn_x2); a load-time probe GEMM against float64 must pass",
        "cuBLASLt CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 needs CC 10.0+ (kernels-facts.md s.2); torch 2.7 "
        "release notes (float4_e2m1fn_x2)", "none: torch's own cuBLASLt kernels (nothing of ours to compile)"),
    BlackwellEntry(
        "sage2", "SageAttention2 sageattn_qk_int8_pv_fp8_cuda (its non-sm_90 kernel, fp32+fp16 PV)",
        ((8, 9), (10, 0), (12, 0), (12, 1)), ("float16", "bfloat16"), "<= 128 (padded to 64/128 by the library)",
        _sage2_head_dim, "NHD views, unit stride in D; H_q == H_kv",
        "SageAttention 2.2.0 built from source: CUDA >= 12.8 for sm_120/sm_100, torch with its cpp_extension",
        "SageAttention setup.py (SUPPORTED_ARCHS 8.0..12.1; 10.0 -> sm_100a, 12.x -> sm_12xa) and core.py "
        "(sm120/sm121 -> sageattn_qk_int8_pv_fp8_cuda, fp32+fp16; sageattn() raises on sm_100)", "sage2"),
    BlackwellEntry(
        "sage3", "SageAttention3 sageattn3_blackwell (FP4 microscaling attention)", ((12, 0), (12, 1)),
        ("float16", "bfloat16"), "64 or 128", _sage_head_dim, "HND [B, H, S, D], H_q == H_kv; S padded to 128",
        "torch >= 2.8, CUDA >= 12.8 (its README), built from source",
        "sageattention3_blackwell/README.md and setup.py (sm_100a, sm_120a, sm_121a targets); its kernel "
        "TORCH_CHECKs sm120 || sm121 at run time, so sm_100 builds but is refused", "sage3"),
    BlackwellEntry(
        "fa4", "FlashAttention-4 flash_attn.cute.flash_attn_func, its SM100 forward", ((10, 0), (10, 3)),
        ("float16", "bfloat16"), "8..128 in steps of 8, or 256", _fa4_head_dim,
        "NHD views, 16-byte aligned (else it copies)",
        "the flash-attn-4 wheel (pure Python, CuTe DSL JIT: nvidia-cutlass-dsl >= 4.6.2, quack-kernels, "
        "apache-tvm-ffi); any torch it installs with",
        "flash-attn-4 4.0.0b40 wheel: interface.py _validate_head_dims (CC 10/11: 8..128 or 256, a multiple of "
        "16 bytes / element; (192, 128) and MLA shapes not used here), fp8 only on CC 10; its SM100 path also "
        "serves CC 11 (sm_110), which this backend does not wire",
        "none: compiled by the CuTe DSL at the first call (no ahead-of-time build exists)"),
    BlackwellEntry(
        "fc2_gb10", "the seed's GB10 FC2 entry: pinned cuBLASLt NVFP4 plan (algo 70, tile 20, stages 37, split-K 1)",
        ((12, 1),), ("nvfp4 -> bf16",), "n/a", _any_head_dim,
        "FC2 only: M 37,810 (padded 37,824), N 5,376, K 14,336, SwiGLU NVFP4 producer, no LoRA/bias; 48 SMs",
        "CUDA 13.0 runtime and headers, cuBLAS 13.1 headers, cuBLASLt 13.0 runtime; any torch with cpp_extension",
        "seed 003 (fc2_nvfp4_scheduling study): the accepted configuration and its guard", "fc2"),
)
BY_NAME: dict[str, BlackwellEntry] = {e.name: e for e in ENTRIES}

README_BEGIN = "<!-- blackwell-table:begin (generated by runtime/ops/blackwell_table.py readme_rows) -->"
README_END = "<!-- blackwell-table:end -->"


def readme_rows() -> list[str]:
    """The README's Blackwell entries table (markdown lines, markers included)."""
    rows = [README_BEGIN, "| Blackwell entry | runs on | dtypes | head dim | shapes | needs | compiled ahead of time |",
            "|---|---|---|---|---|---|---|"]
    for e in ENTRIES:
        rows.append(f"| `{e.name}`: {e.what} | {e.arch_names()} | {', '.join(e.dtypes)} | {e.head_dims} | "
                    f"{e.shapes} | {e.torch} | {e.build} |")
    return rows + [README_END]
