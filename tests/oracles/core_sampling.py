"""Float64 euler sampling as ComfyUI core runs an H3 graph (KSampler / SamplerCustomAdvanced with cfg 1), with the
core_h3 oracle as the model. Torch only; written from core's rules, not from the runtime:

- noise: one CPU generator seeded ``seed`` draws the video noise, then the audio noise (float32)
- ``ModelSamplingAV``: the audio is carried as y = audio_scale * x_audio (audio_scale = shift_v / shift_a) at
  sigma 0; the model sees x_audio = y * sigma_a / sigma_v (sigma_v: core's fp32 timestep round trip) and its
  audio velocity becomes ``(1 - scale) * x_audio + (1 + (scale - 1) * sigma_a) * v_audio``
- start ``sigma0 * noise + (1 - sigma0) * latent``; denoised ``x - sigma * v``; euler
  ``x += (x - denoised) / sigma * (sigma_next - sigma)``
- ``KSamplerX0Inpaint`` + ``MiniMaxH3.scale_latent_inpaint`` with raw masks m (broadcast over channels):
  injected video ``0.999 * latent + 0.001 * noise``, audio ``latent_carried * (sigma_v / sigma_a) / scale``
  (sigma_v = max(sigma, 1e-6)); blended toward x by clamp((g - m) / max(1 - m, 1e-6), 0, 1) where m < 1
  (g: the token-grid mask); model input ``x * m + injected * (1 - m)``; denoised ``den * m + latent * (1 - m)``
"""

from __future__ import annotations

import torch

import core_h3 as o

F64 = torch.float64


def _grid_video(m: torch.Tensor) -> torch.Tensor:
    g = o.pooled_video_mask(m)
    return torch.ones_like(m, dtype=F64) if g is None else g


def _grid_audio(m: torch.Tensor) -> torch.Tensor:
    g = o.pooled_audio_mask(m)
    return torch.ones_like(m, dtype=F64) if g is None else g


def _weight(g, m):
    w = ((g - m) / (1.0 - m).clamp(min=1e-6)).clamp(0.0, 1.0)
    return torch.where(m < 1.0, w, torch.zeros_like(w))


def core_sample_euler(sd, video0, audio0, text_states, token_tags, payload, seed, sigmas, shifts=(12.0, 3.0)):
    """-> (video, audio) float64 after euler over ``sigmas`` (the full schedule, trailing 0 included)."""
    scale = shifts[0] / shifts[1]
    gen = torch.Generator("cpu").manual_seed(int(seed))
    nv = torch.randn(tuple(video0.shape), generator=gen, dtype=torch.float32).to(F64)
    na = torch.randn(tuple(audio0.shape), generator=gen, dtype=torch.float32).to(F64)
    lat_v, lat_a = video0.to(F64), audio0.to(F64) * scale
    s0 = float(sigmas[0])
    xv, xa = s0 * nv + (1 - s0) * lat_v, s0 * na + (1 - s0) * lat_a
    mv, ma = payload.get("denoise_mask"), payload.get("audio_denoise_mask")
    masked = mv is not None or ma is not None
    if masked:
        mv = torch.ones(1, 1, *video0.shape[2:], dtype=F64) if mv is None else mv.to(F64)
        ma = torch.ones(1, 1, *audio0.shape[2:], dtype=F64) if ma is None else ma.to(F64)
        wv, wa = _weight(_grid_video(mv), mv), _weight(_grid_audio(ma), ma)
    for i in range(len(sigmas) - 1):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        iv, ia = xv, xa
        if masked:
            sv = max(s, 1e-6)
            inj_v = 0.999 * lat_v + 0.001 * nv
            inj_a = lat_a * ((sv / o.time_shift(sv, *shifts)) / scale)
            inj_v = inj_v + wv * (xv - inj_v)
            inj_a = inj_a + wa * (xa - inj_a)
            iv, ia = xv * mv + inj_v * (1 - mv), xa * ma + inj_a * (1 - ma)
        sm = o.core_sigma(s)
        sa = o.time_shift(sm, *shifts)
        own_a = ia * (sa / sm)
        v, a = o.core_forward(sd, iv, own_a, text_states, s, token_tags=token_tags, payload=payload, shifts=shifts)
        va = (1 - scale) * own_a + (1 + (scale - 1) * sa) * a
        dv, da = iv - v * s, ia - va * s
        if masked:
            dv, da = dv * mv + lat_v * (1 - mv), da * ma + lat_a * (1 - ma)
        xv = xv + (xv - dv) / s * (s_next - s)
        xa = xa + (xa - da) / s * (s_next - s)
    return xv, xa / scale
