"""Latent previews: `generate --preview` writes an animated WebP of the final video latent; the sampler's
preview callback sees each step's denoised video estimate; a missing Pillow is one clear error."""

import sys

import pytest
import torch
from safetensors import safe_open

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime.sampling import preview as pv

Image = pytest.importorskip("PIL.Image")


def test_generate_preview_webp_frames_size_and_pixels(tmp_path):
    out = tmp_path / "o"
    assert cli.main(["generate", "--output", str(out), "--steps", "2", "--width", "256", "--height", "128",
                     "--frames", "22", "--preview"]) == 0
    with safe_open(str(out / "latents.safetensors"), "pt") as f:
        video = f.get_tensor("video")
    assert list(video.shape) == [1, 24, 7, 8, 16]  # 22 frames -> 7 latent frames; 256x128 -> 16x8
    im = Image.open(out / "preview.webp")
    assert im.format == "WEBP" and im.n_frames == 7 and im.size == (16, 8)  # one pixel per latent pixel
    want = pv.latent_to_rgb(video)
    for t in range(im.n_frames):  # lossless: each frame is exactly the projection of its latent frame
        im.seek(t)
        got = torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8).reshape(8, 16, 3)
        assert torch.equal(got, want[t]), t
    assert len(set(want.flatten().tolist())) > 16  # a real picture, not a constant


def test_latent_to_rgb_is_cores_linear_projection():
    """Random latent vs the float64 formula (x . factors + bias, [-1, 1] -> [0, 255]); uint8 rounding by
    truncation as core's previewer; tolerance 1 level for fp32 vs fp64 at a truncation boundary."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 24, 3, 5, 7, generator=g)
    f = torch.tensor(pv.LATENT_RGB_FACTORS, dtype=torch.float64)
    b = torch.tensor(pv.LATENT_RGB_BIAS, dtype=torch.float64)
    ref = (((x[0].double().movedim(0, -1) @ f + b) + 1) / 2).clamp(0, 1).mul(255).floor()
    got = pv.latent_to_rgb(x).double()
    assert got.shape == (3, 5, 7, 3) and float((got - ref).abs().max()) <= 1.0
    with pytest.raises(Exception, match=r"\[1, 24, T, H, W\]"):
        pv.latent_to_rgb(torch.zeros(1, 32, 2, 5))


def test_preview_callback_gets_each_steps_denoised_video():
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from fixtures.sampling import sample

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    seen = []
    video, audio = torch.zeros(1, 24, 2, 4, 6), torch.zeros(1, 32, 2, 4)
    text = torch.randn(1, 5, 5120, generator=torch.Generator().manual_seed(0))
    res = sample(rt, text, None, video, audio, seed=1, steps=3, sampler="euler",
                 preview=lambda d, n, x0: seen.append((d, n, x0.detach().cpu().clone())))
    assert [(d, n) for d, n, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert all(x0.shape == video.shape for _, _, x0 in seen)
    assert not torch.equal(seen[0][2], seen[1][2])
    # euler's last step lands on sigma 0, where the sample is the step's denoised estimate
    assert torch.allclose(seen[-1][2], res.video, rtol=0, atol=1e-6)


def test_generate_preview_without_pillow_is_one_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` raises ImportError
    assert cli.main(["generate", "--output", str(tmp_path / "o"), "--steps", "1", "--preview"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "Pillow" in err[0], err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
