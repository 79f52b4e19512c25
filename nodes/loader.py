"""H3 NVFP4 Model Loader: a resident H3 DiT for the sampler (type H3_MODEL = runtime.H3Runtime).

The model stays loaded across prompts. It is reloaded only when an input changes (file, backends, switches)
or the file on disk changes (size / mtime); the loader then forgets the previous model, whose memory goes once
nothing holds it (ComfyUI's cache of its outputs). The H3_MODEL output is invisible to ComfyUI's model management
("Unload models" does not free it); the MODEL output (core's type, ``core_classes``) is the same resident model as
ComfyUI sees it. One owner holds the model: the runtime's ``ResidentModel`` (``core_model.RuntimeHandle``), shared
by this node and its MODEL output. Unloading the MODEL releases it: its device memory goes when nothing else holds
the runtime, and it is read again when a graph needs it; while ComfyUI's cache keeps this node's H3_MODEL output
(the runtime itself), the unload offloads it in place to host memory instead, and the next use moves it back.
Its device memory is sized by the memory budget (``vram_budget``; ``auto`` plans around what ComfyUI's other
models hold when sampling starts).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os

from ..runtime import CHOICES, FC2_MODES, SPARSE_METHODS, H3Error, RuntimeOptions, open_model
from ._common import CATEGORY, comfy_module, file_stamp, keyword_inputs, node_error, optional_comfy_module
from .core_model import RuntimeHandle, UnavailableModel

TINY_CHOICE = "embedded tiny (seed 0)"
# the runtime's choices, written once in runtime/options.py (the first value is the default). Widget values are a
# public interface: saved workflows hold them, so a value is never removed; a retired one would stay accepted
# with a deprecation note.
GEMM_CHOICES = list(CHOICES["gemm"])
ATTENTION_CHOICES = list(CHOICES["attention"])
SPARSE_KEEP_PERCENT = RuntimeOptions.sparse_keep_percent
FC2_CHOICES = list(FC2_MODES)

# The model this node keeps resident: the inputs that determine it, its one owner (RuntimeHandle) and its MODEL
# output over that owner.
_SLOT: dict = {"key": None, "handle": None, "core": None}
log = logging.getLogger("h3_blackwell")


def _diffusion_models() -> list[str]:
    fp = optional_comfy_module("folder_paths")
    return list(fp.get_filename_list("diffusion_models")) if fp is not None else []


def resident_handle() -> RuntimeHandle | None:
    """The owner of the model this node keeps resident (None before the first load); for tests and diagnostics."""
    return _SLOT["handle"]


def resident_model():
    """The runtime this node keeps resident, as it is now (None before the first load or once released)."""
    return None if _SLOT["handle"] is None else _SLOT["handle"].loaded


def release_resident() -> None:
    """Forget the resident model: the next load reads the file again. Its memory goes once nothing else holds it
    (the MODEL output, or an output ComfyUI caches, keeps it until then)."""
    _SLOT.update(key=None, handle=None, core=None)
    gc.collect()


def _core_model(handle: RuntimeHandle):
    """The MODEL output over ``handle`` (``core_classes``, imported only where ComfyUI core has H3 support)."""
    try:
        classes = importlib.import_module(".core_classes", __package__)
    except ImportError as e:
        return UnavailableModel(f"{e}")
    return classes.make_core_model(handle)


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
            "sparse_method": (list(SPARSE_METHODS), {"default": SPARSE_METHODS[0], "tooltip": (
                "LOSSY, attention=sparse only: ComfyUI core's Model Sparse Attention method: sol-attn (training-free "
                "threshold), sla (top-k, for SLA LoRAs), vsa (video cubes + the checkpoint's to_gate_compress, for "
                "FastH3)")}),
            "sparse_keep_percent": ("FLOAT", {"default": SPARSE_KEEP_PERCENT, "min": 0.5, "max": 95.0, "step": 0.5,
                                              "tooltip": "sla / vsa: percent of key blocks each query block keeps "
                                                         "(FastH3 was trained at 10)"}),
            "dense_blocks": ("STRING", {"default": "", "tooltip": "blocks that always run dense with attention=sparse, "
                                                                  "e.g. '0, 1, 47-49'"}),
        }}

    def load(self, model: str, gemm: str, attention: str, fc2_lt: str, adaln_cache: bool, vram_budget: str = "auto",
             **sparse_widgets):
        """ComfyUI's FUNCTION; ``sparse_widgets``: the optional sparse_method, sparse_keep_percent, dense_blocks."""
        w = keyword_inputs(self, sparse_widgets)
        sparse_method, sparse_keep_percent, dense_blocks = w["sparse_method"], w["sparse_keep_percent"], w["dense_blocks"]
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
                                              vram_budget=str(vram_budget).strip() or "auto",
                                              sparse_method=sparse_method or None,
                                              sparse_keep_percent=None if sparse_keep_percent is None
                                              else float(sparse_keep_percent), sparse_dense_blocks=dense_blocks or "")
        except ValueError as e:
            raise node_error(self.TITLE, str(e)) from e
        key = (model, path, stamp, tuple(sorted(options.to_dict().items())))
        if _SLOT["key"] != key:
            release_resident()  # the previous model: its memory goes once nothing holds it
            handle = RuntimeHandle(open=lambda: _read(path, options, self.TITLE))
            _SLOT.update(key=key, handle=handle, core=_core_model(handle))
        handle = _SLOT["handle"]
        # as it is (an offloaded runtime moves back at its next use), or read again when its MODEL released it
        return (handle.loaded if handle.resident else handle.runtime(), _SLOT["core"])


def _read(path: str | None, options: RuntimeOptions, title: str):
    """The runtime of ``path`` (None: the embedded tiny model), with ComfyUI's progress bar: the header read once,
    every tensor and shape checked (NVFP4 layers too) before any is read."""
    progress = _load_progress()
    try:
        rt = open_model(path, options, tiny_seed=0).load(progress=progress)
    except H3Error as e:
        raise node_error(title, str(e)) from e
    if progress is not None:
        progress.finish()
    log.info("[h3-blackwell] %s", rt.describe())
    return rt
