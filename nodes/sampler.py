"""H3 Sampler: core's H3 CONDITIONING + H3 LATENT -> sampled LATENT (core's format) + H3_DIAGNOSTICS.

A thin adapter over the runtime's job (``runtime.tensor_job`` validates once, ``runtime.run`` samples): it
converts the ComfyUI types (the conditioning entries of core's MiniMaxH3ImageToVideo / MiniMaxH3AddGuide /
MiniMaxH3ReferenceToVideo and the latent's noise mask become the runtime's ``H3Conditioning``), forwards
ComfyUI's progress bar (with live latent previews), the interruption flag, and turns runtime input errors into
one message on this node.
"""

from __future__ import annotations

import dataclasses

from ..runtime import (SPARSE_METHODS, ConditioningError, H3Error, Hooks, Interrupted, LossySettings, RuntimeOptions,
                       SampleInputs, SamplingSettings, latent_to_rgb, nonfinite_message, tensor_job)
from ..runtime import run as run_job
from ._common import CATEGORY, intermediate_device, keyword_inputs, node_error, optional_comfy_module
from .conditioning import read_conditioning, with_source
from .latents import batch_index_of, pixel_frames, read_latent, read_noise_mask, sampled_latent

SAMPLERS = ["euler", "res_multistep"]
SPARSE_TAU = RuntimeOptions.sparse_tau  # core's default, written once in runtime/options.py
SPARSE_KEEP_PERCENT = RuntimeOptions.sparse_keep_percent
SCHEDULERS = ["simple"]


def _previewer():
    """x0 video latent [1, 24, T, H, W] -> a preview for ComfyUI's progress bar, or None when previews are off
    or outside ComfyUI. Core's own previewer for its ``MiniMaxH3Video`` latent format when the running ComfyUI
    has it (core's latent->RGB factors, the user's --preview-method); on an older core our copy of the same
    projection (``runtime.sampling.preview``), also only when --preview-method is not 'none'."""
    lp = optional_comfy_module("latent_preview")
    if lp is None:
        return None
    formats = optional_comfy_module("comfy.latent_formats")
    if formats is not None and hasattr(formats, "MiniMaxH3Video"):
        core = lp.get_previewer(intermediate_device(), formats.MiniMaxH3Video())
        return None if core is None else (lambda x0: core.decode_latent_to_preview_image("JPEG", x0))
    method = getattr(getattr(lp, "args", None), "preview_method", None)
    if method is None or str(getattr(method, "value", method)).lower() in ("none", "nopreviews"):
        return None
    max_size = getattr(lp, "MAX_PREVIEW_RESOLUTION", 512)
    return lambda x0: ("JPEG", preview_image(x0), max_size)


def preview_image(x0):
    """The first latent frame of x0 [1, 24, T, H, W] as a PIL RGB image of W x H pixels (one per latent pixel)."""
    from PIL import Image  # ComfyUI brings Pillow; this runs only inside it

    return Image.fromarray(latent_to_rgb(x0[:, :, :1])[0].numpy(), "RGB")


def _callbacks(steps: int):
    """(progress(done, total), preview(done, total, x0), interrupt() -> bool) bound to ComfyUI's progress bar
    (with live previews when ComfyUI shows them) and interruption flag; all None outside ComfyUI."""
    utils = optional_comfy_module("comfy.utils")
    mm = optional_comfy_module("comfy.model_management")
    progress = preview = interrupt = None
    if utils is not None:
        bar = utils.ProgressBar(steps)
        to_image = _previewer()
        # under the server each update also runs ComfyUI's interrupt check (and may raise its exception)
        if to_image is None:
            def progress(done: int, total: int) -> None:
                bar.update_absolute(done, total)
        else:
            def preview(done: int, total: int, x0) -> None:
                bar.update_absolute(done, total, to_image(x0))
    if mm is not None:
        interrupt = mm.processing_interrupted
    return progress, preview, interrupt


