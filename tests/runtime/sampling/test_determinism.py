"""The default tiny run (``h3-blackwell generate`` with no model: the embedded tiny H3, seed 0, 256x256, 22 frames,
8 steps, random text of seed 1234) on this machine: the same bytes across runs and across processes, and close to
the float64 reference.

Float bytes are compared only within one machine: ATen's CPU kernels (AVX2, AVX512, NEON, ...) round
differently, so no test pins them across machines. Across the math, the latents are compared with the float64
reference at a stated tolerance instead."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))

import core_sampling  # noqa: E402

from h3_blackwell.cli.main import main  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.tiny import tiny_state_dict  # noqa: E402
from h3_blackwell.runtime.sampling.schedule import get_sigmas  # noqa: E402

MODES = {"nvfp4": [], "dense": ["--dense"]}


def _clean_env(monkeypatch):
    for var in [k for k in os.environ if k.startswith("H3_")]:
        monkeypatch.delenv(var)


def _latents(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "latents.safetensors"))


def _hashes(lat: dict[str, torch.Tensor]) -> tuple[str, str]:
    return tuple(hashlib.sha256(lat[k].contiguous().numpy().tobytes()).hexdigest() for k in ("video", "audio"))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_default_tiny_run_is_the_same_across_runs_and_processes(mode, tmp_path, monkeypatch):
    """Two measured runs in one process and a run in a fresh process give identical latent bytes (CPU here; the
    report's latent_checksums are the sha256 of exactly these bytes)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path (the GPU run's determinism is checked by the GPU benches)")
    _clean_env(monkeypatch)
    here = tmp_path / "here"
    assert main(["generate", "--output", str(here), "--runs", "2", *MODES[mode]]) == 0
    report = json.loads((here / "report.json").read_text())
    assert report["latent_checksums"]["exact_across_measured_runs"] is True
    got = _hashes(_latents(here))
    assert got == (report["latent_checksums"]["video_sha256"], report["latent_checksums"]["audio_sha256"])
    other = tmp_path / "other"
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    r = subprocess.run([sys.executable, "-m", "h3_blackwell.cli", "generate", "--output", str(other), *MODES[mode]],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _hashes(_latents(other)) == got, f"{mode}: another process gave other bytes"


@pytest.mark.slow
def test_default_tiny_run_against_the_float64_reference(tmp_path, monkeypatch):
    """The default tiny canvas, 3 euler steps (the oracle is slow): the dense fp32 run equals a float64 euler run of core's
    sampler math around the float64 oracle of core's model (tests/oracles) within 1e-5 rel-L2 (fp32 rounding over
    3 steps; measured ~1e-6); the default NVFP4 run (W4A4: activations and weights quantized) stays within 4e-2 of
    the dense run (one W4A4 forward on random weights is ~5 % off, the sampler averages it; measured ~1 % on
    res_multistep)."""
    if torch.cuda.is_available():
        pytest.skip("CPU reference run")
    _clean_env(monkeypatch)
    common = ["--sampler", "euler", "--steps", "3", "--device", "cpu"]
    assert main(["generate", "--output", str(tmp_path / "dense"), "--dense", "--dtype", "float32", *common]) == 0
    assert main(["generate", "--output", str(tmp_path / "nvfp4"), *common]) == 0
    dense, nvfp4 = _latents(tmp_path / "dense"), _latents(tmp_path / "nvfp4")
    text = torch.randn(1, 32, TINY.text_dim, generator=torch.Generator().manual_seed(1234))  # generate's default
    sigmas = get_sigmas("simple", 3, TINY.shift_video, 1.0)
    video0, audio0 = torch.zeros_like(dense["video"]), torch.zeros_like(dense["audio"])
    ov, oa = core_sampling.core_sample_euler(tiny_state_dict(TINY, seed=0), video0, audio0, text, None, {}, 440420,
                                             sigmas)
    assert _rel(dense["video"], ov) <= 1e-5 and _rel(dense["audio"], oa) <= 1e-5, (_rel(dense["video"], ov),
                                                                                  _rel(dense["audio"], oa))
    for k in ("video", "audio"):
        assert _rel(nvfp4[k], dense[k]) <= 4e-2, (k, _rel(nvfp4[k], dense[k]))
