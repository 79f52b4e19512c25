"""What an H3Conditioning puts into the packed sequence: condition rows, layout specs, mask rows.

- condition rows (ComfyUI core's ``_cond_video_rows`` / ``_cond_audio_rows`` semantics): every visual
  condition latent (keyframes first, then references, in list order) is patchified as is (no padding) to
  rows [n, C*4]; when ``visual_cond_noise_aug`` < 1 the rows become ``aug * rows + (1 - aug) * noise`` with
  noise = ``torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(seed))`` (float32), the
  generator restarted for every latent. Audio condition latents likewise (channel-major rows [2*ta, Ca]) with
  ``audio_cond_noise_aug`` and ``seed + 1``. The noise is drawn on the CPU, so it is the same on every device.
  A conditioning marked ``augmented`` (its latents noised already: diffusers' pipeline) gets no noise here.
- mask rows: the pooled denoise mask's value for every target row (one per 2x2 patch, rows t, h, w; one per
  stereo audio frame, channel-major).
"""

from __future__ import annotations

import torch

from .conditioning import H3Conditioning
from .layout import KeyframeSpec, pack_audio, patchify_video


def keyframe_specs(cond: H3Conditioning) -> list[KeyframeSpec]:
    """Layout specs of the keyframes, in order."""
    return [KeyframeSpec(k.resolved_frame_index, k.latent_t,
                         0 if k.audio_latent is None else int(k.audio_latent.shape[3])) for k in cond.keyframes]


def _augment(rows: torch.Tensor, aug: float, seed: int) -> torch.Tensor:
    if aug >= 1.0:
        return rows
    noise = torch.randn(tuple(rows.shape), generator=torch.Generator("cpu").manual_seed(int(seed)),
                        dtype=torch.float32)
    return aug * rows + (1.0 - aug) * noise


def condition_rows(cond: H3Conditioning) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(visual rows [Nv, C*4], audio rows [Na, Ca]) float32 on the CPU in packing order, noise-augmented as core;
    None where there are none."""
    vis_aug, aud_aug = (1.0, 1.0) if cond.augmented else (cond.visual_cond_noise_aug, cond.audio_cond_noise_aug)
    vis = [_augment(patchify_video(z.float()), vis_aug, cond.seed) for z in cond.cond_video_latents]
    aud = [_augment(pack_audio(z.float()), aud_aug, cond.seed + 1) for z in cond.cond_audio_latents]
    return (torch.cat(vis) if vis else None), (torch.cat(aud) if aud else None)


def video_mask_rows(pooled: torch.Tensor | None) -> torch.Tensor | None:
    """Pooled video mask [1, 1, T, H, W] (``conditioning.pool_video_mask``) -> [T * ceil(H/2) * ceil(W/2)] float32:
    one value per patch row (the value of the patch's top-left pixel; pooling made the patch uniform)."""
    if pooled is None:
        return None
    return pooled[0, 0, :, ::2, ::2].reshape(-1).float()


def audio_mask_rows(pooled: torch.Tensor | None) -> torch.Tensor | None:
    """Pooled audio mask [1, 1, 2, Ta] -> [2 * Ta] float32 in the rows' channel-major order."""
    if pooled is None:
        return None
    return pooled[0, 0].reshape(-1).float()
