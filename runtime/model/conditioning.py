"""H3Conditioning: everything ComfyUI core's H3 graphs condition one model evaluation on, validated.

This module is the runtime's conditioning contract. Field names are core's (the entries of the
``minimax_payload`` that ``comfy/model_base.py::MiniMaxH3.extra_conds`` builds from the nodes of
``comfy_extras/nodes_minimax_h3.py``); a payload that core's nodes produce is accepted unchanged.

Payload (JSON object; every field optional, defaults are core's)::

    {"keyframes": [{"resolved_frame_index": int, "latent": key|null, "audio_latent": key|null}],
     "refs": [{"kind": "image", "picture_index": int, "latent_h": int, "latent_w": int, "latent": key},
              {"kind": "video"|"video_audio", "latent_t": int, "latent_h": int, "latent_w": int,
               "ref_audio_t": int, "latent": key, "audio_latent": key|null},
              {"kind": "audio", "ref_audio_t": int, "audio_latent": key}],
     "denoise_mask": key|null, "audio_denoise_mask": key|null, "sample_sigmas": key|null,
     "visual_cond_noise_aug": 0.999, "audio_cond_noise_aug": 1.0, "seed": 0,
     "control": {"hint": key, "strength": 1.0, "sigma_start": 1.0, "sigma_end": 0.0,
                 "fade_in_frames": 0, "fade_out_frames": 0}}

A ``key`` names a tensor of the accompanying tensor mapping (the ``--inputs`` safetensors); a value may also
be a ``torch.Tensor`` itself, so a node can hand core's in-memory dicts straight to ``from_payload``.

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

Unknown fields are refused (nothing is silently dropped). Every error is a ``ConditioningError`` whose
message starts with the field path (``refs[1].audio_latent``) and says what was expected and found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import H3Error

VISUAL_COND_NOISE_AUG = 0.999
AUDIO_COND_NOISE_AUG = 1.0
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0
REF_KINDS = ("image", "video", "video_audio", "audio")
MASK_QUANT = 256.0  # core quantises pooled masks to ceil(256 * m) / 256
MASK_FULL = 1.0 - 1e-3  # a mask whose minimum reaches this is "generate everything" and is dropped

_TOP_FIELDS = ("keyframes", "refs", "denoise_mask", "audio_denoise_mask", "sample_sigmas",
               "visual_cond_noise_aug", "audio_cond_noise_aug", "seed", "control")
_CONTROL_FIELDS = ("hint", "strength", "sigma_start", "sigma_end", "fade_in_frames", "fade_out_frames")
CONTROL_HINT_CHANNELS = (24, 49)  # the control video; control | visibility | masked source (inpaint)
MAX_FADE_FRAMES = 3600  # core's widget range
_KEYFRAME_FIELDS = ("resolved_frame_index", "latent", "audio_latent")
_REF_FIELDS = {
    "image": ("kind", "picture_index", "latent_h", "latent_w", "latent"),
    "video": ("kind", "latent_t", "latent_h", "latent_w", "ref_audio_t", "latent", "audio_latent"),
    "video_audio": ("kind", "latent_t", "latent_h", "latent_w", "ref_audio_t", "latent", "audio_latent"),
    "audio": ("kind", "ref_audio_t", "audio_latent"),
}


class ConditioningError(H3Error):
    """A conditioning payload that cannot be honoured; the message names the field first."""


def _err(path: str, expected: str, found: Any, todo: str = "") -> ConditioningError:
    found = str(found)
    if len(found) > 200:  # a hostile value (a list of a million numbers) must not become a megabyte error line
        found = found[:200] + f"... ({len(found):,} characters)"
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

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_payload(cls, payload: Mapping[str, Any] | None, tensors: Mapping[str, torch.Tensor] | None = None,
                     ) -> "H3Conditioning":
        """Validate a payload (see the module docstring) and resolve its tensor keys in ``tensors``.

        Checks every field's type, range and shape on its own; ``check_target`` then checks the fit with the
        target latents and the model. Raises ConditioningError naming the field.
        """
        payload = {} if payload is None else payload
        if not isinstance(payload, Mapping):
            raise _err("payload", "a JSON object", type(payload).__name__)
        _no_unknown("payload", payload, _TOP_FIELDS)
        res = _Resolver(tensors or {})
        keyframes = tuple(_keyframe(f"keyframes[{i}]", kf, res)
                          for i, kf in enumerate(_list("keyframes", payload.get("keyframes"))))
        refs = tuple(_ref(f"refs[{i}]", r, res) for i, r in enumerate(_list("refs", payload.get("refs"))))
        return cls(
            keyframes=keyframes, refs=refs,
            denoise_mask=_mask("denoise_mask", res.get("denoise_mask", payload.get("denoise_mask")), 5),
            audio_denoise_mask=_mask("audio_denoise_mask",
                                     res.get("audio_denoise_mask", payload.get("audio_denoise_mask")), 4),
            sample_sigmas=_sigmas(res.get("sample_sigmas", payload.get("sample_sigmas"))),
            visual_cond_noise_aug=_unit("visual_cond_noise_aug",
                                        payload.get("visual_cond_noise_aug", VISUAL_COND_NOISE_AUG)),
            audio_cond_noise_aug=_unit("audio_cond_noise_aug",
                                       payload.get("audio_cond_noise_aug", AUDIO_COND_NOISE_AUG)),
            seed=_seed(payload.get("seed", 0)),
            control=_control(payload.get("control"), res),
        )

    def to_payload(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON-able payload, tensors by key): the inverse of ``from_payload`` (keys like ``refs.1.latent``)."""
        tensors: dict[str, torch.Tensor] = {}

        def put(key, t):
            if t is None:
                return None
            tensors[key] = t.contiguous()
            return key

        kfs = [{"resolved_frame_index": k.resolved_frame_index, "latent": put(f"keyframes.{i}.latent", k.latent),
                "audio_latent": put(f"keyframes.{i}.audio_latent", k.audio_latent)}
               for i, k in enumerate(self.keyframes)]
        refs = []
        for i, r in enumerate(self.refs):
            d = {"kind": r.kind}
            if r.kind == "image":
                d.update(latent_h=r.latent_h, latent_w=r.latent_w, latent=put(f"refs.{i}.latent", r.latent))
                if r.picture_index is not None:
                    d["picture_index"] = r.picture_index
            elif r.kind == "audio":
                d.update(ref_audio_t=r.ref_audio_t, audio_latent=put(f"refs.{i}.audio_latent", r.audio_latent))
            else:
                d.update(latent_t=r.latent_t, latent_h=r.latent_h, latent_w=r.latent_w, ref_audio_t=r.ref_audio_t,
                         latent=put(f"refs.{i}.latent", r.latent),
                         audio_latent=put(f"refs.{i}.audio_latent", r.audio_latent))
            refs.append(d)
        payload = {"keyframes": kfs, "refs": refs,
                   "denoise_mask": put("denoise_mask", self.denoise_mask),
                   "audio_denoise_mask": put("audio_denoise_mask", self.audio_denoise_mask),
                   "sample_sigmas": put("sample_sigmas", self.sample_sigmas),
                   "visual_cond_noise_aug": self.visual_cond_noise_aug,
                   "audio_cond_noise_aug": self.audio_cond_noise_aug, "seed": self.seed}
        c = self.control
        if c is not None:
            payload["control"] = {"hint": put("control.hint", c.hint), "strength": c.strength,
                                  "sigma_start": c.sigma_start, "sigma_end": c.sigma_end,
                                  "fade_in_frames": c.fade_in_frames, "fade_out_frames": c.fade_out_frames}
        return payload, tensors

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
                raise _err(f"refs[{i}].latent", f"{video_channels} channels (the model's video latent)",
                           list(r.latent.shape))
            if r.audio_latent is not None and r.audio_latent.shape[1] != audio_channels:
                raise _err(f"refs[{i}].audio_latent", f"{audio_channels} channels (the model's audio latent)",
                           list(r.audio_latent.shape))
        if self.denoise_mask is not None and tuple(self.denoise_mask.shape[2:]) != (t, h, w):
            raise _err("denoise_mask", f"[1, 1, {t}, {h}, {w}] (the target video latent's T, H, W)",
                       list(self.denoise_mask.shape))
        if self.audio_denoise_mask is not None and self.audio_denoise_mask.shape[-1] != ta:
            raise _err("audio_denoise_mask", f"[1, 1, 2, {ta}] (the target audio latent's Ta)",
                       list(self.audio_denoise_mask.shape))
        if self.control is not None and tuple(self.control.hint.shape[2:]) != (t, h, w):
            raise _err("control.hint", f"[1, 24 or 49, {t}, {h}, {w}] (the target video latent's T, H, W, unpadded)",
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
# field validators
# ---------------------------------------------------------------------------------------------

class _Resolver:
    """Resolves ``key`` strings to tensors; a tensor value passes through."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def tensor(self, path: str, value: Any, optional: bool) -> torch.Tensor | None:
        if value is None:
            if optional:
                return None
            raise _err(path, "a tensor key", "null")
        if isinstance(value, torch.Tensor):
            t = value
        elif isinstance(value, str):
            if value not in self.tensors:
                names = sorted(self.tensors)
                raise _err(path, f"a key of the inputs file ({', '.join(names[:12]) or 'none'}"
                                 f"{', ...' if len(names) > 12 else ''})", repr(value),
                           "add the tensor to --inputs or fix the key")
            t = self.tensors[value]
        else:
            raise _err(path, "a tensor key (string) or null", f"{type(value).__name__} {value!r}")
        if not t.is_floating_point():
            raise _err(path, "a floating-point tensor", str(t.dtype))
        t = t.detach().to("cpu", torch.float32)  # any float dtype (fp8, fp16, bf16, fp64) is taken as float32
        if not bool(torch.isfinite(t).all()):
            raise _err(path, "finite values (in float32)", "NaN or inf")
        return t

    def get(self, path: str, value: Any) -> torch.Tensor | None:
        return self.tensor(path, value, optional=True)


def _no_unknown(path: str, d: Mapping, known) -> None:
    extra = [k for k in d if k not in known]
    if extra:
        raise _err(f"{path}.{extra[0]}" if path != "payload" else extra[0],
                   f"one of the fields {', '.join(known)}", f"unknown field {extra[0]!r}",
                   "remove it or check its spelling")


def _list(path: str, value: Any) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _err(path, "a list", type(value).__name__)
    for i, v in enumerate(value):
        if not isinstance(v, Mapping):
            raise _err(f"{path}[{i}]", "an object", type(v).__name__)
    return list(value)


def _int(path: str, value: Any, lo: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point()):
            raise _err(path, "an integer", f"{type(value).__name__} {value!r}")
        value = int(value)
    if lo is not None and value < lo:
        raise _err(path, f"an integer >= {lo}", value)
    return int(value)


def _unit(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _err(path, "a number in [0, 1]", f"{type(value).__name__} {value!r}")
    if not 0.0 <= value <= 1.0:
        raise _err(path, "a number in [0, 1]", value)
    return float(value)


def _seed(value: Any) -> int:
    s = _int("seed", value)
    if not -(2 ** 63) <= s < 2 ** 64 - 1:
        raise _err("seed", "an integer in [-2^63, 2^64 - 2] (a CPU generator seed; audio uses seed + 1)", s)
    return s


def _shape(path: str, t: torch.Tensor, expected: str, ok: bool) -> None:
    if not ok:
        raise _err(path, expected, f"shape {list(t.shape)}")


def _video_latent(path: str, t: torch.Tensor) -> torch.Tensor:
    _shape(path, t, "a video latent [1, C, t, H, W]", t.dim() == 5 and t.shape[0] == 1 and t.numel() > 0)
    return t


def _audio_latent(path: str, t: torch.Tensor) -> torch.Tensor:
    _shape(path, t, "an audio latent [1, Ca, 2, ta] with ta >= 1",
           t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == 2 and t.shape[3] >= 1 and t.shape[1] >= 1)
    return t


def _keyframe(path: str, kf: Mapping, res: _Resolver) -> Keyframe:
    _no_unknown(path, kf, _KEYFRAME_FIELDS)
    if "resolved_frame_index" not in kf:
        raise _err(f"{path}.resolved_frame_index", "an integer >= 0", "nothing (the field is missing)")
    idx = _int(f"{path}.resolved_frame_index", kf["resolved_frame_index"], lo=0)
    lat = res.get(f"{path}.latent", kf.get("latent"))
    aud = res.get(f"{path}.audio_latent", kf.get("audio_latent"))
    if lat is None and aud is None:
        raise _err(path, "a latent, an audio_latent or both", "neither", "drop the keyframe or give it a latent")
    if lat is not None:
        _video_latent(f"{path}.latent", lat)
    if aud is not None:
        _audio_latent(f"{path}.audio_latent", aud)
    return Keyframe(idx, lat, aud)


def _ref(path: str, r: Mapping, res: _Resolver) -> Ref:
    kind = r.get("kind")
    if kind not in REF_KINDS:
        raise _err(f"{path}.kind", f"one of {', '.join(REF_KINDS)}", repr(kind))
    _no_unknown(path, r, _REF_FIELDS[kind])
    if kind == "audio":
        rt = _int(f"{path}.ref_audio_t", r.get("ref_audio_t"), lo=1)
        aud = _audio_latent(f"{path}.audio_latent", res.tensor(f"{path}.audio_latent", r.get("audio_latent"), False))
        _shape(f"{path}.audio_latent", aud, f"[1, Ca, 2, {rt}] (ref_audio_t = {rt})", aud.shape[3] == rt)
        return Ref(kind, None, aud, ref_audio_t=rt)
    lat = _video_latent(f"{path}.latent", res.tensor(f"{path}.latent", r.get("latent"), False))
    lt = 1 if kind == "image" else _int(f"{path}.latent_t", r.get("latent_t"), lo=1)
    lh = _int(f"{path}.latent_h", r.get("latent_h"), lo=2)
    lw = _int(f"{path}.latent_w", r.get("latent_w"), lo=2)
    for name, v in (("latent_h", lh), ("latent_w", lw)):
        if v % 2:
            raise _err(f"{path}.{name}", "an even number of latent pixels (image pixels / 16, a multiple of 32 px)",
                       v, "resize the reference to a multiple of 32 pixels")
    _shape(f"{path}.latent", lat, f"[1, C, {lt}, {lh}, {lw}] (latent_t, latent_h, latent_w)",
           tuple(lat.shape[2:]) == (lt, lh, lw))
    if kind == "image":
        pic = r.get("picture_index")
        pic = None if pic is None else _int(f"{path}.picture_index", pic, lo=0)
        return Ref(kind, lat, None, 1, lh, lw, 0, pic)
    rt = _int(f"{path}.ref_audio_t", r.get("ref_audio_t", 0), lo=0)
    aud = res.get(f"{path}.audio_latent", r.get("audio_latent"))
    if aud is None and rt:
        raise _err(f"{path}.audio_latent", f"an audio latent [1, Ca, 2, {rt}] (ref_audio_t = {rt})", "null",
                   "give the soundtrack's latent or set ref_audio_t to 0")
    if aud is not None:
        _audio_latent(f"{path}.audio_latent", aud)
        _shape(f"{path}.audio_latent", aud, f"[1, Ca, 2, {rt}] (ref_audio_t = {rt})", aud.shape[3] == rt)
    return Ref(kind, lat, aud, lt, lh, lw, rt)


def _number(path: str, value: Any, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _err(path, "a finite number", f"{type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise _err(path, f"a number >= {lo}", value)
    return float(value)


def _control(c: Any, res: _Resolver) -> ControlHint | None:
    if c is None:
        return None
    if not isinstance(c, Mapping):
        raise _err("control", "an object {hint, strength, sigma_start, sigma_end, fade_in_frames, fade_out_frames}",
                   type(c).__name__)
    _no_unknown("control", c, _CONTROL_FIELDS)
    hint = res.tensor("control.hint", c.get("hint"), optional=False)
    _shape("control.hint", hint, f"a control latent [1, C, T, H, W] with C in {CONTROL_HINT_CHANNELS} (24: the "
           "control video; 49: control | visibility | masked source)",
           hint.dim() == 5 and hint.shape[0] == 1 and hint.shape[1] in CONTROL_HINT_CHANNELS and hint.numel() > 0)
    fades = []
    for name in ("fade_in_frames", "fade_out_frames"):
        f = _int(f"control.{name}", c.get(name, 0), lo=0)
        if f > MAX_FADE_FRAMES:
            raise _err(f"control.{name}", f"an integer in [0, {MAX_FADE_FRAMES}] (core's range)", f)
        fades.append(f)
    return ControlHint(hint, _number("control.strength", c.get("strength", 1.0), lo=0.0),
                       _number("control.sigma_start", c.get("sigma_start", 1.0), lo=0.0),
                       _number("control.sigma_end", c.get("sigma_end", 0.0), lo=0.0), *fades)


def _mask(path: str, t: torch.Tensor | None, dims: int) -> torch.Tensor | None:
    if t is None:
        return None
    want = "[1, 1, T, H, W]" if dims == 5 else "[1, 1, 2, Ta]"
    ok = t.dim() == dims and t.shape[0] == 1 and t.shape[1] == 1 and t.numel() > 0
    if dims == 4:
        ok = ok and t.shape[2] == 2
    _shape(path, t, f"a mask {want}", ok)
    if float(t.amin()) < 0.0 or float(t.amax()) > 1.0:
        raise _err(path, "values in [0, 1] (1 = generate, 0 = keep)",
                   f"values in [{float(t.amin()):.4g}, {float(t.amax()):.4g}]")
    return t


def _sigmas(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dim() != 1 or t.numel() < 2:
        raise _err("sample_sigmas", "a 1-D schedule [N + 1] (N >= 1 steps, trailing 0 included)",
                   f"shape {list(t.shape)}")
    if float(t[-1]) != 0.0 or float(t.amin()) < 0.0:
        raise _err("sample_sigmas", "sigmas >= 0 ending with the trailing 0 (the full schedule)",
                   f"{[round(float(v), 6) for v in t[-3:]]} at the end")
    up = torch.nonzero(t[1:] > t[:-1])
    if up.numel():
        i = int(up[0, 0])
        raise _err("sample_sigmas", "a non-increasing schedule (each sigma <= the one before, ending with 0)",
                   f"{float(t[i]):.6g} then {float(t[i + 1]):.6g} at indices {i}, {i + 1}",
                   "pass the sampler's sigmas in step order")
    return t


def _check_keyframe(path: str, kf: Keyframe, thw, ta: int, frames: int, vc: int, ac: int) -> None:
    t, h, w = thw
    idx = kf.resolved_frame_index
    if kf.latent is not None:
        lat = kf.latent
        _shape(f"{path}.latent", lat, f"[1, {vc}, t, {h}, {w}] (the target's channels, H and W)",
               lat.shape[1] == vc and tuple(lat.shape[3:]) == (h, w))
        if h % 2 or w % 2:
            raise _err(f"{path}.latent", "an even latent height and width (core patchifies keyframes unpadded)",
                       f"shape {list(lat.shape)}", "use a canvas that is a multiple of 32 pixels")
    if idx + kf.pixel_frames > frames:
        what = "frame" if kf.pixel_frames == 1 else f"{kf.pixel_frames}-frame clip"
        raise _err(f"{path}.resolved_frame_index", f"a {what} that fits in the target's {frames} frames "
                   f"(index <= {frames - kf.pixel_frames})", idx)
    if kf.audio_latent is not None:
        if kf.audio_latent.shape[1] != ac:
            raise _err(f"{path}.audio_latent", f"{ac} channels (the model's audio latent)",
                       list(kf.audio_latent.shape))
        room = math.floor(ta - FRAME_RESCALE * idx)
        if room < 1:
            raise _err(f"{path}.resolved_frame_index", f"a frame that leaves audio to anchor: floor({ta} - 5/3 * index) "
                       f">= 1 for the target's {ta} audio frames", f"{idx} (leaves {room})")
