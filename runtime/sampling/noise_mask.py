"""A LATENT's ``noise_mask`` (SetLatentNoiseMask and friends) -> per-stream denoise masks, as ComfyUI core's
sampler makes them for the nested H3 latent.

Core (``comfy/samplers.py`` ``CFGGuider.sample`` with ``comfy.sampler_helpers.prepare_mask``): a nested mask
gives one mask per stream; a plain mask is the video stream's, and the audio stream is generated whole. Each
mask is resized to its stream's latent shape by linear interpolation: a mask with fewer than 5 dimensions is
read as ``[frames, H, W]`` (leading dimensions become the frame axis) and resized trilinearly to the video's
``(T, H, W)``; an audio mask is read as ``[N, C, h, w]`` and resized bilinearly to ``(2, Ta)``
(``align_corners=False``, core's ``torch.nn.functional.interpolate`` defaults). The runtime's conditioning then
pools them to DiT tokens (``runtime.model.conditioning.pool_video_mask`` / ``pool_audio_mask``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import H3Error


def video_denoise_mask(mask: torch.Tensor, video_shape) -> torch.Tensor:
    """mask [..., h, w] (any leading dims, read as frames) or [N, C, f, h, w] -> [1, 1, T, H, W] float32 for the
    video latent ``video_shape`` [1, C, T, H, W]; channels beyond the first are folded by max."""
    t, h, w = (int(v) for v in video_shape[2:])
    m = mask.detach().to("cpu", torch.float32)
    if m.dim() < 2:
        raise H3Error(f"noise_mask must be at least [H, W]; found shape {list(m.shape)}")
    if m.dim() < 5:
        m = m.reshape(1, 1, -1, m.shape[-2], m.shape[-1])
    out = F.interpolate(m, size=(t, h, w), mode="trilinear")
    return out[:1].amax(dim=1, keepdim=True)


def audio_denoise_mask(mask: torch.Tensor, audio_shape) -> torch.Tensor:
    """mask [..., h, w] (read as [N, 1, h, w] when it has fewer than 4 dims) or [N, C, h, w] -> [1, 1, 2, Ta]
    float32 for the audio latent ``audio_shape`` [1, Ca, 2, Ta]; channels beyond the first are folded by max."""
    ta = int(audio_shape[-1])
    m = mask.detach().to("cpu", torch.float32)
    if m.dim() < 2 or m.dim() > 4:
        raise H3Error(f"an audio noise_mask must be [..., 2, Ta] with at most 4 dimensions; found shape "
                      f"{list(m.shape)}")
    if m.dim() < 4:
        m = m.reshape(-1, 1, m.shape[-2], m.shape[-1])
    out = F.interpolate(m, size=(int(audio_shape[2]), ta), mode="bilinear")
    return out[:1].amax(dim=1, keepdim=True)
