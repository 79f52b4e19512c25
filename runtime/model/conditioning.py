"""H3Conditioning: everything ComfyUI core's H3 graphs condition one model evaluation on, validated.

This module is the runtime's conditioning contract: the validated objects, their fit with the target and
core's mask semantics. Field names are core's (the entries of the ``minimax_payload`` that
``comfy/model_base.py::MiniMaxH3.extra_conds`` builds from the nodes of ``comfy_extras/nodes_minimax_h3.py``).
The payload form (core's JSON, tensors by key) and its parser, which accepts what core's nodes produce
unchanged: ``runtime.io.payload`` (``conditioning_from_payload``).

Tensors (any float dtype; stored as float32, on the CPU):

- keyframe ``latent``: normalised video latent ``[1, C, t, H, W]`` with t = 1 (an image) or t = 5k+2 (core's
  node: a clip of 17k+5 pixel frames; any t >= 1 is taken, as core's model takes it), H / W those of the target
  latent. It conditions the target at pixel frame
  ``resolved_frame_index`` (>= 0; core's node resolves negative indices). keyframe ``audio_latent``:
  ``[1, Ca, 2, ta]`` anchored at the same frame (core's node crops it to ``floor(Ta - 5/3 * index)``). A
  keyframe has a latent, an audio latent or both.
- refs, in request order (core's node emits images, then videos, then standalone audio):
  image ``latent [1, C, 1, latent_h, latent_w]``; video / video_audio ``latent [1, C, latent_t, latent_h,
  latent_w]`` plus ``audio_latent [1, Ca, 2, ref_audio_t]`` when ``ref_audio_t > 0`` (null and 0 otherwise);
  audio ``audio_latent [1, Ca, 2, ref_audio_t]``, ``ref_audio_t >= 1`` and no ``latent`` field (core tests
  ``"latent" in ref``). ``latent_h`` / ``latent_w`` are latent pixels (image pixels / 16), even, and equal to
  the latent's own H / W. ``picture_index`` is carried for the text side; the DiT does not read it.
- ``denoise_mask`` ``[1, 1, T, H, W]`` (the target video latent's T, H, W; 1 = generate, 0 = keep) and
  ``audio_denoise_mask`` ``[1, 1, 2, Ta]``, values in [0, 1]. Raw sampler masks or core's pooled ones: the
  runtime pools them as core does (``pool_video_mask`` / ``pool_audio_mask``, idempotent).
- ``sample_sigmas`` ``[N + 1]``: the run's full sigma schedule including the trailing 0 (needed by PDD
  head banks to find the step's [sigma, sigma_next] interval).

- ``control`` (Fun ControlNet, ``runtime.model.control``): ``hint`` the control latent ``[1, C, T, H, W]`` (C = 24:
  the control video; 49: control | visibility | masked source, core's inpaint hint; T, H, W those of the target
  video latent, unpadded); ``strength`` (>= 0, finite); ``sigma_start`` / ``sigma_end`` the window core resolves
  at apply time (``percent_to_sigma``), the tower active iff ``sigma_end <= sigma <= sigma_start``;
  ``fade_in_frames`` / ``fade_out_frames`` (0 .. 3600, core's PR #16283). Only ``hint`` is required; the
  tower itself is a model patch file (``--control``), not part of the payload.

Scalars: ``visual_cond_noise_aug`` (default 0.999) and ``audio_cond_noise_aug`` (1.0) in [0, 1]: condition
rows become ``aug * rows + (1 - aug) * noise`` (only when aug < 1) and run at timestep ``max(t, aug)``;
``seed`` (int, default 0): visual condition noise comes from ``torch.Generator("cpu").manual_seed(seed)``,
audio condition noise from ``seed + 1``, the generator restarted for every condition block.

Every error is a ``ConditioningError`` whose message starts with the field path (``refs[1].audio_latent``) and
says what was expected and found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import H3Error

VISUAL_COND_NOISE_AUG = 0.999
AUDIO_COND_NOISE_AUG = 1.0
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0
REF_KINDS = ("image", "video", "video_audio", "audio")
MASK_QUANT = 256.0  # core quantises pooled masks to ceil(256 * m) / 256
MASK_FULL = 1.0 - 1e-3  # a mask whose minimum reaches this is "generate everything" and is dropped

CONTROL_HINT_CHANNELS = (24, 49)  # the control video; control | visibility | masked source (inpaint)
MAX_FADE_FRAMES = 3600  # core's widget range


class ConditioningError(H3Error):
    """A conditioning payload that cannot be honoured; the message names the field first."""


def field_error(path: str, expected: str, found: Any, todo: str = "") -> ConditioningError:
    """The ConditioningError of one field: ``path: expected E; found F[; todo]`` (F cut at 200 characters)."""
    found = str(found)
    if len(found) > 200:  # a hostile value (a list of a million numbers) must not become a megabyte error line
        found = found[:200] + f"... ({len(found):,} characters)"
    if len(path) > 200:  # nor a hostile key (an unknown field's name is part of the path)
        path = path[:200] + f"... ({len(path):,} characters)"
    msg = f"{path}: expected {expected}; found {found}"
    return ConditioningError(msg + (f"; {todo}" if todo else ""))


# ---------------------------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Keyframe:
    """A keyframe: ``latent`` [1, C, t, H, W] and / or ``audio_latent`` [1, Ca, 2, ta] at a pixel frame."""

    resolved_frame_index: int
    latent: torch.Tensor | None = None
    audio_latent: torch.Tensor | None = None

    @property
    def latent_t(self) -> int:
        return 0 if self.latent is None else int(self.latent.shape[2])

    @property
    def pixel_frames(self) -> int:
        """Pixel frames the guide covers: 1 for an image or an audio-only guide, sum of (1,4,4,4,4)[k % 5] over
        its latent frames for a clip (17k+5 for core's 5k+2 clips)."""
        return max(1, sum(FRAME_PER_TOKEN[k % 5] for k in range(self.latent_t)))


@dataclass(frozen=True)
class Ref:
    """A reference block (kind image / video / video_audio / audio); see the module docstring for shapes.

    latent_t is 1 for an image and 0 for audio; latent_h / latent_w are 0 for audio; ref_audio_t is 0 for an
    image. latent is None for audio; audio_latent is None for images and silent videos.
    """

    kind: str
    latent: torch.Tensor | None = None
    audio_latent: torch.Tensor | None = None
    latent_t: int = 0
    latent_h: int = 0
    latent_w: int = 0
    ref_audio_t: int = 0
    picture_index: int | None = None

    @property
    def time_span(self) -> float:
        """Span on the shared time axis ahead of the targets: 1 (image), ref_audio_t (audio), and for a video
        max(ref_audio_t, sum of 5/3 * (1,4,4,4,4)[k % 5] over its latent frames)."""
        if self.kind == "image":
            return 1.0
        if self.kind == "audio":
            return float(self.ref_audio_t)
        video = sum(FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(self.latent_t))
        return max(float(self.ref_audio_t), video)


@dataclass(frozen=True)
class ControlHint:
    """The payload's ``control``: the hint latent of a Fun ControlNet and how it is applied (core's
    ``MiniMaxH3FunControlNetApply`` inputs after apply time). hint [1, C, T, H, W] float32, C = 24 or 49."""

    hint: torch.Tensor
    strength: float = 1.0
    sigma_start: float = 1.0
    sigma_end: float = 0.0
    fade_in_frames: int = 0
    fade_out_frames: int = 0

    def active(self, sigma: float) -> bool:
        """Core's window, both ends inclusive: ``sigma_end <= sigma <= sigma_start``."""
        return self.sigma_end <= float(sigma) <= self.sigma_start


@dataclass(frozen=True)
class H3Conditioning:
    """One evaluation's conditioning beyond the text; defaults are core's (no conditioning at all)."""

    keyframes: tuple[Keyframe, ...] = ()
    refs: tuple[Ref, ...] = ()
    denoise_mask: torch.Tensor | None = None
    audio_denoise_mask: torch.Tensor | None = None
    sample_sigmas: torch.Tensor | None = None
    visual_cond_noise_aug: float = VISUAL_COND_NOISE_AUG
    audio_cond_noise_aug: float = AUDIO_COND_NOISE_AUG
    seed: int = 0
    control: ControlHint | None = None
    # picture_index of each text-encoder-only reference image (core's MiniMaxH3TextEncoderOnlyReference: Qwen sees
    # it as a <Picture i>, the DiT does not; None where the payload gave no index). Nothing of the DiT reads them.
    text_only_pictures: tuple = ()
    # True: the condition latents already carry their noise augmentation (diffusers' H3 pipeline noises its keyframes
    # itself, from the request's generator): their rows are packed as given, and still run at max(t, aug)
    augmented: bool = False

    # -- fit with the target ---------------------------------------------------------------------
    def check_target(self, video_shape, audio_shape, video_channels: int, audio_channels: int) -> "H3Conditioning":
        """Check the fit with the target latents ``video_shape`` [1, C, T, H, W] and ``audio_shape`` [1, Ca, 2, Ta]
        and the model's channels: keyframe grids and frame indices, ref channels, mask shapes. Returns self."""
        _, _, t, h, w = (int(v) for v in video_shape)
        ta = int(audio_shape[-1])
        frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(t))
        for i, kf in enumerate(self.keyframes):
            _check_keyframe(f"keyframes[{i}]", kf, (t, h, w), ta, frames, video_channels, audio_channels)
        for i, r in enumerate(self.refs):
            if r.latent is not None and r.latent.shape[1] != video_channels:
                raise field_error(f"refs[{i}].latent", f"{video_channels} channels (the model's video latent)",
                                  list(r.latent.shape))
            if r.audio_latent is not None and r.audio_latent.shape[1] != audio_channels:
                raise field_error(f"refs[{i}].audio_latent", f"{audio_channels} channels (the model's audio latent)",
                                  list(r.audio_latent.shape))
        if self.denoise_mask is not None and tuple(self.denoise_mask.shape[2:]) != (t, h, w):
            raise field_error("denoise_mask", f"[1, 1, {t}, {h}, {w}] (the target video latent's T, H, W)",
                              list(self.denoise_mask.shape))
        if self.audio_denoise_mask is not None and self.audio_denoise_mask.shape[-1] != ta:
            raise field_error("audio_denoise_mask", f"[1, 1, 2, {ta}] (the target audio latent's Ta)",
                              list(self.audio_denoise_mask.shape))
        if self.control is not None and tuple(self.control.hint.shape[2:]) != (t, h, w):
            raise field_error("control.hint",
                              f"[1, 24 or 49, {t}, {h}, {w}] (the target video latent's T, H, W, unpadded)",
                              list(self.control.hint.shape), "encode the control video at the target's size")
        return self

    # -- what the packed sequence gets -------------------------------------------------------------
    @property
    def cond_video_latents(self) -> list[torch.Tensor]:
        """Visual condition latents in packing order: keyframes first, then refs (core's order)."""
        return ([k.latent for k in self.keyframes if k.latent is not None]
                + [r.latent for r in self.refs if r.latent is not None])

    @property
    def cond_audio_latents(self) -> list[torch.Tensor]:
        """Audio condition latents in packing order: keyframes first, then refs (core's order)."""
        return ([k.audio_latent for k in self.keyframes if k.audio_latent is not None]
                + [r.audio_latent for r in self.refs if r.audio_latent is not None])

    @property
    def is_empty(self) -> bool:
        """True when the evaluation is plain t2va (no condition rows, masks or head schedule)."""
        return not (self.keyframes or self.refs or self.denoise_mask is not None
                    or self.audio_denoise_mask is not None)


