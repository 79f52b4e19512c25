"""A float64 oracle of ComfyUI core's H3 Fun ControlNet, written from core's semantics, not from ours.

Core: ``comfy/ldm/minimax/controlnet.py`` @ 9b7fcfe0 (``MiniMaxH3FunControl.init_stream`` / ``step``), the patch of
``comfy_extras/nodes_minimax_h3.py`` @ 13a83ce7 (``MiniMaxH3FunControlPatch``: window, residual, audio rows) with
the fades of PR #16283 @ 542de101, ``ModelPatchLoader`` of ``nodes_model_patch.py`` @ 08f68f09 (places), and
the block patch point of ``comfy/ldm/minimax/model.py`` @ 01a56b76. Torch only; it shares nothing with the
runtime. It rides on ``core_h3.core_forward`` through its ``block_hook`` (core's ``patches_replace`` point):

- active iff ``sigma_end <= sigma <= sigma_start`` with sigma the sampler's fp32 sigma (``transformer_options
  ["sigmas"][0]``), else the hook is absent and the output is the base's;
- the control rows, one per visual row (keyframe, reference, target video, in sequence order): zeros except the
  target video's, which are the hint circularly padded to even H / W and patchified (c, ph, pw), zero-padded to
  196 columns; c = the embedded sequence with those rows replaced by ``control_proj_in`` of them (every other
  row kept), then ``before_proj(c) + x0``;
- after base block places[k]: c = control block k over c (core's DiTBlock with the base's per-row timesteps,
  tags and rope), skip = after_proj(c), zero on every audio row, the target video rows times their frame's fade
  weight, x += strength * skip.
"""

from __future__ import annotations

import torch

import core_h3 as o

F64 = torch.float64
AUDIO = ("audio", "cond_audio", "ref_audio")
VISUAL = ("cond", "ref_img", "video")


def fade_weights(latent_t: int, fade_in: int, fade_out: int) -> list[float]:
    """Per latent frame: the mean over its pixel frames of min(ease-in, ease-out), smoothstep t^2 (3 - 2t) on
    evenly spaced t over the first fade_in / last fade_out pixel frames (a count of 1 zeroes that frame)."""
    spans = [o.FRAME_PER_TOKEN[k % 5] for k in range(latent_t)]
    n = sum(spans)
    fi, fo = min(max(fade_in, 0), n), min(max(fade_out, 0), n)
    env = []
    for f in range(n):
        e = 1.0
        if fi == 1 and f == 0:
            e = 0.0
        elif fi > 1 and f < fi:
            t = f / (fi - 1)
            e = min(e, t * t * (3 - 2 * t))
        j = f - (n - fo)
        if fo == 1 and f == n - 1:
            e = 0.0
        elif fo > 1 and j >= 0:
            t = j / (fo - 1)
            e = min(e, 1 - t * t * (3 - 2 * t))
        env.append(e)
    out, at = [], 0
    for s in spans:
        out.append(sum(env[at:at + s]) / s)
        at += s
    return out


def default_places(blocks: int) -> list[int]:
    """ModelPatchLoader without metadata: spread over 50 base blocks."""
    return list(range(0, 50, 50 // blocks))


class ControlHook:
    """core_forward's block_hook for one active evaluation."""

    def __init__(self, csd: dict, places, hint: torch.Tensor, strength: float, fade_in: int = 0, fade_out: int = 0):
        self.csd = {k: v.to(F64) for k, v in csd.items()}
        self.places = list(places)
        self.hint, self.strength = hint.to(F64), float(strength)
        self.fade_in, self.fade_out = int(fade_in), int(fade_out)
        self.c = None

    def _start(self, ctx):
        x0, kinds = ctx["x0"], ctx["kinds"]
        hint = o.pad_circular_even(self.hint)
        rows = o.video_rows(hint)
        rows = torch.cat([rows, torch.zeros(rows.shape[0], 196 - rows.shape[1], dtype=F64)], dim=1)
        target = o.linear(rows, self.csd, "control_proj_in")
        zero = o.linear(torch.zeros(1, 196, dtype=F64), self.csd, "control_proj_in")[0]
        c = x0.clone()
        vi = 0
        for r, kind in enumerate(kinds):
            if kind == "video":
                c[r] = target[vi]
                vi += 1
            elif kind in VISUAL:
                c[r] = zero
        assert vi == target.shape[0], (vi, target.shape)
        self.c = o.linear(c, self.csd, "control_blocks.0.before_proj") + x0

    def __call__(self, i: int, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        if i not in self.places:
            return x
        k = self.places.index(i)
        if k == 0:
            self._start(ctx)
        self.c = o.dit_block(self.csd, f"control_blocks.{k}", self.c, ctx)
        skip = o.linear(self.c, self.csd, f"control_blocks.{k}.after_proj")
        kinds = ctx["kinds"]
        weights = fade_weights(ctx["latent_t"], self.fade_in, self.fade_out) \
            if (self.fade_in or self.fade_out) else None
        n_video = kinds.count("video")
        per_frame = n_video // ctx["latent_t"]
        vi = 0
        for r, kind in enumerate(kinds):
            if kind in AUDIO:
                skip[r] = 0.0
            elif kind == "video":
                if weights is not None:
                    skip[r] = skip[r] * weights[vi // per_frame]
                vi += 1
        return x + self.strength * skip


def sampler_sigma(sigma: float) -> float:
    """The sigma core's patch compares with its window: the sampler's fp32 sigma."""
    return float(torch.tensor(float(sigma), dtype=torch.float32))


def core_forward_control(sd: dict, csd: dict, places, video, audio, text_states, sigma: float, control: dict,
                         token_tags=None, payload: dict | None = None, shifts=(12.0, 3.0)):
    """Core's output with a Fun ControlNet patched in. control: {"hint" [1, C, T, H, W], "strength",
    "sigma_start", "sigma_end", "fade_in_frames", "fade_out_frames"} (core's apply-time values)."""
    s = sampler_sigma(sigma)
    strength = float(control.get("strength", 1.0))
    active = strength != 0 and float(control.get("sigma_end", 0.0)) <= s <= float(control.get("sigma_start", 1.0))
    hook = ControlHook(csd, places, control["hint"], strength, control.get("fade_in_frames", 0),
                       control.get("fade_out_frames", 0)) if active else None
    return o.core_forward(sd, video, audio, text_states, sigma, token_tags=token_tags, payload=payload,
                          shifts=shifts, block_hook=hook)
