"""``sample(conditioning=...)`` and ``generate --payload --inputs`` against a float64 euler run of core's sampler
math (tests/oracles/core_sampling.py) with the core-semantics oracle as the model: keyframes, references and
denoise masks (core's KSamplerX0Inpaint + MiniMaxH3.scale_latent_inpaint)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))

import cases as case_mod  # noqa: E402
import core_sampling  # noqa: E402

from h3_blackwell.cli import main as cli  # noqa: E402
from h3_blackwell.runtime import RuntimeOptions, load_model  # noqa: E402
from h3_blackwell.runtime.io.payload import conditioning_from_payload, conditioning_to_payload  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict  # noqa: E402
from fixtures.sampling import sample  # noqa: E402
from h3_blackwell.runtime.sampling.schedule import get_sigmas  # noqa: E402

CFG = TINY.replace(text_dim=case_mod.TEXT_DIM)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _case(masks: bool):
    return case_mod.sampling_case(masks)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("m") / "tiny64.safetensors", CFG, seed=1, dtype=torch.float32)


@pytest.mark.parametrize("masks", [False, True], ids=["conditioned", "conditioned_and_masked"])
def test_sample_with_conditioning_equals_core_euler(masks, model_file):
    video0, audio0, text, tags, payload = _case(masks)
    rt = load_model(model_file, RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    cond = conditioning_from_payload(payload)
    res = sample(rt, text, tags, video0, audio0, seed=5, steps=3, sampler="euler", conditioning=cond)
    sigmas = get_sigmas("simple", 3, CFG.shift_video, 1.0)
    ov, oa = core_sampling.core_sample_euler(tiny_state_dict(CFG, seed=1), video0, audio0, text, tags, payload, 5,
                                             sigmas)
    # fp32 runtime vs float64 oracle over 3 steps (measured ~1e-6)
    assert _rel(res.video, ov) <= 1e-5 and _rel(res.audio, oa) <= 1e-5, (_rel(res.video, ov), _rel(res.audio, oa))
    if masks:  # kept content comes back as it went in (the last euler step lands on the blended denoised)
        keep_v = payload["denoise_mask"].expand_as(video0) == 0
        keep_a = payload["audio_denoise_mask"].expand_as(audio0) == 0
        assert torch.allclose(res.video[keep_v], video0[keep_v], atol=1e-5)
        assert torch.allclose(res.audio[keep_a], audio0[keep_a], atol=1e-5)
    seg = res.report["workload"]["segments"]
    assert [s[0] for s in seg] == ["text", "cond", "cond_audio", "ref_img", "audio", "video"]
    assert res.report["workload"]["conditioning"]["refs"] == ["image"]


def test_generate_payload_inputs_cli(model_file, tmp_path):
    video0, audio0, text, tags, payload = _case(True)
    p, tensors = conditioning_to_payload(conditioning_from_payload(payload))
    tensors.update(video=video0, audio=audio0, text_states=text, token_tags=tags)
    save_file(tensors, str(tmp_path / "in.safetensors"))
    (tmp_path / "p.json").write_text(json.dumps(p))
    assert cli.main(["generate", "--model", str(model_file), "--inputs", str(tmp_path / "in.safetensors"),
                     "--payload", str(tmp_path / "p.json"), "--output", str(tmp_path / "out"), "--steps", "3",
                     "--sampler", "euler", "--seed", "5", "--dense", "--device", "cpu", "--dtype", "float32"]) == 0
    with safe_open(str(tmp_path / "out" / "latents.safetensors"), "pt") as f:
        v, a = f.get_tensor("video"), f.get_tensor("audio")
    ov, oa = core_sampling.core_sample_euler(tiny_state_dict(CFG, seed=1), video0, audio0, text, tags, payload, 5,
                                             get_sigmas("simple", 3, CFG.shift_video, 1.0))
    assert _rel(v, ov) <= 1e-5 and _rel(a, oa) <= 1e-5
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["workload"]["segments"][0] == ["text", 0, 6] and rep["workload"]["frames"] == 22


@pytest.mark.parametrize("extra,needle", [
    (["--payload", "p.json"], "--payload needs --inputs"),
    (["--inputs", "in.safetensors", "--width", "256"], "--width with --inputs"),
    (["--inputs", "in.safetensors", "--payload", "bad.json"], "refs[0].kind"),
    (["--inputs", "in.safetensors", "--payload", "late.json"], "keyframes[0].resolved_frame_index"),
])
def test_generate_payload_errors(extra, needle, model_file, tmp_path, capsys):
    video0, audio0, text, tags, _ = _case(False)
    save_file({"video": video0, "audio": audio0, "text_states": text, "lat": torch.randn(1, 24, 1, 4, 6)},
              str(tmp_path / "in.safetensors"))
    (tmp_path / "p.json").write_text("{}")
    (tmp_path / "bad.json").write_text(json.dumps({"refs": [{"kind": "depth"}]}))
    (tmp_path / "late.json").write_text(json.dumps({"keyframes": [{"resolved_frame_index": 22, "latent": "lat"}]}))
    args = [str(tmp_path / x) if x.endswith((".json", ".safetensors")) else x for x in extra]
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(model_file), "--output", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_sample_refuses_a_foreign_schedule(model_file):
    """Core hands the model the sampler's own schedule; a payload naming another one is refused by name."""
    from h3_blackwell.runtime.errors import H3Error

    video0, audio0, text, tags, payload = _case(False)
    rt = load_model(model_file, RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    cond = conditioning_from_payload({**payload, "sample_sigmas": torch.tensor([1.0, 0.5, 0.0])})
    with pytest.raises(H3Error, match="^sample_sigmas: expected this run's schedule"):
        sample(rt, text, tags, video0, audio0, seed=5, steps=3, sampler="euler", conditioning=cond)


def test_generate_payload_sequence_parallel_matches_single_process(model_file, tmp_path):
    """References, guides and masked runs through the sequence-parallel path (2 gloo workers, clipped segment
    tables) give the single-process latents (fp32 both sides; 1e-5 as the sp tests)."""
    video0, audio0, text, tags, payload = _case(True)
    p, tensors = conditioning_to_payload(conditioning_from_payload(payload))
    tensors.update(video=video0, audio=audio0, text_states=text, token_tags=tags)
    save_file(tensors, str(tmp_path / "in.safetensors"))
    (tmp_path / "p.json").write_text(json.dumps(p))
    base = ["generate", "--model", str(model_file), "--inputs", str(tmp_path / "in.safetensors"), "--payload",
            str(tmp_path / "p.json"), "--steps", "2", "--dense", "--device", "cpu", "--dtype", "float32"]
    assert cli.main([*base, "--output", str(tmp_path / "one")]) == 0
    assert cli.main([*base, "--output", str(tmp_path / "sp"), "--sequence-parallel", "2"]) == 0
    outs = []
    for d in ("one", "sp"):
        with safe_open(str(tmp_path / d / "latents.safetensors"), "pt") as f:
            outs.append((f.get_tensor("video"), f.get_tensor("audio")))
    assert _rel(outs[1][0], outs[0][0]) <= 1e-5 and _rel(outs[1][1], outs[0][1]) <= 1e-5
