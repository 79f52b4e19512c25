"""The conditioning contract (runtime.model.conditioning): payloads shaped like core's nodes' outputs are
accepted field for field; every bad field is refused with a message naming it; core's mask pooling."""

import json

import pytest
import torch

from h3_blackwell.runtime.io.payload import conditioning_from_payload, conditioning_to_payload
from h3_blackwell.runtime.model.conditioning import (ConditioningError, pool_audio_mask,
                                                     pool_video_mask)

VIDEO = (1, 24, 7, 4, 6)   # 22 pixel frames
AUDIO = (1, 32, 2, 37)


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _tensors():
    g = _g()
    return {
        "kf0": torch.randn(1, 24, 1, 4, 6, generator=g),
        "kf1": torch.randn(1, 24, 1, 4, 6, generator=g),
        "kfa": torch.randn(1, 32, 2, 11, generator=g),
        "img0": torch.randn(1, 24, 1, 4, 2, generator=g),
        "img1": torch.randn(1, 24, 1, 2, 6, generator=g),
        "vid": torch.randn(1, 24, 2, 2, 4, generator=g),
        "t3": torch.randn(1, 24, 3, 4, 6, generator=g),
        "vida": torch.randn(1, 32, 2, 5, generator=g),
        "aud": torch.randn(1, 32, 2, 3, generator=g),
        "mask": torch.rand(1, 1, 7, 4, 6, generator=g),
        "amask": torch.rand(1, 1, 2, 37, generator=g),
        "sigmas": torch.tensor([1.0, 0.9, 0.5, 0.0]),
    }


def _payload():
    return {
        "keyframes": [{"resolved_frame_index": 0, "latent": "kf0", "audio_latent": None},
                      {"resolved_frame_index": 21, "latent": "kf1"},
                      {"resolved_frame_index": 6, "audio_latent": "kfa"}],
        "refs": [{"kind": "image", "picture_index": 1, "latent_h": 4, "latent_w": 2, "latent": "img0"},
                 {"kind": "image", "picture_index": 2, "latent_h": 2, "latent_w": 6, "latent": "img1"},
                 {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 4, "ref_audio_t": 5,
                  "latent": "vid", "audio_latent": "vida"},
                 {"kind": "audio", "ref_audio_t": 3, "audio_latent": "aud"}],
        "denoise_mask": "mask", "audio_denoise_mask": "amask", "sample_sigmas": "sigmas",
        "visual_cond_noise_aug": 0.99, "audio_cond_noise_aug": 0.95, "seed": 7,
    }


def test_full_payload_round_trips():
    t = _tensors()
    c = conditioning_from_payload(json.loads(json.dumps(_payload())), t).check_target(VIDEO, AUDIO, 24, 32)
    assert [k.resolved_frame_index for k in c.keyframes] == [0, 21, 6]
    assert [r.kind for r in c.refs] == ["image", "image", "video_audio", "audio"]
    assert c.refs[0].picture_index == 1 and c.refs[2].ref_audio_t == 5
    assert (c.visual_cond_noise_aug, c.audio_cond_noise_aug, c.seed) == (0.99, 0.95, 7)
    # packing order is core's: keyframes first, then refs, each in list order
    assert [x.data_ptr() for x in c.cond_video_latents] == [
        c.keyframes[0].latent.data_ptr(), c.keyframes[1].latent.data_ptr(),
        c.refs[0].latent.data_ptr(), c.refs[1].latent.data_ptr(), c.refs[2].latent.data_ptr()]
    assert torch.equal(c.cond_audio_latents[0], t["kfa"]) and torch.equal(c.cond_audio_latents[2], t["aud"])
    # spans on the time axis: image 1, audio ref_audio_t, video max(rt, 5/3 * (1 + 4))
    assert [r.time_span for r in c.refs] == pytest.approx([1.0, 1.0, 25.0 / 3.0, 3.0])
    p, tensors = conditioning_to_payload(c)
    c2 = conditioning_from_payload(json.loads(json.dumps(p)), tensors)
    assert conditioning_to_payload(c2)[0] == p
    assert all(torch.equal(tensors[k], conditioning_to_payload(c2)[1][k]) for k in tensors)


def test_defaults_are_cores():
    c = conditioning_from_payload({}, {})
    assert (c.keyframes, c.refs, c.denoise_mask, c.audio_denoise_mask, c.sample_sigmas) == ((), (), None, None, None)
    assert (c.visual_cond_noise_aug, c.audio_cond_noise_aug, c.seed) == (0.999, 1.0, 0)
    assert c.is_empty


def test_tensors_may_be_passed_directly():
    """A node hands core's in-memory dicts (tensors, not keys) to the same constructor."""
    t = _tensors()
    c = conditioning_from_payload({"keyframes": [{"resolved_frame_index": 0, "latent": t["kf0"].double()}]})
    assert c.keyframes[0].latent.dtype == torch.float32 and torch.equal(c.keyframes[0].latent, t["kf0"])


def _mutate(path, value):
    p = _payload()
    node = p
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return p


