"""The H3 audio+video LATENT, in ComfyUI core's format or this pack's fallback, and the H3 Empty Latent node.

Core's format (ComfyUI with MiniMax H3 support, ``comfy/nested_tensor.py`` present)::

    {"samples": comfy.nested_tensor.NestedTensor((video [1, 24, T, H/16, W/16], audio [1, 32, 2, Ta]))}

float32, on ``model_management.intermediate_device()``. ``VAEDecode`` takes ``unbind()[0]``,
``VAEDecodeAudio`` ``unbind()[-1]``.

Fallback (a ComfyUI without ``comfy.nested_tensor``, e.g. releases before core H3 support)::

    {"samples": video [1, 24, T, H/16, W/16], "h3_audio": audio [1, 32, 2, Ta]}

``samples`` stays a plain tensor, so generic latent nodes (save, preview, copy) keep working on the video
stream, and the audio rides beside it under a key that only this pack reads. Such a latent flows between
this pack's nodes only: an older core has no H3 VAE to decode it anyway.

Every H3 node accepts both forms as input and outputs core's form whenever the running ComfyUI has it.
"""

from __future__ import annotations

import operator

import torch

from ..runtime import (MAX_NOISE_INDEX, H3Error, audio_denoise_mask, audio_frames, latent_frames, snap_frames,
                       video_denoise_mask)
from ._common import CATEGORY, intermediate_device, node_error, optional_comfy_module

VIDEO_CHANNELS = 24
AUDIO_CHANNELS = 32
AUDIO_KEY = "h3_audio"  # the fallback form's audio stream


def nested_tensor_class():
    """core's ``comfy.nested_tensor.NestedTensor``, or None when the running ComfyUI predates it."""
    mod = optional_comfy_module("comfy.nested_tensor")
    return getattr(mod, "NestedTensor", None) if mod is not None else None


def make_latent(video: torch.Tensor, audio: torch.Tensor) -> dict:
    """(video [1, 24, T, H, W], audio [1, 32, 2, Ta]) -> a LATENT dict: core's nested form when available."""
    dev = intermediate_device()
    video = video.to(device=dev, dtype=torch.float32)
    audio = audio.to(device=dev, dtype=torch.float32)
    nested = nested_tensor_class()
    if nested is not None:
        return {"samples": nested((video, audio))}
    return {"samples": video, AUDIO_KEY: audio}


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)} ({str(x.dtype).replace('torch.', '')})"
    if getattr(x, "is_nested", False) and hasattr(x, "tensors"):
        return "a nested latent of " + ", ".join(_describe(t) for t in x.tensors)
    return f"a {type(x).__name__}"


