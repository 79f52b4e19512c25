"""Issue 15 acceptance: ``forward --payload`` equals the float64 oracle of core's semantics (tests/oracles/core_h3.py,
itself checked against core's own model code by tests/oracles/check_core.py) for every conditioning case, and
the NVFP4 stack stays within its usual bound of the dense path on the same conditioning."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))

import cases as case_mod  # noqa: E402
import core_h3  # noqa: E402
from refblock import reference_block  # noqa: E402

from h3_blackwell.cli import main as cli  # noqa: E402
from h3_blackwell.runtime import RuntimeOptions, load_model  # noqa: E402
from h3_blackwell.runtime.io.payload import conditioning_from_payload, conditioning_to_payload  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402

CASES = case_mod.make_cases()


def _cfg(case):
    return TINY.replace(text_dim=case_mod.TEXT_DIM, head_bank=case.get("head_bank", 1),
                        adaln_curve_grid=33 if case.get("curve") else 0)


_SD = {}


def _state_dict(case):
    cfg = _cfg(case)
    if cfg not in _SD:
        _SD[cfg] = tiny_state_dict(cfg, seed=1)
    return _SD[cfg]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for key in {(c.get("head_bank", 1), bool(c.get("curve"))) for c in CASES.values()}:
        cfg = TINY.replace(text_dim=case_mod.TEXT_DIM, head_bank=key[0], adaln_curve_grid=33 if key[1] else 0)
        out[key] = save_tiny(d / f"h{key[0]}_c{int(key[1])}.safetensors", cfg, seed=1, dtype=torch.float32)
    return out


def _model_file(models, case):
    return models[(case.get("head_bank", 1), bool(case.get("curve")))]


def _write_inputs(tmp_path, case):
    payload, tensors = conditioning_to_payload(conditioning_from_payload(case["payload"]))
    tensors.update(video=case["video"], audio=case["audio"], text_states=case["text_states"],
                   token_tags=case["token_tags"], sigma=torch.tensor([case["sigma"]]))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "in.safetensors"))
    (tmp_path / "payload.json").write_text(json.dumps(payload))
    return ["--inputs", str(tmp_path / "in.safetensors"), "--payload", str(tmp_path / "payload.json")]


@pytest.mark.parametrize("name", list(CASES))
def test_forward_payload_equals_core_oracle(name, models, tmp_path, capsys):
    case = CASES[name]
    model = _model_file(models, case)
    args = _write_inputs(tmp_path, case)
    capsys.readouterr()
    assert cli.main(["forward", "--model", str(model), *args, "--out", str(tmp_path / "o.safetensors"),
                     "--dtype", "float32", "--device", "cpu", "--dense"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("segments: text[0:")
    with safe_open(str(tmp_path / "o.safetensors"), "pt") as f:
        v, a = f.get_tensor("video"), f.get_tensor("audio")
    sd = _state_dict(case)  # the weights save_tiny wrote (same config and seed)
    ov, oa = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                  token_tags=case["token_tags"], payload=case["payload"])
    # fp32 runtime vs float64 oracle: fp32 rounding in every layer of a 3-block model (measured ~3e-7)
    assert _rel(v, ov) <= 1e-5 and _rel(a, oa) <= 1e-5, (_rel(v, ov), _rel(a, oa))
    # and the conditioning matters: without it the output is far from the oracle's
    bare = {"sample_sigmas": torch.tensor([1.0, case["sigma"], 0.0])} if case.get("head_bank") else {}
    bv, ba = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                  token_tags=case["token_tags"], payload=bare)
    assert max(_rel(bv, ov), _rel(ba, oa)) > 1e-4


@pytest.mark.parametrize("seed", [0, 3, 9, 22])
def test_random_payloads_equal_core_oracle(seed, tmp_path):
    """Random valid payloads (odd canvases, clips, every ref kind, masks, PDD banks, curve form, any sigma; the
    same generator check_core.py runs against core's own code) through the dense runtime."""
    case = case_mod.random_case(seed)
    cfg = _cfg(case)
    sd = _state_dict(case)
    m = load_model(save_tiny(tmp_path / "m.safetensors", cfg, seed=1, dtype=torch.float32),
                   RuntimeOptions(device="cpu", dtype="float32", quantize=False)).model
    v, a = m(case["video"], case["audio"], case["text_states"], case["sigma"], token_tags=case["token_tags"],
             cond=conditioning_from_payload(case["payload"]))
    ov, oa = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                  token_tags=case["token_tags"], payload=case["payload"])
    assert _rel(v, ov) <= 1e-5 and _rel(a, oa) <= 1e-5, (_rel(v, ov), _rel(a, oa))


