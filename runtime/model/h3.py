"""The MiniMax H3 DiT: plain PyTorch reference (fp32 and bf16) that every fast path is tested against.

Parameter names are ComfyUI's checkpoint keys (``blocks.N.attn.qkv_proj.weight`` ...), so a ComfyUI-named
state dict loads with no renaming. Conventions (ComfyUI core ``comfy/ldm/minimax/model.py``):

- fp32 islands: ``video_patch_proj``, ``audio_patch_proj``, ``time_embedder``, ``final_layer.video_out`` /
  ``audio_out``, ``rope.inv_freq``, ``adaln_t_table`` and, in curve form, every ``adaln_proj``. The rest runs
  at the compute dtype.
- qkv_proj output is contiguous thirds ``[q_all | k_all | v_all]``; per-head RMSNorm of q and k, then
  split-half RoPE on the first ``rope_dim`` (96 of 128) channels of each head.
- AdaLN rows are addressed ``t_index * 3 + modality_tag`` (0 video, 1 text, 2 audio); the six chunks are
  shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp; modulation is ``norm(x) * (1 + scale) + shift``.
- fc1 output is ``[gate | up]``; the MLP is ``fc2(silu(gate) * up)``.
- Final layer: shift then scale, fp32 heads, optional PDD head bank; the model returns the NEGATED network
  output (ComfyUI's CONST velocity ``eps - x0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.reference import ReferenceOps
from .block import AdalnProj, Attention, DiTBlock, MLP, RMSNorm
from .config import ADALN_KEY, H3Config
from .cond_rows import audio_mask_rows, condition_rows, keyframe_specs, video_mask_rows
from .conditioning import H3Conditioning, pool_audio_mask, pool_video_mask
from .layout import (PackedLayout, build_layout, pack_audio, pad_video, patchify_video, step_times, time_shift_sigma,
                     unpack_audio, unpatchify_video)

# ---------------------------------------------------------------------------------------------
# reference ops
# ---------------------------------------------------------------------------------------------

def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, 3] float64 positions -> (cos, sin) [S, 6F] fp32: angles (t | h | w) x inv_freq, duplicated halves."""
    pos = position_ids.to(torch.float32).to(inv_freq.device)
    ang = (pos.unsqueeze(-1) * inv_freq.float().view(1, 1, -1)).flatten(1)  # [S, 3F], axis-major
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[M] t in [0, 1] (unscaled) -> [M, dim] fp32, cos before sin, freqs exp(-ln(1e4) * i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


# ---------------------------------------------------------------------------------------------
# modules (names = ComfyUI checkpoint keys)
# ---------------------------------------------------------------------------------------------

class RefinerBlock(nn.Module):
    def __init__(self, cfg: H3Config, dtype, device=None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.eps, dtype=dtype, device=device)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, cfg: H3Config, dtype, device=None):
        super().__init__()
        self.blocks = nn.ModuleList([RefinerBlock(cfg, dtype, device) for _ in range(cfg.num_refiner_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.eps, dtype=dtype, device=device)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.final_norm(x)


class TimeEmbedder(nn.Module):
    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.freq_dim = cfg.timestep_input_dim
        self.proj_in = nn.Linear(cfg.timestep_input_dim, cfg.time_embed_hidden_size, dtype=torch.float32, device=device)
        self.proj_out = nn.Linear(cfg.time_embed_hidden_size, cfg.time_embed_dim, dtype=torch.float32, device=device)

    def forward(self, t):
        return self.proj_out(F.silu(self.proj_in(timestep_sinusoid(t, self.freq_dim))))


class FinalLayer(nn.Module):
    def __init__(self, cfg: H3Config, dtype, adaln_dtype, device=None):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps, dtype=dtype, device=device)
        self.adaln_proj = AdalnProj(cfg.time_embed_dim, cfg.hidden_size, 2, 1, not cfg.curve_form, adaln_dtype, device)
        n = cfg.head_bank
        self.video_out = nn.Linear(cfg.hidden_size, n * cfg.video_patch_dim, dtype=torch.float32, device=device)
        self.audio_out = nn.Linear(cfg.hidden_size, n * cfg.audio_channels, dtype=torch.float32, device=device)


def pdd_head_weights(weight: torch.Tensor, bias: torch.Tensor, n: int, start: int, stop: int, shift: float):
    """PDD head bank -> the (weight, bias) one step uses.

    weight [n*out, in]: block 0 is a full head, blocks 1..n-1 deltas from it. The step spans base-grid
    intervals [start, stop) of linspace(1, 0, n+1); interval j's weight is its dt under the flow shift,
    normalised over the span; block 0's own interval contributes no delta.
    """
    grid = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
    shifted = shift * grid / (1.0 + (shift - 1.0) * grid)
    dt = (1.0 - shifted).diff()[start:stop]
    w = (dt / dt.sum()).to(weight.dtype).to(weight.device)
    rows = weight.reshape(n, -1, weight.shape[1])
    brows = bias.reshape(n, -1)
    first = max(start, 1)
    wd = w[first - start:]
    return (rows[0] + torch.einsum("n,noi->oi", wd, rows[first:stop]),
            brows[0] + torch.einsum("n,no->o", wd, brows[first:stop]))


def pdd_span(sigma: float, sigma_next: float, n: int, shift_v: float) -> tuple[int, int]:
    """Base-grid interval [start, stop) of one step (sigma -> sigma_next) for an n-head bank."""
    start, stop = (round(float(1.0 - time_shift_sigma(s, shift_v, 1.0)) * n) for s in (sigma, sigma_next))
    start = min(start, n - 1)
    return start, max(stop, start + 1)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------

# Precomputed modulation rows of a run above this many bytes are computed step by step instead (StepMods).
MOD_CACHE_BYTES = 2 << 30
# the head's norm and modulation rows per chunk (``H3Model.head``); >= 16 keeps a GPU row reduction's config, and
# so its bytes, those of the whole (``runtime.budget.activation_phases`` counts one chunk's temporaries)
HEAD_ROWS = 2048


class StepMods:
    """The block modulation rows of one step, computed when a block asks for them: ``mods[j]`` is block j's
    [M*3, 6*hidden] (exactly what the precomputed rows hold). Used when a run has so many distinct timesteps
    (a soft denoise mask gives one per mask level) that precomputing every (step, block) would not fit."""

    def __init__(self, model: "H3Model", t_emb: torch.Tensor):
        self.model, self.t_emb = model, t_emb

    def __len__(self) -> int:
        return len(self.model.blocks)

    def __getitem__(self, j: int) -> torch.Tensor:
        return self.model._block_mods(j, [self.t_emb])[0]

    def __iter__(self):
        return (self[j] for j in range(len(self)))


class BlockModRows:
    """The block modulation rows of every step of one run, block j's computed for all steps when the run first
    asks for any of them (``step(i)[j]``): the bytes the precomputed table held, block-major as before (an AdaLN
    weight off the device crosses once per run), but each block's AdaLN read and product run when the first step
    reaches it, behind the blocks before it (and behind a load still running: ``H3Model.pending``)."""

    def __init__(self, model: "H3Model", t_embs: list):
        self.model, self.t_embs = model, t_embs
        self.rows: dict[int, list] = {}

    def __len__(self) -> int:
        return len(self.model.blocks)

    def get(self, i: int, j: int) -> torch.Tensor:
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(f"block {j} of {len(self)}")
        if j not in self.rows:
            self.rows[j] = self.model._block_mods(j, self.t_embs)
        return self.rows[j][i]

    def step(self, i: int) -> "_StepRows":
        return _StepRows(self, i)


class _StepRows:
    """Step i's view of a ``BlockModRows``: ``[j]`` is block j's [M*3, 6*hidden] rows at that step."""

    def __init__(self, table: BlockModRows, i: int):
        self.table, self.i = table, i

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, j: int) -> torch.Tensor:
        return self.table.get(self.i, j)

    def __iter__(self):
        return (self[j] for j in range(len(self)))


