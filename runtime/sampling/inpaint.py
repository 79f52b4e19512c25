"""Denoise masks in the sampling loop, as ComfyUI core runs them for the nested H3 latent.

Core (``comfy/samplers.py`` ``KSamplerX0Inpaint`` with ``MiniMaxH3.scale_latent_inpaint`` of
``comfy/model_base.py``), per model evaluation at sampler sigma s, in the sampler's carried space
(audio carried as y = audio_scale * x_audio at sigma 0):

- the kept content is injected at condition strength: video ``0.999 * clean + 0.001 * noise`` (the run's
  initial noise), audio ``clean_carried * (s / sigma_a(s)) / audio_scale`` (what the model sees as clean);
- where the pooled token-grid mask g exceeds the raw mask m (a partly kept patch), the injection leans toward
  the current x by ``w = clamp((g - m) / max(1 - m, 1e-6), 0, 1)`` (0 where m = 1);
- the model input is ``x * m + injected * (1 - m)``; the denoised output becomes ``den * m + clean * (1 - m)``.

Masks are the raw sampler masks (``H3Conditioning.denoise_mask`` [1, 1, T, H, W], ``audio_denoise_mask``
[1, 1, 2, Ta]; 1 = generate), broadcast over channels; a missing stream mask generates that stream whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.conditioning import MASK_QUANT, H3Conditioning, video_token_grid
from ..model.layout import VISUAL_COND_T, time_shift_sigma


def _blend_weight(grid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = (grid - mask) / (1.0 - mask).clamp(min=1e-6)
    return torch.where(mask < 1.0, w.clamp(0.0, 1.0), torch.zeros_like(w))


@dataclass
class Inpaint:
    """One run's masks and kept content (fp32, on the run's device); see the module docstring."""

    mask_v: torch.Tensor
    mask_a: torch.Tensor
    weight_v: torch.Tensor
    weight_a: torch.Tensor
    clean_v: torch.Tensor
    clean_a: torch.Tensor   # carried: audio_scale * x_audio
    noise_v: torch.Tensor

    @classmethod
    def build(cls, cond: H3Conditioning, video0, audio0, noise_v, scale: float, device) -> "Inpaint | None":
        """None when the conditioning has no denoise mask (nothing to inpaint)."""
        if cond.denoise_mask is None and cond.audio_denoise_mask is None:
            return None
        mv = torch.ones(1, 1, *video0.shape[2:]) if cond.denoise_mask is None else cond.denoise_mask.float()
        ma = torch.ones(1, 1, *audio0.shape[2:]) if cond.audio_denoise_mask is None else cond.audio_denoise_mask.float()
        gv = video_token_grid(mv)
        ga = torch.ceil(ma * MASK_QUANT) / MASK_QUANT
        d = dict(device=device, dtype=torch.float32)
        return cls(mv.to(**d), ma.to(**d), _blend_weight(gv, mv).to(**d), _blend_weight(ga, ma).to(**d),
                   video0.to(**d), (audio0 * scale).to(**d), noise_v.to(**d))

    def model_input(self, s: torch.Tensor, xv: torch.Tensor, y: torch.Tensor, shifts, scale: float):
        """(video, carried audio) the model sees at sampler sigma s."""
        inj_v = VISUAL_COND_T * self.clean_v + (1.0 - VISUAL_COND_T) * self.noise_v
        inj_a = self.clean_a
        if scale != 1.0:
            sv = s.float().clamp(min=1e-6)
            inj_a = self.clean_a * ((sv / time_shift_sigma(sv, shifts[0], shifts[1])) / scale)
        inj_v = inj_v + self.weight_v * (xv - inj_v)
        inj_a = inj_a + self.weight_a * (y - inj_a)
        return xv * self.mask_v + inj_v * (1.0 - self.mask_v), y * self.mask_a + inj_a * (1.0 - self.mask_a)

    def denoised(self, den_v: torch.Tensor, den_y: torch.Tensor):
        """The denoised (video, carried audio) with the kept content put back."""
        return (den_v * self.mask_v + self.clean_v * (1.0 - self.mask_v),
                den_y * self.mask_a + self.clean_a * (1.0 - self.mask_a))
