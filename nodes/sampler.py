"""H3 Sampler: core's H3 CONDITIONING + H3 LATENT -> sampled LATENT (core's format) + H3_DIAGNOSTICS.

A thin adapter over ``runtime.sample``: it converts the ComfyUI types, forwards ComfyUI's progress bar and
interruption flag, and turns runtime input errors into one message on this node.
"""

from __future__ import annotations

from ..runtime.errors import H3Error, Interrupted
from ._common import CATEGORY, node_error, optional_comfy_module
from .conditioning import read_conditioning
from .latents import make_latent, pixel_frames, read_latent

SAMPLERS = ["euler", "res_multistep"]
SCHEDULERS = ["simple"]


def _progress_and_interrupt(steps: int):
    """(progress(done, total), interrupt() -> bool) bound to ComfyUI, or (None, None) outside it."""
    utils = optional_comfy_module("comfy.utils")
    mm = optional_comfy_module("comfy.model_management")
    progress = interrupt = None
    if utils is not None:
        bar = utils.ProgressBar(steps)

        def progress(done: int, total: int) -> None:
            # under the server this also runs ComfyUI's interrupt check (and may raise its exception)
            bar.update_absolute(done, total)
    if mm is not None:
        interrupt = mm.processing_interrupted
    return progress, interrupt


def _raise_interrupted(exc: Interrupted):
    """Hand an interruption back to ComfyUI as its own exception (the run then ends as 'interrupted')."""
    mm = optional_comfy_module("comfy.model_management")
    if mm is None:
        raise exc
    mm.throw_exception_if_processing_interrupted()  # raises and clears the flag when it is still set
    raise mm.InterruptProcessingException() from exc


class H3Sampler:
    TITLE = "H3 Sampler"
    DESCRIPTION = ("Samples an H3 audio+video latent with the resident model: flow schedule with separate video / "
                   "audio shifts, euler or res_multistep, CFG-free (one model pass per step). Outputs core's H3 "
                   "LATENT (for VAEDecode and VAEDecodeAudio) and the run's diagnostics.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT", "H3_DIAGNOSTICS")
    RETURN_NAMES = ("latent", "diagnostics")
    OUTPUT_TOOLTIPS = ("sampled video + audio latent, float32, in core's nested H3 format",
                       "the run report (backends, timings, latent sha256) for H3 Diagnostics")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("H3_MODEL", {"tooltip": "from H3 NVFP4 Model Loader"}),
            "positive": ("CONDITIONING", {"tooltip": "H3 text conditioning [1, L, 5120] (CLIPLoader type minimax + "
                                                     "CLIPTextEncode, MiniMaxH3ImageToVideo or H3 Text States Loader)"}),
            "latent": ("LATENT", {"tooltip": "H3 audio+video latent (EmptyMiniMaxH3LatentAV, MiniMaxH3ImageToVideo "
                                             "or H3 Empty Latent)"}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True,
                             "tooltip": "noise seed (CPU generator: video noise, then audio noise, as core)"}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 200, "tooltip": "sampling steps (model passes)"}),
            "sampler": (SAMPLERS, {"default": "res_multistep"}),
            "scheduler": (SCHEDULERS, {"default": "simple"}),
            "shift_video": ("FLOAT", {"default": 12.0, "min": 0.01, "max": 100.0, "step": 0.01,
                                      "tooltip": "sigma shift of the video stream (model default 12)"}),
            "shift_audio": ("FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.01,
                                      "tooltip": "sigma shift of the audio stream (model default 3)"}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
        }}

    def sample(self, model, positive, latent, seed: int, steps: int, sampler: str, scheduler: str,
               shift_video: float, shift_audio: float, denoise: float):
        from ..runtime import sample as run_sample
        from ..runtime.lora.apply import sync_loras

        if not hasattr(model, "config") or not hasattr(model, "model"):
            raise node_error(self.TITLE, f"model must come from H3 NVFP4 Model Loader; got {type(model).__name__}")
        cfg = model.config
        text, tags, keyframes = read_conditioning(positive, cfg.text_dim, self.TITLE)
        video, audio = read_latent(latent, self.TITLE, cfg.video_channels, cfg.audio_channels)
        if sampler not in SAMPLERS or scheduler not in SCHEDULERS:
            raise node_error(self.TITLE, f"sampler={sampler!r}, scheduler={scheduler!r}: expected a sampler in "
                                         f"{SAMPLERS} and a scheduler in {SCHEDULERS}")
        progress, interrupt = _progress_and_interrupt(int(steps))
        # the loader's model is shared and resident: make it carry exactly this graph's LoRAs (none if the
        # graph has no LoRA node), so a LoRA from an earlier prompt never leaks into this one
        sync_loras(model)
        try:
            res = run_sample(model, text, tags, video, audio, seed=int(seed), steps=int(steps), sampler=sampler,
                             scheduler=scheduler, shift_video=float(shift_video), shift_audio=float(shift_audio),
                             denoise=float(denoise), keyframes=keyframes, progress=progress, interrupt=interrupt,
                             workload_extra={"frames": pixel_frames(video.shape[2]), "host": "comfyui"})
        except Interrupted as e:
            _raise_interrupted(e)
        except H3Error as e:
            raise node_error(self.TITLE, str(e)) from e
        return (make_latent(res.video, res.audio), res.report)
