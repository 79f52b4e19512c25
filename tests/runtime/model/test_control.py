"""Issue 25: the Fun ControlNet tower. ``forward --payload --control`` equals the float64 oracle of core's control
semantics (tests/oracles/core_control.py on core_h3.py) for the acceptance cases; the CLI contract; the loader's
refusals; the quantized tower; ``generate --control``."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import control_cases  # noqa: E402
import core_control  # noqa: E402
import core_h3  # noqa: E402
from fixtures.tiny_control import (control_metadata, diffusers_control_state_dict, save_tiny_control,  # noqa: E402
                                   tiny_control_state_dict)

from h3_blackwell.cli import main as cli  # noqa: E402
from h3_blackwell.runtime import (ControlError, H3Error, RuntimeOptions, bind_control, load_control,  # noqa: E402
                                  load_model, open_control)
from h3_blackwell.runtime.model.conditioning import ControlHint  # noqa: E402
from h3_blackwell.runtime.io.payload import conditioning_from_payload, conditioning_to_payload  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.control import fade_row_scale  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict  # noqa: E402

TEXT_DIM = control_cases.TEXT_DIM
FULL = TINY.replace(text_dim=TEXT_DIM)
CURVE = FULL.replace(adaln_curve_grid=control_cases.CURVE_GRID)
CASES = control_cases.make_cases()
_f32 = control_cases.f32


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("control")
    out = {"full": save_tiny(d / "full.safetensors", FULL, seed=1, dtype=torch.float32),
           "curve": save_tiny(d / "curve.safetensors", CURVE, seed=1, dtype=torch.float32)}
    for name, case in CASES.items():
        cfg = FULL if case["base"] == "full" else CURVE
        out[name] = save_tiny_control(d / f"{name}.safetensors", cfg, case["places"], seed=11)
    return out


def _write_inputs(tmp_path, case, with_control=True):
    payload = dict(case["payload"])
    if with_control:
        payload["control"] = case["control"]
    payload, tensors = conditioning_to_payload(conditioning_from_payload(payload))
    tensors.update(video=case["video"], audio=case["audio"], text_states=case["text_states"],
                   token_tags=case["token_tags"], sigma=torch.tensor([case["sigma"]]))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "in.safetensors"))
    (tmp_path / "payload.json").write_text(json.dumps(payload))
    return ["--inputs", str(tmp_path / "in.safetensors"), "--payload", str(tmp_path / "payload.json")]


def _forward(files, case_name, tmp_path, extra=(), with_control=True, control=True):
    case = CASES[case_name]
    args = _write_inputs(tmp_path, case, with_control)
    ctl = ["--control", str(files[case_name])] if control else []
    rc = cli.main(["forward", "--model", str(files[case["base"]]), *args, *ctl, "--out",
                   str(tmp_path / "o.safetensors"), "--dtype", "float32", "--device", "cpu", *extra])
    assert rc == 0
    with safe_open(str(tmp_path / "o.safetensors"), "pt") as f:
        return f.get_tensor("video"), f.get_tensor("audio")


def _oracle(case, with_control=True):
    cfg = FULL if case["base"] == "full" else CURVE
    sd = tiny_state_dict(cfg, seed=1)
    args = (case["video"], case["audio"], case["text_states"], case["sigma"])
    if not with_control:
        return core_h3.core_forward(sd, *args, token_tags=case["token_tags"], payload=case["payload"])
    csd = tiny_control_state_dict(cfg, len(case["places"]), seed=11)
    return core_control.core_forward_control(sd, csd, case["places"], *args, case["control"],
                                             token_tags=case["token_tags"], payload=case["payload"])


@pytest.mark.parametrize("name", list(CASES))
def test_forward_control_equals_core_oracle(name, files, tmp_path, capsys):
    case = CASES[name]
    v, a = _forward(files, name, tmp_path)
    ov, oa = _oracle(case)
    # fp32 runtime vs the float64 oracle: fp32 rounding through 3 blocks + the tower (measured ~3e-7)
    assert _rel(v, ov) <= 1e-5 and _rel(a, oa) <= 1e-5, (_rel(v, ov), _rel(a, oa))
    bv, ba = _oracle(case, with_control=False)
    if name == "outside_window":
        # sigma outside the window: exactly the uncontrolled output, byte for byte
        uv, ua = _forward(files, name, tmp_path, with_control=False, control=False)
        assert torch.equal(v, uv) and torch.equal(a, ua)
        assert torch.equal(ov, bv) and torch.equal(oa, ba)
    else:
        # the tower matters: the oracle without it is far from the controlled output (audio moves only through
        # attention, video through the residual)
        assert _rel(bv, ov) > 1e-3 and _rel(ba, oa) > 1e-6, (_rel(bv, ov), _rel(ba, oa))


def test_strength_zero_is_exactly_uncontrolled(files, tmp_path):
    case = CASES["hint24_keyframes"]
    rt = load_model(str(files["full"]), RuntimeOptions(device="cpu", dtype="float32", quantize=False,
                                                       attention="reference"))
    tower = load_control(files["hint24_keyframes"], rt.plan, rt.config)
    cond = conditioning_from_payload(case["payload"])
    with torch.no_grad():
        plan = rt.model.plan(case["text_states"], case["video"].shape, case["audio"].shape, [0.8], cond=cond)
        v0, a0 = rt.model.evaluate(plan, 0, case["video"], case["audio"], rt.ops)
        hint = ControlHint(case["control"]["hint"], 0.0, 1.0, 0.0)
        assert bind_control(rt.model, tower, hint, plan, [0.8]) is None and plan.control is None
        v1, a1 = rt.model.evaluate(plan, 0, case["video"], case["audio"], rt.ops)
        assert torch.equal(v0, v1) and torch.equal(a0, a1)
        # and the window is inclusive at both ends
        for lo, hi in ((0.8, 0.9), (0.7, 0.8)):
            assert bind_control(rt.model, tower, ControlHint(hint.hint, 1.0, _f32(hi), _f32(lo)), plan,
                                [_f32(0.8)]) is not None


def test_fade_weights_by_hand():
    # 7 latent frames = 1 + 6 x 4 = 25 pixel frames; fade in 3: env 0, 0.5, 1 -> frame 0 = 0, frame 1 =
    # mean(0.5, 1, 1, 1); fade out 1 zeroes the last pixel frame -> last latent frame 0.75
    w = fade_row_scale(7, 1, 3, 1)
    assert w.tolist() == [0.0, 0.875, 1.0, 1.0, 1.0, 1.0, 0.75]
    assert core_control.fade_weights(7, 3, 1) == w.tolist()
    for fi, fo in ((0, 0), (5, 0), (0, 9), (25, 25), (40, 2)):
        ours = fade_row_scale(7, 3, fi, fo)
        theirs = torch.tensor(core_control.fade_weights(7, fi, fo), dtype=torch.float32).repeat_interleave(3)
        assert torch.allclose(ours, theirs, atol=1e-6), (fi, fo)


# ---------------------------------------------------------------------------------------------
# the CLI contract
# ---------------------------------------------------------------------------------------------

def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_control_flag_without_field_and_field_without_flag(files, tmp_path, capsys):
    case = CASES["hint24_keyframes"]
    model, ctl = str(files["full"]), str(files["hint24_keyframes"])
    args = _write_inputs(tmp_path, case, with_control=False)
    capsys.readouterr()
    assert cli.main(["forward", "--model", model, *args, "--control", ctl, "--out", str(tmp_path / "o.st")]) == 2
    assert "control field" in _error_line(capsys)
    args = _write_inputs(tmp_path, case, with_control=True)
    assert cli.main(["forward", "--model", model, *args, "--out", str(tmp_path / "o.st")]) == 2
    assert "--control" in _error_line(capsys)
    assert cli.main(["generate", "--model", model, *args, "--steps", "1", "--output", str(tmp_path / "g")]) == 2
    assert "--control" in _error_line(capsys)
    args = _write_inputs(tmp_path, case, with_control=False)
    assert cli.main(["generate", "--model", model, *args, "--control", ctl, "--steps", "1",
                     "--output", str(tmp_path / "g")]) == 2
    assert "control field" in _error_line(capsys)
    assert cli.main(["generate", "--model", model, "--control", ctl, "--output", str(tmp_path / "g")]) == 2
    assert "--inputs" in _error_line(capsys)
    assert not (tmp_path / "o.st").exists() and not (tmp_path / "g").exists()


def test_bad_control_payloads(files, tmp_path, capsys):
    case = CASES["hint24_keyframes"]
    good = case["control"]
    bad = [({**good, "hint": torch.randn(1, 24, 7, 4, 5)}, "control.hint"),
           ({**good, "hint": torch.randn(1, 12, 7, 4, 6)}, "control.hint"),
           ({**good, "strength": float("nan")}, "control.strength"),
           ({**good, "fade_in_frames": -1}, "control.fade_in_frames"),
           ({**good, "sigma_stop": 0.5}, "control.sigma_stop")]
    for control, field in bad:
        if field == "control.strength":  # NaN cannot go through JSON: parse it directly
            with pytest.raises(H3Error, match=field):
                conditioning_from_payload({"control": control})
            continue
        try:
            payload, tensors = conditioning_to_payload(conditioning_from_payload({"control": control}))
        except H3Error as e:
            assert field in str(e)
            continue
        tensors.update(video=case["video"], audio=case["audio"], text_states=case["text_states"],
                       sigma=torch.tensor([0.8]))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "in.safetensors"))
        (tmp_path / "p.json").write_text(json.dumps(payload))
        capsys.readouterr()
        assert cli.main(["forward", "--model", str(files["full"]), "--inputs", str(tmp_path / "in.safetensors"),
                         "--payload", str(tmp_path / "p.json"), "--control", str(files["hint24_keyframes"]),
                         "--out", str(tmp_path / "o.st")]) == 2
        assert field in _error_line(capsys)


# ---------------------------------------------------------------------------------------------
# loading: core's reading and the refusals
# ---------------------------------------------------------------------------------------------

def _save(path, sd, meta):
    save_file(dict(sorted(sd.items())), str(path), metadata=meta)
    return path


def test_loader_reads_places_and_form_like_core(tmp_path):
    sd = tiny_control_state_dict(FULL, 5, seed=2)
    f = _save(tmp_path / "v1.safetensors", sd, {})
    spec = open_control(f).spec
    assert spec.places == (0, 10, 20, 30, 40) and not spec.curve_form and spec.time_embed_dim == 48
    sd10 = tiny_control_state_dict(FULL, 10, seed=2)
    spec = open_control(_save(tmp_path / "v2.safetensors", sd10, {"inpaint_masked_pixel_mode": "post_norm"})).spec
    assert spec.places == tuple(range(0, 50, 5)) and spec.inpaint_post_norm
    sd_c = tiny_control_state_dict(CURVE, 2, seed=2)
    spec = open_control(_save(tmp_path / "c.safetensors", sd_c, control_metadata((0, 2), True))).spec
    assert spec.curve_form and spec.places == (0, 2)
    # core's default places (every 10th of 50 blocks) do not fit a 3-block model: refused at apply time
    with pytest.raises(ControlError, match="control_blocks_places"):
        open_control(f).check_base(FULL)


@pytest.mark.parametrize("places,match", [((0, 1, 2), "expected 2 entries"), ((1, 2), "first place must be 0"),
                                          ((0, 0), "strictly increasing"), ((0, 3), "base blocks 0..2"),
                                          ("[0, true]", "block indices"), ("not json", "not JSON")])
def test_invalid_places_refused(tmp_path, places, match):
    sd = tiny_control_state_dict(FULL, 2, seed=2)
    meta = {"control_blocks_places": places if isinstance(places, str) else json.dumps(list(places))}
    f = _save(tmp_path / "p.safetensors", sd, meta)
    with pytest.raises(ControlError, match=match):
        open_control(f).check_base(FULL)


def test_form_mismatch_refused_at_apply_time(files, tmp_path, capsys):
    # a full-form tower on the curve-form base, and the reverse: one error line before any weight is read
    case = CASES["hint24_keyframes"]
    args = _write_inputs(tmp_path, case)
    capsys.readouterr()
    assert cli.main(["forward", "--model", str(files["curve"]), *args, "--control", str(files["hint24_keyframes"]),
                     "--out", str(tmp_path / "o.st")]) == 2
    assert "full-form" in _error_line(capsys)
    assert cli.main(["forward", "--model", str(files["full"]), *args, "--control",
                     str(files["curve_at_sigma_start"]), "--out", str(tmp_path / "o.st")]) == 2
    assert "curve-form" in _error_line(capsys)
    # a curve-width tower without core's metadata reads as full form (as core reads it) and says what is missing
    sd = tiny_control_state_dict(CURVE, 2, seed=2)
    f = _save(tmp_path / "nometa.safetensors", sd, {"control_blocks_places": "[0, 2]"})
    with pytest.raises(ControlError, match="adaln_basis"):
        open_control(f).check_base(CURVE)


def test_diffusers_prefixed_and_foreign_files_refused(tmp_path):
    sd = tiny_control_state_dict(FULL, 2, seed=2)
    f = _save(tmp_path / "fun_videox.safetensors", diffusers_control_state_dict(sd), {})
    with pytest.raises(H3Error, match="diffusers / VideoX-Fun naming.*h3-blackwell quantize"):
        open_control(f)
    f = _save(tmp_path / "prefixed.safetensors", {"diffusion_model." + k: v for k, v in sd.items()}, {})
    with pytest.raises(H3Error, match="prefix 'diffusion_model.'"):
        open_control(f)
    f = _save(tmp_path / "base.safetensors", tiny_state_dict(FULL, seed=0), {})
    with pytest.raises(H3Error, match="not a MiniMax H3 Fun ControlNet"):
        open_control(f)
    extra = dict(sd, **{"control_blocks.0.attn.to_gate_compress.weight": torch.zeros(128, 96)})
    with pytest.raises(H3Error, match="does not have"):
        open_control(_save(tmp_path / "extra.safetensors", extra, control_metadata((0, 2), False)))
    short = {k: v for k, v in sd.items() if k != "control_blocks.1.mlp.fc2.weight"}
    with pytest.raises(H3Error, match="missing"):
        open_control(_save(tmp_path / "short.safetensors", short, control_metadata((0, 2), False)))


# ---------------------------------------------------------------------------------------------
# the fast stack and generate
# ---------------------------------------------------------------------------------------------

def test_quantized_tower_runs_through_the_base_block_ops(files, tmp_path):
    """--fast: the control block linears are NVFP4 like the base's (run by the same BlockOps); the result stays
    within the usual NVFP4 bound of the dense evaluation."""
    rt = load_model(str(files["full"]), RuntimeOptions(device="cpu", dtype="float32"))
    tower = load_control(files["hint24_keyframes"], rt.plan, rt.config)
    assert type(tower.control_blocks[1].mlp.fc2).__name__ == type(rt.model.blocks[0].mlp.fc2).__name__ \
        == "Nvfp4Linear"
    dv, da = _forward(files, "hint24_keyframes", tmp_path)
    fv, fa = _forward(files, "hint24_keyframes", tmp_path, extra=("--fast",))
    assert _rel(fv, dv) < 0.1 and _rel(fa, da) < 0.1, (_rel(fv, dv), _rel(fa, da))


def test_generate_with_control(files, tmp_path):
    case = CASES["hint24_keyframes"]
    args = _write_inputs(tmp_path, case)
    base = ["generate", "--model", str(files["full"]), *args, "--steps", "3", "--device", "cpu", "--dense"]
    assert cli.main([*base, "--control", str(files["hint24_keyframes"]), "--output", str(tmp_path / "c")]) == 0
    rep = json.loads((tmp_path / "c" / "report.json").read_text())
    # res_multistep 3 steps at shift 12: sigmas 1, 0.97.., 0.92..: the first is above sigma_start 0.9956
    assert rep["control"]["active_steps"] == [1, 2] and rep["control"]["strength"] == 0.7
    est = rep["memory"]["estimate"]  # the memory plan counted the tower (its weights and run tensors)
    assert est["control_tower_weight_bytes"] > 0 and est["control_tower_held_bytes"] > 0
    plain = _write_inputs(tmp_path, case, with_control=False)
    assert cli.main(["generate", "--model", str(files["full"]), *plain, "--steps", "3", "--device", "cpu",
                     "--dense", "--output", str(tmp_path / "p")]) == 0
    with safe_open(str(tmp_path / "c" / "latents.safetensors"), "pt") as f:
        cv = f.get_tensor("video")
    with safe_open(str(tmp_path / "p" / "latents.safetensors"), "pt") as f:
        pv = f.get_tensor("video")
    assert _rel(cv, pv) > 1e-3


def test_quantize_control_files(files, tmp_path):
    """``quantize`` on a tower: native names whatever the source naming (a VideoX-Fun file converts to the same
    tensors as its native twin), the block linears NVFP4, core's metadata; the result applies with --control."""
    from h3_blackwell.runtime.io.header import read_header, read_tensor

    case = CASES["hint24_keyframes"]
    sd = tiny_control_state_dict(FULL, 2, seed=11)
    native = _save(tmp_path / "native.safetensors", sd, control_metadata((0, 2), False))
    videox = _save(tmp_path / "videox.safetensors", diffusers_control_state_dict(sd),
                   {"control_blocks_places": "[0, 2]"})
    outs = []
    for src in (native, videox):
        out = tmp_path / (src.stem + "_nvfp4.safetensors")
        assert cli.main(["quantize", str(src), str(out)]) == 0
        outs.append(read_header(out))
    a, b = outs
    assert sorted(a.tensors) == sorted(b.tensors) and json.loads(a.metadata["control_blocks_places"]) == [0, 2]
    assert all(torch.equal(read_tensor(a, k), read_tensor(b, k)) for k in a.tensors)
    assert a.tensors["control_blocks.1.mlp.fc1.weight"].dtype == "U8"  # NVFP4 bytes
    assert a.tensors["control_blocks.1.after_proj.weight"].dtype == "F32"  # the rest as stored
    spec = open_control(tmp_path / "native_nvfp4.safetensors").check_base(FULL).spec
    assert spec.places == (0, 2) and spec.blocks == 2
    # applied: the dense forward dequantizes the tower, --fast adopts its NVFP4 bytes; both near the bf16 tower
    files = dict(files, q=tmp_path / "native_nvfp4.safetensors")
    CASES["q"] = case
    try:
        dv, da = _forward(files, "hint24_keyframes", tmp_path)
        qv, qa = _forward(files, "q", tmp_path)
        fv, fa = _forward(files, "q", tmp_path, extra=("--fast",))
    finally:
        del CASES["q"]
    for x, y in ((qv, dv), (qa, da), (fv, dv), (fa, da)):
        assert 0 < _rel(x, y) < 0.1, _rel(x, y)