@dataclass
class RunPlan:
    """Everything of one sampling run that depends only on its shapes, conditioning and schedule.

    Built once per run by ``H3Model.plan``; each step then costs only the block stack.
    text: refined text rows [L, hidden] (compute dtype); cond_embed / cond_audio_embed: embedded visual / audio
    condition rows in packing order (keyframes, then references) or None; video_mask / audio_mask: core's
    pooled denoise masks [1, 1, T, H, W] / [1, 1, 2, Ta] (the output is scaled by them) or None;
    cos/sin [S, rope_dim] fp32; times[i] / mods[i][block] / final_mod[i] / heads[i] per step i.
    """

    layout: PackedLayout
    text: torch.Tensor
    cond_embed: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    sigmas: list
    shifts: tuple
    times: list = field(default_factory=list)
    mods: list = field(default_factory=list)
    final_mod: list = field(default_factory=list)
    heads: list = field(default_factory=list)
    orig_hw: tuple = (0, 0)
    cond_audio_embed: torch.Tensor | None = None
    video_mask: torch.Tensor | None = None
    audio_mask: torch.Tensor | None = None
    control: object | None = None  # a bound Fun ControlNet (runtime.model.control.bind_control) or None
    on_block: object | None = None  # (step, blocks done, blocks) after each block: progress within a step
    # a First-Block Cache installed on this plan for its run (runtime.sampling.lossy) or None: ``run(i, x, first,
    # rest)`` may skip blocks 1.. at step i (runtime.sampling.step_cache)
    step_cache: object | None = None


