"""Tiny conditioning cases shaped exactly like the outputs of core's H3 nodes (MiniMaxH3ImageToVideo,
MiniMaxH3AddGuide, MiniMaxH3ReferenceToVideo, SetLatentNoiseMask), shared by the oracle tests and
``check_core.py``. Torch only.

A case is a dict: video [1,24,T,H,W], audio [1,32,2,Ta], text_states [1,L,text_dim], token_tags [L], sigma,
payload (core's field names, tensors in place), and for PDD ``head_bank`` n.
"""

from __future__ import annotations

import torch

TEXT_DIM = 64  # the tiny configs' text width


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _target(g, t=7, h=4, w=6, ta=37, text_len=6):
    video = torch.randn(1, 24, t, h, w, generator=g)
    audio = torch.randn(1, 32, 2, ta, generator=g)
    text = torch.randn(1, text_len, TEXT_DIM, generator=g)
    tags = torch.tensor([1, 0, 0, 0, 1, 1][:text_len] + [1] * max(0, text_len - 6))
    return video, audio, text, tags


def make_cases() -> dict[str, dict]:
    """The acceptance cases of issue 15 plus a few that pin details (odd canvas, clip keyframe, curve form)."""
    cases = {}
    sched = torch.tensor([1.0, 0.93, 0.8, 0.55, 0.3, 0.0])

    g = _g(1)
    v, a, x, tg = _target(g)
    cases["fl2va_first_last"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.8, payload={
        "keyframes": [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)},
                      {"resolved_frame_index": 21, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)}],
        "seed": 440420})

    g = _g(2)
    v, a, x, tg = _target(g)
    cases["audio_guide"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.55, payload={
        "keyframes": [{"resolved_frame_index": 5, "audio_latent": torch.randn(1, 32, 2, 12, generator=g)}],
        "audio_cond_noise_aug": 0.9, "seed": 11})

    g = _g(3)
    v, a, x, tg = _target(g)
    cases["image_and_audio_guide"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.93, payload={
        "keyframes": [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)},
                      {"resolved_frame_index": 9, "latent": torch.randn(1, 24, 1, 4, 6, generator=g),
                       "audio_latent": torch.randn(1, 32, 2, 8, generator=g)}],
        "seed": 3})

    g = _g(4)
    v, a, x, tg = _target(g, text_len=9)
    cases["ref2va"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.3, payload={
        "refs": [{"kind": "image", "picture_index": 1, "latent_h": 4, "latent_w": 2,
                  "latent": torch.randn(1, 24, 1, 4, 2, generator=g)},
                 {"kind": "image", "picture_index": 2, "latent_h": 2, "latent_w": 6,
                  "latent": torch.randn(1, 24, 1, 2, 6, generator=g)},
                 {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 5,
                  "latent": torch.randn(1, 24, 2, 2, 4, generator=g),
                  "audio_latent": torch.randn(1, 32, 2, 5, generator=g)},
                 {"kind": "audio", "ref_audio_t": 3, "audio_latent": torch.randn(1, 32, 2, 3, generator=g)}],
        "seed": 5})

    g = _g(5)
    v, a, x, tg = _target(g, t=2, h=5, w=7, ta=8)
    m = torch.rand(1, 1, 2, 5, 7, generator=g)
    m[..., :2, :] = 0.0   # kept rows
    m[..., 4:, 4:] = 1.0  # fully generated rows
    cases["video_mask_partial"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.55,
                                       payload={"denoise_mask": m})

    g = _g(6)
    v, a, x, tg = _target(g)
    am = torch.ones(1, 1, 2, 37)
    am[..., :10] = 0.0
    am[..., 10:20] = torch.rand(1, 1, 2, 10, generator=g)
    cases["audio_mask"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.8,
                               payload={"audio_denoise_mask": am})

    g = _g(7)
    v, a, x, tg = _target(g)
    # n = 8 heads: sigma 0.93 -> 0.8 spans heads [4, 6) (two deltas, dt-weighted); sigma 1 -> 0.93 spans [0, 4)
    cases["pdd_mid_schedule"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=float(sched[1]),
                                     head_bank=8, payload={"sample_sigmas": sched})
    cases["pdd_first_step"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=float(sched[0]),
                                   head_bank=8, payload={"sample_sigmas": sched})

    g = _g(8)
    v, a, x, tg = _target(g)
    cases["clip_guide_and_video_ref"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.93, payload={
        "keyframes": [{"resolved_frame_index": 4, "latent": torch.randn(1, 24, 2, 4, 6, generator=g)}],
        "refs": [{"kind": "video", "latent_t": 7, "latent_h": 2, "latent_w": 2, "ref_audio_t": 0,
                  "latent": torch.randn(1, 24, 7, 2, 2, generator=g), "audio_latent": None}],
        "visual_cond_noise_aug": 0.95, "seed": 2 ** 40 + 3})

    g = _g(9)
    v, a, x, tg = _target(g)
    cases["curve_form_fl2va"] = dict(video=v, audio=a, text_states=x, token_tags=tg, sigma=0.3, curve=True, payload={
        "keyframes": [{"resolved_frame_index": 21, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)}]})
    return cases
