"""The CLI: the default tiny run, forward, make-tiny, and one clear error line for each bad input."""

import dataclasses
import hashlib
import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime.errors import Interrupted


def _run(args, timeout=300):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "h3_blackwell.cli.main", *args], capture_output=True, text=True,
                       timeout=timeout)
    return p, time.perf_counter() - t0


def test_generate_default_runs_fast_and_deterministic(tmp_path):
    p, secs = _run(["generate", "--output", str(tmp_path / "a")])
    assert p.returncode == 0, p.stderr
    assert secs < 60, secs  # acceptance: under 60 s on a 2-core CPU (process start included)
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    with safe_open(str(tmp_path / "a" / "latents.safetensors"), "pt") as f:
        v = f.get_tensor("video")
    assert hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() == \
        rep["latent_checksums"]["video_sha256"]
    assert rep["workload"]["frames"] == 22 and rep["model"]["source"].startswith("embedded tiny")


def test_generate_in_process_same_and_other_seed(tmp_path):
    assert cli.main(["generate", "--output", str(tmp_path / "a"), "--steps", "2", "--runs", "3"]) == 0
    assert cli.main(["generate", "--output", str(tmp_path / "b"), "--steps", "2"]) == 0
    assert cli.main(["generate", "--output", str(tmp_path / "c"), "--steps", "2", "--seed", "1"]) == 0
    ra, rb, rc = (json.loads((tmp_path / d / "report.json").read_text())["latent_checksums"] for d in "abc")
    assert ra["exact_across_measured_runs"] is True
    assert ra["video_sha256"] == rb["video_sha256"] and ra["audio_sha256"] == rb["audio_sha256"]
    assert ra["video_sha256"] != rc["video_sha256"]


def test_interrupted_generate_writes_nothing(tmp_path, monkeypatch, capsys):
    import h3_blackwell.runtime.sampling.sampler as sampler_mod

    real = sampler_mod.sample

    def interrupted(*a, **k):
        k["hooks"] = dataclasses.replace(k["hooks"], interrupt=iter([False, True]).__next__)
        return real(*a, **k)

    monkeypatch.setattr(sampler_mod, "sample", interrupted)
    out = tmp_path / "x"
    assert cli.main(["generate", "--output", str(out), "--steps", "3"]) == 130
    assert not any(out.rglob("*")) if out.exists() else True
    assert "nothing was written" in capsys.readouterr().err
    monkeypatch.setattr(sampler_mod, "sample", real)
    assert cli.main(["generate", "--output", str(tmp_path / "y"), "--steps", "3"]) == 0
    assert cli.main(["generate", "--output", str(tmp_path / "z"), "--steps", "3"]) == 0
    y, z = (json.loads((tmp_path / d / "report.json").read_text())["latent_checksums"] for d in "yz")
    assert y == z
    _ = Interrupted


def _one_error_line(args, capsys, *needles):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], (n, err[0])


def test_error_frames_off_grid(tmp_path, capsys):
    _one_error_line(["generate", "--output", str(tmp_path), "--frames", "30"], capsys, "17k+5", "39", "--snap")
    assert cli.main(["generate", "--output", str(tmp_path / "s"), "--frames", "30", "--snap", "--steps", "1"]) == 0
    assert json.loads((tmp_path / "s" / "report.json").read_text())["workload"]["frames"] == 39


def test_error_width_not_multiple_of_32(tmp_path, capsys):
    _one_error_line(["generate", "--output", str(tmp_path), "--width", "250"], capsys, "width=250", "multiple of 32")


def test_error_text_states_wrong_width(tmp_path, capsys):
    p = tmp_path / "ts.safetensors"
    save_file({"text_states": torch.randn(1, 7, 4096)}, str(p))
    _one_error_line(["generate", "--output", str(tmp_path / "o"), "--text-states", str(p)], capsys,
                    "[1, 7, 4096]", "[1, L, 5120]")


def test_error_missing_files(tmp_path, capsys):
    _one_error_line(["generate", "--output", str(tmp_path), "--model", str(tmp_path / "no.safetensors")], capsys,
                    "not found")
    _one_error_line(["generate", "--output", str(tmp_path), "--text-states", str(tmp_path / "no.safetensors")], capsys,
                    "not found")


def test_text_states_file_with_tags(tmp_path):
    p = tmp_path / "ts.safetensors"
    save_file({"text_states": torch.randn(1, 6, 5120), "token_tags": torch.tensor([1, 0, 0, 1, 1, 1])}, str(p))
    assert cli.main(["generate", "--output", str(tmp_path / "o"), "--text-states", str(p), "--steps", "1"]) == 0
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["workload"]["text_tokens"] == 6


