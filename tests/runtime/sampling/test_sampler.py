"""The sampler against a step-by-step reference written here from ComfyUI's formulas; determinism;
interruption; the report schema."""

import pytest
import torch

from h3_blackwell.runtime import Interrupted, RuntimeOptions, load_model
from fixtures.sampling import sample
from h3_blackwell.runtime.model.layout import latent_shapes

CPU = RuntimeOptions(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def rt():
    return load_model(None, CPU, tiny_seed=0)


def _inputs(seed=0, frames=22):
    v, a = latent_shapes(128, 96, frames)
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 9, 5120, generator=g)
    tags = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 1])
    return text, tags, torch.zeros(v), torch.zeros(a)


def _reference_trajectory(model, text, tags, video, audio, seed, steps, sampler, denoise=1.0, ops=None):
    """ComfyUI's math, written out: fp32 sigma table, simple scheduler, RandomNoise on the nested latent
    (one generator, video then audio), CONST noise scaling, audio carried x4, euler / res_multistep (eta 0)."""
    S_v, S_a = 12.0, 3.0
    scale = S_v / S_a
    i = torch.arange(1, 1001) / 1000
    table = (S_v * i / (1 + (S_v - 1) * i)).float()
    total = steps if denoise == 1.0 else int(steps / denoise)
    sig = [float(table[-(1 + int(x * (1000 / total)))]) for x in range(total)] + [0.0]
    sig = torch.tensor(sig, dtype=torch.float32)[-(steps + 1):]
    g = torch.Generator().manual_seed(seed)
    nv = torch.randn(video.shape, generator=g)
    na = torch.randn(audio.shape, generator=g)
    xv = sig[0] * nv + (1 - sig[0]) * video
    y = sig[0] * na + (1 - sig[0]) * audio * scale

    def sa_of(sv):  # audio sigma on shift 3 from video sigma on shift 12
        b = sv / (S_v + sv * (1 - S_v))
        return S_a * b / (1 + (S_a - 1) * b)

    old = old_sd = None
    for k in range(steps):
        s, sn = sig[k], sig[k + 1]
        sv = ((s * 1000) / 1000).clamp(min=1e-6)
        xa = y * (sa_of(sv) / sv)
        vv, va = model(xv, xa, text, float(sv), token_tags=tags, ops=ops)
        vy = (1 - scale) * xa + (1 + (scale - 1) * sa_of(sv)) * va
        den = [xv - vv * s, y - vy * s]
        if sampler == "euler" or sn == 0 or old is None:
            xv, y = [x + (x - d) / s * (sn - s) for x, d in zip((xv, y), den)]
        else:
            t, t_old, t_next, t_prev = -s.log(), -old_sd.log(), -sn.log(), -sig[k - 1].log()
            h = t_next - t
            c2 = (t_prev - t_old) / h
            p1 = torch.expm1(-h) / -h
            p2 = (p1 - 1) / -h
            b1, b2 = p1 - p2 / c2, p2 / c2
            xv, y = [(-h).exp() * x + h * (b1 * d + b2 * o) for x, d, o in zip((xv, y), den, old)]
        old, old_sd = den, sn
    return xv, y / scale


@pytest.mark.parametrize("sampler", ["euler", "res_multistep"])
def test_trajectory_equals_reference(rt, sampler):
    text, tags, video, audio = _inputs()
    res = sample(rt, text, tags, video, audio, seed=17, steps=5, sampler=sampler)
    with torch.no_grad():
        ev, ea = _reference_trajectory(rt.model, text, tags, video, audio, 17, 5, sampler, ops=rt.ops)
    assert res.video.abs().mean() > 0.1
    # fp32 precision: identical formulas, only association order of a few scalar products may differ
    torch.testing.assert_close(res.video, ev, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.audio, ea, rtol=1e-5, atol=1e-5)


def test_denoise_below_one_uses_schedule_tail(rt):
    text, tags, video, audio = _inputs()
    g = torch.Generator().manual_seed(3)
    video, audio = torch.randn(video.shape, generator=g), torch.randn(audio.shape, generator=g)
    res = sample(rt, text, tags, video, audio, seed=2, steps=3, sampler="res_multistep", denoise=0.6)
    with torch.no_grad():
        ev, ea = _reference_trajectory(rt.model, text, tags, video, audio, 2, 3, "res_multistep", denoise=0.6, ops=rt.ops)
    torch.testing.assert_close(res.video, ev, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.audio, ea, rtol=1e-5, atol=1e-5)


def test_determinism_and_runs(rt):
    text, tags, video, audio = _inputs()
    a = sample(rt, text, tags, video, audio, seed=5, steps=3)
    b = sample(rt, text, tags, video, audio, seed=5, steps=3)
    c = sample(rt, text, tags, video, audio, seed=6, steps=3)
    ka, kb, kc = (r.report["latent_checksums"] for r in (a, b, c))
    assert ka["video_sha256"] == kb["video_sha256"] and ka["audio_sha256"] == kb["audio_sha256"]
    assert ka["video_sha256"] != kc["video_sha256"] and ka["audio_sha256"] != kc["audio_sha256"]
    r3 = sample(rt, text, tags, video, audio, seed=5, steps=3, runs=3, warmup=1).report
    assert r3["latent_checksums"]["exact_across_measured_runs"] is True
    assert len(r3["sampling_seconds"]) == 3 and r3["measurement_policy"]["canonical_warmup_runs"] == 1
    assert r3["latent_checksums"]["video_sha256"] == ka["video_sha256"]


