"""A local diffusers-layout MiniMax H3 pipeline folder as ``generate --prompt`` uses it: its conditioner encodes the
prompt (and keyframes), its VAEs encode the keyframes and decode the latents our runtime samples; its transformer is
not used. Each stage runs diffusers' own blocks (``diffusers/modular_pipelines/minimax_h3/``: the keyframe resize,
the text encoder, the keyframe VAE encoder, the decoders) with only that stage's components loaded, on the run's
device, and frees them before the next stage, so the DiT and the pipeline's models are never on the device together.

:func:`open_pipeline` checks the folder from its JSON files alone (no weight read): every component present, and
their widths fitting the DiT (the conditioner's hidden size is the DiT's text width; the latent channels of the VAEs
its video / audio channels; more than 50 decoder layers, since H3 reads ``hidden_states[50]``). ``request`` then
checks the prompt against the conditioner's limit and reads the keyframe images, still before any model loads.
"""

from __future__ import annotations

import gc
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..budget import DeviceMemory
from ..errors import H3Error
from ..model.conditioning import H3Conditioning, Keyframe
from ..model.config import H3Config
from ..options import vram_budget_bytes

__all__ = ["PipelineFolder", "PromptRequest", "Decoded", "open_pipeline", "folder_transformer"]

COMPONENTS = ("tokenizer", "processor", "text_encoder", "vae", "audio_vae")
TEXT_LAYER = 50  # MiniMaxH3ModularPipeline.text_encoder_layer


class PipelineError(H3Error):
    """A pipeline folder, prompt or image that ``generate --prompt`` cannot use."""


@dataclass(frozen=True)
class PromptRequest:
    """What the conditioner and the VAE encode: the prompt, and the first / last keyframe images (PIL RGB) or None."""

    prompt: str
    first: object = None
    last: object = None

    @property
    def images(self) -> dict:
        return {k: v for k, v in (("image", self.first), ("last_image", self.last)) if v is not None}


@dataclass
class Decoded:
    """The decoded arrays before any codec: video [F, 3, H, W] in [0, 1] and audio [channels, samples] at ``rate``
    samples per second, fp32 on the CPU."""

    video: torch.Tensor
    audio: torch.Tensor
    rate: int


def _json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"{what}: expected a readable JSON file at {path}; found {type(e).__name__}: {e}; "
                            "point --pipeline at a diffusers MiniMax H3 folder (modular_model_index.json and one "
                            "folder per component)") from None


