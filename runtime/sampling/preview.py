"""Latent previews of the H3 video latent: a linear latent -> RGB projection, and an animated WebP.

The projection is ComfyUI core's latent -> RGB approximation for the H3 video latent (the
``latent_rgb_factors`` [24, 3] and ``latent_rgb_factors_bias`` [3] of ``MiniMaxH3Video`` in
``comfy/latent_formats.py``), so a preview here looks like core's live preview of the same latent. It needs
no VAE: each latent pixel becomes one RGB pixel (``rgb = latent . factors + bias``, mapped from [-1, 1] to
[0, 255] as core's previewer does), so a preview is the latent's size, H/16 x W/16 of the video.

Pillow is optional for the runtime: only ``write_preview_webp`` needs it, and says so when it is missing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import H3Error

# ComfyUI core's MiniMaxH3Video.latent_rgb_factors: row c = the RGB contribution of latent channel c.
LATENT_RGB_FACTORS = (
    (-0.018555, 0.024344, -0.017536), (0.150164, 0.137244, 0.129221), (0.027367, -0.050369, -0.208606),
    (-0.000793, -0.164622, -0.323161), (-0.048556, 0.013970, -0.074286), (0.011740, 0.014172, -0.006906),
    (0.061517, 0.061212, 0.110025), (0.035321, 0.086879, 0.110059), (-0.017426, 0.002997, 0.035356),
    (0.531539, 0.548819, 0.624404), (-0.024968, -0.040234, -0.034302), (-0.032549, -0.029096, -0.017221),
    (0.022609, 0.020286, 0.050661), (-0.084001, -0.038131, -0.020805), (-0.018830, 0.010412, 0.061120),
    (0.020777, 0.011196, -0.030994), (-0.008390, -0.012201, -0.025687), (-0.013281, -0.002924, 0.006331),
    (0.000260, 0.001833, -0.011038), (0.105471, 0.100482, 0.132106), (0.016529, 0.015213, 0.009999),
    (-0.014015, -0.017438, -0.019134), (-0.033787, -0.009984, -0.019725), (0.004224, 0.017284, 0.027196),
)
LATENT_RGB_BIAS = (0.057426, -0.022078, -0.071449)
PREVIEW_FPS = 24.0 / 4.0  # one latent frame stands for ~4 pixel frames at 24 fps (temporal /4)


def latent_to_rgb(video: torch.Tensor) -> torch.Tensor:
    """Video latent [1, 24, T, H, W] (any float dtype, any device) -> uint8 frames [T, H, W, 3] on the CPU."""
    if video.dim() != 5 or video.shape[0] != 1 or video.shape[1] != len(LATENT_RGB_FACTORS):
        raise H3Error(f"a preview needs an H3 video latent [1, {len(LATENT_RGB_FACTORS)}, T, H, W]; found "
                      f"{list(video.shape)}")
    x = video[0].detach().to("cpu", torch.float32).movedim(0, -1)  # [T, H, W, 24]
    rgb = x @ torch.tensor(LATENT_RGB_FACTORS) + torch.tensor(LATENT_RGB_BIAS)
    return ((rgb + 1.0) / 2.0).clamp(0.0, 1.0).mul(255.0).to(torch.uint8)


def _pillow_image():
    try:
        from PIL import Image
    except ImportError:
        raise H3Error("the preview needs Pillow, which is not installed; install it (pip install pillow, or "
                      "the h3-blackwell[preview] extra) or leave out --preview") from None
    return Image


def check_preview_available() -> None:
    """Raise H3Error now (before a long run) when Pillow is missing."""
    _pillow_image()


def write_preview_webp(video: torch.Tensor, path: str | Path, fps: float = PREVIEW_FPS) -> Path:
    """Write an animated WebP of the video latent [1, 24, T, H, W]: T frames of W x H pixels (lossless, looping)."""
    image = _pillow_image()
    frames = [image.fromarray(f.numpy(), "RGB") for f in latent_to_rgb(video)]
    path = Path(path)
    frames[0].save(path, format="WEBP", save_all=True, append_images=frames[1:], duration=round(1000.0 / fps),
                   loop=0, lossless=True)
    return path