BAD = [
    (("bogus",), 1, "bogus"),
    (("seed",), 1.5, "seed"),
    (("seed",), True, "seed"),
    (("visual_cond_noise_aug",), 1.5, "visual_cond_noise_aug"),
    (("audio_cond_noise_aug",), "x", "audio_cond_noise_aug"),
    (("keyframes",), {"a": 1}, "keyframes"),
    (("keyframes", 0, "resolved_frame_index"), -1, "keyframes[0].resolved_frame_index"),
    (("keyframes", 0, "resolved_frame_index"), KeyError, "keyframes[0].resolved_frame_index"),
    (("keyframes", 0, "latent"), "nope", "keyframes[0].latent"),
    (("keyframes", 0, "latent"), None, "keyframes[0]"),
    (("keyframes", 0, "strength"), 1.0, "keyframes[0].strength"),
    (("keyframes", 1, "latent"), "amask", "keyframes[1].latent"),        # not a video latent
    (("refs", 0, "kind"), "depth", "refs[0].kind"),
    (("refs", 0, "latent_h"), 3, "refs[0].latent_h"),
    (("refs", 0, "latent_w"), 4, "refs[0].latent"),                      # disagrees with the tensor
    (("refs", 2, "ref_audio_t"), 4, "refs[2].audio_latent"),
    (("refs", 2, "audio_latent"), None, "refs[2].audio_latent"),
    (("refs", 3, "latent"), "img0", "refs[3].latent"),                   # audio refs carry no latent
    (("refs", 3, "ref_audio_t"), 0, "refs[3].ref_audio_t"),
    (("denoise_mask",), "amask", "denoise_mask"),
    (("audio_denoise_mask",), "mask", "audio_denoise_mask"),
    (("sample_sigmas",), "amask", "sample_sigmas"),
]


@pytest.mark.parametrize("path,value,field", BAD, ids=[".".join(map(str, b[0])) + f"={b[1]!r}" for b in BAD])
def test_bad_field_is_named(path, value, field):
    t = _tensors()
    with pytest.raises(ConditioningError) as e:
        conditioning_from_payload(_mutate(path, value), t)
    assert str(e.value).startswith(field + ":"), str(e.value)
    assert "expected" in str(e.value) and "found" in str(e.value)


def test_bad_values_in_tensors():
    t = _tensors()
    t["mask"] = t["mask"] * 2.0
    with pytest.raises(ConditioningError, match=r"^denoise_mask: expected values in \[0, 1\]"):
        conditioning_from_payload(_payload(), t)
    t = _tensors()
    t["sigmas"] = torch.tensor([1.0, 0.5])
    with pytest.raises(ConditioningError, match="^sample_sigmas: .*trailing 0"):
        conditioning_from_payload(_payload(), t)
    t = _tensors()
    t["kf0"] = t["kf0"].clone()
    t["kf0"][0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ConditioningError, match=r"^keyframes\[0\]\.latent: expected finite"):
        conditioning_from_payload(_payload(), t)


@pytest.mark.parametrize("video,audio,channels,field", [
    ((1, 24, 2, 4, 6), AUDIO, (24, 32), "keyframes[1].resolved_frame_index"),   # 5 frames: index 21 is past the end
    ((1, 24, 7, 4, 8), AUDIO, (24, 32), "keyframes[0].latent"),                  # grid differs from the target's
    (VIDEO, (1, 32, 2, 10), (24, 32), "keyframes[2].resolved_frame_index"),      # no audio left at frame 6
    (VIDEO, AUDIO, (16, 32), "keyframes[0].latent"),                             # model channels
    (VIDEO, AUDIO, (24, 16), "keyframes[2].audio_latent"),
])
def test_target_fit(video, audio, channels, field):
    c = conditioning_from_payload(_payload(), _tensors())
    with pytest.raises(ConditioningError) as e:
        c.check_target(video, audio, *channels)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_mask_shapes_checked_against_target():
    c = conditioning_from_payload({"denoise_mask": "mask"}, _tensors())
    with pytest.raises(ConditioningError, match=r"^denoise_mask: expected \[1, 1, 7, 4, 8\]"):
        c.check_target((1, 24, 7, 4, 8), AUDIO, 24, 32)
    c = conditioning_from_payload({"audio_denoise_mask": "amask"}, _tensors())
    with pytest.raises(ConditioningError, match=r"^audio_denoise_mask: expected \[1, 1, 2, 38\]"):
        c.check_target(VIDEO, (1, 32, 2, 38), 24, 32)


def test_video_mask_pooling_is_cores():
    """amax per 2x2 patch (odd edges replicated), broadcast back, ceil(256 m) / 256, idempotent; an all-generate
    mask is dropped."""
    g = _g(3)
    m = torch.rand(1, 1, 3, 5, 7, generator=g)
    p = pool_video_mask(m)
    assert p.shape == m.shape
    for t in range(3):
        for i in range(5):
            for j in range(7):
                block = m[0, 0, t, i // 2 * 2:i // 2 * 2 + 2, j // 2 * 2:j // 2 * 2 + 2]
                want = torch.ceil(block.max() * 256) / 256
                assert float(p[0, 0, t, i, j]) == float(want)
    assert torch.equal(pool_video_mask(p), p)
    assert pool_video_mask(torch.ones(1, 1, 2, 4, 4)) is None
    almost = torch.ones(1, 1, 2, 4, 4)
    almost[0, 0, 1, 3, 3] = 0.9995   # quantises to 1: dropped as core drops it
    assert pool_video_mask(almost) is None


def test_audio_mask_pooling_is_cores():
    g = _g(4)
    m = torch.rand(1, 32, 2, 9, generator=g)
    p = pool_audio_mask(m)
    assert p.shape == (1, 1, 2, 9)
    assert torch.equal(p, torch.ceil(m.amax(dim=1, keepdim=True) * 256) / 256)
    assert torch.equal(pool_audio_mask(p), p)
    assert pool_audio_mask(torch.ones(1, 1, 2, 9)) is None