def _noise_masked(payload: dict, latent: dict, video, audio, seed: int, title: str) -> dict:
    """Core's H3 payload with the latent's noise mask (video and audio streams) and the sampler's seed."""
    video_mask, audio_mask = read_noise_mask(latent, video.shape, audio.shape, title)
    return {**payload, "denoise_mask": video_mask, "audio_denoise_mask": audio_mask, "seed": int(seed)}


def _job(model, inputs: SampleInputs, sampling: SamplingSettings, title: str, **job):
    """The runtime's job, validated once before any work: the CLI's request checks (finite text states of the
    right shape, finite latents, the seed and step count, the memory estimate against what the model's device
    has free), then core's payload (``inputs.conditioning``) as the runtime's H3Conditioning (its errors name
    the graph input)."""
    try:
        return tensor_job(model, inputs, sampling, ("positive", "latent"), **job)
    except ConditioningError as e:
        raise node_error(title, with_source(str(e))) from e
    except H3Error as e:
        raise node_error(title, str(e)) from e


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
                   "audio shifts, euler or res_multistep, CFG-free (one model pass per step). Takes core's H3 "
                   "conditioning as is: first/last frames, guides (image, clip, audio) and references (images, "
                   "videos with soundtrack, audio), and a latent noise mask. Outputs core's H3 LATENT (for "
                   "VAEDecode and VAEDecodeAudio) and the run's diagnostics; shows live previews while sampling.")
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
            "positive": ("CONDITIONING", {"tooltip": "H3 conditioning [1, L, 5120] (CLIPLoader type minimax + "
                                                     "CLIPTextEncode, MiniMaxH3ImageToVideo, MiniMaxH3AddGuide, "
                                                     "MiniMaxH3ReferenceToVideo or H3 Text States Loader)"}),
            "latent": ("LATENT", {"tooltip": "H3 audio+video latent (EmptyMiniMaxH3LatentAV, MiniMaxH3ImageToVideo, "
                                             "MiniMaxH3ReferenceToVideo or H3 Empty Latent), optionally with a "
                                             "noise mask (SetLatentNoiseMask: 0 keeps the latent, 1 generates)"}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True,
                             "tooltip": "noise seed (CPU generator: video noise, then audio noise, as core)"}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 200, "tooltip": "sampling steps (model passes)"}),
            "sampler": (SAMPLERS, {"default": "res_multistep", "tooltip": "sampling method (core's samplers of the "
                                                                          "same names, flow matching)"}),
            "scheduler": (SCHEDULERS, {"default": "simple", "tooltip": "sigma schedule before the shifts (core's "
                                                                       "'simple')"}),
            "shift_video": ("FLOAT", {"default": 12.0, "min": 0.01, "max": 100.0, "step": 0.01,
                                      "tooltip": "sigma shift of the video stream (model default 12)"}),
            "shift_audio": ("FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.01,
                                      "tooltip": "sigma shift of the audio stream (model default 3)"}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip": (
                "1 = generate from noise; below 1 keeps that much of the input latent (above 0: the runtime needs "
                "at least part of one step)")}),
        }, "optional": {
            "sparse_tau": ("FLOAT", {"default": SPARSE_TAU, "min": 0.0, "max": 4.0, "step": 0.05, "tooltip": (
                "LOSSY, only when the loader's attention is sparse: routing threshold (higher = sparser, faster, "
                f"less accurate; core's default {SPARSE_TAU}). Dense for the first "
                f"{RuntimeOptions.sparse_start:.0%} of the schedule.")}),
            "first_block_cache": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": (
                "LOSSY step reuse (First-Block Cache): skip blocks 1.. when the first block's change is within this "
                "relative L1 of the last computed step's; 0 = off (peers use 0.05-0.1)")}),
            "sparse_method": (["loader"] + list(SPARSE_METHODS), {"default": "loader", "tooltip": (
                "LOSSY, only when the loader's attention is sparse: this run's method (loader = the loader's); sla "
                "with SLA LoRAs, vsa with FastH3")}),
            "sparse_keep_percent": ("FLOAT", {"default": SPARSE_KEEP_PERCENT, "min": 0.5, "max": 95.0, "step": 0.5,
                                              "tooltip": "sla / vsa (this run's method): percent of key blocks kept"}),
        }}

    def sample(self, model, positive, latent, **widgets):
        """ComfyUI's FUNCTION: INPUT_TYPES' widgets (seed, steps, sampler, ... first_block_cache) as keywords."""
        if not hasattr(model, "config") or not hasattr(model, "model"):
            raise node_error(self.TITLE, f"model must come from H3 NVFP4 Model Loader; got {type(model).__name__}")
        w = keyword_inputs(self, widgets)
        seed, steps, sampler, scheduler = w["seed"], w["steps"], w["sampler"], w["scheduler"]
        shift_video, shift_audio, denoise = w["shift_video"], w["shift_audio"], w["denoise"]
        sparse_tau, first_block_cache = w["sparse_tau"], w["first_block_cache"]
        cfg = model.config
        text, tags, payload = read_conditioning(positive, cfg.text_dim, self.TITLE)
        video, audio = read_latent(latent, self.TITLE, cfg.video_channels, cfg.audio_channels)
        batch_index = batch_index_of(latent, self.TITLE)
        if sampler not in SAMPLERS or scheduler not in SCHEDULERS:
            raise node_error(self.TITLE, f"sampler={sampler!r}, scheduler={scheduler!r}: expected a sampler in "
                                         f"{SAMPLERS} and a scheduler in {SCHEDULERS}")
        payload = _noise_masked(payload, latent, video, audio, seed, self.TITLE)
        control = None
        fc = getattr(model, "fun_control", None)  # H3 Fun ControlNet: its hint for this latent, its tower
        if fc is not None:
            try:
                payload["control"] = fc.hint(video.shape, float(shift_video))
                control = fc.tower(model, (video.shape, audio.shape), text.shape[1], int(steps))
            except H3Error as e:
                raise node_error(self.TITLE, f"Fun ControlNet: {e}") from e
        progress, preview, interrupt = _callbacks(int(steps))
        # the loader's model is shared and resident: the run makes it carry exactly this graph's LoRAs (none if
        # the graph has no LoRA node), so a LoRA from an earlier prompt never leaks into this one
        settings = SamplingSettings(int(seed), int(steps), sampler, scheduler, float(denoise), float(shift_video),
                                    float(shift_audio), batch_index)
        lossy = LossySettings(float(sparse_tau) if getattr(model, "sparse", None) is not None else None,
                              float(first_block_cache) if first_block_cache > 0 else None,
                              _run_sparse(model, w["sparse_method"], sparse_tau, w["sparse_keep_percent"]))
        job = _job(model, SampleInputs(text, tags, video, audio, payload), settings, self.TITLE, lossy=lossy,
                   hooks=Hooks(preview=preview, interrupt=interrupt),
                   progress=None if progress is None else (lambda: progress),
                   workload_extra={"frames": pixel_frames(video.shape[2]), "host": "comfyui"}, control=control)
        try:
            res = run_job(job)
        except Interrupted as e:
            _raise_interrupted(e)
        except H3Error as e:
            raise node_error(self.TITLE, str(e)) from e
        if res.report.get("latents_finite") is False:
            raise node_error(self.TITLE, nonfinite_message(res.report["nonfinite"]))
        return (sampled_latent(res.video, res.audio, latent), res.report)


def _run_sparse(model, method, tau, keep_percent):
    """This run's sparse settings from the sampler's widgets: None (the loader's) unless a method is chosen here
    on a model loaded with attention=sparse (elsewhere the loader's attention runs and the widgets do nothing)."""
    sparse = getattr(model, "sparse", None)
    if sparse is None or method in (None, "", "loader"):
        return None
    keep = SPARSE_KEEP_PERCENT if keep_percent is None else float(keep_percent)
    return dataclasses.replace(sparse.settings, method=method, tau=float(tau), keep_percent=keep)
