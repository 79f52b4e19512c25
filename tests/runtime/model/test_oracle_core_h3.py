"""Checks of the core-semantics oracle (tests/oracles/core_h3.py) that need no ComfyUI: values worked out by hand
from core's rules (h3-comfyui-facts.md sections 1-3 and 10), and the runtime's layout / heads / condition rows
against the oracle's independent versions. (check_core.py compares the oracle with core's own code.)"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))

import core_h3 as o  # noqa: E402

from h3_blackwell.runtime.model.cond_rows import condition_rows  # noqa: E402
from h3_blackwell.runtime.model.conditioning import Ref  # noqa: E402
from h3_blackwell.runtime.io.payload import conditioning_from_payload  # noqa: E402
from h3_blackwell.runtime.model.h3 import pdd_head_weights, pdd_span  # noqa: E402
from h3_blackwell.runtime.model.layout import KeyframeSpec, build_layout  # noqa: E402


def _mini_ref2va_positions():
    """text 2 | image ref 2x2 latent | audio ref (2 frames) | keyframe at pixel frame 3 | target 2 frames of
    2x4 latent, 2 audio frames; worked out by hand."""
    h_coord = (1 - 2 / math.sqrt(8)) / 2 * 32           # one patch row, ratio 2/sqrt(8)
    r = 4 / math.sqrt(8)
    w0, w1 = ((1 - r) / 2) * 32, (r / 2 + (1 - r) / 2) * 32   # two patch columns, ratio 4/sqrt(8)
    origin = 2 + 1 + 2                                  # text + image span 1 + audio span 2
    kf = origin + 5 / 3 * 3
    return [
        (0, 0, 0), (1, 0, 0),                                         # text
        (kf, h_coord, w0), (kf, h_coord, w1),                         # keyframe (cond) on the target grid
        (2, 0, 0),                                                    # image ref: t = its start, 1x1 patch grid
        (3, 0, w0), (4, 0, w0), (3, 0, w1), (4, 0, w1),               # audio ref: target w extremes
        (origin, 0, w0), (origin + 1, 0, w0), (origin, 0, w1), (origin + 1, 0, w1),   # target audio
        (origin, h_coord, w0), (origin, h_coord, w1),                 # target video frame 0
        (origin + 5 / 3, h_coord, w0), (origin + 5 / 3, h_coord, w1),  # frame 1 (+5/3 * 1)
    ]


def _mini_payload():
    return {"keyframes": [{"resolved_frame_index": 3, "latent": torch.randn(1, 24, 1, 2, 4)}],
            "refs": [{"kind": "image", "latent_h": 2, "latent_w": 2, "latent": torch.randn(1, 24, 1, 2, 2)},
                     {"kind": "audio", "ref_audio_t": 2, "audio_latent": torch.randn(1, 32, 2, 2)}]}


def test_oracle_positions_by_hand():
    rows = o.build_rows(2, None, torch.zeros(1, 24, 2, 2, 4), torch.zeros(1, 32, 2, 2), _mini_payload())
    expect = _mini_ref2va_positions()
    assert rows.kind == ["text"] * 2 + ["cond"] * 2 + ["ref_img"] + ["ref_audio"] * 4 + ["audio"] * 4 + ["video"] * 4
    assert rows.tag == [1, 1, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0]
    assert torch.allclose(torch.tensor(rows.pos, dtype=torch.float64), torch.tensor(expect, dtype=torch.float64),
                          atol=1e-12, rtol=0)


def test_runtime_layout_matches_hand_positions():
    c = conditioning_from_payload(_mini_payload())
    lay = build_layout(2, 2, 2, 4, 2, [KeyframeSpec(3, 1)], c.refs)
    assert [k for _, _, k in lay.segments] == ["text", "cond", "ref_img", "ref_audio", "audio", "video"]
    assert torch.allclose(lay.position_ids, torch.tensor(_mini_ref2va_positions(), dtype=torch.float64),
                          atol=1e-12, rtol=0)


def test_video_ref_soundtrack_takes_its_own_grid_and_span():
    """A video ref: soundtrack rows first, w at ITS grid's extremes; span max(ref_audio_t, 5/3*(1+4))."""
    ref = Ref("video_audio", latent_t=2, latent_h=2, latent_w=8, ref_audio_t=3)
    lay = build_layout(1, 2, 2, 2, 1, refs=[ref])
    assert [k for _, _, k in lay.segments] == ["text", "ref_audio", "ref_img", "audio", "video"]
    r = 8 / 4.0
    ws = [(i * r / 4 + (1 - r) / 2) * 32 for i in range(4)]
    a, b = lay.segment("ref_audio")
    assert lay.position_ids[a:b, 2].tolist() == [ws[0]] * 3 + [ws[-1]] * 3
    assert lay.position_ids[a:b, 0].tolist() == [1.0, 2.0, 3.0] * 2
    va, _ = lay.segment("video")
    assert lay.position_ids[va, 0].item() == 1 + 25 / 3


