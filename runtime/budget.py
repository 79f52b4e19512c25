"""The device-memory budget: which DiT blocks stay resident, which stream from pinned host memory, and which
activation chunking a run needs, decided from the checkpoint header and the request's size before any tensor
is read.

The budget (``RuntimeOptions.vram_budget``: ``--vram-budget GB``, the loader node's widget, ``H3_VRAM_BUDGET``)
bounds the run's peak device bytes as torch's allocator counts them (``torch.cuda.max_memory_allocated``):
weights, streaming buffers, activations and the run's own tensors. ``auto`` is the device's free memory less
a margin (``AUTO_MARGIN_BYTES`` + ``AUTO_MARGIN_FRACTION`` of the total) for the allocator's fragmentation and
whatever else the process (ComfyUI's text encoder and VAE) allocates later.

The decision, in order (each step only when the one before does not fit):

1. everything resident, activations unchunked;
2. stream blocks: the largest number of resident blocks that fits beside ``SLOTS`` device buffers of one
   block each (a copy stream fills them from pinned host memory, ``runtime.ops.streaming``); resident blocks
   are spread evenly over the stack so each streamed block's copy hides behind the compute before it;
3. chunk the FFN over rows (fc1 -> SwiGLU -> fc2 -> gate/add per row chunk; halving down to
   ``MIN_CHUNK_ROWS``), only where every op of the FFN is row-local so the bytes cannot change;
4. chunk the attention half too, over query rows of the same size (``DiTBlock._attend_in_row_chunks``: K and V of
   every row kept, the QKV projection run again per chunk for its Q, attention of the chunk over all of K and V,
   out_proj and the gated residual per chunk), where the activations are row-local and the attention has a row
   form (not the sparse backend); the bytes equal the unchunked run's where the kernel is row-exact
   (``runtime.ops.attention.row_exactness``);
5. otherwise refuse, naming the smallest budget that works (every block streamed, the smallest chunking).

CPU: with ``auto`` nothing streams (device memory is host memory); an explicit budget runs the same decision
and the streaming loop with host-to-host copies (an emulation, for tests). An integrated GPU (GB10,
``is_integrated``) shares memory with the host: nothing streams, everything stays resident.

The estimate (``estimate``) is the sum of the resident weights (from the header's shapes), the streaming
buffers, the scratch of the GEMM backend, the run's tensors (modulation rows of every step and block, RoPE
tables, latents and sampler state) and the largest activation phase of one block (the QKV buffer with
attention's operands and output, or the FFN's fc1 output with the SwiGLU bytes and fc2's output), plus a
fixed allowance for library workspaces. A run with a Fun ControlNet (``Workload.tower``, from the control
file's header) adds the tower: its weights (its block linears in the base's form, on the device or, past
"everything resident", streamed through two buffers of its own; full-form AdaLN in host memory like the
base's), and what it holds through an evaluation (its stream ``c``, the skip residual, the control rows'
embedding and its modulation rows of every step), so the blocks that stream make room for it. A sparse run
(``attention=sparse``) adds the phases of its sparse calls for the method it runs (``sparse_phases``: one producer
chunk, comfy-kitchen's workspace and output, VSA's padded tiles and its ``to_gate_compress`` buffer; the eager
reference's copies on the CPU) beside the dense ones its dense steps and ``dense_blocks`` still run, and holds its
call-order rotary tables and per-conditioning statistics (``sparse_held_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Sequence

import torch

from .errors import H3Error
from .io.adaln_file import BLOCKS_IN_FLIGHT
from .model.config import QUANT_LINEARS, H3Config
from .model.h3 import HEAD_ROWS, H3Model
from .ops import nvfp4
from .ops.attention import row_exactness
from .ops.host_buffers import aligned  # each tensor's place in a streamed block's buffer
from .ops.rows_kv import Bf16KV
from .ops.sage_kv import SageKV
from .ops.sparse_methods import BLOCK, PRODUCER_CHUNK, VSA_CUBE
from .options import vram_budget_bytes
from .plan import ADALN_FROM_FILE, ADALN_ON_DEVICE, Choice
from .sampling.request import RequestError, host_available_bytes, latent_rows, resolve_request

GB = 1e9
SLOTS = 2  # device buffers of one streamed block each: block i+1 is copied while block i computes
AUTO_MARGIN_BYTES = int(0.5e9)
AUTO_MARGIN_FRACTION = 0.05
MIN_CHUNK_ROWS = 2048  # row chunks below this make the GEMMs inefficient (and were not measured byte-exact)
MIN_CHUNK_ROWS_CPU = 128  # the CPU emulation chunks the tiny model's few hundred rows too (tests)
CHUNK_MULTIPLE = 128  # chunk boundaries on the producers' and GEMMs' 128-row tiles
WORKSPACE_BYTES = 64 << 20  # cuBLAS / cuBLASLt workspaces and small per-run tensors (CUDA)
# The process's own host memory beside a plan's host figure, at H3's full size: torch and CUDA's libraries and
# context, the load's read-ahead (``runtime.io.prefetch.READ_AHEAD_BYTES``), the LoRA's factors, the run's host
# tensors; the largest peak host RSS less the plan's host figure measured, rounded up (bench/NOTES.md, "Ninth
# session"). The full-form AdaLN weights are kept in host memory only where they fit beside the streamed blocks and
# this (``_check_host``); else they are read from the file each run.
HOST_PROCESS_BYTES = int(10e9)



class BudgetError(H3Error):
    """A device-memory budget that cannot run the job (too small, not enough host memory, a bad value)."""


def parse_vram_budget(value, option: str = "vram_budget") -> int | None:
    """``options.vram_budget_bytes`` (the one parser: ``auto`` -> None, a number of GB -> bytes) raising
    BudgetError for a bad value of ``option`` (vram_budget, host_budget)."""
    try:
        return vram_budget_bytes(value, option)
    except ValueError as e:
        raise BudgetError(str(e).removeprefix("option ")) from None


def gb(n: int | float) -> str:
    """Bytes as GB (1e9), or MB below 0.1 GB (the tiny model's numbers)."""
    return f"{n / GB:.2f} GB" if abs(n) >= 0.1 * GB else f"{n / 1e6:.2f} MB"


# ---------------------------------------------------------------------------------------------
# what the plan knows: device, workload, model
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceMemory:
    """The device the budget is planned for. ``probe`` reads a real one; tests pass a simulated one."""

    kind: str  # "cuda" | "cpu"
    name: str
    total_bytes: int
    free_bytes: int
    integrated: bool = False

    @classmethod
    def probe(cls, device: torch.device) -> "DeviceMemory":
        """free: what new allocations can get: the driver's free memory plus what torch's caching allocator
        holds unused (a second run must not see the first run's cache as taken)."""
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            props = torch.cuda.get_device_properties(device)
            return cls("cuda", props.name, int(total), int(free + max(0, cached)),
                       bool(getattr(props, "is_integrated", False)))
        free = host_available_bytes()
        return cls("cpu", "cpu", free, free)


@dataclass(frozen=True)
class TowerSize:
    """A Fun ControlNet tower as the memory plan sees it, from its file's header: ``cfg`` its block config
    (``runtime.model.control.block_config``), ``blocks`` its control blocks."""

    cfg: H3Config
    blocks: int

    @classmethod
    def of(cls, control) -> "TowerSize | None":
        """The size of an opened control file (``runtime.io.control.ControlFile``: its ``spec``), of a loaded
        tower (``runtime.model.control.FunControl``), or None for None."""
        if control is None:
            return None
        spec = getattr(control, "spec", None)
        if spec is not None:
            return cls(spec.block_config, len(spec.places))
        return cls(control.cfg, len(control.places))


@dataclass(frozen=True)
class Workload:
    """The run the activations are sized for. rows: packed rows (text + audio + video + conditions);
    video_rows: the video segment's rows; steps: evaluations of one run; t_values: distinct timesteps per step
    (2 for t2va: video/text and audio; keyframes and references add theirs); latent_bytes: fp32 video + audio."""

    rows: int
    video_rows: int
    steps: int
    latent_bytes: int
    t_values: int = 2
    tower: TowerSize | None = None
    video_grid: tuple = ()  # (T, H/2, W/2) of the target video: VSA's cube padding (``sparse_rows``)
    prefix_segments: int = 2  # non-video segments at most (text, audio, each condition's): VSA pads each to 64 rows

    @classmethod
    def from_shapes(cls, video_shape, audio_shape, text_tokens: int, steps: int, cond=None,
                    tower: TowerSize | None = None) -> "Workload":
        """Latent shapes video [1, C, T, H, W] / audio [1, Ca, 2, Ta]; cond: the run's H3Conditioning (its
        keyframe and reference rows, and their timesteps: two more per kind present); tower: the run's Fun
        ControlNet (``TowerSize.of``), None without one."""
        t, h, w = video_shape[2], -(-video_shape[3] // 2), -(-video_shape[4] // 2)
        numel = math.prod(video_shape) + math.prod(audio_shape)
        extra = 0 if cond is None else 2 * (bool(getattr(cond, "keyframes", None)) + bool(getattr(cond, "refs", None)))
        items = 0 if cond is None else len(getattr(cond, "keyframes", None) or ()) + len(getattr(cond, "refs", None) or ())
        return cls(latent_rows(video_shape, audio_shape, text_tokens, cond), t * h * w, steps, 4 * numel, 2 + extra,
                   tower, (t, h, w), 2 + 2 * items)

    @classmethod
    def for_request(cls, cfg: H3Config, width=None, height=None, frames=None, steps=None,
                    text_tokens: int = 100) -> "Workload":
        """A pixel request (the model's defaults where None: 1344x768, 124 frames, 20 steps for the full model)."""
        from .model.layout import latent_shapes

        req = resolve_request(cfg, width, height, frames, steps, text_tokens)
        vs, as_ = latent_shapes(req.width, req.height, req.frames, cfg.video_channels, cfg.audio_channels)
        return cls.from_shapes(vs, as_, text_tokens, req.steps)

    def describe(self) -> str:
        tower = "" if self.tower is None else f", a control tower of {self.tower.blocks} blocks"
        return f"{self.rows:,} rows, {self.steps} steps{tower}"


def linear_dims(cfg: H3Config) -> dict[str, tuple[int, int]]:
    """Block linear -> (N, K)."""
    h, inner, ffn = cfg.hidden_size, cfg.inner_dim, cfg.ffn_hidden_size
    return {"attn.qkv_proj": (3 * inner, h), "attn.out_proj": (h, inner), "mlp.fc1": (2 * ffn, h),
            "mlp.fc2": (h, ffn)}


def streamed_tensor_bytes(n: int, k: int, quantized: bool, dtype_bytes: int) -> list[int]:
    """Bytes of the tensors of one block linear that stream: NVFP4 packed [roundup(N,16), K/2] and swizzled
    scales (one byte each), or the dense weight."""
    if not quantized:
        return [n * k * dtype_bytes]
    return [math.prod(nvfp4.packed_shape(n, k, 16)), math.prod(nvfp4.scale_shape(n, k))]


def streamed_linear_bytes(n: int, k: int, quantized: bool, dtype_bytes: int) -> int:
    """The host buffer of one streamed block linear [N, K]: its streamed tensors, each aligned as ``HostLinear``
    places them."""
    return sum(aligned(b) for b in streamed_tensor_bytes(n, k, quantized, dtype_bytes))


def block_linear_bytes(cfg: H3Config, quantized: bool, dtype_bytes: int) -> int:
    """The streamable bytes of one block of ``cfg`` (a DiT block or a control block): its four linears' host
    buffers."""
    return sum(streamed_linear_bytes(n, k, quantized, dtype_bytes) for n, k in linear_dims(cfg).values())


@dataclass(frozen=True)
class ModelMemory:
    """The model's side of the estimate, from its config and the load plan's choices (no tensor read).

    block_bytes: the streamable bytes of one block (the four linears' large tensors, each aligned);
    other_bytes: every other tensor that lives on the device (token refiner, projections, norms, final layer,
    small per-linear scalars); adaln_host_bytes: full-form AdaLN weights the plan keeps in host memory."""

    cfg: H3Config
    dtype_bytes: int
    act_format: str  # "fp8" | "nvfp4" | "dense"
    gemm: str
    attention: str
    v_handling: str
    block_bytes: int
    other_bytes: int
    adaln_host_bytes: int
    ffn_row_local: bool
    ffn_row_local_why: str
    adaln_on_host: bool = True
    sparse: bool = False  # the sparse backend runs attention (``attention`` is then its dense steps' backend)
    adaln_file: bool = False  # the AdaLN weights can stay in the checkpoint file (a file source, AdaLN off the device)
    refiner_bytes: int = 0  # the token refiner's weights (in other_bytes): in host memory whenever blocks stream
    adaln_block_bytes: int = 0  # one block's AdaLN weight and bias (a run reading them from the file holds
    #                             BLOCKS_IN_FLIGHT of them: ``adaln_read_bytes``)
    sparse_method: str = ""  # with ``sparse``: sol-attn | sla | vsa (``sparse_phases``)
    sparse_token_aug: int = 0  # with ``sparse``: the kernel's extra tokens (``SparseSettings.token_aug``)

    @property
    def adaln_read_bytes(self) -> int:
        """Host memory a run reading the AdaLN weights from the file holds at once (``runtime.io.adaln_file``)."""
        return self.adaln_block_bytes * BLOCKS_IN_FLIGHT

    @property
    def attn_rows(self) -> tuple[bool, str]:
        """Whether the attention half may run in query-row chunks -> (may, why): row-local activations and an
        attention with a row form; the why says whether the kernel is row-exact."""
        if not self.ffn_row_local:
            return False, f"attention unchunked: {self.ffn_row_local_why}"
        if self.sparse:
            return False, "attention unchunked: the sparse backend pools over query blocks and carries state per call"
        return True, row_exactness(self.attention)[1]

    @property
    def attn_kv_sage(self) -> bool:
        """Whether query-row chunks may hold K and V as Sage2's sm_90 operands (``ops.sage_kv``): Sage2 on its
        sm_90 stages (v_handling "fused") and chunks allowed at all."""
        return self.attention == "sage2" and self.v_handling == "fused" and self.attn_rows[0]

    @classmethod
    def build(cls, cfg: H3Config, dtype: torch.dtype, act_format: str, gemm: str = "fp8", attention: str = "sage2",
              v_handling: str = "fused", adaln_on_host: bool = True, calibrated_scales: bool = False
              ) -> "ModelMemory":
        """calibrated_scales: the activations take the checkpoint's calibrated scales in every layer
        (act_scale=calibrated and every fc1/fc2 carries an input_scale), so W4A4's FFN rows are row-local."""
        quantized = act_format != "dense"
        e = torch.empty((), dtype=dtype).element_size()
        block = block_linear_bytes(cfg, quantized, e)
        with torch.device("meta"):
            meta = H3Model(cfg, dtype)
        other = adaln = refiner = 0
        for name, t in list(meta.named_parameters()) + list(meta.named_buffers()):
            nbytes = t.numel() * t.element_size()
            refiner += nbytes if name.startswith("token_refiner.") else 0
            layer = name.rsplit(".", 1)[0]
            if QUANT_LINEARS.match(layer) and name.endswith(".weight"):
                continue  # the streamable part of a block linear: counted in block_bytes
            if adaln_on_host and name.startswith("blocks.") and ".adaln_proj." in name:
                adaln += nbytes
                continue
            other += nbytes
        if quantized:
            other += cfg.num_layers * 4 * 64  # per linear: global scale (and the odd small buffer)
        if act_format == "nvfp4" and not calibrated_scales:
            row_local, why = False, ("W4A4 with a dynamic activation scale: the SwiGLU bytes take one amax over all "
                                     "rows, so a row chunk would quantize differently")
        else:
            row_local, why = True, "row-local (per-row activation scales; GEMM rows independent)"
        return cls(cfg, e, act_format, gemm, attention, v_handling, block, other, adaln, row_local, why, adaln_on_host,
                   refiner_bytes=refiner)

    @classmethod
    def for_options(cls, cfg: H3Config, choices: dict, dtype: torch.dtype) -> "ModelMemory":
        """Before a load plan exists (the request checks), from ``plan.memory_choices``: the block linears
        quantized to one byte a weight at most ("fp8") or dense, AdaLN where the options keep it, and the
        attention the options name."""
        form = choices["form"]
        mm = cls.build(cfg, dtype, form, "fp8" if form != "dense" else "dense", choices["attention"],
                       choices.get("v_handling", "fused"), choices["adaln_on_host"])
        return replace(mm, sparse=choices["attention"] == "sparse", sparse_method=choices.get("sparse_method", ""),
                       sparse_token_aug=choices.get("sparse_token_aug", 0))

    @classmethod
    def from_plan(cls, plan, placed: bool = True) -> "ModelMemory":
        """From a ``runtime.plan.LoadPlan`` (its config, dtype and choices). placed=False: full-form AdaLN weights
        the plan keeps on the device (``ADALN_ON_DEVICE``) counted off it, where a run without room for them puts
        them (``H3Runtime.fit_memory``): the model a request check or ``smallest_budget`` must see, since those
        weights never stop a smaller budget from running."""
        ck = plan.checkpoint
        adaln_on_host = plan.adaln_on_host or (not placed and plan.choices["adaln"].choice == ADALN_ON_DEVICE)
        calibrated = False
        if plan.act_scale == "calibrated" and ck is not None and hasattr(ck, "keys"):
            keys = set(ck.keys())
            calibrated = all(f"blocks.{j}.{n}.input_scale" in keys for j in range(plan.config.num_layers)
                             for n in ("mlp.fc1", "mlp.fc2"))
        mm = cls.build(plan.config, plan.dtype, plan.act_format, plan.gemm, plan.dense_attention,
                       plan.v_handling, adaln_on_host, calibrated).with_source(ck)
        sparse = plan.sparse_settings() if plan.attention == "sparse" else None
        return replace(mm, sparse=sparse is not None, sparse_method=sparse.method if sparse else "",
                       sparse_token_aug=sparse.token_aug if sparse else 0,
                       adaln_host_bytes=0 if plan.adaln_from_file else mm.adaln_host_bytes)

    def with_adaln_on_device(self) -> "ModelMemory":
        """The same model with its full-form AdaLN weights held on the device (counted in ``other_bytes``)."""
        return replace(self, other_bytes=self.other_bytes + self.adaln_host_bytes, adaln_host_bytes=0,
                       adaln_on_host=False, adaln_file=False, adaln_block_bytes=0)

    def with_source(self, source) -> "ModelMemory":
        """The same, knowing where the weights come from: a checkpoint file (its ``headers``) can keep the AdaLN
        weights a run reads block by block (``adaln_file``; ``runtime.io.adaln_file``)."""
        return replace(self, adaln_file=self.adaln_on_host and hasattr(source, "headers"),
                       adaln_block_bytes=self.adaln_host_bytes // max(1, self.cfg.num_layers))


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------

def _act_in(mm: ModelMemory, rows: int, k: int) -> int:
    """The producer's output that feeds a GEMM of K inputs over ``rows`` rows."""
    if mm.act_format == "fp8":
        return rows * k + 4 * rows
    if mm.act_format == "nvfp4":
        return rows * k // 2 + math.prod(nvfp4.scale_shape(rows, k)) + 16
    return rows * k * (mm.dtype_bytes + 4)  # dense: the modulated rows and RMSNorm's fp32 temporary


def _swiglu_out(mm: ModelMemory, rows: int) -> int:
    f = mm.cfg.ffn_hidden_size
    rows16 = -(-rows // 16) * 16
    if mm.act_format == "fp8":
        return rows * f + 4 * rows
    if mm.act_format == "nvfp4":
        return rows16 * f // 2 + math.prod(nvfp4.scale_shape(rows16, f))
    return 2 * rows * f * mm.dtype_bytes


def _attention_operands(mm: ModelMemory, rows: int, kv_rows: int | None = None) -> int:
    """What the attention backend allocates beside its q, k, v and its output, for ``rows`` query rows over
    ``kv_rows`` keys (default: the same rows)."""
    c = mm.cfg
    kv_rows = rows if kv_rows is None else kv_rows
    per_row = c.inner_dim
    a = mm.attention
    if a in ("sage2", "sage1", "sparse"):
        # int8 q and k, fp8 v (fused operands) or the library wrapper's own copies at the compute dtype
        return (rows + 2 * kv_rows) * per_row * (1 if mm.v_handling == "fused" else 1 + mm.dtype_bytes) \
            + 8 * kv_rows * c.num_heads
    if a.startswith("sdpa"):
        return rows * per_row * mm.dtype_bytes + 4 * rows * c.num_heads  # the [H, S, D] -> [S, H*D] copy, logsumexp
    # exact attention: fp32 q, k, v and a score chunk of at most 1 GiB, alive together with its softmax input
    # (measured on the CPU: two chunks at the peak)
    return (rows + 2 * kv_rows) * per_row * 4 + 2 * min(4 * c.num_heads * rows * kv_rows, 1 << 30)


# the sparse path (runtime.ops.sparse_step; comfy-kitchen's sol_attn_chunked on CUDA, the eager reference on the CPU)
SPARSE_TOPK_BYTES = 3 * (64 << 20)  # sla / vsa: the threshold's head slices of <= 64 MiB scores, topk's values and
#                                     indices beside them (comfy-kitchen's _SOL_TOPK_SLICE_BYTES)


def sparse_rows(mm: ModelMemory, wl: Workload) -> int:
    """The rows one sparse call runs on: the packed rows, or VSA's padded tiles (``sparse_methods.vsa_plan``):
    each non-video segment padded to 64 rows and the video grid padded to multiples of 4 per axis. Without
    ``wl.video_grid`` the padding's bound over every grid of ``video_rows`` rows: 16 x (video_rows + 3)."""
    if mm.sparse_method != "vsa":
        return wl.rows
    if wl.video_grid:
        video = math.prod(-(-g // c) * c for g, c in zip(wl.video_grid, VSA_CUBE))
    else:
        video = 16 * (wl.video_rows + 3)
    return video + wl.rows - wl.video_rows + (BLOCK - 1) * wl.prefix_segments


def sparse_held_bytes(mm: ModelMemory, wl: Workload, conditionings: int = 2) -> int:
    """What a sparse run keeps through a step beside the blocks' activations: the rotary tables in the call's row
    order (split-half cos/sin padded for VSA, the kernel's rotation table [n, R/2, 2, 2] fp32 and comfy-kitchen's
    packed copy of it [n, R, 2] fp32; one conditioning's at a time) and, per conditioning (CFG's two at most), the
    pooled statistics carried per block ((kmean, vscale) fp32 [H, 128] each) and VSA's tile order (int64 padded
    row -> row and back)."""
    if not mm.sparse:
        return 0
    c, n = mm.cfg, sparse_rows(mm, wl)
    vsa = mm.sparse_method == "vsa"
    tables = n * c.rope_dim * 8 * 2 + (2 * n * c.rope_dim * 4 if vsa else 0)
    per_conditioning = c.num_layers * 2 * c.inner_dim * 4 + ((n + wl.rows) * 8 if vsa else 0)
    return tables + conditionings * per_conditioning


def sol_workspace_bytes(heads: int, n: int, token_aug: int = 0, head_dim: int = 128) -> int:
    """comfy-kitchen's Sol-Attn workspace (``_C.sol_attn_plan(1, n, heads, token_aug)["total"]``, the layout of
    its 0.2.40 kernels; a GPU test compares the two) for one sequence of ``n`` rows: each slot rounded up to 16
    bytes. With T blocks of 64 rows (Tp = 64 T rows), P = T rounded up to 64 (route reads pooled keys in groups
    of 64 blocks), per head:

    - the int8 operands: q of every row with an fp32 scale per row, k and v^T padded to Tp (k with two fp32 sums
      per row);
    - pooled keys (int8, fp32 scale, P of them), pooled v (bf16, P), per query block a threshold, its routed key
      block ids (uint16, T x T: the one quadratic slot), their count, an int8 centroid and scale, the route's
      hand-over (o bf16, m and l fp32), v's absmax, fp32 query-block means (P), and the preprocess scratch
      (fp32 P x 128 per head plus two fp32 head vectors);
    - with ``token_aug`` > 0 (extra tokens): v by row (int8, Tp), per query block a reference and candidate bits,
      per group of 2 query blocks a centroid, reference, bits, ``token_aug`` token ids, a count and a
      128-bin histogram, the tile lists of 64-group CTAs and the split partials (o bf16, m, l; up to 8 splits)."""
    def a16(b):
        return -(-b // 16) * 16

    hd, t = head_dim, -(-n // BLOCK)
    tp, pad, words = t * BLOCK, -(-t // 64) * 64, -(-t // 32)
    slots = [n * hd, n * 4, tp * hd, tp * 8, hd * tp, hd * 4, pad * hd, pad * 4, hd * pad * 2, t * 4, t * t * 2,
             t * 4, t * hd, t * 4, t * hd * 2, t * 4, t * 4, hd * 4, pad * hd * 4]
    if token_aug:
        groups = -(-t // 2)
        ctas = -(-groups // BLOCK)
        splits = max(1, min(8, -(-512 // ctas)))
        parts = splits * groups
        slots += [tp * hd, t * 4, t * words * 4, groups * hd, groups * 4, groups * 4, groups * words * 4,
                  groups * token_aug * 4, groups * 4, groups * 128 * 4]
        slots = [s * heads for s in slots] + [ctas * heads * t * 2, ctas * heads * 4]
        slots += [heads * parts * hd * 2, heads * parts * 4, heads * parts * 4]
    else:
        slots = [s * heads for s in slots]
    slots.append((heads * pad * hd + 2 * heads * hd) * 4)
    return sum(a16(s) for s in slots)


def sparse_workspace(mm: ModelMemory, n: int) -> int:
    """comfy-kitchen's ``sol_attn_chunked`` workspace for ``n`` rows at the method's extra tokens
    (``sol_workspace_bytes``): the producer quantizes each qkv chunk into it; the bf16 q/k/v are never whole."""
    return sol_workspace_bytes(mm.cfg.num_heads, n, mm.sparse_token_aug, mm.cfg.head_dim)


def sparse_phases(mm: ModelMemory, wl: Workload, device_kind: str = "cuda") -> dict[str, int]:
    """Bytes live at the peak of each phase of one sparse block call (``SparseStepAttention.block_attention``),
    weights excluded, on the method's rows ``n`` (``sparse_rows``): the residual ``x``, VSA's gate buffer
    (``to_gate_compress`` of every padded row, [n, H*D] at the compute dtype, alive through the call), and

    - produce: one 4096-row chunk's work (sol-attn / sla: the qkv GEMM's input and output; vsa: the gathered
      rows, their modulated copy (the gate's input), the qkv output, its zeros and the masked copy) beside the
      kernel's workspace (``sparse_workspace``);
    - kernel: the workspace, the output [n, H*D] and sla/vsa's top-k scratch;
    - gather (vsa): the output in padded order and gathered back to the packed rows.

    On the CPU the eager reference runs instead: every chunk and their concatenation, q/k (fp32 math, then the
    compute dtype), fp32 copies of q, k, v and centred k, the fp32 output and one chunk of 16 query blocks'
    scores (scores, masked scores and their powers, fp32)."""
    c, e, s = mm.cfg, mm.dtype_bytes, wl.rows
    h, inner, n = c.hidden_size, c.inner_dim, sparse_rows(mm, wl)
    x = s * h * e
    vsa = mm.sparse_method == "vsa"
    gate = n * inner * e if vsa and c.gate_compress else 0
    rc = min(PRODUCER_CHUNK, n)
    y = rc * 3 * inner * e
    if device_kind == "cpu":
        r = min(16 * BLOCK, n)
        work = 2 * n * 3 * inner * e + 2 * n * inner * (4 + e) + 4 * n * inner * 4 + 3 * c.num_heads * r * n * 4
        return {"sparse_reference": x + gate + work + (2 * rc * h * (e + 4) if vsa else 0)}
    ws = sparse_workspace(mm, n)
    producer = _act_in(mm, rc, h) + y
    if mm.act_format == "dense":  # an unfused RMSNorm: its fp32 copy, the normed rows and their weighted copy
        producer = max(producer, rc * h * (12 + e))
    chunk = rc * h * e + rc * h * (e + 4) + max(producer, 3 * y) if vsa else producer
    out = n * inner * e
    phases = {"sparse_produce": x + gate + ws + chunk,
              "sparse_kernel": x + gate + ws + out + (SPARSE_TOPK_BYTES if mm.sparse_method != "sol-attn" else 0)}
    if vsa:
        phases["sparse_gather"] = x + gate + out + s * inner * e
    return phases


def activation_phases(mm: ModelMemory, wl: Workload, chunk_rows: int | None = None,
                      attn_rows: int | None = None, device_kind: str = "cuda", kv_form: str = "bf16"
                      ) -> dict[str, int]:
    """Bytes live at the peak of each phase of one evaluation, weights excluded. chunk_rows: the FFN's rows
    per chunk (None: all rows at once); attn_rows: the attention half's query rows per chunk (None: unchunked),
    holding K and V in ``kv_form`` (``runtime.ops.rows_kv``: "bf16" at the compute dtype, beside the backend's
    per-call operands; "sage": once as Sage2's operands, ``SageKV.nbytes``, with the store pass's temporaries, and
    the head's video rows in chunks of the same rows beside its fp32 output).
    A sparse run adds its sparse calls' phases (``sparse_phases``) beside the dense ones, which its dense steps
    (before ``start_percent``, under ``min_tokens``) and ``dense_blocks`` still run."""
    c, e, s = mm.cfg, mm.dtype_bytes, wl.rows
    h, inner, ffn = c.hidden_size, c.inner_dim, c.ffn_hidden_size
    rc = s if chunk_rows is None else min(chunk_rows, s)
    x = s * h * e
    qkv = s * 3 * inner * e
    o = s * inner * e
    sv = wl.video_rows
    rh = sv  # the head's video rows at once: all, or in the Sage form's query-row chunks (``H3Model.evaluate``)
    if attn_rows is not None and attn_rows < s:
        ra, sage = attn_rows, kv_form == "sage"
        kv = (SageKV if sage else Bf16KV).nbytes(s, c.num_heads, c.head_dim, e)  # K and V of every row, kept
        chunk = ra * 3 * inner * e  # one chunk's qkv buffer (Q, K and V are views of it)
        attention = {"qkv": x + kv + _act_in(mm, ra, h) + chunk}
        if sage:  # the store pass's temporaries; the attention's int8 q and its scales
            attention["kv_store"] = x + kv + chunk + ra * inner * SageKV.STORE_TEMP_BYTES
            operands, rh = ra * inner + 4 * c.num_heads * -(-ra // 16), ra
        else:  # the backend's own operands of the chunk over all of K and V
            operands = _attention_operands(mm, ra, s)
        attention["attention"] = x + kv + chunk + operands + ra * inner * e
        attention["out_proj"] = x + kv + ra * inner * e + _act_in(mm, ra, inner) + ra * h * e
    else:
        attention = {"qkv": x + _act_in(mm, s, h) + qkv, "attention": x + qkv + _attention_operands(mm, s) + o,
                     "out_proj": x + o + _act_in(mm, s, inner) + s * h * e}
    return {
        "pack": x + sv * h * 4 + sv * c.video_patch_dim * 4,
        **attention,
        "fc1": x + _act_in(mm, rc, h) + rc * 2 * ffn * e,
        "fc2": x + rc * 2 * ffn * e + _swiglu_out(mm, rc) + rc * h * e,
        # the fp32 input of the rows projected at once, one HEAD_ROWS chunk's norm temporaries (fp32 copy, normed,
        # weighted, back at e; the modulated rows and a per-row gathered shift and scale), and the fp32 output with
        # its unpatchified copy
        "head": x + min(rh, sv) * h * 4 + min(HEAD_ROWS, rh, sv) * h * (12 + 5 * e) + 2 * sv * c.video_patch_dim * 4,
        **(sparse_phases(mm, wl, device_kind) if mm.sparse else {}),
    }


def run_bytes(mm: ModelMemory, wl: Workload) -> int:
    """A run's tensors that live through every step: the modulation rows of every (step, block) (the model
    precomputes them up to ``MOD_CACHE_BYTES``), RoPE tables, latents and the sampler's state."""
    c = mm.cfg
    mods = wl.steps * c.num_layers * 3 * wl.t_values * 6 * c.hidden_size * mm.dtype_bytes
    rope = 2 * wl.rows * c.rope_dim * 4
    return mods + rope + 10 * wl.latent_bytes + sparse_held_bytes(mm, wl)


def scratch_bytes(mm: ModelMemory, wl: Workload) -> int:
    """The GEMM backend's reusable scratch: fp8 expands each NVFP4 weight to rowwise e4m3, bf16 to bf16 (and
    the activation too)."""
    dims = linear_dims(mm.cfg).values()
    nk = max(n * k for n, k in dims)
    n_max = max(n for n, _ in dims)
    if mm.act_format == "fp8" or mm.gemm == "fp8":
        return nk + 4 * n_max + (0 if mm.act_format == "fp8" else wl.rows * max(k for _, k in dims))
    if mm.gemm == "bf16":
        return 2 * nk + 2 * wl.rows * max(k for _, k in dims)
    return 0


def tower_block_bytes(mm: ModelMemory, tower: TowerSize) -> int:
    """The streamable bytes of one control block: its four linears in the base's form (what one of the tower's
    device buffers holds, and what each streamed control block keeps in pinned host memory)."""
    return block_linear_bytes(tower.cfg, mm.act_format != "dense", mm.dtype_bytes)


def tower_bytes(mm: ModelMemory, wl: Workload, streams: bool = False) -> tuple[int, int]:
    """The control tower's device bytes for ``wl`` (0, 0 without one) -> (weights, held through an evaluation).

    Weights, as ``runtime.io.control.load_control`` places them: the four block linears of each control block in
    the base's form (NVFP4 bytes and scales when the load quantizes, else the compute dtype), every other tensor
    at its own dtype, full-form AdaLN in host memory when the base keeps its own there. ``streams``: the control
    blocks' linears stream from pinned host memory through ``SLOTS`` device buffers (``runtime.ops.streaming``)
    instead of staying on the device. Held: the stream ``c`` and the skip residual (``S x hidden`` each), the
    control rows' embedding (video rows x hidden) and the modulation rows of every step and control block
    (``bind_control``)."""
    tw = wl.tower
    if tw is None:
        return 0, 0
    from .model.control import FunControl  # the tower's modules (meta: shapes and dtypes only)

    cfg = tw.cfg
    with torch.device("meta"):
        meta = FunControl(cfg, tuple(range(tw.blocks)), torch.bfloat16 if mm.dtype_bytes == 2 else torch.float32)
    quantized = mm.act_format != "dense"
    dims = linear_dims(cfg)
    rest = adaln_width = 0
    for name, t in list(meta.named_parameters()) + list(meta.named_buffers()):
        layer, _, leaf = name.rpartition(".")
        sub = layer.split(".", 2)[-1] if layer.startswith("control_blocks.") else ""
        if sub in dims and leaf == "weight":
            rest += 64 if quantized else 0  # an NVFP4 layer's global scale (and the odd small buffer)
            continue
        if ".adaln_proj." in name:
            adaln_width = t.element_size()
            if mm.adaln_on_host and not cfg.curve_form:
                continue
        rest += t.numel() * t.element_size()
    lin_block = tower_block_bytes(mm, tw)
    h, e = cfg.hidden_size, mm.dtype_bytes
    mods = wl.steps * tw.blocks * 3 * wl.t_values * 6 * h * max(adaln_width, e)
    return rest + (min(SLOTS, tw.blocks) if streams else tw.blocks) * lin_block, \
        2 * wl.rows * h * e + wl.video_rows * h * e + mods


@dataclass(frozen=True)
class Estimate:
    weights_resident: int
    stream_buffers: int
    scratch: int
    run: int
    activations: int
    peak_phase: str
    workspace: int
    control_weights: int = 0
    control_held: int = 0

    @property
    def total(self) -> int:
        return (self.weights_resident + self.stream_buffers + self.scratch + self.run + self.activations
                + self.workspace + self.control_weights + self.control_held)

    def as_dict(self) -> dict:
        return {"total_bytes": self.total, "weights_resident_bytes": self.weights_resident,
                "stream_buffer_bytes": self.stream_buffers, "gemm_scratch_bytes": self.scratch,
                "run_bytes": self.run, "activation_bytes": self.activations, "peak_phase": self.peak_phase,
                "workspace_bytes": self.workspace, "control_tower_weight_bytes": self.control_weights,
                "control_tower_held_bytes": self.control_held}

    def describe(self) -> str:
        tower = "" if not (self.control_weights or self.control_held) else (
            f" + {gb(self.control_weights)} control tower weights + {gb(self.control_held)} its run tensors")
        return (f"estimate {gb(self.total)} = {gb(self.weights_resident)} resident weights + "
                f"{gb(self.stream_buffers)} stream buffers + {gb(self.activations)} activations ({self.peak_phase}) "
                f"+ {gb(self.run)} run tensors + {gb(self.scratch + self.workspace)} scratch{tower}")


class Chunking(NamedTuple):
    """Activation chunking: the FFN's rows per chunk (None: all at once), the attention half's query rows per
    chunk (None: unchunked) and how those chunks hold K and V (``runtime.ops.rows_kv``)."""

    ffn: int | None = None
    attn: int | None = None
    kv_form: str = "bf16"


def estimate(mm: ModelMemory, wl: Workload, resident: int, slots: int, chunks: "Chunking | int | None",
             device_kind: str = "cuda", tower_streams: bool = False) -> Estimate:
    """Peak device bytes of a run with ``resident`` blocks resident (the others streamed through ``slots``
    buffers) and the activations chunked as ``chunks`` (a ``Chunking``; an int or None: the FFN's rows per chunk
    alone); ``tower_streams``: the control tower's blocks stream too (``tower_bytes``)."""
    ch = chunks if isinstance(chunks, Chunking) else Chunking(chunks)
    phases = activation_phases(mm, wl, ch.ffn, ch.attn, device_kind, ch.kv_form)
    streamed = mm.cfg.num_layers - resident
    refiner_off = mm.refiner_bytes if streamed else 0  # in host memory, on the device for the run's one refine
    if refiner_off:
        phases["refine"] = refiner_off + wl.rows * mm.cfg.hidden_size * mm.dtype_bytes
    phase = max(phases, key=phases.get)
    return Estimate(mm.other_bytes - refiner_off + resident * mm.block_bytes,
                    (slots if streamed else 0) * mm.block_bytes,
                    scratch_bytes(mm, wl), run_bytes(mm, wl), phases[phase], phase,
                    WORKSPACE_BYTES if device_kind == "cuda" else 0, *tower_bytes(mm, wl, tower_streams))


def chunk_options(rows: int, device_kind: str = "cuda") -> list[int]:
    """FFN row chunks to try, largest first: rows/2, rows/4, ... on 128-row boundaries, >= MIN_CHUNK_ROWS."""
    least = MIN_CHUNK_ROWS if device_kind == "cuda" else MIN_CHUNK_ROWS_CPU
    out, parts = [], 2
    while parts <= rows:
        c = -(-rows // parts)
        c = -(-c // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
        if c < least:
            break
        if c < rows and (not out or c < out[-1]):
            out.append(c)
        parts *= 2
    return out


def spread(n: int, count: int) -> tuple[int, ...]:
    """``count`` of the indices 0..n-1, evenly spaced (resident blocks between the streamed ones)."""
    if count <= 0:
        return ()
    if count >= n:
        return tuple(range(n))
    return tuple(sorted({min(n - 1, int((k + 0.5) * n / count)) for k in range(count)}))


# ---------------------------------------------------------------------------------------------
# the decision
# ---------------------------------------------------------------------------------------------

@dataclass
class MemoryPlan:
    """The budget decision of one load (or one sampling run, ``fit_memory``)."""

    budget_bytes: int | None
    budget_text: str
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    slots: int
    ffn_chunk_rows: int | None
    estimate: Estimate
    workload: Workload
    block_bytes: int
    host_bytes: int  # host memory the streamed blocks take (pinned on CUDA)
    adaln_host_bytes: int
    smallest_budget_bytes: int | None
    device_kind: str
    emulated: bool = False  # CPU: streaming runs with host-to-host copies (tests)
    note: str = ""
    row_local: str = ""
    steps_copied: dict = field(default_factory=dict)
    tower_streams: bool = False  # the control tower's blocks stream from pinned host memory (Workload.tower)
    tower_host_bytes: int = 0  # host memory the streamed control blocks take (pinned on CUDA)
    outside_bytes: int = 0  # taken off a given budget: what the model holds beside the estimate (``Outside``)
    attn_chunk_rows: int | None = None  # the attention half in query-row chunks of this many rows (None: unchunked)
    attn_rows_why: str = ""  # whether those chunks are row-exact, and why (``ModelMemory.attn_rows``)
    attn_kv_form: str = "bf16"  # how those chunks hold K and V (``runtime.ops.rows_kv``)
    adaln_from_file: bool = False  # AdaLN left in the checkpoint file: each run reads it block by block
    host_limit_bytes: int | None = None  # the host memory the plan fitted its host figure into (None: not checked)

    @property
    def streams(self) -> bool:
        return bool(self.streamed)

    @property
    def refiner_on_host(self) -> bool:
        """The token refiner's weights stay in host memory and come to the device for each run's one refine call
        (``H3Model.refiner_on_host``): whenever blocks stream (``estimate`` counts it so)."""
        return bool(self.streamed)

    @property
    def host_bytes_planned(self) -> int:
        """Host memory the plan keeps for the model beside the device's: the streamed blocks (pinned on CUDA), the
        streamed control tower and the full-form AdaLN weights it keeps in host memory (the process's other host
        memory, torch and the run's tensors, comes on top)."""
        return self.host_bytes + self.tower_host_bytes + self.adaln_host_bytes

    def host_text(self) -> str:
        """The plan's host figure, as the choice states it beside the device's."""
        adaln = "AdaLN read from the checkpoint file block by block each run" if self.adaln_from_file else \
            f"{gb(self.adaln_host_bytes)} AdaLN weights"
        limit = "" if self.host_limit_bytes is None else f" of {gb(self.host_limit_bytes)} host memory"
        return f"host: {gb(self.host_bytes_planned)}{limit} ({gb(self.host_bytes)} streamed blocks, {adaln})"

    @property
    def copy_bytes_per_step(self) -> int:
        return len(self.streamed) * self.block_bytes

    def choice(self) -> Choice:
        n = len(self.resident) + len(self.streamed)
        if self.note and not self.streamed and self.ffn_chunk_rows is None:
            return Choice("all resident", f"{self.note}; {self.estimate.describe()} for {self.workload.describe()}"
                          + (f"; {self.host_text()}" if self.adaln_from_file else ""))
        what = "all resident" if not self.streamed else f"{len(self.resident)} resident, {len(self.streamed)} streamed"
        if self.tower_streams:
            what += ", control tower streamed"
        parts = [self.budget_text]
        if self.streamed:
            parts.append(f"{len(self.streamed)} of {n} blocks stream from {'host' if self.emulated else 'pinned host'} "
                         f"memory through {self.slots} device buffers of {gb(self.block_bytes)} "
                         f"({gb(self.copy_bytes_per_step)} copied per step"
                         + (", emulated with host copies on the CPU" if self.emulated else "") + ")")
        if self.streamed:
            parts.append("the token refiner in host memory, on the device for each run's refine")
        if self.tower_streams:
            parts.append(f"the control tower's {self.workload.tower.blocks} blocks stream through "
                         f"{min(self.slots, self.workload.tower.blocks)} device buffers of their own")
        parts.append("FFN unchunked" if self.ffn_chunk_rows is None
                     else f"FFN in row chunks of {self.ffn_chunk_rows:,} ({self.row_local})")
        if self.attn_chunk_rows is not None:
            parts.append(f"attention in query-row chunks of {self.attn_chunk_rows:,} ({self.attn_rows_why})")
        parts.append(f"{self.estimate.describe()} for {self.workload.describe()}")
        parts.append(self.host_text())
        if self.smallest_budget_bytes is not None:
            parts.append(f"smallest budget that runs: {gb(self.smallest_budget_bytes)}"
                         + (f" (with the {gb(self.outside_bytes)} held beside it)" if self.outside_bytes else ""))
        return Choice(what, "; ".join(parts))

    def report(self) -> dict:
        return {"vram_budget_bytes": self.budget_bytes, "budget": self.budget_text,
                "outside_bytes": self.outside_bytes,
                "resident_blocks": list(self.resident), "streamed_blocks": list(self.streamed),
                "refiner_on_host": self.refiner_on_host,
                "stream_buffers": self.slots if self.streamed else 0, "block_bytes": self.block_bytes,
                "ffn_chunk_rows": self.ffn_chunk_rows, "attn_chunk_rows": self.attn_chunk_rows,
                "attn_kv_form": self.attn_kv_form if self.attn_chunk_rows is not None else None,
                "estimate": self.estimate.as_dict(),
                "workload": {"rows": self.workload.rows, "steps": self.workload.steps},
                "pinned_host_bytes": 0 if self.emulated else self.host_bytes,
                "host_bytes_streamed_weights": self.host_bytes, "adaln_host_bytes": self.adaln_host_bytes,
                "host_bytes_planned": self.host_bytes_planned, "adaln_from_file": self.adaln_from_file,
                "host_limit_bytes": self.host_limit_bytes,
                "smallest_budget_bytes": self.smallest_budget_bytes,
                "copy_bytes_per_step_planned": self.copy_bytes_per_step,
                "control_tower_streams": self.tower_streams, "control_tower_host_bytes": self.tower_host_bytes,
                **({"note": self.note} if self.note else {}), **({"emulated": True} if self.emulated else {})}


@dataclass(frozen=True)
class Outside:
    """Device memory a model holds beside what ``estimate`` counts: ``nbytes``, ``what`` holds it (for the budget's
    text: "a loaded Fun ControlNet tower this run does not use holds"), ``advice`` for a budget it makes too small."""

    nbytes: int
    what: str
    advice: str = ""


def _resolve_budget(requested: int | None, dev: DeviceMemory, held_bytes: int, outside: Sequence[Outside] = ()
                    ) -> tuple[int, str]:
    if requested is not None:
        idle = sum(o.nbytes for o in outside)
        if idle:  # held on the device beside what the estimate counts
            left = max(0, requested - idle)
            what = " and ".join(f"the {gb(o.nbytes)} {o.what}" for o in outside if o.nbytes)
            return left, f"budget {gb(requested)} (vram_budget) less {what} = {gb(left)}"
        return requested, f"budget {gb(requested)} (vram_budget)"
    avail = dev.free_bytes + held_bytes
    margin = AUTO_MARGIN_BYTES + int(AUTO_MARGIN_FRACTION * dev.total_bytes)
    held = f" + {gb(held_bytes)} this model holds" if held_bytes else ""
    return max(0, avail - margin), (f"auto: {gb(dev.free_bytes)} free of {gb(dev.total_bytes)} on {dev.name}{held} "
                                    f"less a {gb(margin)} margin = {gb(max(0, avail - margin))}")


@dataclass(frozen=True)
class _Shape:
    """One candidate of ``decide``: blocks kept resident, the activations' chunking, whether the control tower
    streams, and whether it is past "everything resident" (on the CPU: streaming emulated)."""

    resident: int
    chunks: Chunking = Chunking()
    tower_streams: bool = False
    streams: bool = False


def _plan(mm: ModelMemory, wl: Workload, dev: DeviceMemory, budget: tuple[int | None, str], shape: _Shape,
          smallest: int | None = None, outside_bytes: int = 0) -> MemoryPlan:
    n = mm.cfg.num_layers
    res = spread(n, shape.resident)
    streamed = tuple(j for j in range(n) if j not in set(res))
    ch = shape.chunks
    est = estimate(mm, wl, shape.resident, SLOTS, ch, dev.kind, shape.tower_streams)
    tower_host = wl.tower.blocks * tower_block_bytes(mm, wl.tower) if shape.tower_streams else 0
    emulated = shape.streams and dev.kind == "cpu"
    return MemoryPlan(budget[0], budget[1], res, streamed, SLOTS, ch.ffn, est, wl, mm.block_bytes,
                      len(streamed) * mm.block_bytes, mm.adaln_host_bytes, smallest, dev.kind, emulated,
                      row_local=mm.ffn_row_local_why, tower_streams=shape.tower_streams, tower_host_bytes=tower_host,
                      outside_bytes=outside_bytes, attn_chunk_rows=ch.attn,
                      attn_rows_why=_attn_rows_why(mm, ch) if ch.attn is not None else "", attn_kv_form=ch.kv_form)


def _attn_rows_why(mm: ModelMemory, ch: Chunking) -> str:
    if ch.kv_form == "sage":
        return ("K and V held once as Sage2's int8/fp8 operands; not row-exact against one Sage2 call: K's mean "
                "comes from fp32 chunk sums, so a mean element may round to its bf16 neighbour (ops.sage_kv)")
    return mm.attn_rows[1]


def chunkings(mm: ModelMemory, wl: Workload, device_kind: str = "cuda") -> list[Chunking]:
    """The (FFN rows, attention query rows, K/V form) per chunk ``decide`` tries, in order: unchunked, the FFN alone
    in halving chunks, then the FFN and the attention half in chunks of the same rows (only as far as this model
    allows) holding K and V at the compute dtype, then holding them as Sage2's operands (on CUDA where Sage2 runs
    its sm_90 stages: ``ModelMemory.attn_kv_sage``)."""
    chunks = chunk_options(wl.rows, device_kind) if mm.ffn_row_local else []
    out = [Chunking()] + [Chunking(c) for c in chunks]
    if mm.attn_rows[0]:
        out += [Chunking(c, c) for c in chunks]
    if mm.attn_kv_sage and device_kind == "cuda":
        out += [Chunking(c, c, "sage") for c in chunks]
    return out


def smallest_budget(mm: ModelMemory, wl: Workload, device_kind: str = "cuda") -> int:
    """Every block streamed (the control tower's too) and the smallest chunking this model allows."""
    return estimate(mm, wl, 0, SLOTS, chunkings(mm, wl, device_kind)[-1], device_kind, wl.tower is not None).total


@dataclass(frozen=True)
class Held:
    """What a loaded model already holds when it is planned again: ``device_bytes`` on the device (auto counts
    them as available), ``host_bytes`` in host memory for its streamed blocks."""

    device_bytes: int = 0
    host_bytes: int = 0


def decide(mm: ModelMemory, wl: Workload, dev: DeviceMemory, requested: int | None,
           host_free: int | None = None, held: Held = Held(), outside: Sequence[Outside] = (),
           unchanged: str = "nothing was loaded") -> MemoryPlan:
    """The memory plan (module docstring). requested: the budget in bytes (None = auto); host_free: available
    host memory (default: measured); held: what the model already holds (re-planning a loaded model);
    outside: device memory this model holds beside what the estimate counts (``Outside``: a loaded Fun ControlNet
    tower the run leaves out, LoRA side paths): it comes off a given budget (auto's free memory excludes it), and
    the smallest budget named is the run's plus it. Raises BudgetError (its message ends with ``unchanged``, what
    the caller left as it was) when the budget cannot run the job or the host cannot hold the streamed weights."""
    n = mm.cfg.num_layers
    if dev.integrated:
        p = _plan(mm, wl, dev, (requested or dev.total_bytes, ""), _Shape(n))
        p.budget_text = f"{dev.name} is integrated (memory shared with the host)"
        p.note = (f"{dev.name} shares its memory with the host (is_integrated): streaming does not apply, every "
                  "block stays resident")
        return p
    if dev.kind == "cpu" and requested is None:
        p = _plan(mm, wl, dev, (None, "auto on the CPU"), _Shape(n))
        p.note = "cpu: device memory is host memory, nothing streams (an explicit budget emulates streaming)"
        _check_host(p, mm, host_free, held.host_bytes, unchanged)
        return p
    budget, text = _resolve_budget(requested, dev, held.device_bytes, outside)
    extra = sum(o.nbytes for o in outside) if requested is not None else 0
    full = estimate(mm, wl, n, SLOTS, None, dev.kind)
    if full.total <= budget:
        p = _plan(mm, wl, dev, (budget, text), _Shape(n), outside_bytes=extra)
        _check_host(p, mm, host_free, held.host_bytes, unchanged)
        return p
    smallest = smallest_budget(mm, wl, dev.kind) + extra
    ts = wl.tower is not None  # past "everything resident", the control tower streams first (it runs 5 or 10 blocks)
    options = chunkings(mm, wl, dev.kind)
    for ch in options:
        if (ch.ffn is not None or ts) and estimate(mm, wl, n, SLOTS, ch, dev.kind, ts).total <= budget:
            p = _plan(mm, wl, dev, (budget, text), _Shape(n, ch, ts, True), smallest, extra)
            _check_host(p, mm, host_free, held.host_bytes, unchanged)
            return p
        base = estimate(mm, wl, 0, SLOTS, ch, dev.kind, ts).total
        if base > budget:
            continue
        resident = min(n - 1, (budget - base) // mm.block_bytes) if mm.block_bytes else n
        p = _plan(mm, wl, dev, (budget, text), _Shape(int(resident), ch, ts, True), smallest, extra)
        _check_host(p, mm, host_free, held.host_bytes, unchanged)
        return p
    what = "auto (the free device memory less the margin)" if requested is None else "the budget"
    raise BudgetError(
        f"{text}: too small for {wl.describe()}: even with every block streamed and the smallest activation "
        f"chunking the run needs {gb(smallest - extra)} "
        f"({estimate(mm, wl, 0, SLOTS, options[-1], dev.kind, ts).describe()})"
        f"{f', and {gb(extra)} more is held beside it' if extra else ''}; {what} must be at least {gb(smallest)}: set "
        f"--vram-budget / H3_VRAM_BUDGET to {budget_arg(smallest)} or more"
        f"{''.join(f', {o.advice}' for o in outside if o.nbytes and o.advice)}, or lower the width, height or frames "
        f"({unchanged})")



@dataclass(frozen=True)
class MemoryAsk:
    """A request as the memory check names it: ``what`` (e.g. "1344x768, 124 frames, 512 text tokens") and
    ``lower``, what the user can reduce."""

    what: str
    lower: str = "the width, height, frames or text length"


def check_request(mm: ModelMemory, wl: Workload, dev: DeviceMemory, vram_budget, ask: MemoryAsk,
                  held: Held = Held(), host_free: int | None = None) -> MemoryPlan:
    """The request-time memory check, before any weight is read: the budget's own decision (``decide``, the
    same estimate, the same free memory: the driver's plus torch's unused cache) for ``wl`` on ``dev`` under
    ``vram_budget`` (the option's text), and that decision's estimate against what the device has free (plus
    ``held``, what a loaded model already holds there): auto on CUDA plans within it, but nothing streams on the
    CPU under auto (device memory is host memory) or on an integrated GPU, and a given budget may exceed it.
    Raises RequestError saying what the request needs, what the device has and what to change; returns the plan
    the load would make."""
    try:
        p = decide(mm, wl, dev, parse_vram_budget(vram_budget), host_free, held)
    except BudgetError as e:
        raise RequestError(f"{ask.what} ({wl.rows:,} packed rows): {e}") from None
    have = dev.free_bytes + held.device_bytes
    if p.estimate.total > have:
        where = f"free of {dev.total_bytes / GB:.1f} GB on {dev.name}" if dev.kind == "cuda" else \
            "of available host memory"
        raise RequestError(f"{ask.what} ({wl.rows:,} packed rows) needs ~{p.estimate.total / GB:.1f} GB, the device "
                           f"has {have / GB:.1f} GB {where}; lower {ask.lower}, or use a device with more memory "
                           f"(the {p.estimate.describe()})")
    return p


def budget_arg(nbytes: int) -> str:
    """The smallest ``--vram-budget`` value (GB, rounded up) that is at least ``nbytes``."""
    digits = 2 if nbytes >= GB else 4
    return f"{math.ceil(nbytes / GB * 10 ** digits) / 10 ** digits:.{digits}f}"


def _check_host(p: MemoryPlan, mm: ModelMemory, host_free: int | None, host_held_bytes: int,
                unchanged: str = "nothing was loaded") -> None:
    """The plan's host figure against the host memory (``host_free``: the host budget, else what is available):
    the streamed blocks (and tower) and the full-form AdaLN weights kept there. Where they do not fit and the
    AdaLN weights can stay in the checkpoint file (``ModelMemory.adaln_file``), they do: each run then reads them
    block by block (``ModelMemory.adaln_read_bytes`` in host memory at once). Raises BudgetError where the streamed
    weights alone do not fit."""
    need = p.host_bytes + p.tower_host_bytes - host_held_bytes
    adaln = p.adaln_host_bytes if host_held_bytes == 0 else 0  # loaded alongside, before the blocks
    if need + adaln <= 0 or (need <= 0 and not mm.adaln_file):  # nothing streams and nothing can move: unchecked
        return
    free = host_available_bytes() if host_free is None else host_free
    p.host_limit_bytes = free
    # AdaLN kept in host memory only with room for the process beside it, where the file could serve it instead
    room = free - (HOST_PROCESS_BYTES if adaln and mm.adaln_file else 0)
    if need + adaln <= room:
        return
    if adaln and mm.adaln_file and need + mm.adaln_read_bytes <= free:
        p.adaln_from_file, p.adaln_host_bytes = True, 0
        return
    tower = f" and the control tower's {p.workload.tower.blocks} blocks" if p.tower_host_bytes else ""
    if adaln and mm.adaln_file:  # even with the AdaLN weights read from the file, block by block
        raise BudgetError(f"{p.budget_text}: needs {(need + mm.adaln_read_bytes) / GB:.2f} GB of host memory (the "
                          f"streamed weights of {len(p.streamed)} blocks{tower}, and {BLOCKS_IN_FLIGHT} blocks' AdaLN "
                          f"weights read from the checkpoint file), {free / GB:.2f} GB given; raise the host budget or "
                          f"the device budget so fewer blocks stream ({unchanged})")
    avail = free - adaln
    extra = f" after the {gb(adaln)} of AdaLN weights kept there" if adaln else ""
    raise BudgetError(f"{p.budget_text}: needs {need / GB:.1f} GB of host memory for the streamed weights "
                      f"({len(p.streamed)} blocks{tower}), {max(0, avail) / GB:.1f} GB free{extra}; raise the "
                      f"budget so fewer blocks stream, or free host memory ({unchanged})")


def plan_memory(plan, workload: Workload | None = None, dev: DeviceMemory | None = None,
                host_free: int | None = None) -> MemoryPlan:
    """The memory plan of a load (``runtime.plan.LoadPlan``), for ``workload`` (default: the model's default
    request, as ``defaults_for``); sets ``plan.memory`` and the ``memory`` choice. Reads no tensor."""
    wl = workload or Workload.for_request(plan.config)
    dev = dev or DeviceMemory.probe(plan.device)
    mm = ModelMemory.from_plan(plan)
    if host_free is None:
        host_free = host_budget_bytes(plan.host_budget)
    requested = parse_vram_budget(plan.vram_budget)
    mp = decide(mm, wl, dev, requested, host_free)
    on_device = adaln_on_device(mm, wl, dev, requested, host_free, mp)
    if on_device is not None:
        mp = on_device
        plan.choices["adaln"] = Choice(ADALN_ON_DEVICE, (
            f"the {gb(mm.adaln_host_bytes)} of full-form AdaLN weights fit on the device beside every block, "
            f"unchunked ({mp.budget_text}): held there, so the load pins no host copy and a run copies none; a later "
            "run that needs the room moves them to pinned host memory (H3Runtime.fit_memory)"))
    plan.memory = mp
    plan.choices["memory"] = mp.choice()
    if mp.adaln_from_file:
        plan.choices["adaln"] = Choice(ADALN_FROM_FILE, (
            f"modulation rows precomputed per run from the AdaLN weights read block by block from the checkpoint "
            f"file ({gb(mm.adaln_read_bytes)} in host memory at a time): the {gb(mm.adaln_host_bytes)} of them do "
            f"not fit beside the streamed blocks and the process's own {gb(HOST_PROCESS_BYTES)} in "
            f"{gb(mp.host_limit_bytes)} of host memory"))
    return mp


def adaln_on_device(mm: ModelMemory, wl: Workload, dev: DeviceMemory, requested: int | None,
                    host_free: int | None, host_plan: MemoryPlan | None = None, held: Held = Held(),
                    outside: Sequence[Outside] = ()) -> MemoryPlan | None:
    """The plan with the full-form AdaLN weights on the device, where the model keeps them off it (``mm``: AdaLN in
    host memory, rows per run) and the budget holds them there beside every block with nothing streamed or
    chunked; else None. ``host_plan``: the decision with AdaLN off the device, when known (nothing to gain where it
    already streams or chunks, since AdaLN on the device would stream more). A discrete CUDA device only: the
    CPU's and an integrated GPU's device memory is host memory."""
    if not mm.adaln_on_host or not mm.adaln_host_bytes or dev.kind != "cuda" or dev.integrated:
        return None
    if host_plan is not None and (host_plan.streamed or host_plan.ffn_chunk_rows or host_plan.attn_chunk_rows):
        return None
    try:
        p = decide(mm.with_adaln_on_device(), wl, dev, requested, host_free, held, outside)
    except BudgetError:
        return None
    return None if p.streamed or p.ffn_chunk_rows or p.attn_chunk_rows else p


def host_budget_bytes(text) -> int | None:
    """The host memory a load plans within: the ``host_budget`` option's text (GB) where given, else None (what is
    available)."""
    return parse_vram_budget(text, "host_budget")


__all__ = ["BudgetError", "DeviceMemory", "Estimate", "Held", "MemoryAsk", "MemoryPlan", "ModelMemory", "TowerSize",
           "Workload", "adaln_on_device", "check_request", "chunkings", "decide", "estimate", "parse_vram_budget",
           "plan_memory", "smallest_budget", "tower_block_bytes", "tower_bytes"]
