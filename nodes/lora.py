"""H3 LoRA: one LoRA from models/loras on top of the H3 model's LoRA stack (merge or side path).

The output is the same resident model seen with one more LoRA (``runtime.lora.LoraView``): chained nodes
stack in graph order, and whenever a sampler uses the output, the resident model is made to carry exactly
that stack first (nothing is redone when it already does). So two graphs sharing one loaded model each
get their own LoRAs, and the model itself is never copied.
"""

from __future__ import annotations

import logging

from ..runtime import H3Error
from ._common import CATEGORY, comfy_module, file_stamp, node_error, optional_comfy_module

MODES = ["merge", "side"]
NO_LORAS = "(no LoRA files in models/loras)"
log = logging.getLogger("h3_blackwell")


def _loras() -> list[str]:
    fp = optional_comfy_module("folder_paths")
    names = list(fp.get_filename_list("loras")) if fp is not None else []
    return names or [NO_LORAS]


class H3LoRA:
    TITLE = "H3 LoRA"
    DESCRIPTION = ("Adds a MiniMax H3 LoRA (ComfyUI, kohya, diffusers or PEFT key names; turbo LoRAs included) to "
                   "the model. merge: merged into the weights at load (NVFP4 layers re-quantized), no cost per step. "
                   "side: a bf16 low-rank path added to each layer's output, exact LoRA math (a side path on fc2 "
                   "turns off the cuBLASLt FC2 fast path). Chain nodes to stack LoRAs.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("H3_MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("the same resident model with this LoRA added to its stack",)
    FUNCTION = "apply"

    @classmethod
    def IS_CHANGED(cls, lora_name=None, **_):
        """The LoRA file's size and mtime: a file replaced between two prompts runs this node (and the sampler
        after it) again; the runtime re-applies a LoRA whose file changed (``sync_loras`` compares the same). A
        linked input arrives as None, or not at all in older ComfyUI versions; this never raises (a raise makes
        ComfyUI run the node, and the sampler after it, on every prompt)."""
        fp = optional_comfy_module("folder_paths")
        named = isinstance(lora_name, str) and lora_name != NO_LORAS
        path = fp.get_full_path("loras", lora_name) if fp is not None and named else None
        return file_stamp(path)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("H3_MODEL", {"tooltip": "from H3 NVFP4 Model Loader or another H3 LoRA"}),
            "lora_name": (_loras(), {"tooltip": "a .safetensors LoRA in models/loras made for MiniMax H3"}),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                   "tooltip": "multiplies the LoRA update (1.0 = as trained)"}),
            "mode": (MODES, {"default": "merge", "tooltip": "merge: into the weights at load, no per-step cost; "
                                                            "side: bf16 low-rank path per step, exact math"}),
        }}

    def apply(self, model, lora_name: str, strength: float, mode: str):
        from ..runtime import LoraSpec, LoraView

        if not hasattr(model, "config") or not hasattr(model, "model"):
            raise node_error(self.TITLE, f"model must come from H3 NVFP4 Model Loader; got {type(model).__name__}")
        if mode not in MODES:
            raise node_error(self.TITLE, f"mode={mode!r}: expected one of {', '.join(MODES)}")
        fp = comfy_module("folder_paths")
        path = None if lora_name == NO_LORAS else fp.get_full_path("loras", lora_name)
        if path is None:
            folders = ", ".join(fp.get_folder_paths("loras")) or "(none configured)"
            raise node_error(self.TITLE, f"LoRA file '{lora_name}' was not found in loras (searched {folders}). Put "
                                         "the .safetensors file there and refresh.")
        try:
            view = LoraView(model, tuple(model.lora_stack) + (LoraSpec(path, strength, mode),))
            view.sync()  # apply now: a bad LoRA fails on this node, with its message
        except H3Error as e:
            raise node_error(self.TITLE, str(e)) from e
        log.info("[h3-blackwell] %s", view.backends.get("lora", {}).get("reason", "LoRA applied"))
        return (view,)
