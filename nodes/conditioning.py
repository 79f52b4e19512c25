"""H3 CONDITIONING: reading core's format for the sampler, and the H3 Text States Loader node.

Core's H3 CONDITIONING (CLIPLoader type "minimax" + CLIPTextEncode, or MiniMaxH3ImageToVideo)::

    [[cond [1, L, 5120] float32, {"minimax_token_tags": LongTensor [L]  (1 text, 0 vision tokens),
                                  "minimax_keyframes": [{"resolved_frame_index", "latent", "audio_latent"}]
                                      (MiniMaxH3ImageToVideo fl2va, MiniMaxH3AddGuide; optional),
                                  "minimax_refs": [{"kind": "image" | "video" | "video_audio" | "audio", ...}]
                                      (MiniMaxH3ReferenceToVideo; optional),
                                  "pooled_output": ...}]]
"""

from __future__ import annotations

import os
import re

import torch

from ._common import CATEGORY, file_stamp, input_directory, list_input_files, node_error

EMBEDDED_STATES = "embedded random (seed 1234, 32 tokens)"
# The same states as `h3-blackwell generate` without --text-states: a CPU generator seeded 1234, randn [1, 32, 5120].
EMBEDDED_SEED, EMBEDDED_TOKENS, TEXT_DIM = 1234, 32, 5120


# conditioning-dict entries that change what core's sampler computes and that the H3 Sampler does not do
_NOT_HONOURED = {
    "control": "a ControlNet (Apply ControlNet)", "area": "an area (ConditioningSetArea)",
    "mask": "a conditioning mask (ConditioningSetMask)", "hooks": "hooks (LoRA / model hooks on the conditioning)",
    "start_percent": "a timestep range (ConditioningSetTimestepRange)",
    "end_percent": "a timestep range (ConditioningSetTimestepRange)", "gligen": "GLIGEN boxes",
    "reference_latents": "reference latents (ReferenceLatent; H3 takes references from MiniMaxH3ReferenceToVideo)",
}
# core's H3 entries (MiniMaxH3ImageToVideo, MiniMaxH3AddGuide, MiniMaxH3ReferenceToVideo, the minimax CLIP) ->
# the runtime payload field (runtime.model.conditioning); minimax_token_tags is read separately
_PAYLOAD_FIELDS = {"minimax_keyframes": "keyframes", "minimax_refs": "refs",
                   "minimax_visual_cond_noise_aug": "visual_cond_noise_aug",
                   "minimax_audio_cond_noise_aug": "audio_cond_noise_aug"}

# the runtime's conditioning fields -> where they come from in a ComfyUI graph (for error messages)
PAYLOAD_SOURCES = {"keyframes": "minimax_keyframes (MiniMaxH3ImageToVideo / MiniMaxH3AddGuide)",
                   "refs": "minimax_refs (MiniMaxH3ReferenceToVideo)",
                   "denoise_mask": "the latent's noise_mask (video stream)",
                   "audio_denoise_mask": "the latent's noise_mask (audio stream)",
                   "visual_cond_noise_aug": "minimax_visual_cond_noise_aug",
                   "audio_cond_noise_aug": "minimax_audio_cond_noise_aug", "seed": "the sampler's seed"}


def with_source(message: str) -> str:
    """A runtime conditioning error (``refs[0].latent: expected ...``) prefixed with where its field comes from in
    the graph; unchanged when it names no conditioning field."""
    field = re.match(r"\w*", message).group()
    return f"{PAYLOAD_SOURCES[field]}: {message}" if field in PAYLOAD_SOURCES else message