def test_mask_pooling_by_hand():
    m = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 1.0], [0.7, 0.0, 0.25]]).view(1, 1, 1, 3, 3)
    p = o.pooled_video_mask(m)[0, 0, 0]
    q = lambda v: math.ceil(v * 256) / 256  # noqa: E731
    expect = torch.tensor([[q(0.5), q(0.5), 1.0], [q(0.5), q(0.5), 1.0], [q(0.7), q(0.7), 0.25]], dtype=torch.float64)
    assert torch.equal(p, expect)
    assert o.pooled_video_mask(torch.ones(1, 1, 2, 2, 2)) is None
    a = o.pooled_audio_mask(torch.tensor([[[[0.0, 0.3]], [[0.2, 0.1]]]]).expand(1, 2, 2, 2))
    assert a.shape == (1, 1, 2, 2) and a[0, 0, 0].tolist() == [0.203125, q(0.3)]


def test_masked_row_times_by_hand():
    rows = o.Rows()
    rows.add("video", [(0, 0, 0)] * 3, 0, None)
    vmask = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64).view(1, 1, 1, 1, 3).repeat_interleave(2, -1)
    vmask = vmask.repeat_interleave(2, -2)
    t = o.row_times(rows, 0.4, (12.0, 3.0), {}, vmask, None)
    assert t == [0.999, 1 - 0.5 * 0.4, 1 - 0.4]  # kept rows pin at the cond timestep


def test_pdd_by_hand_and_runtime():
    w = torch.arange(3 * 2 * 4, dtype=torch.float64).view(6, 4)   # n = 3 heads of 2 rows
    b = torch.arange(6, dtype=torch.float64)
    # no shift: dt = 1/3 each; span [0, 3): block 0 + (1/3) block 1 + (1/3) block 2
    wt, bt = o.pdd_weight(w, b, 3, 0, 3, 1.0)
    assert torch.allclose(wt, w[:2] + (w[2:4] + w[4:]) / 3) and torch.allclose(bt, b[:2] + (b[2:4] + b[4:]) / 3)
    # span [1, 3) under shift 1: weights 1/2, 1/2
    wt, _ = o.pdd_weight(w, b, 3, 1, 3, 1.0)
    assert torch.allclose(wt, w[:2] + (w[2:4] + w[4:]) / 2)
    for start, stop, shift in ((0, 3, 1.0), (1, 3, 12.0), (2, 3, 3.0), (0, 1, 12.0)):
        rw, rb = pdd_head_weights(w, b, 3, start, stop, shift)
        ow, ob = o.pdd_weight(w, b, 3, start, stop, shift)
        assert torch.allclose(rw, ow) and torch.allclose(rb, ob)
    sched = [1.0, 0.93, 0.8, 0.55, 0.3, 0.0]
    for s in sched[:-1]:
        assert pdd_span(s, sched[sched.index(s) + 1], 8, 12.0) == o.pdd_span(s, sched, 8, 12.0)
    # sigma 1 -> 0.93 under shift 12: base 0.525 -> round(0.475 * 8) = 4
    assert o.pdd_span(1.0, sched, 8, 12.0) == (0, 4)


def test_condition_noise_is_seeded_per_block_like_core():
    g = torch.Generator().manual_seed(0)
    k0, r0 = torch.randn(1, 24, 1, 2, 4, generator=g), torch.randn(1, 24, 1, 2, 4, generator=g)
    au = torch.randn(1, 32, 2, 3, generator=g)
    payload = {"keyframes": [{"resolved_frame_index": 0, "latent": k0}],
               "refs": [{"kind": "image", "latent_h": 2, "latent_w": 4, "latent": r0},
                        {"kind": "audio", "ref_audio_t": 3, "audio_latent": au}],
               "visual_cond_noise_aug": 0.9, "audio_cond_noise_aug": 0.8, "seed": 77}
    vis, aud = condition_rows(conditioning_from_payload(payload))
    noise_v = torch.randn(2, 96, generator=torch.Generator().manual_seed(77))
    noise_a = torch.randn(6, 32, generator=torch.Generator().manual_seed(78))
    assert torch.allclose(vis[:2], 0.9 * o.video_rows(k0).float() + 0.1 * noise_v)
    assert torch.allclose(vis[2:], 0.9 * o.video_rows(r0).float() + 0.1 * noise_v)  # restarted per block
    assert torch.allclose(aud, 0.8 * o.audio_rows(au).float() + 0.2 * noise_a)
    rows = o.build_rows(0, None, torch.zeros(1, 24, 2, 2, 4), torch.zeros(1, 32, 2, 2), payload)
    assert torch.allclose(torch.cat([f for k, f in rows.parts if k in ("cond", "ref_img")]).float(), vis)
