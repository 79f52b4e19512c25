"""Core's conditioning payload (its JSON form, tensors by key) and the request files that carry it: the parser
(:func:`conditioning_from_payload`) and its inverse, the ``--inputs`` safetensors and the ``--payload`` JSON.

Field names are core's (the entries of the ``minimax_payload`` that ``comfy/model_base.py::MiniMaxH3.extra_conds``
builds from the nodes of ``comfy_extras/nodes_minimax_h3.py``); a payload that core's nodes produce is accepted
unchanged. What the fields mean, their tensors' shapes and their fit with the target: ``runtime.model.conditioning``
(H3Conditioning).

Payload (JSON object; every field optional, defaults are core's)::

    {"keyframes": [{"resolved_frame_index": int, "latent": key|null, "audio_latent": key|null}],
     "refs": [{"kind": "image", "picture_index": int, "latent_h": int, "latent_w": int, "latent": key},
              {"kind": "image", "picture_index": int},   # text-encoder-only: Qwen's <Picture i>, not the DiT's
              {"kind": "video"|"video_audio", "latent_t": int, "latent_h": int, "latent_w": int,
               "ref_audio_t": int, "latent": key, "audio_latent": key|null},
              {"kind": "audio", "ref_audio_t": int, "audio_latent": key}],
     "denoise_mask": key|null, "audio_denoise_mask": key|null, "sample_sigmas": key|null,
     "visual_cond_noise_aug": 0.999, "audio_cond_noise_aug": 1.0, "seed": 0,
     "control": {"hint": key, "strength": 1.0, "sigma_start": 1.0, "sigma_end": 0.0,
                 "fade_in_frames": 0, "fade_out_frames": 0}}

A ``key`` names a tensor of the accompanying tensor mapping (the ``--inputs`` safetensors); a value may also
be a ``torch.Tensor`` itself, so a node can hand core's in-memory dicts straight to ``conditioning_from_payload``.

The ``--inputs`` file also holds the evaluation's own tensors (``video``, ``audio``, ``text_states``, optional
``token_tags``; ``sigma`` for ``forward``); what they must be is checked by the job (``runtime.job``) against
the model's config.

Unknown fields are refused (nothing is silently dropped). Every error is a ``ConditioningError`` whose
message starts with the field path (``refs[1].audio_latent``) and says what was expected and found.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..errors import H3Error
from ..model.conditioning import (CONTROL_HINT_CHANNELS, MAX_FADE_FRAMES, REF_KINDS, AUDIO_COND_NOISE_AUG,
                                  VISUAL_COND_NOISE_AUG, ControlHint, H3Conditioning, Keyframe, Ref,
                                  check_field_shape, field_error)
from .header import read_tensors
from .strict_json import load_object

_TOP_FIELDS = ("keyframes", "refs", "denoise_mask", "audio_denoise_mask", "sample_sigmas",
               "visual_cond_noise_aug", "audio_cond_noise_aug", "seed", "control")
_CONTROL_FIELDS = ("hint", "strength", "sigma_start", "sigma_end", "fade_in_frames", "fade_out_frames")
_KEYFRAME_FIELDS = ("resolved_frame_index", "latent", "audio_latent")
_REF_FIELDS = {
    "image": ("kind", "picture_index", "latent_h", "latent_w", "latent"),
    "video": ("kind", "latent_t", "latent_h", "latent_w", "ref_audio_t", "latent", "audio_latent"),
    "video_audio": ("kind", "latent_t", "latent_h", "latent_w", "ref_audio_t", "latent", "audio_latent"),
    "audio": ("kind", "ref_audio_t", "audio_latent"),
}


class PayloadError(H3Error):
    """The inputs or payload file cannot be read (the message names the file and what to do)."""


def read_inputs(path: str, need: list[str], what: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; ``need`` must be among them (``what`` describes them for the error)."""
    hdr, tensors = read_tensors(path, "inputs file")  # the checked header: every extent, shape and dtype
    missing = [k for k in need if k not in hdr.tensors]
    if missing:
        raise PayloadError(f"{path}: missing {missing}; expected {what}")
    return tensors


def load_payload(path: str | None, tensors: dict[str, torch.Tensor], default_seed: int | None = None
                 ) -> H3Conditioning:
    """Parse and validate ``path`` (None: no conditioning) against the inputs' tensors; a payload without ``seed``
    takes ``default_seed`` when given (core's default 0 otherwise)."""
    if path is None:
        return H3Conditioning(seed=0 if default_seed is None else int(default_seed))
    # strictly one object: null, duplicate keys, NaN constants and runaway nesting are refused naming the file
    data = load_object(path, "payload file", "an object with core's fields (keyframes, refs, denoise_mask, ...)")
    if "seed" not in data and default_seed is not None:
        data["seed"] = int(default_seed)
    return conditioning_from_payload(data, tensors)


