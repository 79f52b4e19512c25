"""ComfyUI core's model classes over the resident H3 runtime: the loader's MODEL output.

This module subclasses core's classes at import, so it is imported only inside a ComfyUI with core H3 support
(``comfy.model_base.MiniMaxH3``): the loader imports it when it makes the MODEL output, and an ImportError here
means that support is missing (the MODEL output is then ``core_model.UnavailableModel``).

- ``H3CoreDiffusionModel`` is ``core_model.H3DiffusionModel`` and an instance of core's ``MiniMaxH3Model`` (none of
  its weights built), so nodes that patch core's H3 blocks (core's Model Sparse Attention) record on it what
  ``core_patches`` reads.
- ``H3CoreModel`` is core's ``model_base.MiniMaxH3`` (its ``extra_conds``, audio carry in ``process_latent_in`` /
  ``_out``, inpainting, ``ModelSamplingAV``) whose diffusion model is ``core_model.H3DiffusionModel`` and that has
  no weights of its own. Its ``state_dict`` names every weight as core would (meta tensors), so core's LoRA loaders
  find their keys.
- ``H3ModelPatcher`` is core's ``ModelPatcher`` whose weight work goes to the runtime: ``model_size`` is what the
  runtime holds on the device (``H3Runtime.device_bytes``: weights, stream buffers, GEMM scratch, LoRA side paths)
  plus the Fun ControlNet tower it holds; loading makes sure the runtime is resident; an unload from a CUDA device
  releases it (``ResidentModel.release``: the next load reads the file again, or, while another output ComfyUI
  caches still holds it, it is offloaded in place to host memory and the next load moves it back); core's weight
  paths (patching a weight, merging, saving) are refused. Its ``pre_run`` / ``cleanup`` callbacks (core's
  ``CallbacksMP``) bracket the run: ``RuntimeHandle.begin_sampling`` / ``end_sampling``.
"""

from __future__ import annotations

import torch
from comfy.ldm.minimax.model import MiniMaxH3Model
from comfy.model_base import MiniMaxH3
from comfy.model_management import unet_offload_device
from comfy.model_patcher import ModelPatcher
from comfy.patcher_extension import CallbacksMP
from comfy.supported_models import MiniMaxH3 as MiniMaxH3Config
from comfy.utils import set_attr

from ._common import node_error
from .core_model import H3DiffusionModel, RuntimeHandle
from .core_patches import TITLE, fun_patch_models

CALLBACK_KEY = "h3_blackwell"


class H3CoreDiffusionModel(H3DiffusionModel, MiniMaxH3Model):
    """``H3DiffusionModel`` that is also an instance of core's ``MiniMaxH3Model`` (none of its weights are built):
    nodes that patch core's H3 blocks find one (core's Model Sparse Attention installs its H3 block patches and
    accepts vsa only then); ``core_patches`` reads what they record and the runtime runs it."""


class H3CoreModel(MiniMaxH3):
    """core's MiniMaxH3 whose diffusion model is this pack's runtime (module docstring)."""

    def __init__(self, model_config, handle: RuntimeHandle, device=None):
        super().__init__(model_config, device=device)
        self.diffusion_model = H3CoreDiffusionModel(handle)
        self.h3_handle = handle

    def process_latent_out(self, latent):
        """core's (audio carry undone), the result remembered: the run's samples and a custom sampler's denoised
        output come out here, so H3 Model Run Report can tell that its LATENT is this model's last run's."""
        out = super().process_latent_out(latent)
        self.h3_handle.record_output(out)
        return out

    def state_dict(self, *args, **kwargs):
        """core's names of every weight (meta tensors of core's dense shapes: what LoRA loaders match against;
        the resident weights live in the runtime) plus this module's own buffers."""
        sd = super().state_dict(*args, **kwargs)
        for k, (shape, dtype) in self.h3_handle.names.items():
            sd["diffusion_model." + k] = torch.empty(shape, dtype=dtype, device="meta")
        return sd


