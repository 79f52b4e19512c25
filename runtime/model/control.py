"""H3's Fun ControlNet-Union (v1: 5 control blocks, v2: 10) at ComfyUI core's semantics.

Core loads it as a model patch (``comfy/ldm/minimax/controlnet.py`` ``MiniMaxH3FunControl``, applied by
``MiniMaxH3FunControlNetApply`` in ``comfy_extras/nodes_minimax_h3.py``). Names are core's checkpoint keys:
``control_proj_in`` (49 * 1*2*2 = 196 -> hidden, bias, fp32), ``control_blocks.N`` = a DiT block (norm1/2,
attn.qkv_proj/q_norm/k_norm/out_proj, mlp.fc1/fc2, adaln_proj.linear) plus ``after_proj`` (hidden -> hidden,
bias) and, on block 0, ``before_proj``.

One evaluation with the tower active (``sigma_end <= sigma <= sigma_start``, both inclusive):

- h = the packed stream entering base block ``places[0]`` (always 0, so the embedded sequence);
- c = h with every visual row (keyframe ``cond``, reference ``ref_img``, target ``video``) replaced by
  ``control_proj_in(rows)`` cast to the compute dtype: the target video rows get the hint patchified like the
  latent ([1, C, T, H, W] circularly padded to even H / W, features (c, ph, pw), 24-channel hints zero-padded
  to 49), keyframe and reference rows a zero row (so the projection's bias); text and audio rows keep h;
  c = before_proj(c) + h;
- after base block ``places[k]`` (its output x): c = control block k over c with the base's per-row
  modulation (the tower's own AdaLN on the base's t table, masks included), RoPE and a DENSE attention;
  skip = after_proj(c); skip = 0 on every audio row (target, keyframe and reference audio); with fades the
  target video rows are scaled per latent frame (``fade_row_scale``); x += strength * skip.

Strength 0, or sigma outside the window, leaves the evaluation exactly the uncontrolled one (nothing runs).

The control blocks reuse ``DiTBlock`` and run through the same BlockOps as the base (NVFP4 / W4A8 linears
when the load quantizes; a LoRA wrapper finds no side path for them: their index is ``"control.k"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import H3Error
from ..ops.streaming import module_device_bytes
from .block import DiTBlock
from .conditioning import ControlHint
from .config import H3Config
from .layout import FRAME_PER_TOKEN, PackedLayout, pad_video, patchify_video

CONTROL_IN_CHANNELS = 49           # core's control_in_dim: 24 control | 1 visibility | 24 masked source
VISUAL_KINDS = ("cond", "ref_img", "video")   # core's layout.img_pos
AUDIO_KINDS = ("cond_audio", "ref_audio", "audio")   # core's layout.audio_pos


class ControlError(H3Error):
    """A control tower that cannot be applied to this model or request (the message says what to do)."""


class ControlBlock(DiTBlock):
    """A DiT block plus ``after_proj`` (and ``before_proj`` on block 0), hidden -> hidden with bias."""

    def __init__(self, cfg: H3Config, dtype, adaln_dtype, device=None, first: bool = False):
        super().__init__(cfg, dtype, adaln_dtype, device)
        h = cfg.hidden_size
        if first:
            self.before_proj = nn.Linear(h, h, bias=True, dtype=dtype, device=device)
        self.after_proj = nn.Linear(h, h, bias=True, dtype=dtype, device=device)


def block_config(hidden: int, heads: int, head_dim: int, ffn: int, t_dim: int, curve: bool,
                 eps: float = 1e-5) -> H3Config:
    """The H3Config the control blocks are built from: the tower's own dimensions and adaLN width; curve form
    (fp32 adaLN, no SiLU) when ``curve``. Only block fields are meaningful (the tower takes the base's RoPE
    tables and t table, so it has no rope or time embedder of its own)."""
    return H3Config(hidden_size=hidden, num_layers=0, num_refiner_layers=0, num_heads=heads, head_dim=head_dim,
                    ffn_hidden_size=ffn, time_embed_dim=t_dim, adaln_curve_grid=2 if curve else 0, eps=eps,
                    rope_inv_freq_len=0, gate_compress=False)


class FunControl(nn.Module):
    """The tower (core's ``MiniMaxH3FunControl``): ``control_proj_in`` and ``control_blocks``.

    cfg: ``block_config(...)``; places: the base blocks after which each control block runs (strictly increasing,
    starting at 0); curve form when ``cfg.curve_form``. inpaint_post_norm: the file's
    ``inpaint_masked_pixel_mode == "post_norm"`` flag (carried; core's nodes do not read it).
    """

    def __init__(self, cfg: H3Config, places, dtype=torch.float32, device=None, inpaint_post_norm: bool = False):
        super().__init__()
        self.cfg = cfg
        self.places = check_places(places, len(places))
        self.dtype = dtype
        self.inpaint_post_norm = bool(inpaint_post_norm)
        self.streamer = None  # load_control's BlockStreamer over control_blocks (streamed blocks, or none)
        adaln_dtype = torch.float32 if cfg.curve_form else dtype
        self.control_proj_in = nn.Linear(CONTROL_IN_CHANNELS * 4, cfg.hidden_size, bias=True, dtype=torch.float32,
                                         device=device)
        self.control_blocks = nn.ModuleList([ControlBlock(cfg, dtype, adaln_dtype, device, first=(k == 0))
                                             for k in range(len(self.places))])

    @property
    def curve_form(self) -> bool:
        return self.cfg.curve_form

    def device_bytes(self, device: torch.device) -> int:
        """Bytes the tower holds on ``device``'s type: its tensors there and, where its blocks stream, its
        streamer's device buffers (the streamed linears themselves sit in host memory between blocks)."""
        return module_device_bytes(self, device) + (0 if self.streamer is None else self.streamer.device_bytes)

    @property
    def version(self) -> str:
        return {5: "v1", 10: "v2"}.get(len(self.places), f"{len(self.places)} blocks")

    def describe(self) -> str:
        return (f"Fun ControlNet {self.version}: {len(self.places)} control blocks after base blocks "
                f"{list(self.places)}, {'curve' if self.curve_form else 'full'}-form adaLN of width "
                f"{self.cfg.time_embed_dim}")

    def check_base(self, base: H3Config) -> "FunControl":
        """Refuse a tower that cannot run on ``base``: another adaLN form or width (core raises at the first
        active step; we refuse at apply time), other block dimensions, places past the base's blocks."""
        check_fits(self.cfg, self.places, base)
        return self


def check_places(places, count: int, num_layers: int | None = None) -> tuple[int, ...]:
    """Core's rules for ``control_blocks_places``: one integer per control block, strictly increasing, the first
    0 (the tower starts from the embedded sequence); with ``num_layers``, every place must be a base block."""
    if not isinstance(places, (list, tuple)) or any(isinstance(p, bool) or not isinstance(p, int) for p in places):
        raise ControlError(f"control_blocks_places: expected a list of block indices; found {places!r}; fix the "
                           "file's metadata or drop it (defaults: range(0, 50, 50 // blocks))")
    places = tuple(int(p) for p in places)
    if len(places) != count:
        raise ControlError(f"control_blocks_places: expected {count} entries (one per control block); found "
                           f"{len(places)} {list(places)}; core's ModelPatchLoader refuses this file too")
    if not places or places[0] != 0:
        raise ControlError(f"control_blocks_places: the first place must be 0 (the tower starts from the embedded "
                           f"sequence); found {list(places)}")
    if any(b <= a for a, b in zip(places, places[1:])):
        raise ControlError(f"control_blocks_places: expected strictly increasing block indices; found {list(places)}")
    if num_layers is not None and places[-1] >= num_layers:
        raise ControlError(f"control_blocks_places: expected base blocks 0..{num_layers - 1}; found {list(places)} "
                           f"(this model has {num_layers} blocks; core would never run the control blocks past its "
                           "last block); use a control made for this model")
    return places


def check_fits(cfg: H3Config, places, base: H3Config) -> None:
    """``cfg`` / ``places`` of a tower against the base model's config (see ``FunControl.check_base``)."""
    form = "curve" if cfg.curve_form else "full"
    base_form = "curve" if base.curve_form else "full"
    if form != base_form:
        raise ControlError(f"the control is {form}-form (adaLN width {cfg.time_embed_dim}"
                           f"{', no SiLU' if cfg.curve_form else ''}) but the model is {base_form}-form (adaLN width "
                           f"{base.time_embed_dim}); core raises at the first active step; use the control made for "
                           f"{base_form}-form checkpoints (metadata minimax_h3_fun_controlnet="
                           f"{'adaln_basis' if base.curve_form else 'absent'})")
    if cfg.time_embed_dim != base.time_embed_dim:
        raise ControlError(f"the control's adaLN is {cfg.time_embed_dim} wide but the model's time embedding is "
                           f"{base.time_embed_dim} wide; use a control made for this model")
    mine = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_hidden_size)
    theirs = (base.hidden_size, base.num_heads, base.head_dim, base.ffn_hidden_size)
    if mine != theirs:
        raise ControlError(f"the control's blocks are hidden/heads/head_dim/ffn {mine}; the model's {theirs}; use a "
                           "control made for this model")
    check_places(list(places), len(places), base.num_layers)


# ---------------------------------------------------------------------------------------------
# per run
# ---------------------------------------------------------------------------------------------

def fade_row_scale(latent_t: int, rows_per_frame: int, fade_in: int, fade_out: int) -> torch.Tensor:
    """Per target-video row weight [latent_t * rows_per_frame] fp32 (core PR #16283): a smoothstep envelope over the
    output-video frames (sum of (1,4,4,4,4)[k % 5]), easing in over the first ``fade_in`` and out over the last
    ``fade_out`` (1 zeroes that end frame), each latent frame weighted by the mean over its pixel frames."""
    spans = [FRAME_PER_TOKEN[k % 5] for k in range(latent_t)]
    n = sum(spans)
    fade_in, fade_out = min(max(fade_in, 0), n), min(max(fade_out, 0), n)
    env = torch.ones(n, dtype=torch.float32)
    for count, rising in ((fade_in, True), (fade_out, False)):
        if count == 0:
            continue
        if count == 1:
            env[0 if rising else -1] = 0.0
            continue
        t = torch.linspace(0.0, 1.0, count, dtype=torch.float32)
        s = t * t * (3.0 - 2.0 * t)
        sl = slice(0, count) if rising else slice(n - count, n)
        env[sl] = torch.minimum(env[sl], s if rising else 1.0 - s)
    starts = [sum(spans[:k]) for k in range(latent_t)]
    w = torch.stack([env[a:a + s].mean() for a, s in zip(starts, spans)])
    return w.repeat_interleave(rows_per_frame)


def hint_rows(hint: torch.Tensor) -> torch.Tensor:
    """[1, C, T, H, W] hint (C = 24 or 49) -> target video rows [T*(H'/2)*(W'/2), 196] fp32: circularly padded to
    even H / W like the latent, patchified (features (c, ph, pw)), right-padded with zeros to 49 channels."""
    rows = patchify_video(pad_video(hint.float()))
    return F.pad(rows, (0, CONTROL_IN_CHANNELS * 4 - rows.shape[1])) if rows.shape[1] < CONTROL_IN_CHANNELS * 4 \
        else rows


def _slices(layout: PackedLayout, kinds) -> list[tuple[int, int]]:
    return [(a, b) for a, b, k in layout.segments if k in kinds and b > a]


def _adaln_rows(blk, t_embs: list, device) -> list:
    """A control block's modulation rows [M*3, 6*hidden] for each t table in ``t_embs`` (its adaLN weight may sit
    in host memory: brought over once)."""
    ap = blk.adaln_proj
    w = ap.linear.weight.to(device, non_blocking=True)
    b = ap.linear.bias.to(device, non_blocking=True)
    out = []
    for t in t_embs:
        x = F.silu(t) if ap.apply_silu else t
        y = F.linear(x.to(w.dtype), w, b)
        out.append(y.reshape(y.shape[0] * ap.modalities, ap.expand * ap.hidden))
    return out


@dataclass
class ControlRun:
    """A tower bound to one sampling run's plan (``bind_control``): per step whether it is active, the control
    rows' embedding, the tower's modulation rows of the active steps, the fade weights. ``step(i)`` gives the
    evaluation's hooks (``ControlStep``) or None when the tower does not run at step i."""

    tower: FunControl
    hint: ControlHint
    layout: PackedLayout
    active: list
    target_embed: torch.Tensor          # [n_video, hidden] compute dtype
    zero_embed: torch.Tensor            # [hidden]: the projection of a zero row (keyframe / reference rows)
    mods: dict                          # step -> [per control block [M*3, 6*hidden]]
    row_scale: torch.Tensor | None      # [n_video] fp32 or None (no fades)
    ops: object | None = None           # the tower's BlockOps when they differ from the base's (dense attention)

    @property
    def fc2_calls(self) -> int:
        """FC2 calls the tower adds to a run (one per control block per active step)."""
        return len(self.tower.places) * sum(self.active)

    def step(self, plan, i: int) -> "ControlStep | None":
        """The tower's hooks for evaluation i of ``plan`` (the plan it was bound to), None when inactive."""
        return ControlStep(self, plan, i) if self.active[i] else None

    def summary(self) -> dict:
        """The report's ``control`` block (with the tower's streaming counters where its blocks stream)."""
        out = {"tower": self.tower.describe(), "strength": self.hint.strength,
               "sigma_window": [self.hint.sigma_end, self.hint.sigma_start],
               "active_steps": [i for i, a in enumerate(self.active) if a],
               "hint_channels": int(self.hint.hint.shape[1]),
               "fades": [self.hint.fade_in_frames, self.hint.fade_out_frames]}
        st = self.tower.streamer
        out["streamed_blocks"] = [] if st is None else list(st.order)
        if st is not None and st.order:
            stats = st.summary()
            out["streaming"] = {k: stats[k] for k in ("evaluations", "bytes_copied_per_step", "copy_ms_per_step",
                                                      "copy_exposed_ms_per_step", "timing")}
        return out


class ControlStep:
    """The tower during one evaluation: ``before(j, x)`` before base block j, ``after(j, x, ops)`` after it."""

    def __init__(self, run: ControlRun, plan, i: int):
        self.run, self.i = run, i
        self.segs, self.cos, self.sin = plan.times[i].mod_segments, plan.cos, plan.sin
        self.places = {p: k for k, p in enumerate(run.tower.places)}
        self.c = None

    def before(self, j: int, x: torch.Tensor) -> None:
        run = self.run
        if j != run.tower.places[0]:
            return
        lay = run.layout
        if x.shape[0] != lay.seq_len:
            raise ControlError(f"the control tower needs the whole packed sequence ({lay.seq_len} rows); this "
                               f"evaluation holds {x.shape[0]} (sequence parallelism); run without "
                               "--sequence-parallel or without the control")
        c = x.clone()
        for a, b, kind in lay.segments:
            if kind in ("cond", "ref_img"):
                c[a:b] = run.zero_embed
        a, b = lay.segment("video")
        c[a:b] = run.target_embed
        self.c = run.tower.control_blocks[0].before_proj(c).add_(x)

    def after(self, j: int, x: torch.Tensor, ops) -> torch.Tensor:
        k = self.places.get(j)
        if k is None:
            return x
        run = self.run
        ops = run.ops if run.ops is not None else ops
        blk = run.tower.control_blocks[k]
        st = run.tower.streamer
        streamed = st is not None and k in st.streamed
        if streamed:
            st.enter(k)  # its linears bound to the tower's device buffer (prefetching the next control block)
        try:
            self.c = blk(self.c, run.mods[self.i][k], self.segs, self.cos, self.sin, ops, f"control.{k}")
        finally:
            if streamed:
                st.leave(k)
        skip = blk.after_proj(self.c)
        for a, b in _slices(run.layout, AUDIO_KINDS):
            skip[a:b] = 0
        if run.row_scale is not None:
            a, b = run.layout.segment("video")
            skip[a:b].mul_(run.row_scale.to(device=skip.device, dtype=skip.dtype).unsqueeze(-1))
        x.add_(skip, alpha=run.hint.strength)
        if k == len(run.tower.places) - 1:
            self.c = None
        return x


def bind_control(model, tower: FunControl, hint: ControlHint, plan, window_sigmas, ops=None) -> ControlRun | None:
    """Bind ``tower`` with ``hint`` to a run ``plan`` of ``model`` (an H3Model) and set ``plan.control``.

    window_sigmas: the sigma of each step as core's wrapper reads it (the sampler's sigma, fp32) for the window
    test; ops: the tower's BlockOps when the base's attention is not dense (core runs the tower dense), else None.
    Returns None (and leaves plan.control None) when strength is 0 or no step is in the window: the run is then
    exactly the uncontrolled one. Raises ControlError for a tower or hint that does not fit.
    """
    tower.check_base(model.cfg)
    lay = plan.layout
    t, (h, w) = lay.latent_t, plan.orig_hw
    if tuple(hint.hint.shape[2:]) != (t, h, w) or hint.hint.shape[1] not in (24, CONTROL_IN_CHANNELS):
        raise ControlError(f"control.hint: expected [1, 24 or 49, {t}, {h}, {w}] (the target video latent); found "
                           f"{list(hint.hint.shape)}")
    window_sigmas = [float(s) for s in window_sigmas]
    if len(window_sigmas) != len(plan.times):
        raise ControlError(f"bind_control: {len(window_sigmas)} window sigmas for a plan of {len(plan.times)} steps")
    active = [hint.strength != 0 and hint.active(s) for s in window_sigmas]
    plan.control = None
    if not any(active):
        return None
    dev, dtype = model.device, model.dtype
    proj = tower.control_proj_in
    target = proj(hint_rows(hint.hint).to(dev)).to(dtype)
    zero = proj.bias.to(dtype)
    steps = [i for i, a in enumerate(active) if a]
    t_embs = [model.time_embedding(plan.times[i].t_values) for i in steps]
    per_block = [_adaln_rows(blk, t_embs, dev) for blk in tower.control_blocks]
    mods = {i: [per_block[k][n] for k in range(len(per_block))] for n, i in enumerate(steps)}
    scale = None
    if hint.fade_in_frames or hint.fade_out_frames:
        scale = fade_row_scale(t, lay.rows_per_frame, hint.fade_in_frames, hint.fade_out_frames).to(dev)
    run = ControlRun(tower, hint, lay, active, target, zero, mods, scale, ops)
    plan.control = run
    return run
