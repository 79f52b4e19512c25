"""The initial noise of a one-clip (video, audio) latent tagged ``batch_index`` [k]: what core's
``comfy.sample.prepare_noise`` draws for it (checked against core itself by tests/oracles/check_core_noise.py).
Core's rule, restated here as the reference: one CPU generator seeded once; per stream (video, then audio), k + 1
draws of one entry's shape, the last kept."""

import pytest
import torch

from h3_blackwell.runtime.sampling.request import RequestError
from h3_blackwell.runtime.sampling.sampler import initial_noise

VSHAPE, ASHAPE = (1, 24, 3, 4, 6), (1, 32, 2, 9)


def _reference(seed, k):
    g = torch.Generator().manual_seed(seed)
    video = [torch.randn(VSHAPE, generator=g) for _ in range(k + 1)][-1]
    audio = [torch.randn(ASHAPE, generator=g) for _ in range(k + 1)][-1]
    return video, audio


@pytest.mark.parametrize("k", [0, 1, 5])
def test_batch_entry_k_draws_core_noise(k):
    v, a = initial_noise(440420, VSHAPE, ASHAPE, k)
    rv, ra = _reference(440420, k)
    assert v.dtype == a.dtype == torch.float32 and torch.equal(v, rv) and torch.equal(a, ra)


def test_entries_differ_and_entry_zero_is_the_plain_draw():
    plain = initial_noise(7, VSHAPE, ASHAPE)
    assert all(torch.equal(x, y) for x, y in zip(plain, initial_noise(7, VSHAPE, ASHAPE, 0)))
    assert not torch.equal(plain[0], initial_noise(7, VSHAPE, ASHAPE, 1)[0])


def test_a_job_refuses_a_batch_index_out_of_range():
    from h3_blackwell.runtime import RuntimeOptions, SampleInputs, SamplingSettings, load_model, tensor_job

    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False))
    text = torch.randn(1, 8, rt.config.text_dim)
    for bad in (-1, 4096, 1.0, True):
        with pytest.raises(RequestError, match=r"^batch_index="):
            tensor_job(rt, SampleInputs(text, None, torch.zeros(VSHAPE), torch.zeros(ASHAPE)),
                       SamplingSettings(seed=1, steps=2, batch_index=bad))


def test_sampling_from_batch_entry_two_reports_it_and_differs_from_entry_zero():
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from fixtures.sampling import sample

    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False))
    text = torch.randn(1, 8, rt.config.text_dim, generator=torch.Generator().manual_seed(0))
    args = (rt, text, None, torch.zeros(VSHAPE), torch.zeros(ASHAPE))
    zero, two = sample(*args, seed=3, steps=2), sample(*args, seed=3, steps=2, batch_index=2)
    assert "batch_index" not in zero.report["workload"] and two.report["workload"]["batch_index"] == 2
    assert not torch.equal(zero.video, two.video)


def test_reduced_precision_latents_get_the_noise_rounded_to_their_dtype(monkeypatch):
    """Core rounds each stream's noise to its latent's dtype (fp16 / bf16 intermediates): an fp16 latent samples as
    the fp32 one with fp16-rounded noise."""
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from fixtures.sampling import sample
    from h3_blackwell.runtime.sampling import sampler as S

    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False))
    text = torch.randn(1, 8, rt.config.text_dim, generator=torch.Generator().manual_seed(0))
    got = sample(rt, text, None, torch.zeros(VSHAPE).half(), torch.zeros(ASHAPE).half(), seed=3, steps=2)
    plain = sample(rt, text, None, torch.zeros(VSHAPE), torch.zeros(ASHAPE), seed=3, steps=2)
    real = S.initial_noise
    monkeypatch.setattr(S, "initial_noise", lambda *a: tuple(n.half().float() for n in real(*a)))
    want = sample(rt, text, None, torch.zeros(VSHAPE), torch.zeros(ASHAPE), seed=3, steps=2)
    assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)
    assert not torch.equal(got.video, plain.video)