def test_forward_segments_of_ref2va(models, tmp_path, capsys):
    case = CASES["ref2va"]
    args = _write_inputs(tmp_path, case)
    capsys.readouterr()
    assert cli.main(["forward", "--model", str(_model_file(models, case)), *args,
                     "--out", str(tmp_path / "o.safetensors")]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    # 9 text | image 2x1 patches | image 1x3 | video_audio: 5 stereo frames then 2 frames of 1x2 | audio 3
    # | target audio 37 stereo | target video 7 x 2x3
    assert line == ("segments: text[0:9] ref_img[9:11] ref_img[11:14] ref_audio[14:24] ref_img[24:28] "
                    "ref_audio[28:34] audio[34:108] video[108:150]")


@pytest.mark.parametrize("name", ["fl2va_first_last", "image_and_audio_guide", "ref2va", "video_mask_partial",
                                  "audio_mask", "pdd_mid_schedule"])
def test_nvfp4_stack_close_to_dense_with_conditioning(name, models):
    """The NVFP4 stack on the same conditioning: the usual W4A4 bound of the dense path (tests/runtime/ops/test_block_ops.py)."""
    case = CASES[name]
    path = _model_file(models, case)
    dense = load_model(path, RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    fp4 = load_model(path, RuntimeOptions(device="cpu", dtype="float32"))
    assert fp4.ops.name == "nvfp4" and dense.ops.name == "reference"
    cond = conditioning_from_payload(case["payload"])
    args = (case["video"], case["audio"], case["text_states"], case["sigma"])
    dv, da = dense.model(*args, token_tags=case["token_tags"], cond=cond, ops=dense.ops)
    qv, qa = fp4.model(*args, token_tags=case["token_tags"], cond=cond, ops=fp4.ops)
    assert 1e-4 < _rel(qv, dv) < 0.2 and 1e-4 < _rel(qa, da) < 0.2, (_rel(qv, dv), _rel(qa, da))


def _q(x):
    return nv.dequantize(nv.quantize(x.float(), nv.global_scale(x.float()), pad_rows=1), torch.float64)


def test_stack_block_with_masked_runs_equals_w4a4_reference(models):
    """A masked stream's many (start, stop, row) runs go through the NVFP4 producers exactly like plain
    segments: the stack block equals the explicit W4A4 reference block (same bound as tests/runtime/ops/test_block_ops.py)."""
    case = CASES["video_mask_partial"]
    rt = load_model(_model_file(models, case), RuntimeOptions(device="cpu", dtype="float32", gemm="reference"))
    m = rt.model
    cond = conditioning_from_payload(case["payload"])
    plan = m.plan(case["text_states"], tuple(case["video"].shape), tuple(case["audio"].shape), [case["sigma"]],
                  token_tags=case["token_tags"], cond=cond)
    segs = plan.times[0].mod_segments
    assert sum(1 for s in segs if s[0] >= plan.layout.segment("video")[0]) > 3  # several runs in the video
    x = m.pack(plan, case["video"], case["audio"])
    blk = m.blocks[0]
    wq = {n: nv.dequantize(getattr(getattr(blk, p), n).weight, torch.float64)
          for p, n in (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))}
    expect = reference_block(blk, x, plan.mods[0][0], segs, plan.cos, plan.sin, m.cfg, wq, _q)
    got = blk(x.clone(), plan.mods[0][0], segs, plan.cos, plan.sin, rt.ops, 0)
    assert _rel(got, expect) < 1e-6


@pytest.mark.parametrize("name", ["ref2va", "video_mask_partial"])
def test_forward_fast_payload_within_nvfp4_bound(name, models, tmp_path):
    """``forward --fast --payload``: the plan's NVFP4 stack on core's conditioning, within the W4A4 bound of the
    reference evaluation of the same command."""
    case = CASES[name]
    args = ["forward", "--model", str(_model_file(models, case)), *_write_inputs(tmp_path, case)]
    outs = {}
    for flag in ("--dense", "--fast"):
        out = tmp_path / f"o{flag}.safetensors"
        assert cli.main([*args, "--out", str(out), flag]) == 0
        with safe_open(str(out), "pt") as f:
            outs[flag] = (f.get_tensor("video"), f.get_tensor("audio"))
    (dv, da), (qv, qa) = outs["--dense"], outs["--fast"]
    assert 1e-4 < _rel(qv, dv) < 0.2 and 1e-4 < _rel(qa, da) < 0.2, (_rel(qv, dv), _rel(qa, da))


@pytest.mark.parametrize("payload,needle", [
    ({"keyframes": [{"resolved_frame_index": 0, "latent": "nope"}]}, "keyframes[0].latent: expected a key of the inputs"),
    ({"keyframes": [{"resolved_frame_index": 22, "latent": "kf"}]}, "keyframes[0].resolved_frame_index"),
    ({"refs": [{"kind": "depth", "latent": "kf"}]}, "refs[0].kind: expected one of image, video, video_audio, audio"),
    ({"refs": [{"kind": "image", "latent_h": 4, "latent_w": 4, "latent": "kf"}]}, "refs[0].latent: expected"),
    ({"denoise_mask": "kf"}, "denoise_mask: expected a mask [1, 1, T, H, W]"),
    ({"seed": "x"}, "seed: expected an integer"),
    ("not json", "not valid JSON"),
])
def test_forward_bad_payload_is_one_error_line(payload, needle, models, tmp_path, capsys):
    case = CASES["fl2va_first_last"]
    save_file({"video": case["video"], "audio": case["audio"], "text_states": case["text_states"],
               "sigma": torch.tensor([0.5]), "kf": torch.randn(1, 24, 1, 4, 6)}, str(tmp_path / "in.safetensors"))
    (tmp_path / "p.json").write_text(payload if isinstance(payload, str) else json.dumps(payload))
    capsys.readouterr()
    assert cli.main(["forward", "--model", str(_model_file(models, case)), "--inputs", str(tmp_path / "in.safetensors"),
                     "--payload", str(tmp_path / "p.json"), "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "o.safetensors").exists()


def test_forward_pdd_without_schedule_is_refused(models, tmp_path, capsys):
    """Core raises for a PDD head bank without the sampler's schedule; forward names the field."""
    case = CASES["pdd_mid_schedule"]
    args = _write_inputs(tmp_path, {**case, "payload": {}})
    capsys.readouterr()
    assert cli.main(["forward", "--model", str(_model_file(models, case)), *args,
                     "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: sample_sigmas: expected the run's full sigma schedule"), err


def test_step_mods_equal_precomputed_rows(models, monkeypatch):
    """A soft mask gives many distinct timesteps; past MOD_CACHE_BYTES the modulation rows are computed per step
    (StepMods) and the output is bit-identical to the precomputed rows."""
    from h3_blackwell.runtime.model import h3

    case = CASES["video_mask_partial"]
    rt = load_model(_model_file(models, case), RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    cond = conditioning_from_payload(case["payload"])
    args = (case["video"], case["audio"], case["text_states"], case["sigma"])
    v0, a0 = rt.model(*args, token_tags=case["token_tags"], cond=cond, ops=rt.ops)
    monkeypatch.setattr(h3, "MOD_CACHE_BYTES", 0)
    plan = rt.model.plan(case["text_states"], tuple(case["video"].shape), tuple(case["audio"].shape),
                         [case["sigma"]], token_tags=case["token_tags"], cond=cond)
    assert isinstance(plan.mods[0], h3.StepMods)
    v1, a1 = rt.model(*args, token_tags=case["token_tags"], cond=cond, ops=rt.ops)
    assert torch.equal(v0, v1) and torch.equal(a0, a1)
