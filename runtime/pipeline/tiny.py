"""A tiny random diffusers-layout MiniMax H3 pipeline folder, built offline from diffusers' and transformers' own
classes: a byte-level tokenizer, a Qwen3-VL conditioner (its processor included), the video and audio VAEs, the two
schedulers and the transformer. Nothing is downloaded; the same seed writes the same weights.

The folder is what ``ModularPipeline.from_pretrained(folder)`` loads and what ``h3-blackwell generate --pipeline``
reads (tests, the bench and ``scripts/make_tiny_pipeline.py``). Its geometry is the released model's where the
pipeline hard-codes it (16x spatial / 17-to-5 temporal video compression, 800-sample audio hop at 32 kHz, the
conditioner read after decoder layer 50, so 51 layers), with tiny widths; the transformer is our tiny H3 in
diffusers naming (``transformer/diffusion_pytorch_model.safetensors``), which our loader reads as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..io.keys import comfy_to_diffusers_state_dict
from ..model.config import H3Config
from ..model.tiny import tiny_state_dict

__all__ = ["TinyPipeline", "save_tiny_pipeline", "tiny_components", "TINY_PIPELINE_DIT", "diffusers_kwargs"]

# the tiny transformer of the folder: every structural feature of H3, at widths a CPU runs in seconds
TINY_PIPELINE_DIT = H3Config(hidden_size=64, num_layers=2, num_refiner_layers=1, num_heads=2, head_dim=32,
                             ffn_hidden_size=96, text_dim=32, time_embed_hidden_size=64, time_embed_dim=32,
                             rope_inv_freq_len=4)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@dataclass(frozen=True)
class TinyPipeline:
    """What the folder holds: the transformer's config (its text_dim is the conditioner's width), the
    conditioner's decoder layers (> 50: the pipeline reads hidden_states[50]) and token limit, the VAEs' widths."""

    dit: H3Config = TINY_PIPELINE_DIT
    conditioner_layers: int = 51
    max_tokens: int = 256
    vae_width: int = 8
    audio_width: int = 8
    # the canvas rules (the release: 768 short edge, 768 x 1344 pixels, image references at a 2048 short edge): the
    # default canvas and every ref2va reference's are this small
    canvas_short_edge: int = 64
    canvas_max_pixels: int = 64 * 128
    reference_short_edge: int = 64
    seed: int = 0


def _byte_tokenizer():
    """A byte-level BPE with no merges (one token per UTF-8 byte) and Qwen's special tokens."""
    from transformers import Qwen2TokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> unicode table: printable bytes map to themselves, the rest above 255
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = 256
    tok = Qwen2TokenizerFast(vocab=vocab, merges=[], unk_token="<|endoftext|>", eos_token="<|endoftext|>",
                             pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def _processor(tok):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    sizes = dict(patch_size=8, merge_size=2, temporal_patch_size=2)
    image = Qwen2VLImageProcessor(**sizes, min_pixels=16 * 16, max_pixels=64 * 64)
    video = Qwen3VLVideoProcessor(**sizes, size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64 * 4})
    return Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video)


def _conditioner(tp: TinyPipeline, tok):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    text = dict(vocab_size=len(tok), hidden_size=tp.dit.text_dim, intermediate_size=48,
                num_hidden_layers=tp.conditioner_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                max_position_embeddings=tp.max_tokens,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=tp.dit.text_dim, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    return Qwen3VLForConditionalGeneration(cfg).eval()


def _vaes(tp: TinyPipeline, g: torch.Generator):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    c, ca, w = tp.dit.video_channels, tp.dit.audio_channels, tp.vae_width
    mean = lambda n: (0.1 * torch.randn(n, generator=g)).tolist()  # noqa: E731
    std = lambda n: (1.0 + 0.2 * torch.rand(n, generator=g)).tolist()  # noqa: E731
    vae = AutoencoderKLMiniMaxH3(latent_channels=c, block_out_channels=(w,) * 6, layers_per_block=1,
                                 norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
                                 decoder_attention_head_dim=8, decoder_num_register_tokens=1,
                                 latents_mean=tuple(mean(c)), latents_std=tuple(std(c)))
    audio = AutoencoderKLMiniMaxH3Audio(encoder_dim=tp.audio_width, latent_dim=2 * ca, latent_channels=ca,
                                        num_attention_heads=2, decoder_dim=16 * tp.audio_width,
                                        latents_mean=mean(ca), latents_std=std(ca))
    return vae.eval(), audio.eval()


def diffusers_kwargs(cfg: H3Config) -> dict:
    """``MiniMaxH3Transformer3DModel``'s constructor arguments for an H3 of ``cfg`` (its config names)."""
    return dict(num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_layers, num_refiner_layers=cfg.num_refiner_layers, ffn_dim=cfg.ffn_hidden_size,
                in_channels=cfg.video_channels, audio_in_channels=cfg.audio_channels, text_dim=cfg.text_dim,
                freq_dim=cfg.timestep_input_dim, time_embed_hidden_dim=cfg.time_embed_hidden_size,
                time_embed_dim=cfg.time_embed_dim, rope_freq_dim=cfg.rope_inv_freq_len)


def _transformer(cfg: H3Config, seed: int):
    from diffusers import MiniMaxH3Transformer3DModel

    m = MiniMaxH3Transformer3DModel(**diffusers_kwargs(cfg))
    m.load_state_dict(comfy_to_diffusers_state_dict(tiny_state_dict(cfg, seed=seed)), strict=False)
    return m.eval()


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    """Every parameter N(0, 1/fan_in) (norm weights 1 + N(0, 0.1)): random, never zeros, deterministic."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                base = 1.0 if "norm" in name or name.endswith(("alpha", "beta", "gamma")) else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)


def tiny_components(tiny: TinyPipeline = TinyPipeline(), transformer: bool = True) -> dict:
    """The pipeline's components by name (``update_components``' keywords): the tokenizer, processor, conditioner,
    VAEs, schedulers and, with ``transformer``, the stock transformer with our tiny weights of ``tiny.dit``."""
    from diffusers import MiniMaxH3Scheduler

    torch.manual_seed(tiny.seed)  # transformers / diffusers initialise some buffers from the global generator
    g = torch.Generator("cpu").manual_seed(tiny.seed)
    tok = _byte_tokenizer()
    encoder = _conditioner(tiny, tok)
    vae, audio_vae = _vaes(tiny, g)
    for m in (encoder, vae, audio_vae):
        _randomize(m, g)
    parts = dict(text_encoder=encoder, tokenizer=tok, processor=_processor(tok), vae=vae, audio_vae=audio_vae,
                 scheduler=MiniMaxH3Scheduler(shift=tiny.dit.shift_video),
                 audio_scheduler=MiniMaxH3Scheduler(shift=tiny.dit.shift_audio))
    if transformer:
        parts["transformer"] = _transformer(tiny.dit, tiny.seed)
    return parts


def save_tiny_pipeline(folder: str | Path, tiny: TinyPipeline = TinyPipeline()) -> Path:
    """Write the tiny pipeline into ``folder`` (created): every component ``MiniMaxH3ModularPipeline`` loads, in
    diffusers' layout (``modular_model_index.json`` and one sub-folder per component). -> the folder."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    folder = Path(folder)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**tiny_components(tiny), reference_image_short_edge=tiny.reference_short_edge,
                           canvas_short_edge=tiny.canvas_short_edge, canvas_max_pixels=tiny.canvas_max_pixels)
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    return folder
