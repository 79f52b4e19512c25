"""H3 NVFP4 Model Loader: a resident H3 DiT for the sampler (type H3_MODEL = runtime.H3Runtime).

The model stays loaded across prompts. It is reloaded only when an input changes (file, backends, switches)
or the file on disk changes (size / mtime); the previous model is released first, so at most one H3 DiT
loaded by this node is resident. The H3_MODEL output is invisible to ComfyUI's model management ("Unload models"
does not free it); the MODEL output (core's type, ``core_model``) is the same resident model as ComfyUI sees it.
Unloading the MODEL there frees the model's device memory only when nothing else holds the runtime, and it is read
again when a graph needs it; while ComfyUI's cache keeps this node's H3_MODEL output (the runtime itself), the
unload frees nothing, says so (0 bytes freed) and the model stays loaded. Its device memory is sized by the
memory budget (``vram_budget``; ``auto`` plans around what ComfyUI's other models hold when sampling starts).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref

from ..runtime import CHOICES, FC2_MODES, H3Error, RuntimeOptions, open_model
from ._common import CATEGORY, comfy_module, file_stamp, node_error, optional_comfy_module

TINY_CHOICE = "embedded tiny (seed 0)"
# the runtime's choices, written once in runtime/options.py (the first value is the default). Widget values are a
# public interface: saved workflows hold them, so a value is never removed; a retired one would stay accepted
# with a deprecation note.
GEMM_CHOICES = list(CHOICES["gemm"])
ATTENTION_CHOICES = list(CHOICES["attention"])
FC2_CHOICES = list(FC2_MODES)

# One resident model, keyed on everything that determines it. "previous": (key, weak reference) of the model last
# released; when something still holds it (ComfyUI's output cache holds the loader's outputs), a load with the same
# key takes it back instead of reading a second copy of the same weights onto the device.
_RESIDENT: dict = {"key": None, "model": None, "core": None, "previous": None}
log = logging.getLogger("h3_blackwell")


def _diffusion_models() -> list[str]:
    fp = optional_comfy_module("folder_paths")
    return list(fp.get_filename_list("diffusion_models")) if fp is not None else []


def resident_model():
    """The model this node keeps resident (None before the first load); for tests and diagnostics."""
    return _RESIDENT["model"]


def release_resident() -> None:
    """Drop the resident model: the next load reads the file again, unless the released model is still alive
    (held elsewhere, e.g. by ComfyUI's output cache), in which case a load with the same inputs and file takes
    that model back rather than loading a duplicate."""
    if _RESIDENT["model"] is not None:
        _RESIDENT["previous"] = (_RESIDENT["key"], weakref.ref(_RESIDENT["model"]))
    _RESIDENT["key"] = None
    _RESIDENT["model"] = None
    _RESIDENT["core"] = None
    gc.collect()


def _core_model(rt, inputs: tuple):
    """The MODEL output over the resident ``rt`` (nodes/core_model.py): it reloads through this node's inputs when
    ComfyUI unloaded it, and releasing it releases the resident model here too."""
    from .core_model import make_core_model

    ref = weakref.ref(rt)

    def on_release():
        """Drop the resident entry; returns what puts it back (the handle calls it when the runtime stayed alive,
        held by an output ComfyUI caches, so this node keeps one entry and one MODEL for it, not two)."""
        if _RESIDENT["model"] is None or _RESIDENT["model"] is not ref():
            return None
        key, core = _RESIDENT["key"], _RESIDENT["core"]
        release_resident()

        def keep(kept) -> None:
            if _RESIDENT["model"] is None:  # nothing else was loaded meanwhile
                _RESIDENT.update(key=key, model=kept, core=core, previous=None)
        return keep

    return make_core_model(rt, reload=lambda: H3ModelLoader().load(*inputs)[0], on_release=on_release)


class _LoadProgress:
    """ComfyUI's progress bar fed by load_model's per-tensor callback (done, total, name). The runtime reports
    the tensors done *before* each one it reads, so ``finish()`` moves the bar to total once the load returned."""

    def __init__(self, utils):
        self.utils, self.bar, self.total = utils, None, 0

    def __call__(self, done: int, total: int, name: str = "") -> None:
        if self.bar is None:
            self.bar = self.utils.ProgressBar(total)
        self.total = total
        self.bar.update_absolute(done, total)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.update_absolute(self.total, self.total)


def _load_progress():
    utils = optional_comfy_module("comfy.utils")
    return None if utils is None else _LoadProgress(utils)


def _model_path(model: str) -> str | None:
    """The file of a ``model`` choice (None for the embedded tiny model or outside ComfyUI)."""
    if model == TINY_CHOICE:
        return None
    fp = optional_comfy_module("folder_paths")
    return fp.get_full_path("diffusion_models", model) if fp is not None else None


class H3ModelLoader:
    TITLE = "H3 NVFP4 Model Loader"
    DESCRIPTION = ("Loads an H3 DiT from models/diffusion_models (bf16, fp8, int8-convrot or NVFP4 safetensors) "
                   "or the embedded tiny random model, picks the GEMM / attention backends once, and keeps the "
                   "model resident across prompts (reloaded only when an input or the file changes).")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("H3_MODEL", "MODEL")
    RETURN_NAMES = ("model", "MODEL")
    OUTPUT_TOOLTIPS = ("the resident H3 model with its backend choices",
                       "the same resident model as ComfyUI core's MODEL: core's KSampler / SamplerCustomAdvanced, "
                       "MiniMaxH3SigmaShift and LoraLoaderModelOnly drive this pack's fast stack")
    FUNCTION = "load"

    @classmethod
    def IS_CHANGED(cls, model=None, **_):
        """The model file's size and mtime: ComfyUI runs the loader again (which reloads) when the file was replaced
        or deleted between two prompts; the other inputs are in ComfyUI's cache key already. A linked input arrives
        as None, or not at all in older ComfyUI versions; this never raises (a raise makes ComfyUI run the node on
        every prompt)."""
        return "embedded" if model == TINY_CHOICE else file_stamp(_model_path(model) if isinstance(model, str) else None)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ([TINY_CHOICE] + _diffusion_models(), {
                "default": TINY_CHOICE,
                "tooltip": "an H3 DiT file in models/diffusion_models, or the embedded tiny random model (tests)"}),
            "gemm": (GEMM_CHOICES, {"default": GEMM_CHOICES[0], "tooltip": "NVFP4 linear backend (auto picks per "
                                                                           "GPU)"}),
            "attention": (ATTENTION_CHOICES, {"default": ATTENTION_CHOICES[0], "tooltip": (
                "attention backend (auto picks per GPU); sparse = LOSSY training-free sparse attention "
                "(comfy-kitchen sol_attn, ComfyUI core's H3 rules; its tau is on the H3 Sampler)")}),
            "fc2_lt": (FC2_CHOICES, {"default": FC2_CHOICES[0], "tooltip": "guarded cuBLASLt FC2 path: on (fall back when the "
                                                                 "guard fails), off, strict (fail instead)"}),
            "adaln_cache": ("BOOLEAN", {"default": True, "tooltip": "compute the AdaLN modulation rows of every "
                                                                    "(step, block) once per run"}),
        }, "optional": {
            "vram_budget": ("STRING", {"default": "auto", "tooltip": (
                "device memory the H3 model may use, in GB (1 GB = 1e9 bytes), or auto: the free memory when "
                "sampling starts less a margin, so the text encoder and VAE ComfyUI holds keep their room. Blocks "
                "that do not fit stream from pinned host memory while the others compute (same latents); a budget "
                "too small is refused naming the smallest that works")}),
        }}

    def load(self, model: str, gemm: str, attention: str, fc2_lt: str, adaln_cache: bool, vram_budget: str = "auto"):
        if fc2_lt not in FC2_CHOICES:
            raise node_error(self.TITLE, f"fc2_lt={fc2_lt!r}: expected one of {', '.join(FC2_CHOICES)}")
        if not isinstance(model, str) or not model:
            raise node_error(self.TITLE, f"model: expected a file name of diffusion_models or '{TINY_CHOICE}'; got "
                                         f"{model!r}")
        if vram_budget is None:  # an optional socket left empty (V3 / API prompts pass None)
            vram_budget = "auto"
        if model == TINY_CHOICE:
            path, stamp = None, None
        else:
            fp = comfy_module("folder_paths")
            path = fp.get_full_path("diffusion_models", model)
            if path is None or not os.path.exists(path):
                folders = ", ".join(fp.get_folder_paths("diffusion_models")) or "(none configured)"
                raise node_error(self.TITLE, f"model file '{model}' was not found in diffusion_models (searched "
                                             f"{folders}). Put the .safetensors file there and refresh, or pick "
                                             f"'{TINY_CHOICE}'.")
            st = os.stat(path)
            stamp = (st.st_size, st.st_mtime_ns)
        try:
            options = RuntimeOptions.from_env(gemm=gemm, attention=attention, fc2=fc2_lt, adaln_cache=bool(adaln_cache),
                                              vram_budget=str(vram_budget).strip() or "auto")
        except ValueError as e:
            raise node_error(self.TITLE, str(e)) from e
        key = (model, path, stamp, tuple(sorted(options.to_dict().items())))
        if _RESIDENT["key"] == key and _RESIDENT["model"] is not None:
            return (_RESIDENT["model"], _RESIDENT["core"])
        release_resident()
        prev = _RESIDENT["previous"]
        rt = prev[1]() if prev is not None and prev[0] == key else None
        if rt is None:
            progress = _load_progress()
            try:
                # the header read once, every tensor and shape checked (NVFP4 layers too) before any is read
                rt = open_model(path, options, tiny_seed=0).load(progress=progress)
            except H3Error as e:
                raise node_error(self.TITLE, str(e)) from e
            if progress is not None:
                progress.finish()
            log.info("[h3-blackwell] %s", rt.describe())
        else:
            log.info("[h3-blackwell] H3 model taken back (still held since it was released; same inputs and file)")
        _RESIDENT["previous"] = None
        _RESIDENT["key"], _RESIDENT["model"] = key, rt
        _RESIDENT["core"] = _core_model(rt, (model, gemm, attention, fc2_lt, adaln_cache, vram_budget))
        return (rt, _RESIDENT["core"])