def check_control_args(control: str | None, cond: H3Conditioning) -> None:
    """``--control FILE`` and the payload's ``control`` field come together (the file is the tower, the field its
    hint and settings); either alone is refused."""
    if control is not None and cond.control is None:
        raise PayloadError(f"--control {control}: expected the payload's control field (hint, strength, sigma_start, "
                           "sigma_end, fade_in_frames, fade_out_frames); found none; add it to --payload or drop "
                           "--control")
    if control is None and cond.control is not None:
        raise PayloadError("payload field control: expected --control CONTROL.safetensors (the Fun ControlNet the "
                           "hint is for); found no --control; pass the tower or drop the field")


# ---------------------------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------------------------

def conditioning_from_payload(payload: Mapping[str, Any] | None,
                              tensors: Mapping[str, torch.Tensor] | None = None) -> H3Conditioning:
    """Validate a payload (see the module docstring) and resolve its tensor keys in ``tensors``.

    Checks every field's type, range and shape on its own; ``check_target`` then checks the fit with the
    target latents and the model. Raises ConditioningError naming the field.
    """
    payload = {} if payload is None else payload
    if not isinstance(payload, Mapping):
        raise field_error("payload", "a JSON object", type(payload).__name__)
    _no_unknown("payload", payload, _TOP_FIELDS)
    res = _Resolver(tensors or {})
    keyframes = tuple(_keyframe(f"keyframes[{i}]", kf, res)
                      for i, kf in enumerate(_list("keyframes", payload.get("keyframes"))))
    refs, text_only = [], []
    for i, r in enumerate(_list("refs", payload.get("refs"))):
        if _is_text_only(r):
            text_only.append(_text_only(f"refs[{i}]", r))
        else:
            refs.append(_ref(f"refs[{i}]", r, res))
    cond = H3Conditioning(
        keyframes=keyframes, refs=tuple(refs), text_only_pictures=tuple(text_only),
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
    if cond.seed == _SEED_MAX and cond.audio_cond_noise_aug < 1.0 and cond.cond_audio_latents:
        raise field_error("seed", "an integer below 2^64 - 1 here: the audio condition rows are noise-augmented "
                                  "with seed + 1 (as core's)", cond.seed)
    return cond


def conditioning_to_payload(cond: H3Conditioning) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON-able payload, tensors by key): the inverse of ``conditioning_from_payload`` (keys like
    ``refs.1.latent``)."""
    tensors: dict[str, torch.Tensor] = {}

    def put(key, t):
        if t is None:
            return None
        tensors[key] = t.contiguous()
        return key

    kfs = [{"resolved_frame_index": k.resolved_frame_index, "latent": put(f"keyframes.{i}.latent", k.latent),
            "audio_latent": put(f"keyframes.{i}.audio_latent", k.audio_latent)}
           for i, k in enumerate(cond.keyframes)]
    refs = []
    for i, r in enumerate(cond.refs):
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
    refs += [{"kind": "image"} if p is None else {"kind": "image", "picture_index": p} for p in cond.text_only_pictures]
    payload = {"keyframes": kfs, "refs": refs,
               "denoise_mask": put("denoise_mask", cond.denoise_mask),
               "audio_denoise_mask": put("audio_denoise_mask", cond.audio_denoise_mask),
               "sample_sigmas": put("sample_sigmas", cond.sample_sigmas),
               "visual_cond_noise_aug": cond.visual_cond_noise_aug,
               "audio_cond_noise_aug": cond.audio_cond_noise_aug, "seed": cond.seed}
    c = cond.control
    if c is not None:
        payload["control"] = {"hint": put("control.hint", c.hint), "strength": c.strength,
                              "sigma_start": c.sigma_start, "sigma_end": c.sigma_end,
                              "fade_in_frames": c.fade_in_frames, "fade_out_frames": c.fade_out_frames}
    return payload, tensors


class _Resolver:
    """Resolves ``key`` strings to tensors; a tensor value passes through."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.done: dict[int, tuple] = {}  # id(source) -> (source, checked float32): a tensor named N times once

    def tensor(self, path: str, value: Any, optional: bool) -> torch.Tensor | None:
        if value is None:
            if optional:
                return None
            raise field_error(path, "a tensor key", "null")
        if isinstance(value, torch.Tensor):
            t = value
        elif isinstance(value, str):
            if value not in self.tensors:
                names = sorted(self.tensors)
                raise field_error(path, f"a key of the inputs file ({', '.join(names[:12]) or 'none'}"
                                        f"{', ...' if len(names) > 12 else ''})", repr(value),
                                  "add the tensor to --inputs or fix the key")
            t = self.tensors[value]
        else:
            raise field_error(path, "a tensor key (string) or null", f"{type(value).__name__} {value!r}")
        if id(t) in self.done:
            return self.done[id(t)][1]
        if not t.is_floating_point():
            raise field_error(path, "a floating-point tensor", str(t.dtype))
        f32 = t.detach().to("cpu", torch.float32)  # any float dtype (fp8, fp16, bf16, fp64) is taken as float32
        if not bool(torch.isfinite(f32).all()):
            raise field_error(path, "finite values (in float32)", "NaN or inf")
        self.done[id(t)] = (t, f32)
        return f32

    def get(self, path: str, value: Any) -> torch.Tensor | None:
        return self.tensor(path, value, optional=True)