class H3Model(nn.Module):
    """MiniMax H3 DiT (batch 1). ``forward`` is one evaluation; ``plan`` + ``evaluate`` serve a sampling run.
    ``adaln_source``: where the blocks' AdaLN weights are read from when the load left them in the checkpoint file
    (``runtime.io.adaln_file.AdalnFromFile``: ``read(j, device) -> (weight, bias)``), else None.
    ``adaln_merges``: {"blocks.j.adaln_proj.linear.weight|bias": fn(tensor on the device) -> merged tensor}, the
    LoRA merges into AdaLN weights kept off the device (``adaln_off_device``), applied by each run to the copy it
    brings over (``runtime.lora.merge.merge_on_transfer``); the stored weights are never written."""

    adaln_source = None
    refiner_on_host = False  # the memory plan keeps the token refiner's weights in host memory (runtime.budget)
    # a load running behind the first step (``runtime.pending_load.PendingLoad``) or None: the model's entries
    # outside the blocks are used after ``pending.prelude()``, block j's after ``pending.block(j)``
    pending = None

    def __init__(self, cfg: H3Config, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cfg = cfg.validate()
        self.dtype = dtype
        adaln_dtype = torch.float32 if cfg.curve_form else dtype
        self.video_patch_proj = nn.Linear(cfg.video_patch_dim, cfg.hidden_size, dtype=torch.float32, device=device)
        self.audio_patch_proj = nn.Linear(cfg.audio_channels, cfg.hidden_size, dtype=torch.float32, device=device)
        self.condition_proj = nn.Linear(cfg.text_dim, cfg.hidden_size, dtype=dtype, device=device)
        if cfg.curve_form:
            self.register_buffer("adaln_t_table", torch.zeros(cfg.adaln_curve_grid, cfg.time_embed_dim,
                                                              dtype=torch.float32, device=device))
        else:
            self.time_embedder = TimeEmbedder(cfg, device)
        self.rope = nn.Module()
        # computed on the CPU whatever device context is active: under ``torch.device("meta")`` a bare arange goes
        # through torch's meta decompositions, whose first use imports torch._dynamo (~1.4 s of the plan's time)
        inv = cfg.rope_theta ** (-torch.arange(cfg.rope_inv_freq_len, dtype=torch.float64, device="cpu")
                                 / cfg.rope_inv_freq_len)
        target = torch.get_default_device() if device is None else device  # a ``torch.device`` context included
        self.rope.register_buffer("inv_freq", inv.to(torch.float32).to(target))
        self.token_refiner = TokenRefiner(cfg, dtype, device)
        self.blocks = nn.ModuleList([DiTBlock(cfg, dtype, adaln_dtype, device) for _ in range(cfg.num_layers)])
        self.final_layer = FinalLayer(cfg, dtype, adaln_dtype, device)
        self.adaln_merges: dict = {}

    @property
    def device(self) -> torch.device:
        if self.pending is not None:
            self.pending.prelude()
        return self.condition_proj.weight.device

    def adaln_off_device(self, name: str) -> bool:
        """Whether ``name`` is a block AdaLN weight or bias that a run brings to the device rather than one the
        model holds there: kept in host memory (the plan's AdaLN rows per run) or left in the checkpoint file."""
        if not ADALN_KEY.match(name):
            return False
        t = self.get_parameter(name)
        return (t.is_meta and self.adaln_source is not None) or (not t.is_meta and t.device != self.device)

    # -- pieces computed once per run ----------------------------------------------------------
    def refine_text(self, text_states: torch.Tensor) -> torch.Tensor:
        """[1, L, text_dim] Qwen states -> [L, hidden] refined rows. Rows already at hidden width pass through as
        refined, whatever text_dim is: core tells refined rows by their width alone, so a checkpoint with
        text_dim == hidden_size never runs condition_proj or the refiner there, and here neither."""
        x = text_states[0].to(self.device)
        if x.shape[-1] == self.cfg.hidden_size:
            return x.to(self.dtype)
        if x.shape[-1] != self.cfg.text_dim:
            raise ValueError(f"text states have width {x.shape[-1]}; this model expects {self.cfg.text_dim} "
                             f"(Qwen3-VL hidden states [1, L, {self.cfg.text_dim}])")
        if x.shape[0] == 0:
            return x.new_zeros(0, self.cfg.hidden_size, dtype=self.dtype)
        h = self.condition_proj(x.to(self.dtype))
        if not self.refiner_on_host:
            return self.token_refiner(h)
        # its weights in host memory between runs: on the device for this one call (the same math)
        on_device = {n: t.to(self.device, non_blocking=True)
                     for n, t in list(self.token_refiner.named_parameters()) + list(self.token_refiner.named_buffers())}
        return torch.func.functional_call(self.token_refiner, on_device, (h,))

    def time_embedding(self, t_values) -> torch.Tensor:
        """Distinct t values -> t_emb [M, time_embed_dim]: time embedder (cast to the compute dtype, as core) or
        the curve table's linear interpolation (fp32, no SiLU downstream)."""
        t = torch.tensor([float(v) for v in t_values], dtype=torch.float32, device=self.device)
        if self.cfg.curve_form:
            table = self.adaln_t_table
            pos = t.clamp(0.0, 1.0) * (table.shape[0] - 1)
            i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
            return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))
        return self.time_embedder(t).to(self.dtype)

    def embed_video_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.video_patch_proj(rows.float()).to(self.dtype)

    def embed_audio_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.audio_patch_proj(rows.float()).to(self.dtype)

    def plan(self, text_states: torch.Tensor, video_shape, audio_shape, sigmas, token_tags=None,
             shifts=None, cond: H3Conditioning | None = None) -> RunPlan:
        """Precompute a run. ``sigmas`` are the video sigmas the model will be evaluated at (one per step; for
        a PDD bank the schedule's next sigma is taken from this list, or from ``cond.sample_sigmas`` when set).

        cond: the run's conditioning (``conditioning.H3Conditioning``: keyframes, references, masks, noise
        augmentation, seed; core's payload dicts become one with ``runtime.io.payload.conditioning_from_payload``).
        Without it: plain t2va (``H3Conditioning()``: seed 0, its default noise augmentation).
        """
        cfg = self.cfg
        shifts = tuple(shifts or (cfg.shift_video, cfg.shift_audio))
        _, c, t, h, w = video_shape
        if c != cfg.video_channels:
            raise ValueError(f"video latent has {c} channels; this model expects {cfg.video_channels}")
        if audio_shape[1] != cfg.audio_channels or audio_shape[2] != 2:
            raise ValueError(f"audio latent has shape {list(audio_shape)}; expected [1, {cfg.audio_channels}, 2, Ta]")
        if cond is None:
            cond = H3Conditioning()
        cond.check_target(video_shape, audio_shape, cfg.video_channels, cfg.audio_channels)
        layout = build_layout(text_states.shape[1], t, h, w, audio_shape[3], keyframe_specs(cond), cond.refs)
        text = self.refine_text(text_states)
        vis_rows, aud_rows = condition_rows(cond)
        cos, sin = rope_tables(layout.position_ids, self.rope.inv_freq)
        tags = None if token_tags is None else [int(v) for v in token_tags.view(-1).tolist()]
        p = RunPlan(layout, text, None if vis_rows is None else self.embed_video_rows(vis_rows.to(self.device)),
                    cos, sin, [float(s) for s in sigmas], shifts, orig_hw=(h, w),
                    cond_audio_embed=None if aud_rows is None else self.embed_audio_rows(aud_rows.to(self.device)),
                    video_mask=pool_video_mask(cond.denoise_mask), audio_mask=pool_audio_mask(cond.audio_denoise_mask))
        self._plan_steps(p, tags, cond)
        return p

    def _plan_steps(self, p: RunPlan, tags, cond: H3Conditioning) -> None:
        """Per step: timesteps (masked rows included), final-layer modulation, output heads, block modulation."""
        shifts, layout = p.shifts, p.layout
        vrows, arows = video_mask_rows(p.video_mask), audio_mask_rows(p.audio_mask)
        schedule = None if cond.sample_sigmas is None else [float(v) for v in cond.sample_sigmas]
        t_embs = []
        for i, sigma in enumerate(p.sigmas):
            st = step_times(layout, sigma, (shifts[0], shifts[1]), tags, visual_cond_t=cond.visual_cond_noise_aug,
                            audio_cond_t=cond.audio_cond_noise_aug, video_mask_rows=vrows, audio_mask_rows=arows)
            p.times.append(st)
            t_embs.append(self.time_embedding(st.t_values))
            shift, scale = self.final_layer.adaln_proj(t_embs[-1]).chunk(2, dim=-1)
            p.final_mod.append((shift, scale))
            p.heads.append(self._heads_for(sigma, p.sigmas, i, shifts, schedule))
        rows = sum(len(st.t_values) for st in p.times) * 3 * len(self.blocks)
        if rows * 6 * self.cfg.hidden_size * 4 > MOD_CACHE_BYTES:
            # many distinct t (a soft denoise mask: one per mask level): each step's rows when it runs
            p.mods = [StepMods(self, t) for t in t_embs]
            return
        # modulation rows of every (step, block), block-major so an offloaded AdaLN weight crosses to the
        # device once per run; each block's when the run first reaches it where its AdaLN weights are still to come
        # (a load behind the first step, or read from the checkpoint file: the read overlaps the blocks before it)
        if self.pending is not None or self.adaln_source is not None:
            table = BlockModRows(self, t_embs)
            p.mods = [table.step(i) for i in range(len(p.sigmas))]
            return
        per_block = [self._block_mods(j, t_embs) for j in range(len(self.blocks))]
        p.mods = [[per_block[j][i] for j in range(len(self.blocks))] for i in range(len(p.sigmas))]

    def _block_mods(self, j: int, t_embs):
        """Block j's modulation rows for each t_emb: from its AdaLN module where the weights live on the device,
        else from the weights brought over once (host memory, or the checkpoint file: ``adaln_source``)."""
        if self.pending is not None:
            self.pending.block(j)
        blk = self.blocks[j]
        lin = blk.adaln_proj.linear
        if self.adaln_source is not None and lin.weight.is_meta:  # left in the file (runtime.io.adaln_file)
            w, b = self.adaln_source.read(j, self.device)
        elif lin.weight.device == self.device:
            return [blk.adaln_proj(t) for t in t_embs]
        else:  # AdaLN weights kept in host memory (offload_adaln): bring this block's weight over once
            w = lin.weight.to(self.device, non_blocking=True)
            b = lin.bias.to(self.device, non_blocking=True)
        names = (f"blocks.{j}.adaln_proj.linear.weight", f"blocks.{j}.adaln_proj.linear.bias")
        w, b = (t if self.adaln_merges.get(n) is None else self.adaln_merges[n](t) for n, t in zip(names, (w, b)))
        ap = blk.adaln_proj
        out = []
        for t in t_embs:
            x = F.silu(t) if ap.apply_silu else t
            y = F.linear(x.to(w.dtype), w, b)
            # a side-path LoRA on this AdaLN: AdaLN is outside BlockOps, so it keeps the module's side attribute
            # (runtime.lora.side), here read because the offloaded weight is applied without calling the module
            side = getattr(lin, "_h3_lora_side", None)
            if side is not None and side.active:
                side.add_(x, y)
            out.append(y.reshape(y.shape[0] * ap.modalities, ap.expand * ap.hidden))
        return out

    def _heads_for(self, sigma, sigmas, i, shifts, schedule=None):
        """Output heads of step i. A PDD bank spans [sigma, next): next is the entry after the one nearest to
        sigma in ``schedule`` (the run's full sample_sigmas, core's rule) or else ``sigmas[i + 1]`` (0 at the end)."""
        fl, n = self.final_layer, self.cfg.head_bank
        if n == 1:
            return (fl.video_out.weight, fl.video_out.bias, fl.audio_out.weight, fl.audio_out.bias)
        if schedule is not None:
            j = min(range(len(schedule)), key=lambda k: abs(schedule[k] - sigma))
            nxt = schedule[min(j + 1, len(schedule) - 1)]
        else:
            nxt = sigmas[i + 1] if i + 1 < len(sigmas) else 0.0
        start, stop = pdd_span(sigma, nxt, n, shifts[0])
        vw, vb = pdd_head_weights(fl.video_out.weight, fl.video_out.bias, n, start, stop, shifts[0])
        aw, ab = pdd_head_weights(fl.audio_out.weight, fl.audio_out.bias, n, start, stop, shifts[1])
        return (vw, vb, aw, ab)

    # -- one evaluation -------------------------------------------------------------------------
    def pack(self, plan: RunPlan, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Assemble the packed residual stream x [S, hidden] (compute dtype) for the current latents."""
        lay = plan.layout
        x = torch.empty(lay.seq_len, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        a, b = lay.segment("text")
        x[a:b] = plan.text
        # condition rows fill the cond / ref segments in order (keyframes first, then references, as core)
        voff = aoff = 0
        for a, b, kind in lay.segments:
            if kind in ("cond", "ref_img"):
                x[a:b] = plan.cond_embed[voff:voff + b - a]
                voff += b - a
            elif kind in ("cond_audio", "ref_audio"):
                x[a:b] = plan.cond_audio_embed[aoff:aoff + b - a]
                aoff += b - a
        a, b = lay.segment("audio")
        x[a:b] = self.embed_audio_rows(pack_audio(audio.to(self.device)))
        a, b = lay.segment("video")
        x[a:b] = self.embed_video_rows(patchify_video(pad_video(video.to(self.device).float())))
        return x

    def run_blocks(self, x: torch.Tensor, plan: RunPlan, i: int, ops) -> torch.Tensor:
        """The block stack at step i over ``ops`` (BlockOps resolved at load; ReferenceOps for the oracle).
        A First-Block Cache installed on the plan (``plan.step_cache``) may skip blocks 1.. at this step.
        A control tower bound to the plan (``plan.control``) runs beside the blocks it is placed after."""
        segs = plan.times[i].mod_segments
        ctl = None if plan.control is None else plan.control.step(plan, i)

        def blocks(x, first, stop):
            for j in range(first, stop):
                if self.pending is not None:  # a load behind the first step: block j's tensors are there now
                    self.pending.block(j)
                if ctl is not None:
                    ctl.before(j, x)
                x = self.blocks[j](x, plan.mods[i][j], segs, plan.cos, plan.sin, ops, j)
                if ctl is not None:
                    x = ctl.after(j, x, ops)
                if plan.on_block is not None:
                    plan.on_block(i, j + 1, len(self.blocks))
            return x

        n, cache = len(self.blocks), plan.step_cache
        if cache is None:
            return blocks(x, 0, n)
        return cache.run(i, x, lambda x: blocks(x, 0, 1), lambda x: blocks(x, 1, n))

    def head(self, x: torch.Tensor, plan: RunPlan, i: int, rows: int | None = None):
        """Final layer on the target segments -> negated (video [1,C,T,H,W], audio [1,Ca,2,Ta]) in fp32, scaled by
        the pooled denoise masks when the plan has them (core scales the velocity of masked rows).

        The norm and modulation run ``HEAD_ROWS`` rows at a time into one fp32 input (row-local: the bytes of the
        whole at once, without its fp32 temporaries over every video row), then one fp32 projection. rows: the
        video rows' projection in chunks of that many rows too (the memory plan's last tier, see ``evaluate``: the
        GEMM's M changes, so equal to fp32 blocking only); None: one projection."""
        lay, st = plan.layout, plan.times[i]
        shift, scale = plan.final_mod[i]
        vw, vb, aw, ab = plan.heads[i]

        def part(row, a, b):
            """Entries a..b of a t-table row index: an int (every row's) as is, one entry per row sliced."""
            return row if isinstance(row, int) else row[a:b]

        def head_rows(a, b, row, w, bias):
            """rows a..b of x through the head; row: their t-table row (an int, or one entry per row)."""
            h = torch.empty(b - a, x.shape[1], dtype=torch.float32, device=x.device)
            for r in range(a, b, HEAD_ROWS):
                e = min(b, r + HEAD_ROWS)
                t = part(row, r - a, e - a)
                h[r - a:e - a] = self.final_layer.norm(x[r:e]) * (1.0 + scale[t]) + shift[t]
            return F.linear(h, w, bias)

        va, vz = lay.segment("video")
        if rows is None or rows >= vz - va:
            v = head_rows(va, vz, st.video_t_index, vw, vb)
        else:
            v = torch.empty(vz - va, vw.shape[0], dtype=torch.float32, device=x.device)
            for r in range(va, vz, rows):
                e = min(vz, r + rows)
                v[r - va:e - va] = head_rows(r, e, part(st.video_t_index, r - va, e - va), vw, vb)
        a = head_rows(*lay.segment("audio"), st.audio_t_index, aw, ab)
        h, w = plan.orig_hw
        video = -unpatchify_video(v, lay.latent_t, lay.lat_h, lay.lat_w, self.cfg.video_channels)[..., :h, :w]
        audio = -unpack_audio(a)
        if plan.video_mask is not None:
            video = video * plan.video_mask.to(video.device)
        if plan.audio_mask is not None:
            audio = audio * plan.audio_mask.to(audio.device)
        return video, audio

    def evaluate(self, plan: RunPlan, i: int, video: torch.Tensor, audio: torch.Tensor, ops=None):
        """Model output at step i of a plan: negated velocity (video, audio), fp32, no audio carry. ops: the
        BlockOps to run the blocks with (default: the exact reference)."""
        ops = ops if ops is not None else ReferenceOps(self.cfg)
        x = self.run_blocks(self.pack(plan, video, audio), plan, i, ops)
        # where the plan holds K and V in Sage's operands (its last tier) the head runs in row chunks too
        return self.head(x, plan, i, ops.attn_chunk_rows if ops.attn_kv_form == "sage" else None)

    @torch.no_grad()
    def forward(self, video, audio, text_states, sigma: float, token_tags=None, shifts=None,
                cond: H3Conditioning | None = None, ops=None):
        """One evaluation: exactly ComfyUI core's H3 output for the same conditioning, with no audio carry.

        video [1, C, T, H, W], audio [1, Ca, 2, Ta], text_states [1, L, text_dim] (fp32 ok), sigma: video sigma.
        cond: keyframes, references, masks, noise augmentation, seed and sample_sigmas (``H3Conditioning``; the
        run's schedule, needed only by PDD head banks); without it plain t2va with seed 0. ops: the BlockOps (default: the exact reference, whatever the
        stored weights' format). Returns (video, audio) fp32.
        """
        sig = [float(sigma)]
        plan = self.plan(text_states, tuple(video.shape), tuple(audio.shape), sig, token_tags=token_tags,
                         shifts=shifts, cond=cond)
        return self.evaluate(plan, 0, video, audio, ops)