def read_latent(latent, title: str, video_channels: int = VIDEO_CHANNELS,
                audio_channels: int = AUDIO_CHANNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """A LATENT (core's nested form or the fallback) -> (video [1, C, T, H, W], audio [1, Ca, 2, Ta]).

    Raises H3NodeError naming what was found when the latent is not an H3 audio+video latent of batch 1.
    """
    what = (f"an H3 audio+video LATENT (video [1, {video_channels}, T, H, W] + audio [1, {audio_channels}, 2, Ta]) "
            "from EmptyMiniMaxH3LatentAV, MiniMaxH3ImageToVideo or H3 Empty Latent")
    if not isinstance(latent, dict) or "samples" not in latent:
        raise node_error(title, f"expected {what}; got {_describe(latent)} without a 'samples' entry")
    samples = latent["samples"]
    if isinstance(samples, torch.Tensor) and not samples.is_nested:
        if AUDIO_KEY not in latent:
            raise node_error(title, f"expected {what}; got {_describe(samples)}, which is an image or video-only "
                                    "latent, not an H3 audio+video latent")
        video, audio = samples, latent[AUDIO_KEY]
    elif getattr(samples, "is_nested", False) and hasattr(samples, "tensors"):
        tensors = list(samples.tensors)
        if len(tensors) != 2:
            raise node_error(title, f"expected {what}; got a nested latent with {len(tensors)} streams")
        video, audio = tensors
    else:
        raise node_error(title, f"expected {what}; got {_describe(samples)}")
    if not isinstance(video, torch.Tensor) or video.dim() != 5 or video.shape[1] != video_channels:
        raise node_error(title, f"expected {what}; its video stream is {_describe(video)}")
    if not isinstance(audio, torch.Tensor) or audio.dim() != 4 or audio.shape[1] != audio_channels \
            or audio.shape[2] != 2:
        raise node_error(title, f"expected {what}; its audio stream is {_describe(audio)}")
    if video.shape[0] != 1 or audio.shape[0] != 1:
        raise node_error(title, f"H3 samples one clip at a time (batch 1); the latent has batch "
                                f"{video.shape[0]} (video) / {audio.shape[0]} (audio). Remove the batching node "
                                "(RepeatLatentBatch, LatentBatch), or run one clip per prompt and vary the seed")
    return video, audio


def _indices(inds) -> list[int]:
    """A batch_index as core's batch nodes write it (a list of ints; or an int array / tensor) -> ints; ValueError
    for anything else (booleans, floats, strings, mappings)."""
    if isinstance(inds, (list, tuple)):
        values = list(inds)
    elif hasattr(inds, "reshape") and hasattr(inds, "tolist") and hasattr(inds, "dtype"):  # numpy / torch
        values = inds.reshape(-1).tolist()
    else:
        raise ValueError
    if any(isinstance(v, bool) or type(v).__name__ == "bool_" for v in values):
        raise ValueError
    try:
        return [operator.index(v) for v in values]  # int and numpy integers; floats and the rest raise
    except TypeError:
        raise ValueError from None


def batch_index_of(latent: dict, title: str) -> int:
    """The noise entry of a one-clip latent: its ``batch_index`` [k] -> k (none: 0). Core's sampler draws the noise
    of batch entry k as the k-th draw of its generator per stream (``comfy.sample.prepare_noise``), so a latent tagged
    [k] by LatentFromBatch or LatentBatchSeedBehavior gets that noise here too. Refused: not one integer per clip,
    or outside [0, MAX_NOISE_INDEX]."""
    inds = latent.get("batch_index") if isinstance(latent, dict) else None
    if inds is None:
        return 0
    try:
        values = _indices(inds)
    except ValueError:
        raise node_error(title, f"the latent's batch_index must be a list of integers; got {inds!r}") from None
    if len(values) != 1:
        raise node_error(title, f"the latent's batch_index is {values}: expected one index for its one clip. "
                                "Remove the node that set it, or use LatentFromBatch to pick one clip")
    if not 0 <= values[0] <= MAX_NOISE_INDEX:
        raise node_error(title, f"the latent's batch_index is {values}: expected an index in [0, {MAX_NOISE_INDEX}] "
                                "(the noise of batch entry k is drawn after k entries of every stream). Remove the "
                                "node that set it and vary the seed instead")
    return values[0]


def sampled_latent(video: torch.Tensor, audio: torch.Tensor, given: dict) -> dict:
    """The sampler's output LATENT as core's KSampler makes it: the input latent's other entries (``batch_index``,
    ``noise_mask``) kept, the samples replaced (``make_latent``)."""
    out = {k: v for k, v in given.items() if k not in ("samples", AUDIO_KEY, "downscale_ratio_spacial",
                                                        "downscale_ratio_temporal")}
    out.update(make_latent(video, audio))
    return out


def read_noise_mask(latent: dict, video_shape, audio_shape, title: str
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The latent's ``noise_mask`` (SetLatentNoiseMask: [B, 1, H, W] for the video; or core's nested form, one
    mask per stream) -> (video mask [1, 1, T, H, W] | None, audio mask [1, 1, 2, Ta] | None) at latent
    resolution, resized as core's sampler does (``runtime.sampling.noise_mask``). A plain mask leaves the audio
    fully generated (None), as in core. 1 = generate, 0 = keep the input latent."""
    mask = latent.get("noise_mask")
    if mask is None:
        return None, None
    if getattr(mask, "is_nested", False) and hasattr(mask, "tensors"):
        streams = list(mask.tensors)
    elif isinstance(mask, torch.Tensor):
        streams = [mask]
    else:
        raise node_error(title, f"noise_mask must be a MASK tensor or core's nested mask; got {_describe(mask)}")
    if not streams or len(streams) > 2 or not all(isinstance(m, torch.Tensor) for m in streams):
        raise node_error(title, f"noise_mask: expected one mask per stream (video, audio); got {_describe(mask)}")
    try:
        video_mask = video_denoise_mask(streams[0], video_shape)
        audio_mask = audio_denoise_mask(streams[1], audio_shape) if len(streams) == 2 else None
    except (H3Error, RuntimeError) as e:
        raise node_error(title, f"noise_mask {_describe(mask)} cannot be fitted to the latent ({e})") from e
    return video_mask, audio_mask


def pixel_frames(latent_t: int) -> int | None:
    """Latent frames (5k+2) -> pixel frames (17k+5); None off that grid."""
    if latent_t == 2:
        return 5
    if latent_t < 2 or (latent_t - 2) % 5:
        return None
    return 5 + (latent_t - 2) // 5 * 17


class H3EmptyLatent:
    """Zeros in the H3 audio+video layout for a canvas and a frame count (t2va), like core's
    EmptyMiniMaxH3LatentAV, but it refuses frame counts off the 17k+5 grid instead of snapping them."""

    TITLE = "H3 Empty Latent"
    DESCRIPTION = ("An empty H3 audio+video latent: video [1, 24, T, H/16, W/16] + audio [1, 32, 2, Ta] "
                   "(frames 17k+5 -> T = 5k+2, Ta = round(frames / 24 * 40)).")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("core's nested H3 latent when ComfyUI has it, else {'samples': video, 'h3_audio': audio}",)
    FUNCTION = "create"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "width": ("INT", {"default": 1344, "min": 32, "max": 8192, "step": 32,
                              "tooltip": "canvas width in pixels, a multiple of 32"}),
            "height": ("INT", {"default": 768, "min": 32, "max": 8192, "step": 32,
                               "tooltip": "canvas height in pixels, a multiple of 32"}),
            "frames": ("INT", {"default": 124, "min": 5, "max": 3600, "step": 17,
                               "tooltip": "pixel frames at 24 fps on the 17k+5 grid (5, 22, 39, ..., 124 = 5.2 s)"}),
        }}

    def create(self, width: int, height: int, frames: int):
        for name, v in (("width", width), ("height", height)):
            if v < 32 or v % 32:
                raise node_error(self.TITLE, f"{name}={v} must be a positive multiple of 32 "
                                             f"(nearest: {max(32, round(v / 32) * 32)})")
        if frames < 5 or (frames - 5) % 17:
            up = snap_frames(frames)
            down = up - 17 if up - 17 >= 5 else None
            hint = f"use {up}" + (f" or {down}" if down else "")
            raise node_error(self.TITLE, f"frames={frames} is not on H3's 17k+5 grid (5, 22, 39, ..., 124, ...): "
                                         f"{hint}")
        video = torch.zeros(1, VIDEO_CHANNELS, latent_frames(frames), height // 16, width // 16)
        audio = torch.zeros(1, AUDIO_CHANNELS, 2, audio_frames(frames))
        return (make_latent(video, audio),)