@dataclass
class PipelineFolder:
    """A checked pipeline folder: its path, the conditioner's token limit and the audio VAE's sample rate; the
    device budget of its stages (``budget``: bytes, None for the device's free memory) and where each ran."""

    path: Path
    max_tokens: int
    rate: int
    budget: int | None = None
    stages: dict = field(default_factory=dict)

    def _device(self, names: tuple, device: torch.device, what: str) -> torch.device:
        """Where a stage of components ``names`` runs: ``device``, or the CPU where their weights (at the load
        dtype, with a quarter more for activations) exceed the device budget, so the budget holds for the whole
        command; recorded in ``stages``."""
        if device.type == "cuda":
            need = 1.25 * sum(f.stat().st_size for n in names for f in (self.path / n).glob("*.safetensors"))
            free = self.budget if self.budget is not None else DeviceMemory.probe(device).free_bytes
            if need > free:
                device = torch.device("cpu")
        self.stages[what] = str(device)
        return device

    def request(self, prompt: str, first_frame=None, last_frame=None) -> PromptRequest:
        """The prompt checked against the conditioner's limit (tokenized with its tokenizer) and the images read;
        PipelineError otherwise. Nothing is loaded but the tokenizer."""
        from transformers import AutoTokenizer

        if not prompt or not prompt.strip():
            raise PipelineError("--prompt: expected some text; found an empty prompt")
        tok = AutoTokenizer.from_pretrained(str(self.path / "tokenizer"))
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        if n > self.max_tokens:
            raise PipelineError(f"--prompt: expected at most {self.max_tokens} tokens (the conditioner's "
                                f"max_position_embeddings); found {n}; shorten the prompt")
        return PromptRequest(prompt, _image(first_frame, "--first-frame"), _image(last_frame, "--last-frame"))

    def _stage(self, blocks, device: torch.device):
        """diffusers' ``blocks`` as a pipeline over this folder, its components loaded onto ``device`` (bf16 on a
        GPU, fp32 on the CPU; diffusers keeps the modules it must in fp32)."""
        pipe = blocks.init_pipeline(str(self.path))
        pipe.load_components(torch_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        return pipe.to(device)

    def encode(self, req: PromptRequest, size: tuple[int, int, int], device: torch.device, seed: int):
        """Text states [1, L, text_dim] fp32, token tags [L] and the keyframe conditioning (None for t2va) of ``req``
        on a canvas ``size`` = (width, height, pixel frames): diffusers' resize, text encoder and keyframe VAE
        encoder blocks, the conditioner then the VAE loaded, used and freed in turn."""
        from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
        from diffusers.modular_pipelines.minimax_h3.encoders import (MiniMaxH3FL2VATextEncoderStep,
                                                                     MiniMaxH3KeyframeVaeEncoderStep,
                                                                     MiniMaxH3TextEncoderStep)

        width, height, frames = size
        images, keyframes, anchors = req.images, [], ()
        if images:
            pre = self._stage(MiniMaxH3ResizeStep(), torch.device("cpu"))
            out = pre(**images, height=height, width=width, output=["keyframes", "keyframe_anchors"])
            keyframes, anchors = out["keyframes"], out["keyframe_anchors"]
        step = MiniMaxH3FL2VATextEncoderStep() if keyframes else MiniMaxH3TextEncoderStep()
        pipe = self._stage(step, self._device(("text_encoder",), device, "encode"))
        out = pipe(prompt=req.prompt, **({"keyframes": keyframes} if keyframes else {}),
                   output=["prompt_embeds", "text_token_tags"])
        text, tags = out["prompt_embeds"].float().cpu(), out["text_token_tags"].long().cpu()
        _free(pipe)
        if not keyframes:
            return text, tags, None
        pipe = self._stage(MiniMaxH3KeyframeVaeEncoderStep(), self._device(("vae",), device, "keyframes"))
        latents = pipe(keyframes=keyframes, output="condition_latents")
        _free(pipe)
        kfs = tuple(Keyframe(0 if a == "first" else frames - 1, latent=z.float().cpu()) for a, z in zip(anchors, latents))
        return text, tags, H3Conditioning(keyframes=kfs, seed=int(seed))

    def decode(self, video: torch.Tensor, audio: torch.Tensor, device: torch.device) -> Decoded:
        """Our latents (video [1, C, T, H, W], audio [1, Ca, 2, Ta]) through diffusers' decode blocks (the VAEs
        loaded, used, freed) -> the decoded arrays."""
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3DecodeStep

        gc.collect()  # the sampling run's model is gone: its cached device memory goes back before the VAEs load
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        device = self._device(("vae", "audio_vae"), device, "decode")
        pipe = self._stage(MiniMaxH3DecodeStep(), device)
        out = pipe(latents=video.to(device), audio_latents=audio[0].permute(1, 0, 2).contiguous().to(device),
                   output_type="pt", output=["videos", "audio", "sampling_rate"])
        _free(pipe)
        return Decoded(out["videos"][0].float().cpu().contiguous(), out["audio"][0].float().cpu().contiguous(),
                       int(out["sampling_rate"]))


def _free(pipe) -> None:
    """Return a stage's device memory: its components leave the device (the caller drops the pipeline)."""
    if torch.cuda.is_available():
        pipe.to("cpu")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _image(path, flag: str):
    if path is None:
        return None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise PipelineError(f"{flag}: expected an image file (PNG, JPEG, WebP, ...); {path} could not be read "
                            f"({type(e).__name__}: {e})") from None


def open_pipeline(folder, cfg: H3Config, vram_budget="auto") -> PipelineFolder:
    """Check ``folder`` from its JSON files (module docstring) against the DiT's config -> a PipelineFolder whose
    stages keep to the device budget ``vram_budget`` (the option's form: auto, the device's free memory, or GB)."""
    missing_pkgs = [m for m in ("diffusers", "transformers", "torchvision", "av") if importlib.util.find_spec(m) is None]
    if missing_pkgs:
        raise PipelineError(f"--pipeline needs {', '.join(missing_pkgs)} (not installed): pip install "
                            "'h3-blackwell[pipeline]' (torchvision: the build matching your torch)")
    path = Path(folder)
    if not path.is_dir():
        raise PipelineError(f"--pipeline: expected a diffusers MiniMax H3 folder; {path} is not a folder")
    missing = [c for c in COMPONENTS if not (path / c).is_dir()]
    if missing:
        raise PipelineError(f"--pipeline {path}: expected the components {', '.join(COMPONENTS)}; missing "
                            f"{', '.join(missing)}")
    enc = _json(path / "text_encoder" / "config.json", "the conditioner's config")
    text = enc.get("text_config", enc)
    vae = _json(path / "vae" / "config.json", "the video VAE's config")
    avae = _json(path / "audio_vae" / "config.json", "the audio VAE's config")
    fits = [("the conditioner's hidden size", text.get("hidden_size"), cfg.text_dim, "text width"),
            ("the video VAE's latent channels", vae.get("latent_channels"), cfg.video_channels, "video channels"),
            ("the audio VAE's latent channels", avae.get("latent_channels"), cfg.audio_channels, "audio channels")]
    for what, found, want, dit in fits:
        if found != want:
            raise PipelineError(f"--pipeline {path}: {what} is {found}; the transformer's {dit} is {want}: the "
                                "checkpoint and the pipeline are of different models")
    layers = text.get("num_hidden_layers", 0)
    if layers <= TEXT_LAYER:
        raise PipelineError(f"--pipeline {path}: the conditioner has {layers} decoder layers; H3 reads the hidden "
                            f"state after layer {TEXT_LAYER}, so it needs more than {TEXT_LAYER}")
    return PipelineFolder(path, int(text.get("max_position_embeddings", 0)), int(avae.get("sampling_rate", 32000)),
                          vram_budget_bytes(vram_budget))


def folder_transformer(folder) -> str | None:
    """The folder's own transformer weights (``transformer/diffusion_pytorch_model.safetensors`` or its sharded
    index), which our loader reads in diffusers' naming; None when the folder has none."""
    base = Path(folder) / "transformer"
    for name in ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json"):
        if (base / name).is_file():
            return str(base / name)
    return None
