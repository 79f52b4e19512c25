"""Tiny Fun ControlNet cases (issue 25's acceptance cases plus masked rows), shared by tests/runtime/model/test_control.py and
check_core_control.py. Torch only. A case: video, audio, text_states, token_tags, sigma, base ("full" / "curve"),
places (the tower's control_blocks_places), payload (core's fields, tensors in place), control (the payload's
control field: hint, strength, sigma_start, sigma_end, fades)."""

from __future__ import annotations

import torch

TEXT_DIM = 64
CURVE_GRID = 33


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _target(g, t=7, h=4, w=6, ta=37, text_len=6):
    return (torch.randn(1, 24, t, h, w, generator=g), torch.randn(1, 32, 2, ta, generator=g),
            torch.randn(1, text_len, TEXT_DIM, generator=g), torch.tensor([1, 0, 0, 0, 1, 1][:text_len]))


def f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def make_cases():
    cases = {}
    g = _g(1)
    v, a, x, tg = _target(g)
    cases["hint24_keyframes"] = dict(
        video=v, audio=a, text_states=x, token_tags=tg, sigma=0.8, base="full", places=(0, 2), payload={
            "keyframes": [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)},
                          {"resolved_frame_index": 21, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)}],
            "seed": 7},
        control={"hint": torch.randn(1, 24, 7, 4, 6, generator=g), "strength": 0.7, "sigma_start": 0.9956,
                 "sigma_end": 0.75, "fade_in_frames": 0, "fade_out_frames": 0})

    g = _g(2)
    v, a, x, tg = _target(g, t=2, h=5, w=7, ta=8, text_len=5)
    hint = torch.randn(1, 49, 2, 5, 7, generator=g)
    hint[:, 24] = (torch.rand(1, 2, 5, 7, generator=g) > 0.5).float()  # a visibility channel
    cases["inpaint49_refs_odd"] = dict(
        video=v, audio=a, text_states=x, token_tags=tg, sigma=0.55, base="full", places=(0, 1, 2), payload={
            "refs": [{"kind": "image", "picture_index": 0, "latent_h": 4, "latent_w": 2,
                      "latent": torch.randn(1, 24, 1, 4, 2, generator=g)},
                     {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 5,
                      "latent": torch.randn(1, 24, 2, 2, 4, generator=g),
                      "audio_latent": torch.randn(1, 32, 2, 5, generator=g)},
                     {"kind": "audio", "ref_audio_t": 3, "audio_latent": torch.randn(1, 32, 2, 3, generator=g)}],
            "seed": 3},
        control={"hint": hint, "strength": 1.0, "sigma_start": 1.0, "sigma_end": 0.0})

    g = _g(3)
    v, a, x, tg = _target(g)
    cases["narrow_window_fades"] = dict(
        video=v, audio=a, text_states=x, token_tags=tg, sigma=0.55, base="full", places=(0, 2), payload={},
        control={"hint": torch.randn(1, 24, 7, 4, 6, generator=g), "strength": 2.5, "sigma_start": 0.5501,
                 "sigma_end": 0.5499, "fade_in_frames": 3, "fade_out_frames": 6})

    g = _g(4)
    v, a, x, tg = _target(g)
    cases["curve_at_sigma_start"] = dict(
        video=v, audio=a, text_states=x, token_tags=tg, sigma=0.93, base="curve", places=(0, 1), payload={
            "keyframes": [{"resolved_frame_index": 9, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)}]},
        control={"hint": torch.randn(1, 24, 7, 4, 6, generator=g), "strength": 0.8, "sigma_start": f32(0.93),
                 "sigma_end": 0.5, "fade_in_frames": 1, "fade_out_frames": 1})

    g = _g(5)
    v, a, x, tg = _target(g)
    cases["outside_window"] = dict(
        video=v, audio=a, text_states=x, token_tags=tg, sigma=0.3, base="full", places=(0, 2), payload={},
        control={"hint": torch.randn(1, 24, 7, 4, 6, generator=g), "strength": 1.0, "sigma_start": 0.9,
                 "sigma_end": 0.5})

    g = _g(6)
    v, a, x, tg = _target(g, t=2, h=4, w=6, ta=8)
    m = torch.rand(1, 1, 2, 4, 6, generator=g)
    m[..., :2, :] = 0.0
    am = torch.ones(1, 1, 2, 8)
    am[..., :3] = 0.0
    cases["masked_rows"] = dict(
        video=v, audio=a, text_states=x, token_tags=tg, sigma=0.8, base="full", places=(0, 2),
        payload={"denoise_mask": m, "audio_denoise_mask": am},
        control={"hint": torch.randn(1, 49, 2, 4, 6, generator=g), "strength": 1.3, "sigma_start": 0.9,
                 "sigma_end": 0.1})
    return cases
