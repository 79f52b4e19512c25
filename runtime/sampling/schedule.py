"""Flow schedule, samplers and the audio carry, equal to ComfyUI core for H3.

- ``ModelSamplingDiscreteFlow``: a 1000-entry fp32 table sigma(t) = S*t / (1 + (S-1)*t), t = i/1000,
  i = 1..1000, with the video shift S = 12.
- ``simple`` scheduler: ``steps`` entries read backwards from the table at stride 1000/steps, then 0.
  denoise < 1 schedules int(steps/denoise) steps and keeps the last steps+1 sigmas.
- CONST (flow) model: denoised x0 = x - sigma * v; start x = sigma0 * noise + (1 - sigma0) * latent.
- euler: x += (x - x0)/sigma * (sigma_next - sigma).
- res_multistep (eta 0): Euler on the first step and onto sigma 0; otherwise the second-order RES
  update in t = -log(sigma) with phi functions, coefficients in fp32 like core's 0-d tensors.
- Audio carry (``ModelSamplingAV``): one schedule (video sigma). The sampler carries audio as
  y = audio_scale * x_audio (audio_scale = shift_video / shift_audio = 4); the model sees
  y * sigma_a / sigma_v and returns v_a; the carried velocity is
  v_y = (1 - s) * x_a + (1 + (s - 1) * sigma_a) * v_a. The result is divided by audio_scale.
"""

from __future__ import annotations

import torch

from ..errors import H3Error
from ..model.layout import time_shift_sigma

SAMPLERS = ("euler", "res_multistep")
SCHEDULERS = ("simple",)


def flow_sigma_table(shift: float, timesteps: int = 1000) -> torch.Tensor:
    """The model-sampling table [timesteps] fp32, computed with core's op order."""
    t = (torch.arange(1, timesteps + 1, 1) / timesteps) * 1000
    t = t / 1000
    if shift == 1.0:
        return t.float()
    return (shift * t / (1 + (shift - 1) * t)).float()


def simple_sigmas(steps: int, shift: float, denoise: float = 1.0) -> torch.Tensor:
    """``simple`` scheduler sigmas [steps + 1] fp32 ending in 0 (denoise < 1 keeps the tail)."""
    if steps < 1:
        raise H3Error(f"steps={steps}: need at least 1")
    if not 0.0 < denoise <= 1.0:
        raise H3Error(f"denoise={denoise}: expected 0 < denoise <= 1")
    total = steps if denoise >= 1.0 else int(steps / denoise)
    table = flow_sigma_table(shift)
    stride = len(table) / total
    # core builds all ``total`` sigmas and keeps the last steps + 1; only those are computed here (same values), so
    # a tiny denoise costs nothing
    sig = [float(table[-(1 + int(x * stride))]) for x in range(total - steps, total)] + [0.0]
    return torch.tensor(sig, dtype=torch.float32)


def get_sigmas(scheduler: str, steps: int, shift: float, denoise: float = 1.0) -> torch.Tensor:
    if scheduler not in SCHEDULERS:
        raise H3Error(f"scheduler {scheduler!r} is not supported; choose one of {', '.join(SCHEDULERS)}")
    return simple_sigmas(steps, shift, denoise)


def audio_scale(shift_video: float, shift_audio: float | None) -> float:
    return 1.0 if shift_audio is None else shift_video / shift_audio


def model_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """The video sigma the network sees: core passes timestep = sigma * 1000 and divides again (fp32)."""
    return ((sigma.float() * 1000) / 1000.0).clamp(min=1e-6)


def carry_in(y: torch.Tensor, sigma_v: torch.Tensor, shift_v: float, shift_a: float) -> torch.Tensor:
    """Carried audio y -> the stream's own latent x_a = y * sigma_a / sigma_v (fp32 0-d math, as core)."""
    sa = time_shift_sigma(sigma_v, shift_v, shift_a)
    return y * (sa / sigma_v).to(y.dtype)


def carry_out(v_a: torch.Tensor, x_a: torch.Tensor, sigma_v: torch.Tensor, shift_v: float, shift_a: float,
              scale: float) -> torch.Tensor:
    """Audio velocity in the stream's own space -> velocity of the carried variable."""
    sa = time_shift_sigma(sigma_v, shift_v, shift_a)
    return (1.0 - scale) * x_a + (1.0 + (scale - 1.0) * sa).to(v_a.dtype) * v_a


class Stepper:
    """One sampler's update rule over a list of tensors (video, carried audio), keeping its history."""

    def __init__(self, name: str, sigmas: torch.Tensor):
        if name not in SAMPLERS:
            raise H3Error(f"sampler {name!r} is not supported; choose one of {', '.join(SAMPLERS)}")
        self.name, self.sigmas = name, sigmas.float()
        self.old_denoised = None
        self.old_sigma_down = None

    def step(self, i: int, x: list, denoised: list) -> list:
        s, sn = self.sigmas[i], self.sigmas[i + 1]
        if self.name == "euler" or sn == 0 or self.old_denoised is None:
            dt = sn - s
            out = [xi + (xi - di) / s * dt for xi, di in zip(x, denoised)]
        else:
            t, t_old, t_next, t_prev = (-s.log(), -self.old_sigma_down.log(), -sn.log(), -self.sigmas[i - 1].log())
            h = t_next - t
            c2 = (t_prev - t_old) / h
            phi1 = torch.expm1(-h) / (-h)
            phi2 = (phi1 - 1.0) / (-h)
            b1 = torch.nan_to_num(phi1 - phi2 / c2, nan=0.0)
            b2 = torch.nan_to_num(phi2 / c2, nan=0.0)
            e = (-h).exp()
            out = [e * xi + h * (b1 * di + b2 * oi) for xi, di, oi in zip(x, denoised, self.old_denoised)]
        self.old_denoised = denoised
        self.old_sigma_down = sn
        return out