def test_report_has_seed_profile_fields(rt):
    text, tags, video, audio = _inputs()
    rep = sample(rt, text, tags, video, audio, seed=5, steps=2).report
    for k in ("device", "compute_capability", "tools", "workload", "configuration", "sampling_seconds",
              "per_step_seconds", "peak_allocated_bytes", "peak_reserved_bytes", "latent_checksums",
              "fc2_dispatch", "measurement_policy"):
        assert k in rep, k
    for k in ("resolution", "frames", "packed_tokens", "text_tokens", "steps", "seed", "attention"):
        assert k in rep["workload"], k
    assert rep["fc2_dispatch"]["required_per_run"] == rt.config.num_layers * 2
    assert rep["fc2_dispatch"]["consistent_with_configuration"] is True, rep["fc2_dispatch"]
    assert [s["step"] for s in rep["per_step_seconds"][0]] == [1, 2]
    assert "H3_SAGE_QKV_LAYOUT" not in rep["configuration"]  # a seed name this runtime does not act on
    lc = rep["latent_checksums"]
    assert lc["video"]["dtype"] == "float32" and lc["video"]["shape"] == list(video.shape)


def test_interrupt_leaves_model_usable(rt):
    text, tags, video, audio = _inputs()
    clean = sample(rt, text, tags, video, audio, seed=9, steps=4).report["latent_checksums"]

    def boom(done, total):
        if done == 2:
            raise Interrupted("user cancelled")

    with pytest.raises(Interrupted):
        sample(rt, text, tags, video, audio, seed=9, steps=4, progress=boom)
    calls = iter([False, False, True])
    with pytest.raises(Interrupted):
        sample(rt, text, tags, video, audio, seed=9, steps=4, interrupt=lambda: next(calls))
    again = sample(rt, text, tags, video, audio, seed=9, steps=4).report["latent_checksums"]
    assert again["video_sha256"] == clean["video_sha256"] and again["audio_sha256"] == clean["audio_sha256"]


def test_fl2va_keyframes_are_fixed_rows(rt):
    """Keyframe rows are conditioning: the output shape is the target's and the noise aug is seeded."""
    text, tags, video, audio = _inputs()
    g = torch.Generator().manual_seed(4)
    kf = [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 6, 8, generator=g)},
          {"resolved_frame_index": 21, "latent": torch.randn(1, 24, 1, 6, 8, generator=g)}]
    a = sample(rt, text, tags, video, audio, seed=1, steps=2, keyframes=kf)
    b = sample(rt, text, tags, video, audio, seed=1, steps=2)
    assert a.video.shape == video.shape
    assert a.report["workload"]["cond_tokens"] == 2 * 3 * 4
    assert a.report["latent_checksums"]["video_sha256"] != b.report["latent_checksums"]["video_sha256"]


def test_fc2_consistency_rules():
    from h3_blackwell.runtime.sampling.report import fc2_consistency

    run = lambda a, s, f, d=0: {"attempts": a, "successes": s, "fallbacks": f, "direct_calls": d}  # noqa: E731
    w4a8 = {"lt_path": "not applicable (act_format fp8)"}
    assert fc2_consistency(w4a8, 600, [run(0, 0, 0, 600)] * 3)[0] is True
    assert fc2_consistency(w4a8, 600, [run(0, 0, 0, 600), run(0, 0, 0, 599)])[0] is False
    assert fc2_consistency(w4a8, 600, [run(600, 0, 600, 0)])[0] is False  # W4A8 must not reach the dispatcher
    disp = {"lt_path": "dispatcher", "strict": False}
    assert fc2_consistency(disp, 600, [run(600, 0, 600), run(600, 600, 0)])[0] is True
    assert fc2_consistency(disp, 600, [run(599, 0, 599)])[0] is False
    assert fc2_consistency({**disp, "strict": True}, 600, [run(600, 590, 10)])[0] is False
    assert fc2_consistency({"lt_path": "none (fallback GEMM)"}, 600, [run(0, 0, 0)])[0] is True
    assert fc2_consistency(disp, 600, [])[0] is False  # no measured run proves nothing


def test_call_carries_audio_at_carry_sigma(rt):
    """CallOptions.carry_sigma: the plan is keyed by the call's sigma, the audio carry computes with carry_sigma
    (the runtime's sampler passes the schedule's model sigma computed on the model's device, where CUDA's
    scalar division may round an ulp away from the host's). Same value: the same bytes as the default; another
    value: only the carry moves (the video velocity is the plan's, unchanged)."""
    from h3_blackwell.runtime.sampling.model_call import CallOptions, ModelCall
    from h3_blackwell.runtime.sampling.schedule import audio_scale, model_sigma

    text, tags, video, audio = _inputs(seed=3)
    g = torch.Generator().manual_seed(4)
    video, audio = torch.randn(video.shape, generator=g), torch.randn(audio.shape, generator=g)
    sm = model_sigma(torch.tensor(0.7))
    opts = CallOptions((12.0, 3.0), audio_scale(12.0, 3.0))

    def call(options):
        c = ModelCall(rt)
        c.begin_run()
        return c(video, audio, sm, text, tags, None, options)

    base = call(opts)
    same = call(CallOptions(opts.shifts, opts.audio_scale, carry_sigma=sm.clone()))
    assert torch.equal(base[0], same[0]) and torch.equal(base[1], same[1])
    moved = call(CallOptions(opts.shifts, opts.audio_scale, carry_sigma=torch.nextafter(sm, torch.tensor(1.0))))
    # one ulp of sigma moves the carried audio's velocity by rounding-sized amounts, not more
    assert not torch.equal(base[1], moved[1])
    assert float((base[1] - moved[1]).abs().max()) < 1e-3