def _no_unknown(path: str, d: Mapping, known) -> None:
    extra = [k for k in d if k not in known]
    if extra:
        raise field_error(f"{path}.{extra[0]}" if path != "payload" else extra[0],
                          f"one of the fields {', '.join(known)}", f"unknown field {extra[0]!r}",
                          "remove it or check its spelling")


def _list(path: str, value: Any) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise field_error(path, "a list", type(value).__name__)
    for i, v in enumerate(value):
        if not isinstance(v, Mapping):
            raise field_error(f"{path}[{i}]", "an object", type(v).__name__)
    return list(value)


def _int(path: str, value: Any, lo: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point()):
            raise field_error(path, "an integer", f"{type(value).__name__} {value!r}")
        value = int(value)
    if lo is not None and value < lo:
        raise field_error(path, f"an integer >= {lo}", value)
    return int(value)


def _unit(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise field_error(path, "a number in [0, 1]", f"{type(value).__name__} {value!r}")
    if not 0.0 <= value <= 1.0:
        raise field_error(path, "a number in [0, 1]", value)
    return float(value)


_SEED_MAX = 2 ** 64 - 1  # torch.Generator.manual_seed's range is [-2^63, 2^64 - 1]; ComfyUI's widget ends there


def _seed(value: Any) -> int:
    s = _int("seed", value)
    if not -(2 ** 63) <= s <= _SEED_MAX:
        raise field_error("seed", "an integer in [-2^63, 2^64 - 1] (a CPU generator seed)", s)
    return s


def _video_latent(path: str, t: torch.Tensor) -> torch.Tensor:
    check_field_shape(path, t, "a video latent [1, C, t, H, W]", t.dim() == 5 and t.shape[0] == 1 and t.numel() > 0)
    return t


def _audio_latent(path: str, t: torch.Tensor) -> torch.Tensor:
    check_field_shape(path, t, "an audio latent [1, Ca, 2, ta] with ta >= 1",
                      t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == 2 and t.shape[3] >= 1 and t.shape[1] >= 1)
    return t


def _keyframe(path: str, kf: Mapping, res: _Resolver) -> Keyframe:
    _no_unknown(path, kf, _KEYFRAME_FIELDS)
    if "resolved_frame_index" not in kf:
        raise field_error(f"{path}.resolved_frame_index", "an integer >= 0", "nothing (the field is missing)")
    idx = _int(f"{path}.resolved_frame_index", kf["resolved_frame_index"], lo=0)
    lat = res.get(f"{path}.latent", kf.get("latent"))
    aud = res.get(f"{path}.audio_latent", kf.get("audio_latent"))
    if lat is None and aud is None:
        raise field_error(path, "a latent, an audio_latent or both", "neither", "drop the keyframe or give it a latent")
    if lat is not None:
        _video_latent(f"{path}.latent", lat)
    if aud is not None:
        _audio_latent(f"{path}.audio_latent", aud)
    return Keyframe(idx, lat, aud)


def _ref(path: str, r: Mapping, res: _Resolver) -> Ref:
    kind = r.get("kind")
    if kind not in REF_KINDS:
        raise field_error(f"{path}.kind", f"one of {', '.join(REF_KINDS)}", repr(kind))
    _no_unknown(path, r, _REF_FIELDS[kind])
    if kind == "audio":
        rt = _int(f"{path}.ref_audio_t", r.get("ref_audio_t"), lo=1)
        aud = _audio_latent(f"{path}.audio_latent", res.tensor(f"{path}.audio_latent", r.get("audio_latent"), False))
        check_field_shape(f"{path}.audio_latent", aud, f"[1, Ca, 2, {rt}] (ref_audio_t = {rt})", aud.shape[3] == rt)
        return Ref(kind, None, aud, ref_audio_t=rt)
    lat = _video_latent(f"{path}.latent", res.tensor(f"{path}.latent", r.get("latent"), False))
    lt = 1 if kind == "image" else _int(f"{path}.latent_t", r.get("latent_t"), lo=1)
    lh = _int(f"{path}.latent_h", r.get("latent_h"), lo=2)
    lw = _int(f"{path}.latent_w", r.get("latent_w"), lo=2)
    for name, v in (("latent_h", lh), ("latent_w", lw)):
        if v % 2:
            raise field_error(f"{path}.{name}",
                              "an even number of latent pixels (image pixels / 16, a multiple of 32 px)", v,
                              "resize the reference to a multiple of 32 pixels")
    check_field_shape(f"{path}.latent", lat, f"[1, C, {lt}, {lh}, {lw}] (latent_t, latent_h, latent_w)",
                      tuple(lat.shape[2:]) == (lt, lh, lw))
    if kind == "image":
        pic = r.get("picture_index")
        pic = None if pic is None else _int(f"{path}.picture_index", pic, lo=0)
        return Ref(kind, lat, None, 1, lh, lw, 0, pic)
    rt = _int(f"{path}.ref_audio_t", r.get("ref_audio_t", 0), lo=0)
    aud = res.get(f"{path}.audio_latent", r.get("audio_latent"))
    if aud is None and rt:
        raise field_error(f"{path}.audio_latent", f"an audio latent [1, Ca, 2, {rt}] (ref_audio_t = {rt})", "null",
                          "give the soundtrack's latent or set ref_audio_t to 0")
    if aud is not None:
        _audio_latent(f"{path}.audio_latent", aud)
        check_field_shape(f"{path}.audio_latent", aud, f"[1, Ca, 2, {rt}] (ref_audio_t = {rt})", aud.shape[3] == rt)
    return Ref(kind, lat, aud, lt, lh, lw, rt)


def _is_text_only(r: Mapping) -> bool:
    """An image reference with no latent and no latent size: a text-encoder-only reference (core's
    MiniMaxH3TextEncoderOnlyReference; its ReferenceToVideo leaves it out of the DiT's refs)."""
    return r.get("kind") == "image" and all(r.get(k) is None for k in ("latent", "latent_h", "latent_w"))


def _text_only(path: str, r: Mapping) -> int | None:
    _no_unknown(path, r, ("kind", "picture_index"))
    pic = r.get("picture_index")
    return None if pic is None else _int(f"{path}.picture_index", pic, lo=0)


def _number(path: str, value: Any, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise field_error(path, "a finite number", f"{type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise field_error(path, f"a number >= {lo}", value)
    return float(value)


def _control(c: Any, res: _Resolver) -> ControlHint | None:
    if c is None:
        return None
    if not isinstance(c, Mapping):
        raise field_error("control",
                          "an object {hint, strength, sigma_start, sigma_end, fade_in_frames, fade_out_frames}",
                          type(c).__name__)
    _no_unknown("control", c, _CONTROL_FIELDS)
    hint = res.tensor("control.hint", c.get("hint"), optional=False)
    check_field_shape("control.hint", hint, f"a control latent [1, C, T, H, W] with C in {CONTROL_HINT_CHANNELS} "
                      "(24: the control video; 49: control | visibility | masked source)",
                      hint.dim() == 5 and hint.shape[0] == 1 and hint.shape[1] in CONTROL_HINT_CHANNELS
                      and hint.numel() > 0)
    fades = []
    for name in ("fade_in_frames", "fade_out_frames"):
        f = _int(f"control.{name}", c.get(name, 0), lo=0)
        if f > MAX_FADE_FRAMES:
            raise field_error(f"control.{name}", f"an integer in [0, {MAX_FADE_FRAMES}] (core's range)", f)
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
    check_field_shape(path, t, f"a mask {want}", ok)
    if float(t.amin()) < 0.0 or float(t.amax()) > 1.0:
        raise field_error(path, "values in [0, 1] (1 = generate, 0 = keep)",
                          f"values in [{float(t.amin()):.4g}, {float(t.amax()):.4g}]")
    return t


def _sigmas(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dim() != 1 or t.numel() < 2:
        raise field_error("sample_sigmas", "a 1-D schedule [N + 1] (N >= 1 steps, trailing 0 included)",
                          f"shape {list(t.shape)}")
    if float(t[-1]) != 0.0 or float(t.amin()) < 0.0:
        raise field_error("sample_sigmas", "sigmas >= 0 ending with the trailing 0 (the full schedule)",
                          f"{[round(float(v), 6) for v in t[-3:]]} at the end")
    up = torch.nonzero(t[1:] > t[:-1])
    if up.numel():
        i = int(up[0, 0])
        raise field_error("sample_sigmas", "a non-increasing schedule (each sigma <= the one before, ending with 0)",
                          f"{float(t[i]):.6g} then {float(t[i + 1]):.6g} at indices {i}, {i + 1}",
                          "pass the sampler's sigmas in step order")
    return t