def test_tower_streams_under_a_tight_budget(files, tmp_path):
    """A budget below the estimate with the tower resident streams the tower's blocks first (their four linears
    from host memory through two device buffers of their own): the report says so, the tower's copies are
    counted, and the latents are the resident run's bytes."""
    name = "inpaint49_refs_odd"  # three control blocks: streaming saves one block's linears
    case = CASES[name]
    args = _write_inputs(tmp_path, case)
    base = ["generate", "--model", str(files[case["base"]]), *args, "--steps", "3", "--device", "cpu",
            "--control", str(files[name])]
    assert cli.main([*base, "--output", str(tmp_path / "r")]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    total = rep["memory"]["estimate"]["total_bytes"]
    assert not rep["memory"]["control_tower_streams"] and rep["control"]["streamed_blocks"] == []
    assert rep["control"]["active_steps"], "the tower must run for this test to mean anything"
    assert cli.main([*base, "--vram-budget", repr((total - 1) / 1e9), "--output", str(tmp_path / "s")]) == 0
    rep2 = json.loads((tmp_path / "s" / "report.json").read_text())
    assert rep2["memory"]["control_tower_streams"] and rep2["memory"]["streamed_blocks"] == []
    assert rep2["control"]["streamed_blocks"] == [0, 1, 2]
    assert rep2["control"]["streaming"]["bytes_copied_per_step"] > 0
    assert rep2["memory"]["estimate"]["total_bytes"] < total
    for key in ("video", "audio"):
        with safe_open(str(tmp_path / "r" / "latents.safetensors"), "pt") as f, \
                safe_open(str(tmp_path / "s" / "latents.safetensors"), "pt") as g:
            assert torch.equal(f.get_tensor(key), g.get_tensor(key)), key


def test_sampling_start_moves_a_tower_loaded_resident(files):
    """A tower loaded while the budget kept it resident (the node path loads it at apply time) streams once the
    plan at sampling start says so, and goes back to the device when a later plan has room; the latents never
    change."""
    from fixtures.sampling import sample
    from fixtures.reports import report_hashes

    name = "inpaint49_refs_odd"
    case = CASES[name]
    rt = load_model(str(files["full"]), RuntimeOptions(device="cpu", dtype="float32"))
    tower = load_control(files[name], rt.plan, rt.config)
    assert tower.streamer.order == []

    def run():
        cond = conditioning_from_payload(dict(case["payload"], control=case["control"]))
        return sample(rt, case["text_states"], case["token_tags"], case["video"], case["audio"], seed=3, steps=3,
                      conditioning=cond, control=tower)

    want = run()
    total = want.report["memory"]["estimate"]["total_bytes"]
    rt.plan.options.vram_budget = repr((total - 1) / 1e9)
    got = run()
    assert tower.streamer.order == [0, 1, 2] and got.report["memory"]["control_tower_streams"]
    assert got.report["control"]["streaming"]["bytes_copied_per_step"] > 0
    assert report_hashes(got) == report_hashes(want)
    rt.plan.options.vram_budget = "auto"  # CPU auto: everything resident again
    back = run()
    assert tower.streamer.order == [] and not back.report["memory"]["control_tower_streams"]
    assert report_hashes(back) == report_hashes(want)


def test_a_loaded_tower_a_run_leaves_out_counts_against_the_budget(files):
    """A tower loaded onto the plan but left out of a run still holds its device bytes (found on the H200: a run
    without the tower, the tower resident, peaked 2.6 GB past a 10 GB budget): the run plans with the budget less
    those bytes and says so, its latents are the unbounded run's, and a tower that is gone no longer counts."""
    import gc

    from fixtures.sampling import sample
    from fixtures.reports import report_hashes

    case = CASES["inpaint49_refs_odd"]
    rt = load_model(str(files["full"]), RuntimeOptions(device="cpu", dtype="float32"))

    def run():
        return sample(rt, case["text_states"], case["token_tags"], case["video"], case["audio"], seed=3, steps=3,
                      conditioning=conditioning_from_payload(case["payload"]))

    want = run()
    total = want.report["memory"]["estimate"]["total_bytes"]
    tower = load_control(files["inpaint49_refs_odd"], rt.plan, rt.config)
    idle = tower.device_bytes(torch.device("cpu"))
    assert 0 < idle < total
    budget = total + idle - 1  # the run and the tower together, less a byte: the base streams a little
    rt.plan.options.vram_budget = repr(budget / 1e9)
    got = run()
    mem = got.report["memory"]
    assert "does not use" in mem["budget"] and abs(mem["vram_budget_bytes"] - (budget - idle)) <= 1, mem["budget"]
    assert mem["estimate"]["total_bytes"] + idle <= budget
    assert mem["streamed_blocks"], "the base must stream to leave room for the idle tower"
    assert report_hashes(got) == report_hashes(want)
    del tower
    gc.collect()
    again = run()
    assert "does not use" not in again.report["memory"]["budget"] and again.report["memory"]["streamed_blocks"] == []
    assert report_hashes(again) == report_hashes(want)