def read_conditioning(positive, text_dim: int, title: str) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Core's H3 CONDITIONING -> (text_states [1, L, text_dim] fp32, token_tags LongTensor [L] or None, payload).

    payload: core's H3 entries under the runtime's field names (``keyframes``, ``refs``,
    ``visual_cond_noise_aug``, ``audio_cond_noise_aug``; see ``runtime.model.conditioning``), their values as core's
    nodes made them (tensors inline). Raises H3NodeError for anything the H3 sampler cannot take, naming it;
    nothing is dropped silently.
    """
    if not isinstance(positive, (list, tuple)) or not positive:
        raise node_error(title, f"positive must be a CONDITIONING list [[cond, {{...}}]]; got {type(positive).__name__}")
    if len(positive) != 1:
        raise node_error(title, f"H3 takes one conditioning entry; got {len(positive)} (from ConditioningCombine or "
                                "area/timestep nodes). Connect a single text encode.")
    entry = positive[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor):
        raise node_error(title, "positive is not a CONDITIONING entry [cond tensor, dict]")
    cond, extra = entry[0], entry[1] or {}
    if cond.dim() != 3 or cond.shape[0] != 1 or cond.shape[-1] != text_dim:
        raise node_error(title, f"the conditioning is {list(cond.shape)}; H3 needs [1, L, {text_dim}] "
                                f"(Qwen3-VL-32B states). Encode the prompt with CLIPLoader type 'minimax', or load "
                                f"precomputed states with H3 Text States Loader.")
    tags = extra.get("minimax_token_tags")
    if tags is not None:
        tags = torch.as_tensor(tags).reshape(-1).long()
        if tags.numel() != cond.shape[1]:
            raise node_error(title, f"minimax_token_tags has {tags.numel()} entries for {cond.shape[1]} text tokens")
    for key, what in _NOT_HONOURED.items():
        if extra.get(key) is not None:
            raise node_error(title, f"the conditioning carries {what} ('{key}'), which the H3 Sampler does not "
                                    "apply; remove that node or sample with core's KSampler")
    unknown = sorted(k for k in extra if k.startswith("minimax_") and k != "minimax_token_tags"
                     and k not in _PAYLOAD_FIELDS)
    if unknown:
        raise node_error(title, f"the conditioning carries {unknown[0]!r}, an H3 entry this pack does not know; "
                                f"it takes {', '.join(sorted(_PAYLOAD_FIELDS))}. Update h3-blackwell or remove it")
    payload = {field: extra[key] for key, field in _PAYLOAD_FIELDS.items() if extra.get(key) is not None}
    return cond.float(), tags, payload


def _embedded_states() -> torch.Tensor:
    g = torch.Generator().manual_seed(EMBEDDED_SEED)
    return torch.randn(1, EMBEDDED_TOKENS, TEXT_DIM, generator=g)


def _states_path(name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(input_directory() or "", name)


class H3TextStatesLoader:
    """Precomputed text-encoder states -> H3 CONDITIONING, for ComfyUI versions without the minimax text
    encoder and for headless runs. File: safetensors with ``text_states`` [1, L, 5120] (or [L, 5120]) and
    optional ``token_tags`` [L] (1 text, 0 vision)."""

    TITLE = "H3 Text States Loader"
    DESCRIPTION = ("Loads precomputed Qwen3-VL text states (safetensors: text_states [1, L, 5120], optional "
                   "token_tags [L]) from ComfyUI's input folder as H3 CONDITIONING. The embedded entry is random "
                   "states for smoke tests, the same as `h3-blackwell generate` without --text-states.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("positive",)
    FUNCTION = "load"

    @classmethod
    def IS_CHANGED(cls, text_states=None, **_):
        """The file's size and mtime, so a states file replaced between two prompts is read again (a linked input:
        None or absent; never raises)."""
        if text_states == EMBEDDED_STATES or not isinstance(text_states, str):
            return "embedded"
        return file_stamp(_states_path(text_states))

    @classmethod
    def INPUT_TYPES(cls):
        files = list_input_files((".safetensors",))
        return {"required": {
            "text_states": ([EMBEDDED_STATES] + files, {
                "default": EMBEDDED_STATES,
                "tooltip": "a .safetensors file in ComfyUI's input folder, or the embedded random states"}),
        }}

    def load(self, text_states: str):
        if text_states == EMBEDDED_STATES:
            return ([[_embedded_states(), {}]],)
        path = _states_path(text_states)
        if not os.path.isfile(path):
            raise node_error(self.TITLE, f"text states file '{text_states}' was not found (looked for {path}); put "
                                         "it in ComfyUI's input folder")
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, "pt") as f:
                keys = set(f.keys())
                if "text_states" not in keys:
                    raise node_error(self.TITLE, f"{text_states}: expected a tensor 'text_states' [1, L, {TEXT_DIM}]; "
                                                 f"found {sorted(keys)[:8]}")
                states = f.get_tensor("text_states").float()
                tags = f.get_tensor("token_tags").long() if "token_tags" in keys else None
        except SafetensorError as e:
            raise node_error(self.TITLE, f"{text_states} is not a readable safetensors file ({e})") from e
        if states.dim() == 2:
            states = states.unsqueeze(0)
        if states.dim() != 3 or states.shape[0] != 1 or states.shape[-1] != TEXT_DIM:
            raise node_error(self.TITLE, f"{text_states}: text_states is {list(states.shape)}; expected "
                                         f"[1, L, {TEXT_DIM}] (Qwen3-VL-32B hidden states)")
        extra = {}
        if tags is not None:
            tags = tags.reshape(-1)
            if tags.numel() != states.shape[1]:
                raise node_error(self.TITLE, f"{text_states}: token_tags has {tags.numel()} entries for "
                                             f"{states.shape[1]} text tokens")
            extra["minimax_token_tags"] = tags
        return ([[states, extra]],)