class H3ModelPatcher(ModelPatcher):
    """core's ModelPatcher whose weight work goes to the runtime (module docstring)."""

    def model_size(self):
        return self.model.h3_handle.size

    def loaded_size(self):
        """What is loaded now: the runtime's bytes while it is on the device (``size``, measured again as the
        runtime re-plans), else 0 (released, or offloaded in place); read from the runtime itself, which the H3
        Sampler or an H3 LoRA output may have brought back since core's unload. Core reads size - loaded_size
        as offloaded memory."""
        h = self.model.h3_handle
        return h.size if h.resident and not h.offloaded else 0

    def model_patches_models(self):
        """core's patch models to load beside this one, less core's Fun ControlNet tower: the H3 MODEL runs
        its own copy of it (loaded from that module, in the pack's form and memory budget)."""
        skip = fun_patch_models(self.model_options.get("transformer_options", {}) or {})
        return [m for m in super().model_patches_models() if all(m is not f for f in skip)]

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        with self.use_ejected():
            handle = self.model.h3_handle
            handle.runtime()
            m = self.model
            if device_to is not None:
                m.device = device_to
            m.model_loaded_weight_memory = handle.size
            m.model_lowvram, m.lowvram_patch_counter, m.model_offload_buffer_memory = False, 0, 0
            m.current_weight_patches_uuid = self.patches_uuid
            for cb in self.get_all_callbacks(CallbacksMP.ON_LOAD):
                cb(self, device_to, lowvram_model_memory, force_patch_weights, full_load)

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        before = self.model.model_loaded_weight_memory if self.model.h3_handle.resident else 0
        self.patch_model(device_to, load_weights=before == 0)
        return self.model.model_loaded_weight_memory - before

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return self._unload(device_to)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        self.eject_model()
        if unpatch_weights:
            self._unload(device_to)
        for k, old in list(self.object_patches_backup.items()):
            set_attr(self.model, k, old)
        self.object_patches_backup.clear()

    def _unload(self, device_to) -> int:
        """The bytes freed (``RuntimeHandle.unload``); core is told nothing is loaded unless the runtime stayed
        on the device (a runtime held elsewhere that could not be offloaded)."""
        freed, stays = self.model.h3_handle.unload(device_to)
        if not stays:
            self.model.model_loaded_weight_memory = 0
            self.model.current_weight_patches_uuid = None
        return freed

    def patch_weight_to_device(self, key, *args, **kwargs):
        raise node_error(TITLE, f"core tried to patch the weight {key} of the H3 MODEL; its weights live in this "
                                "pack's runtime (LoRAs are applied there at sampling start)")

    def get_key_patches(self, filter_prefix=None):
        raise node_error(TITLE, "model merging reads the weights in core's format, which the H3 MODEL does not "
                                "hold; merge checkpoints with core's UNETLoader models")

    def state_dict_for_saving(self, *args, **kwargs):
        raise node_error(TITLE, "saving the H3 MODEL is not supported (its weights are the loader's file, in "
                                "this pack's resident format); save or convert the file itself")



def _begin_sampling(patcher) -> None:
    patcher.model.h3_handle.begin_sampling(patcher)


def _end_sampling(patcher) -> None:
    patcher.model.h3_handle.end_sampling()


def make_core_model(handle: RuntimeHandle) -> H3ModelPatcher:
    """The MODEL over a resident runtime: an H3ModelPatcher over an H3CoreModel, sharing ``handle``."""
    cfg = handle.config
    config = MiniMaxH3Config({"image_model": "minimax_h3", "disable_unet_model_creation": True})
    config.sampling_settings = {"shift": cfg.shift_video, "audio_shift": cfg.shift_audio}
    config.set_inference_dtype(handle.dtype, None)
    model = H3CoreModel(config, handle, device=handle.device)
    patcher = H3ModelPatcher(model, load_device=handle.device, offload_device=unet_offload_device())
    # core's pre_run / cleanup bracket a sampling run and call these (clones copy them)
    patcher.add_callback_with_key(CallbacksMP.ON_PRE_RUN, CALLBACK_KEY, _begin_sampling)
    patcher.add_callback_with_key(CallbacksMP.ON_CLEANUP, CALLBACK_KEY, _end_sampling)
    return patcher