def test_make_tiny_deterministic_and_forward(tmp_path):
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    assert cli.main(["make-tiny", str(a), "--seed", "3"]) == 0
    assert cli.main(["make-tiny", str(b), "--seed", "3"]) == 0
    assert cli.main(["make-tiny", str(c), "--seed", "4"]) == 0
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    g = torch.Generator().manual_seed(0)
    inp = {"video": torch.randn(1, 24, 2, 5, 6, generator=g), "audio": torch.randn(1, 32, 2, 4, generator=g),
           "text_states": torch.randn(1, 4, 5120, generator=g), "sigma": torch.tensor([0.5])}
    save_file(inp, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    assert cli.main(["forward", "--model", str(a), "--inputs", str(tmp_path / "in.safetensors"),
                     "--out", str(out)]) == 0
    with safe_open(str(out), "pt") as f:
        v, au = f.get_tensor("video"), f.get_tensor("audio")
    assert v.shape == inp["video"].shape and au.shape == inp["audio"].shape
    # equals the reference model evaluated directly on the same weights (bf16 file -> fp32 compute, dense
    # linears, exact attention): `forward` is the reference evaluation by default
    from h3_blackwell.runtime import RuntimeOptions, load_model

    m = load_model(a, RuntimeOptions(device="cpu", dtype="float32", quantize=False)).model
    with torch.no_grad():
        ev, ea = m(inp["video"], inp["audio"], inp["text_states"], 0.5)
    assert torch.equal(v, ev) and torch.equal(au, ea)


@pytest.mark.parametrize("missing", ["sigma", "video"])
def test_forward_input_errors(tmp_path, capsys, missing):
    a = tmp_path / "a.safetensors"
    cli.main(["make-tiny", str(a)])
    inp = {"video": torch.randn(1, 24, 2, 4, 4), "audio": torch.randn(1, 32, 2, 4),
           "text_states": torch.randn(1, 4, 5120), "sigma": torch.tensor([0.5])}
    del inp[missing]
    save_file(inp, str(tmp_path / "in.safetensors"))
    capsys.readouterr()
    _one_error_line(["forward", "--model", str(a), "--inputs", str(tmp_path / "in.safetensors"),
                     "--out", str(tmp_path / "o.safetensors")], capsys, missing)


def test_act_format_flag(tmp_path):
    """--act-format reaches the stack; fp8 with the fp8 GEMM backend runs W4A8 (on the CPU too) and the report
    says so; auto on the CPU (emulated GEMMs) keeps NVFP4 activations."""
    assert cli.main(["generate", "--output", str(tmp_path / "w"), "--steps", "1", "--gemm", "fp8",
                     "--act-format", "fp8"]) == 0
    rep = json.loads((tmp_path / "w" / "report.json").read_text())
    assert rep["backends"]["act_format"]["choice"] == "fp8" and rep["configuration"]["H3_ACT_FORMAT"] == "fp8"
    assert rep["fc2_dispatch"]["consistent_with_configuration"] is True
    assert cli.main(["generate", "--output", str(tmp_path / "n"), "--steps", "1"]) == 0
    rep = json.loads((tmp_path / "n" / "report.json").read_text())
    assert rep["backends"]["act_format"]["choice"] == "nvfp4"


def test_quantize_says_what_it_wrote(tmp_path, capsys):
    src, out = tmp_path / "tiny.safetensors", tmp_path / "tiny_nvfp4.safetensors"
    assert cli.main(["make-tiny", str(src)]) == 0
    assert cli.main(["quantize", str(src), str(out)]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    # the tiny model: 3 blocks x (qkv, out_proj, fc1, fc2)
    assert said.startswith(f"wrote {out}: 12 block linears as NVFP4 (comfy_quant format \"nvfp4\"") and \
        said.endswith(f"; {out.stat().st_size:,} bytes"), said


def test_generate_flags_take_every_value_the_options_accept(tmp_path, capsys):
    """The backend flags list runtime.CHOICES (sdpa_cudnn, float16, act_scale, precision ...) and --fc2 the
    FC2_MODES; a value outside them is a usage error naming the accepted ones."""
    from h3_blackwell.cli.parser import build_parser
    from h3_blackwell.runtime import CHOICES, FC2_MODES

    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices["generate"]
    flags = {a.dest: a for a in sub._actions}
    for name in ("dtype", "attention", "gemm", "act_format", "act_scale", "precision"):
        assert tuple(flags[name].choices) == CHOICES[name] and flags[name].default is None, name
    assert tuple(flags["fc2"].choices) == tuple(FC2_MODES)
    a = sub.parse_args(["--output", "o", "--attention", "sdpa_cudnn", "--dtype", "float16", "--precision", "exact",
                        "--act-scale", "calibrated", "--fc2", "strict"])
    assert (a.attention, a.dtype, a.precision, a.act_scale, a.fc2) == ("sdpa_cudnn", "float16", "exact",
                                                                       "calibrated", "strict")
    assert cli.main(["generate", "--output", str(tmp_path / "o"), "--attention", "flash9"]) == 2
    assert "invalid choice: 'flash9' (choose from 'auto', 'sage2'" in capsys.readouterr().err
