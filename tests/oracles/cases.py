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


FRAME_PER_TOKEN = (1, 4, 4, 4, 4)


def _ri(g, lo, hi):
    """Random int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _coin(g, p=0.5):
    return float(torch.rand(1, generator=g)) < p


def _raw_mask(g, shape):
    m = torch.rand(*shape, generator=g)
    m[m < 0.3] = 0.0
    m[m > 0.8] = 1.0
    return m


def random_case(seed: int) -> dict:
    """A random valid payload in the shapes core's nodes produce (and some they do not, but core's model takes):
    odd canvases, clips of any length, every ref kind, masks, PDD banks, curve form, any sigma."""
    g = _g(1000 + seed)
    t, ta, text_len = _ri(g, 1, 8), _ri(g, 2, 30), _ri(g, 1, 10)
    even = _coin(g, 0.7)
    h, w = (2 * _ri(g, 1, 3), 2 * _ri(g, 1, 4)) if even else (_ri(g, 1, 5), _ri(g, 1, 7))
    video, audio = torch.randn(1, 24, t, h, w, generator=g), torch.randn(1, 32, 2, ta, generator=g)
    text = torch.randn(1, text_len, TEXT_DIM, generator=g)
    tags = (torch.rand(text_len, generator=g) < 0.7).long()
    frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(t))
    payload, kfs, refs = {}, [], []
    for _ in range(_ri(g, 0, 3)):
        kt = 1 if _coin(g, 0.6) else _ri(g, 2, 7)
        kframes = sum(FRAME_PER_TOKEN[k % 5] for k in range(kt))
        with_video = even and kframes <= frames and _coin(g, 0.7)
        idx = _ri(g, 0, frames - (kframes if with_video else 1))
        kf = {"resolved_frame_index": idx}
        if with_video:
            kf["latent"] = torch.randn(1, 24, kt, h, w, generator=g)
        room = int(ta - 5 / 3 * idx)
        if room >= 1 and (not with_video or _coin(g, 0.5)):
            kf["audio_latent"] = torch.randn(1, 32, 2, _ri(g, 1, min(room, 12)), generator=g)
        if len(kf) > 1:
            kfs.append(kf)
    for i in range(_ri(g, 0, 4)):
        kind = ("image", "video", "video_audio", "audio")[_ri(g, 0, 3)]
        if kind == "audio":
            rt = _ri(g, 1, 8)
            refs.append({"kind": "audio", "ref_audio_t": rt, "audio_latent": torch.randn(1, 32, 2, rt, generator=g)})
            continue
        lh, lw = 2 * _ri(g, 1, 3), 2 * _ri(g, 1, 3)
        if kind == "image":
            refs.append({"kind": "image", "picture_index": i + 1, "latent_h": lh, "latent_w": lw,
                         "latent": torch.randn(1, 24, 1, lh, lw, generator=g)})
            continue
        lt = _ri(g, 1, 7)
        rt = _ri(g, 1, 12) if kind == "video_audio" else 0
        refs.append({"kind": kind, "latent_t": lt, "latent_h": lh, "latent_w": lw, "ref_audio_t": rt,
                     "latent": torch.randn(1, 24, lt, lh, lw, generator=g),
                     "audio_latent": torch.randn(1, 32, 2, rt, generator=g) if rt else None})
    if kfs:
        payload["keyframes"] = kfs
    if refs:
        payload["refs"] = refs
    if _coin(g, 0.35):
        payload["denoise_mask"] = _raw_mask(g, (1, 1, t, h, w))
    if _coin(g, 0.35):
        payload["audio_denoise_mask"] = _raw_mask(g, (1, 1, 2, ta))
    for key, choices in (("visual_cond_noise_aug", (0.999, 0.9, 1.0, 0.97)), ("audio_cond_noise_aug", (1.0, 0.8))):
        if _coin(g, 0.5):
            payload[key] = choices[_ri(g, 0, len(choices) - 1)]
    if _coin(g, 0.7):
        payload["seed"] = _ri(g, 0, 2 ** 31)
    case = dict(video=video, audio=audio, text_states=text, token_tags=tags, payload=payload,
                curve=_coin(g, 0.2))
    steps = _ri(g, 2, 8)
    sched = torch.cat([torch.sort(torch.rand(steps, generator=g), descending=True).values, torch.zeros(1)])
    sched[0] = 1.0
    case["sigma"] = float(sched[_ri(g, 0, steps - 1)]) if _coin(g, 0.7) else float(torch.rand(1, generator=g))
    if _coin(g, 0.3):
        case["head_bank"] = (2, 4, 8, 32)[_ri(g, 0, 3)]
        payload["sample_sigmas"] = sched
    return case


def sampling_case(masks: bool):
    """A guided run with a kept first stretch (video frames and audio) for the sampler checks: (video0, audio0,
    text_states, token_tags, payload)."""
    g = torch.Generator().manual_seed(21)
    video0, audio0 = torch.randn(1, 24, 7, 4, 6, generator=g), torch.randn(1, 32, 2, 37, generator=g)
    payload = {"keyframes": [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 6, generator=g),
                              "audio_latent": torch.randn(1, 32, 2, 9, generator=g)}],
               "refs": [{"kind": "image", "latent_h": 2, "latent_w": 4, "latent": torch.randn(1, 24, 1, 2, 4, generator=g)}],
               "visual_cond_noise_aug": 0.99, "seed": 5}
    if masks:
        m = torch.rand(1, 1, 7, 4, 6, generator=g)
        m[..., :3, :, :] = 0.0       # keep the first frames
        m[..., 5:, :2, :2] = 1.0
        am = torch.ones(1, 1, 2, 37)
        am[..., :12] = 0.0
        am[..., 12:16] = 0.5
        payload.update(denoise_mask=m, audio_denoise_mask=am)
    text = torch.randn(1, 6, TEXT_DIM, generator=g)
    return video0, audio0, text, torch.tensor([1, 0, 0, 1, 1, 1]), payload