# ---------------------------------------------------------------------------------------------
# core's mask semantics
# ---------------------------------------------------------------------------------------------

def video_token_grid(mask: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, H, W] -> core's token-grid mask [1, 1, T, H, W] float32: amax over each 2x2 DiT patch (H / W padded
    by replication to even first), broadcast back to the latent pixels, quantised to ceil(256 * m) / 256."""
    m = mask.float()
    h, w = m.shape[-2:]
    p = torch.nn.functional.pad(m[0], (0, w % 2, 0, h % 2), mode="replicate")  # [1, T, H', W']
    p = p.reshape(p.shape[0], p.shape[1], p.shape[2] // 2, 2, p.shape[3] // 2, 2).amax(dim=(3, 5))
    p = p.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)[..., :h, :w]
    return (torch.ceil(p * MASK_QUANT) / MASK_QUANT)[None]


def pool_video_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """[1, 1, T, H, W] -> core's token-grid mask (``video_token_grid``), or None when nothing is kept: its minimum
    is >= 1 - 1e-3 (core drops the mask then: no per-row timesteps, no velocity scaling). Idempotent."""
    if mask is None:
        return None
    p = video_token_grid(mask)
    return None if float(p.amin()) >= MASK_FULL else p


def pool_audio_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """[1, C, 2, Ta] (C = 1 or the latent's channels) -> core's [1, 1, 2, Ta] float32 (amax over channels, i.e.
    per stereo latent frame; ceil(256 * m) / 256), or None when its minimum is >= 1 - 1e-3."""
    if mask is None:
        return None
    p = torch.ceil(mask.float().amax(dim=1, keepdim=True) * MASK_QUANT) / MASK_QUANT
    return None if float(p.amin()) >= MASK_FULL else p


# ---------------------------------------------------------------------------------------------
# the fit of a keyframe
# ---------------------------------------------------------------------------------------------

def check_field_shape(path: str, t: torch.Tensor, expected: str, ok: bool) -> None:
    """Raise the field's ConditioningError naming ``t``'s shape unless ``ok``."""
    if not ok:
        raise field_error(path, expected, f"shape {list(t.shape)}")


def _check_keyframe(path: str, kf: Keyframe, thw, ta: int, frames: int, vc: int, ac: int) -> None:
    t, h, w = thw
    idx = kf.resolved_frame_index
    if kf.latent is not None:
        lat = kf.latent
        check_field_shape(f"{path}.latent", lat, f"[1, {vc}, t, {h}, {w}] (the target's channels, H and W)",
                          lat.shape[1] == vc and tuple(lat.shape[3:]) == (h, w))
        if h % 2 or w % 2:
            raise field_error(f"{path}.latent", "an even latent height and width (core patchifies keyframes unpadded)",
                              f"shape {list(lat.shape)}", "use a canvas that is a multiple of 32 pixels")
    if idx + kf.pixel_frames > frames:
        what = "frame" if kf.pixel_frames == 1 else f"{kf.pixel_frames}-frame clip"
        raise field_error(f"{path}.resolved_frame_index", f"a {what} that fits in the target's {frames} frames "
                          f"(index <= {frames - kf.pixel_frames})", idx)
    if kf.audio_latent is not None:
        if kf.audio_latent.shape[1] != ac:
            raise field_error(f"{path}.audio_latent", f"{ac} channels (the model's audio latent)",
                              list(kf.audio_latent.shape))
        room = math.floor(ta - FRAME_RESCALE * idx)
        if room < 1:
            raise field_error(f"{path}.resolved_frame_index",
                              f"a frame that leaves audio to anchor: floor({ta} - 5/3 * index) >= 1 for the "
                              f"target's {ta} audio frames", f"{idx} (leaves {room})")
