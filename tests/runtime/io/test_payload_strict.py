"""The conditioning payload is read strictly (issue 26): one JSON object (``null`` is not "no conditioning"), each
key once, standard JSON only, bounded nesting; ``sample_sigmas`` non-increasing and ending at 0; a tensor of any
float dtype is converted (fp8 keyframe latents included), any other dtype refused naming the field. Each refusal:
exit 2, one ``error:`` line naming the field or file, no traceback, nothing written, before the model loads.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fixtures.cli_contract import listing, leftovers, refused_inproc
from h3_blackwell.runtime import ConditioningError, conditioning_from_payload


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("payload")
    g = torch.Generator().manual_seed(0)
    kf = torch.randn(1, 24, 1, 4, 4, generator=g)
    p = d / "in.safetensors"
    save_file({"video": torch.randn(1, 24, 2, 4, 4, generator=g), "audio": torch.randn(1, 32, 2, 4, generator=g),
               "text_states": torch.randn(1, 4, 5120, generator=g), "sigma": torch.tensor([0.5]),
               "kf": kf, "kf_fp8": kf.to(torch.float8_e4m3fn), "kf_bf16": kf.bfloat16(), "kf_f64": kf.double(),
               "kf_int": kf.round().to(torch.int32), "kf_bool": kf > 0,
               "sig_up": torch.tensor([1.0, 0.5, 0.7, 0.0]), "sig_flat": torch.tensor([1.0, 0.5, 0.5, 0.0]),
               "sig_end": torch.tensor([1.0, 0.5, 0.1]), "sig_2d": torch.tensor([[1.0, 0.0]]),
               "sig_nan": torch.tensor([1.0, float("nan"), 0.0]),
               "kf_fp8_nan": torch.full((1, 24, 1, 4, 4), float("nan")).to(torch.float8_e4m3fn)}, str(p))
    return p




def _refused(capsys, inputs, out, payload_bytes: bytes, *needles, command: str = "generate") -> str:
    p = out / "payload.json"
    p.write_bytes(payload_bytes)
    before = listing(out)
    argv = (["generate", "--output", out / "o", "--inputs", inputs, "--payload", p, "--steps", "1"]
            if command == "generate" else
            ["forward", "--model", "-", "--inputs", inputs, "--payload", p, "--out", out / "v.safetensors"])
    if command == "forward":
        from h3_blackwell.runtime.model.tiny import save_tiny

        argv[2] = save_tiny(out.parent / "tiny.safetensors", seed=0)
        before = listing(out)
    line = refused_inproc(capsys, argv, *needles)
    assert listing(out) == before and not leftovers(out)
    assert len(line) < 1000, len(line)  # a hostile value is never echoed whole
    return line


TOP_LEVEL = [(b"null", "null"), (b"[]", "array"), (b'"text"', "string"), (b"1", "number"), (b"true", "boolean"),
             (b"[{}]", "array")]


@pytest.mark.parametrize("command", ["generate", "forward"])
@pytest.mark.parametrize("content,found", TOP_LEVEL, ids=[c.decode() for c, _ in TOP_LEVEL])
def test_the_payload_is_strictly_an_object(content, found, command, inputs, out, capsys):
    _refused(capsys, inputs, out, content, "payload.json", "expected an object", found, command=command)


@pytest.mark.parametrize("content,needles", [
    (b'{"keyframes": [], "keyframes": [{"resolved_frame_index": 0, "latent": "kf"}]}', ["'keyframes' twice"]),
    (b'{"denoise_mask": null, "seed": 1, "denoise_mask": "nope"}', ["'denoise_mask' twice"]),
    (b'{"keyframes": [{"resolved_frame_index": 0, "latent": "kf", "latent": "missing"}]}', ["'latent' twice"]),
    (b'{"control": {"hint": "kf", "hint": "kf"}}', ["'hint' twice"]),
])
def test_duplicate_keys_are_refused_at_any_depth(content, needles, inputs, out, capsys):
    _refused(capsys, inputs, out, content, "payload.json", *needles)


@pytest.mark.parametrize("content,needles", [
    (b'{"seed": NaN}', ["NaN"]), (b'{"visual_cond_noise_aug": Infinity}', ["Infinity"]),
    (b'{"audio_cond_noise_aug": -Infinity}', ["-Infinity"]),
    (b"{" + b'"a": {' * 100 + b"}" * 100 + b"}", ["nested deeper than 64"]),
    (b'{"keyframes": ' + b"[" * 100000 + b"]" * 100000 + b"}", ["nested deeper"]),
    (b"\xff\xfe{\x00}\x00", ["not UTF-8"]), (b"", ["not valid JSON"]), (b"{", ["not valid JSON"]),
    (b'\xef\xbb\xbf{"seed": 1}', ["not valid JSON"]),
    (b'{"seed": [' + b"0, " * 200000 + b"0]}", ["seed", "characters"]),
    (b'{"keyframes": {"resolved_frame_index": 0}}', ["keyframes", "a list"]),
    (b'{"sample_sigmas": "' + b"x" * 5000 + b'"}', ["sample_sigmas", "characters"]),
])
def test_malformed_payload_files(content, needles, inputs, out, capsys):
    _refused(capsys, inputs, out, content, *needles)


def test_a_payload_folder_or_a_missing_file(inputs, out, capsys):
    (out / "dir.json").mkdir()
    refused_inproc(capsys, ["generate", "--output", out / "o", "--inputs", inputs, "--payload", out / "dir.json"],
                   "payload file", "dir.json")
    refused_inproc(capsys, ["generate", "--output", out / "o", "--inputs", inputs, "--payload", out / "none.json"],
                   "payload file not found")
    assert not (out / "o").exists()


@pytest.mark.parametrize("key,needles", [
    ("sig_up", ["sample_sigmas", "non-increasing", "0.5 then 0.7", "indices 1, 2"]),
    ("sig_end", ["sample_sigmas", "trailing 0"]),
    ("sig_2d", ["sample_sigmas", "1-D"]),
    ("sig_nan", ["sample_sigmas", "finite"]),
])
def test_sample_sigmas(key, needles, inputs, out, capsys):
    _refused(capsys, inputs, out, json.dumps({"sample_sigmas": key}).encode(), *needles)


def test_sample_sigmas_may_repeat_a_value():
    c = conditioning_from_payload({"sample_sigmas": "s"}, {"s": torch.tensor([1.0, 0.5, 0.5, 0.0])})
    assert c.sample_sigmas.tolist() == [1.0, 0.5, 0.5, 0.0]


@pytest.mark.parametrize("key,found", [("kf_int", "torch.int32"), ("kf_bool", "torch.bool")])
def test_a_non_float_tensor_is_refused_naming_the_field(key, found, inputs, out, capsys):
    payload = {"keyframes": [{"resolved_frame_index": 0, "latent": key}]}
    _refused(capsys, inputs, out, json.dumps(payload).encode(), "keyframes[0].latent", "floating-point", found)


def test_a_nonfinite_fp8_latent_is_refused_naming_the_field(inputs, out, capsys):
    payload = {"keyframes": [{"resolved_frame_index": 0, "latent": "kf_fp8_nan"}]}
    _refused(capsys, inputs, out, json.dumps(payload).encode(), "keyframes[0].latent", "finite")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16,
                                   torch.float64])
def test_any_float_dtype_is_converted(dtype):
    """Every tensor of the payload arrives as float32 with the values of its stored dtype (fp8 included)."""
    kf = torch.randn(1, 24, 1, 4, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = torch.rand(1, 1, 2, 4, 4, generator=torch.Generator().manual_seed(2)).to(dtype)
    c = conditioning_from_payload({"keyframes": [{"resolved_frame_index": 0, "latent": "kf"}],
                                     "denoise_mask": "m"}, {"kf": kf, "m": mask})
    assert c.keyframes[0].latent.dtype == torch.float32 and c.denoise_mask.dtype == torch.float32
    assert torch.equal(c.keyframes[0].latent, kf.float()) and torch.equal(c.denoise_mask, mask.float())


def test_complex_tensor_refused_naming_the_field():
    with pytest.raises(ConditioningError, match=r"refs\[0\]\.latent: expected a floating-point tensor; found "
                                                r"torch\.complex64"):
        conditioning_from_payload({"refs": [{"kind": "image", "latent_h": 4, "latent_w": 4, "latent": "r"}]},
                                    {"r": torch.zeros(1, 24, 1, 4, 4, dtype=torch.complex64)})


def test_an_fp8_keyframe_latent_runs_as_its_float32_values(inputs, out, capsys):
    """End to end: the fp8 keyframe gives the same latents as the float32 tensor of its values."""
    from safetensors.torch import load_file

    from h3_blackwell.cli import main as cli

    t = load_file(str(inputs))
    t["kf_vals"] = t["kf_fp8"].float()
    both = out / "in2.safetensors"
    save_file(t, str(both))
    lat = {}
    for key in ("kf_fp8", "kf_vals"):
        p = out / f"{key}.json"
        p.write_text(json.dumps({"keyframes": [{"resolved_frame_index": 0, "latent": key}]}))
        assert cli.main(["generate", "--output", str(out / key), "--inputs", str(both), "--payload", str(p),
                         "--steps", "1", "--dense"]) == 0, capsys.readouterr().err
        lat[key] = load_file(str(out / key / "latents.safetensors"))
    for k in ("video", "audio"):
        assert torch.equal(lat["kf_fp8"][k], lat["kf_vals"][k]), k


@pytest.mark.parametrize("name,value,ok", [
    ("video", lambda t: t.to(torch.float8_e4m3fn), True), ("audio", lambda t: t.bfloat16(), True),
    ("text_states", lambda t: t.to(torch.float8_e5m2), True), ("video", lambda t: t.round().to(torch.int16), False),
    ("audio", lambda t: t > 0, False), ("text_states", lambda t: t.round().to(torch.int32), False),
])
def test_the_inputs_own_tensors_any_float_dtype(name, value, ok, inputs, out, capsys):
    """The latents and text states of --inputs: any float dtype is converted, anything else refused naming it."""
    from safetensors.torch import load_file

    from h3_blackwell.runtime import JobFiles, SamplingSettings, make_job

    t = load_file(str(inputs))
    t[name] = value(t[name])
    p = out / "in.safetensors"
    save_file(t, str(p))
    if ok:
        job = make_job(None, sampling=SamplingSettings(seed=0, steps=1), files=JobFiles(inputs=str(p)))
        assert job.inputs.text.dtype == torch.float32
        return
    refused_inproc(capsys, ["generate", "--output", out / "o", "--inputs", p, "--steps", "1"], name, "dtype",
                   "float")
    assert not (out / "o").exists()


def test_a_hostile_key_is_not_echoed_whole(inputs, out, capsys):
    _refused(capsys, inputs, out, json.dumps({"k" * 100000: 1}).encode(), "unknown field", "characters")
    _refused(capsys, inputs, out, json.dumps({"keyframes": [{"x" * 100000: 1}]}).encode(), "keyframes[0]",
             "characters")
