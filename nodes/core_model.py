"""The resident H3 runtime as ComfyUI core's MODEL (H3 NVFP4 Model Loader's second output).

Core's samplers (KSampler, KSamplerAdvanced, SamplerCustomAdvanced: every sampler and scheduler), its sigma shift
(``MiniMaxH3SigmaShift``), its H3 conditioning nodes and its LoRA loaders drive this pack's fast stack, as they drive
a model loaded by ``UNETLoader``. Three pieces, the core classes subclassed when the loader first runs (importing
this module needs no ComfyUI):

- ``H3DiffusionModel`` fills core's ``diffusion_model`` slot. Its ``forward`` has the signature of core's
  ``MiniMaxH3Model.forward`` (``comfy/ldm/minimax/model.py``, newest core)::

      forward(x=[video [B,24,T,H,W], carried audio [B,32,2,Ta]], timestep [B] (= sigma * 1000),
              context [B, L, 5120], transformer_options, minimax_payload, denoise_mask, audio_denoise_mask,
              control=None) -> [video velocity, carried audio velocity]

  ``minimax_payload`` is what ``MiniMaxH3.extra_conds`` builds (``text_token_tags``, ``keyframes``, ``refs``, the
  condition-noise values, ``seed``, ``audio_scale``, ``layout``); it becomes the runtime's ``H3Conditioning``
  (built once per payload and run). ``transformer_options`` gives the run's schedule (``sample_sigmas``) and the
  shifts ``MiniMaxH3SigmaShift`` sets (``minimax_h3_sigma_shift_video`` / ``_audio``). The evaluation is the
  runtime's ``ModelCall`` (audio carry as core's model; the network sees ``timestep / 1000``). Core's Fun
  ControlNet (``MiniMaxH3FunControlNetApply``'s wrapper and block patches in ``transformer_options``,
  ``core_patches.fun_control_patch``) runs as the runtime's tower loaded from core's control module, with core's
  hint latent, strength, window and fades (``RuntimeHandle.fun_control``).
- ``H3CoreModel`` is core's ``model_base.MiniMaxH3`` (its ``extra_conds``, audio carry in ``process_latent_in`` /
  ``_out``, inpainting, ``ModelSamplingAV``) with that slot filled and no weights of its own. Its ``state_dict``
  names every weight as core would (meta tensors), so core's LoRA loaders find their keys.
- ``H3ModelPatcher`` is core's ``ModelPatcher`` whose weight work goes to the runtime: ``model_size`` is what the
  runtime holds on the device (``H3Runtime.device_bytes``: weights, stream buffers, GEMM scratch, LoRA side
  paths) plus the Fun ControlNet tower it holds; loading makes sure the runtime is resident; an unload from a
  CUDA device releases it (the next load reads the file again), or, while another output ComfyUI caches still
  holds it, offloads it in place to host memory (``H3Runtime.offload``; the next load moves it back); at sampling
  start (``pre_run``) the LoRA records on the patcher are applied through the runtime's LoRA machinery
  (``core_patches.lora_specs``) and anything it cannot honour is refused (``core_patches``); ``cleanup`` closes the
  run, whose report ``H3 Model Run Report`` reads.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref

import torch

from ..runtime import (CallOptions, ControlHint, H3Conditioning, H3Error, LossySettings, ModelCall,
                       conditioning_from_payload, latent_sha256, load_control, sync_loras, weight_shapes)
from ._common import H3NodeError, node_error, optional_comfy_module
from .control import PatchSource, prepare_hint
from .core_patches import LORA_MODE, TITLE, check_patcher, check_transformer_options, fun_patch_models, lora_specs

log = logging.getLogger("h3_blackwell")

# what core's _apply_model passes besides the documented arguments, all None in an H3 graph
_EMPTY_KWARGS = ("y", "c_concat", "crossattn_controlnet")
# payload entries MiniMaxH3.extra_conds writes that carry no information of their own (derived, or core's caches)
_DERIVED = ("cond_video_latents", "cond_audio_latents", "layout", "audio_scale", "_text_token_tags_list")
# core's payload field -> where it comes from in a graph (for error messages)
_SOURCES = {"keyframes": "minimax_keyframes (MiniMaxH3ImageToVideo / MiniMaxH3AddGuide)",
            "refs": "minimax_refs (MiniMaxH3ReferenceToVideo)",
            "denoise_mask": "the latent's noise mask (video)", "audio_denoise_mask": "the latent's noise mask (audio)",
            "visual_cond_noise_aug": "minimax_visual_cond_noise_aug",
            "audio_cond_noise_aug": "minimax_audio_cond_noise_aug",
            "seed": "the sampler's seed"}
# per-graph LOSSY settings a node may put in transformer_options (default: the loader's)
SPARSE_TAU_KEY, FIRST_BLOCK_CACHE_KEY = "h3b_sparse_tau", "h3b_first_block_cache"
# how the LoRA records are applied: "merge" (default, as core merges) or "side" (the exact bf16 side path)
LORA_MODE_KEY = "h3b_lora_mode"
# H3 Model Run Report's check of its LATENT: the last outputs of a run, and the dtypes core's sample() hands out
_OUTPUTS_KEPT = 4
_INTERMEDIATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# core's conditioning kwargs -> the runtime's conditioning
# ---------------------------------------------------------------------------------------------

def conditioning_from_core(payload: dict | None, denoise_mask=None, audio_denoise_mask=None, target=None
                           ) -> tuple[torch.Tensor | None, H3Conditioning]:
    """core's ``minimax_payload`` (+ the pooled masks of the newest core) -> (token tags [L] or None,
    H3Conditioning). target: (video shape, audio shape, video channels, audio channels) to check the fit with.
    Unknown payload entries and fields the runtime cannot honour raise H3NodeError naming them and their node."""
    payload = dict(payload or {})
    tags = payload.pop("text_token_tags", None)
    for k in _DERIVED:
        payload.pop(k, None)
    unknown = sorted(k for k in payload if k not in _SOURCES)
    if unknown:
        raise node_error(TITLE, f"the conditioning payload carries {unknown[0]!r}, an H3 entry this pack does not "
                                f"know (it takes {', '.join(sorted(_SOURCES))}); update h3-blackwell or remove the "
                                "node that adds it")
    payload["denoise_mask"], payload["audio_denoise_mask"] = denoise_mask, audio_denoise_mask
    try:
        cond = conditioning_from_payload(payload)
        if target is not None:
            cond.check_target(*target)
    except H3Error as e:
        msg = str(e)
        field = msg.split(":", 1)[0].split("[", 1)[0].split(".", 1)[0]
        raise node_error(TITLE, f"{_SOURCES.get(field, field)}: {msg}") from e
    if tags is not None:
        tags = torch.as_tensor(tags).reshape(-1).long().cpu()
    return tags, cond


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a, b.to(a.device, a.dtype))


# ---------------------------------------------------------------------------------------------
# the resident runtime behind every MODEL of one loader
# ---------------------------------------------------------------------------------------------

class RuntimeHandle:
    """The resident runtime a MODEL evaluates (shared by every clone of its patcher), the per-run state, and
    release / reload. ``reload()`` returns the runtime again (the loader's resident one, reading the file when it
    was released); ``on_release()`` tells the loader to drop it too, and may return ``keep(runtime)``, called when
    the runtime outlived the release (held elsewhere) so the loader lists it again."""

    def __init__(self, rt, reload=None, on_release=None):
        self._rt, self._reload, self._on_release = rt, reload, on_release
        parked = getattr(rt, "parked", None)  # an offloaded runtime: what it held on the device
        self.size = parked.held_bytes if parked is not None else rt.device_bytes()
        self.dtype, self.device, self.config = rt.dtype, rt.device, rt.config
        self.names = weight_shapes(rt)
        self.call = ModelCall(rt)
        self.pending = False  # a run started (pre_run): the first call begins it with the schedule it sees
        self._fitted_rows = 0  # the run's planned size when ``size`` was last measured (``after_call``)
        self.conds: list = []  # (payload, masks, batch index) -> (tags, H3Conditioning), per run
        self.outputs: list = []  # latent_fingerprints of what core's process_latent_out handed out in the last run
        self.sampling, self._late_outputs = False, 0
        self.lossy = LossySettings()
        self.towers: dict = {}  # id(core's control module) -> (module, load plan, the runtime's tower)
        self.controlled: dict = {}  # (patch, cond, target) ids -> (patch, cond, cond with the control hint), per run

    def record_output(self, latent) -> None:
        """What core's process_latent_out handed out, for H3 Model Run Report: recorded while a run samples (the
        sampler's result) and once right after it (SamplerCustomAdvanced's denoised output); a later call (core's
        AddNoise) is not the run's."""
        if not self.sampling:
            if self._late_outputs <= 0:
                return
            self._late_outputs -= 1
        self.outputs.append(latent_fingerprints(latent))
        del self.outputs[:-_OUTPUTS_KEPT]

    @property
    def resident(self) -> bool:
        return self._rt is not None

    @property
    def offloaded(self) -> bool:
        """The runtime is this handle's but its weights are in host memory (``H3Runtime.offload``)."""
        return self._rt is not None and getattr(self._rt, "parked", None) is not None

    def runtime(self):
        if self._rt is None:
            if self._reload is None:
                raise node_error(TITLE, "the H3 model was unloaded and this MODEL cannot reload it; run the graph "
                                        "again from H3 NVFP4 Model Loader")
            self._rt = self._reload()
            self.call = ModelCall(self._rt)
            log.info("[h3-blackwell] H3 model reloaded for the MODEL output")
        elif self.offloaded:
            self._rt.onload()
            log.info("[h3-blackwell] H3 model back on the device")
        return self._rt

    def release(self) -> int:
        """Drop the runtime -> the bytes that freed: ``size`` when that was the last reference. When something
        else still holds it (ComfyUI's cache of the loader's H3_MODEL output, or an H3 LoRA output), dropping it
        frees nothing: the runtime stays this handle's and is offloaded in place instead (``H3Runtime.offload``:
        its weights to host memory until the next use), and the bytes the allocator freed are returned."""
        if self._rt is None:
            return 0
        self.call.end_run()
        last = self.call.last_run  # H3 Model Run Report still reads it when the runtime stays (offloaded)
        ref = weakref.ref(self._rt)
        self._rt, self.call = None, ModelCall(None)
        self._drop_towers()
        keep = self._on_release() if self._on_release is not None else None
        gc.collect()
        held = ref()
        if held is not None:
            self._rt, self.call = held, ModelCall(held)
            self.call.last_run = last
            if callable(keep):  # the loader keeps its entry (and this MODEL) for the runtime that stayed
                keep(held)
            offload = getattr(held, "offload", None)
            freed = offload() if offload is not None else 0
            if self.offloaded:
                log.info("[h3-blackwell] H3 model offloaded to host memory (%.2f GB of device memory freed): another "
                         "output still holds it (the loader's H3_MODEL output or an H3 LoRA output, cached by "
                         "ComfyUI); its next use moves it back", freed / 1e9)
            else:
                log.info("[h3-blackwell] H3 model not released: another output still holds it and it was not "
                         "offloaded; its device memory stays in use")
            return freed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("[h3-blackwell] H3 model released (ComfyUI unloaded the MODEL)")
        return self.size

    # -- one sampling run --------------------------------------------------------------------
    def begin_sampling(self, patcher) -> None:
        """Sampling starts with ``patcher``: refuse what it cannot honour, make the resident model carry the
        patcher's LoRAs, reset the run."""
        fun = check_patcher(patcher)
        to = (getattr(patcher, "model_options", {}) or {}).get("transformer_options", {}) or {}
        mode = to.get(LORA_MODE_KEY, LORA_MODE)
        if mode not in ("merge", "side"):
            raise node_error(TITLE, f"transformer_options[{LORA_MODE_KEY!r}] = {mode!r}: expected 'merge' or 'side'")
        specs = lora_specs(getattr(patcher, "patches", {}) or {}, mode)
        rt = self.runtime()
        try:
            sync_loras(rt, specs)
        except H3Error as e:
            raise node_error(TITLE, f"LoRA from the MODEL's patches (LoraLoaderModelOnly / LoraLoader): {e}") from e
        self.call.end_run()
        self.lossy = LossySettings(to.get(SPARSE_TAU_KEY), to.get(FIRST_BLOCK_CACHE_KEY))
        self.pending, self.conds, self.controlled, self.outputs = True, [], {}, []
        self.sampling, self._late_outputs = True, 0
        if fun is None:
            self._drop_towers()  # a run without core's Fun ControlNet: its tower's memory goes back
        self._measure()  # and side-path LoRAs hold device bytes of their own

    def end_sampling(self) -> None:
        self.pending, self.sampling, self._late_outputs = False, False, 1
        if self._rt is not None:
            self.call.end_run()
            self._measure()

    def after_call(self) -> None:
        """After a model call: the run's first call (or a larger clip) plans the memory budget again and may move
        blocks (``ModelCall._fit``), so ``size`` is measured again when the planned size changed."""
        run = self.call.run
        rows = 0 if run is None else run.fitted_rows
        if rows != self._fitted_rows:
            self._fitted_rows = rows
            self._measure()

    def conditioning(self, payload, denoise_mask, audio_denoise_mask, video_shape, audio_shape):
        for p, dm, adm, shapes, out in self.conds:
            if p is payload and _same(dm, denoise_mask) and _same(adm, audio_denoise_mask) \
                    and shapes == (video_shape, audio_shape):
                return out
        cfg = self.config
        out = conditioning_from_core(payload, denoise_mask, audio_denoise_mask,
                                     (video_shape, audio_shape, cfg.video_channels, cfg.audio_channels))
        self.conds.append((payload, denoise_mask, audio_denoise_mask, (video_shape, audio_shape), out))
        return out

    def _drop_towers(self) -> None:
        self.towers, self.controlled = {}, {}

    def _measure(self) -> None:
        """``size`` (what ComfyUI is told the MODEL holds) from the runtime and the tower it holds now (kept while
        the runtime is offloaded: what it holds on the device once back)."""
        if self._rt is not None and not self.offloaded:
            self.size = self._rt.device_bytes() + sum(e[2].device_bytes(self._rt.device) for e in self.towers.values())

    def fun_control(self, patch, cond, shapes: tuple, text_tokens: int, schedule, window: float):
        """Core's Fun ControlNet patch (``core_patches.fun_control_patch``) for one clip of ``shapes`` (video,
        audio) -> (the runtime's tower loaded from core's control module, ``cond`` with the control hint), or
        (None, ``cond``) when neither the run's schedule nor this call's sigma is inside the patch's window (core
        then neither encodes nor runs the tower). The memory budget is planned with the tower before it loads
        (so it streams where it must), once per module and load plan; the hint is core's own latent where its
        wrapper prepared it for this clip's shape, else the same preparation here (``control.prepare_hint``,
        with core's guard: the models loaded before the VAE encode are loaded again after it); one
        conditioning object per run and shape, so the run's plan is reused."""
        lo, hi = float(patch.sigma_end), float(patch.sigma_start)
        sigmas = [] if schedule is None else [float(v) for v in torch.as_tensor(schedule).flatten()[:-1]]
        if not (lo <= window <= hi or any(lo <= v <= hi for v in sigmas)):
            return None, cond
        module = patch.model_patch.model
        rt = self.runtime()
        entry = self.towers.get(id(module))
        if entry is None or entry[0] is not module or entry[1] is not rt.plan:
            try:
                source = PatchSource(module)
                rt.fit_memory(shapes[0], shapes[1], text_tokens, max(1, len(sigmas)), cond, control=source)
                entry = (module, rt.plan, load_control(source, rt.plan, rt.config))
            except H3Error as e:
                raise node_error(TITLE, f"the Fun ControlNet of MiniMaxH3FunControlNetApply: {e}") from e
            self.towers = {id(module): entry}
            self._measure()
        key = (id(patch), id(cond), shapes[0])
        if key not in self.controlled:
            latent = getattr(patch, "control_latent", None)
            if latent is None or tuple(getattr(patch, "control_latent_shape", None) or ()) != shapes[0]:
                latent = _guarded(lambda: prepare_hint(patch.vae, shapes[0], patch.control_video, patch.mask,
                                                       patch.source_video))
            hint = ControlHint(latent.detach().float().cpu(), float(patch.strength), hi, lo,
                               int(getattr(patch, "fade_in_frames", 0)), int(getattr(patch, "fade_out_frames", 0)))
            self.controlled[key] = (patch, cond, dataclasses.replace(cond or H3Conditioning(), control=hint))
        return entry[2], self.controlled[key][2]


def _guarded(fn):
    """``fn()`` (a VAE encode) the way core's Fun patch runs its own: the models ComfyUI has loaded and in use are
    loaded again afterwards (the encode may have pushed them out)."""
    mm = optional_comfy_module("comfy.model_management")
    loaded = mm.loaded_models(only_currently_used=True) if mm is not None and hasattr(mm, "loaded_models") else None
    try:
        with torch.no_grad():
            return fn()
    finally:
        if loaded is not None:
            mm.load_models_gpu(loaded)


class H3DiffusionModel(torch.nn.Module):
    """core's ``diffusion_model`` slot over the runtime (module docstring). Holds no parameters."""

    patch_size = (1, 2, 2)

    def __init__(self, handle: RuntimeHandle):
        super().__init__()
        self.handle = handle
        cfg = handle.config
        self.hidden_size, self.latents_dim, self.audio_latents_dim = (cfg.hidden_size, cfg.video_channels,
                                                                      cfg.audio_channels)
        self.sigma_shift_video, self.sigma_shift_audio = cfg.shift_video, cfg.shift_audio

    @property
    def dtype(self) -> torch.dtype:
        return self.handle.dtype

    def preprocess_text_embeds(self, text_states: torch.Tensor) -> torch.Tensor:
        """core refines the text once in ``extra_conds``; the runtime refines it once per run in its plan (through
        the LoRA the run carries), so the states pass through unchanged."""
        return text_states

    def forward(self, x, timestep, context, transformer_options=None, minimax_payload=None, denoise_mask=None,
                audio_denoise_mask=None, control=None, **kwargs):
        options = transformer_options or {}
        if control is not None:
            raise node_error(TITLE, "a ControlNet on the conditioning (Apply ControlNet) cannot run on the H3 MODEL; "
                                    "remove it, or use core's UNETLoader model for ControlNet graphs")
        extra = sorted(k for k, v in kwargs.items() if not (k in _EMPTY_KWARGS and v is None))
        if extra:
            raise node_error(TITLE, f"the model call carries {extra[0]!r} (from a conditioning or model node), which "
                                    "the H3 MODEL does not take; remove that node")
        fun = check_transformer_options(options)  # core's Fun ControlNet (or None): run as this pack's tower
        pe = optional_comfy_module("comfy.patcher_extension") if fun is not None else None
        if pe is None:
            return self._forward(x, timestep, context, options, minimax_payload, denoise_mask, audio_denoise_mask,
                                 fun=fun)

        def inner(x, timestep, context, transformer_options, **kw):
            return self._forward(x, timestep, context, transformer_options, fun=fun, **kw)

        # core's model runs its diffusion-model wrappers around the network (its Fun patch prepares its hint
        # latent there, under its memory guard); the only ones that pass the checks above are the Fun patch's
        wrappers = pe.get_all_wrappers(pe.WrappersMP.DIFFUSION_MODEL, options)
        return pe.WrapperExecutor.new_class_executor(inner, self, wrappers).execute(
            x, timestep, context, options, minimax_payload=minimax_payload, denoise_mask=denoise_mask,
            audio_denoise_mask=audio_denoise_mask)

    def _forward(self, x, timestep, context, options, minimax_payload=None, denoise_mask=None,
                 audio_denoise_mask=None, fun=None):
        h = self.handle
        h.runtime()
        if h.pending or h.call.run is None:
            h.call.begin_run(options.get("sample_sigmas"), h.lossy)
            h.pending = False
        payload = minimax_payload or {}
        scale = float(payload.get("audio_scale", 1.0))
        shifts = (float(options.get("minimax_h3_sigma_shift_video", h.config.shift_video)),
                  float(options.get("minimax_h3_sigma_shift_audio", h.config.shift_audio)))
        video, audio = x[0], x[1]
        steps = timestep.flatten()
        outs = []
        for b in range(video.shape[0]):  # core's model takes one clip; a batch (cfg > 1) runs clip by clip
            dm = None if denoise_mask is None else denoise_mask[b:b + 1]
            adm = None if audio_denoise_mask is None else audio_denoise_mask[b:b + 1]
            tags, cond = h.conditioning(payload, dm, adm, tuple(video[b:b + 1].shape), tuple(audio[b:b + 1].shape))
            sigma = (steps[min(b, steps.numel() - 1)] / 1000.0).float()
            # core's Fun wrapper tests its window on transformer_options["sigmas"][0] (else timestep / 1000)
            window = options.get("sigmas")
            window = float(torch.as_tensor(window).flatten()[0]) if window is not None else float(sigma)
            tower = None
            if fun is not None:
                tower, cond = h.fun_control(fun, cond, (tuple(video[b:b + 1].shape), tuple(audio[b:b + 1].shape)),
                                            context.shape[1], options.get("sample_sigmas"), window)
                h.runtime()  # a VAE encode for the hint may have had ComfyUI unload and reload the model
                if h.call.run is None:
                    h.call.begin_run(options.get("sample_sigmas"), h.lossy)
            try:
                outs.append(h.call(video[b:b + 1], audio[b:b + 1], sigma, context[b:b + 1], tags, cond,
                                   CallOptions(shifts, scale, window), tower))
                h.after_call()
            except H3NodeError:
                raise
            except H3Error as e:
                raise node_error(TITLE, str(e)) from e
        vv = torch.cat([o[0] for o in outs]).to(video.dtype)
        va = torch.cat([o[1] for o in outs]).to(audio.dtype)
        return [vv, va]


# ---------------------------------------------------------------------------------------------
# core's classes, subclassed once core is importable
# ---------------------------------------------------------------------------------------------

_CLASSES: dict = {}


def _core_classes():
    """(H3CoreModel, H3ModelPatcher), built on the running ComfyUI's classes; None without core H3 support."""
    if _CLASSES:
        return _CLASSES["model"], _CLASSES["patcher"]
    mb = optional_comfy_module("comfy.model_base")
    mp = optional_comfy_module("comfy.model_patcher")
    if mb is None or mp is None or not hasattr(mb, "MiniMaxH3"):
        return None
    utils = optional_comfy_module("comfy.utils")
    ext = optional_comfy_module("comfy.patcher_extension")

    class H3CoreModel(mb.MiniMaxH3):
        """core's MiniMaxH3 whose diffusion model is this pack's runtime (module docstring)."""

        def __init__(self, model_config, handle: RuntimeHandle, device=None):
            super().__init__(model_config, device=device)
            self.diffusion_model = H3DiffusionModel(handle)

        @property
        def h3_handle(self) -> RuntimeHandle:
            return self.diffusion_model.handle

        def process_latent_out(self, latent):
            """core's (audio carry undone), the result remembered: the run's samples and a custom sampler's denoised
            output come out here, so H3 Model Run Report can tell that its LATENT is this model's last run's."""
            out = super().process_latent_out(latent)
            self.h3_handle.record_output(out)
            return out

        def state_dict(self, *args, **kwargs):
            """core's names of every weight (meta tensors of core's dense shapes: what LoRA loaders match
            against; the resident weights live in the runtime) plus this module's own buffers."""
            sd = super().state_dict(*args, **kwargs)
            for k, (shape, dtype) in self.h3_handle.names.items():
                sd["diffusion_model." + k] = torch.empty(shape, dtype=dtype, device="meta")
            return sd

    class H3ModelPatcher(mp.ModelPatcher):
        """core's ModelPatcher whose weight work goes to the runtime (module docstring)."""

        def _handle(self) -> RuntimeHandle:
            return self.model.h3_handle

        def model_size(self):
            return self._handle().size

        def loaded_size(self):
            """What is loaded now: the runtime's bytes while it is on the device (``size``, measured again as the
            runtime re-plans), else 0 (released, or offloaded in place); read from the runtime itself, which the H3
            Sampler or an H3 LoRA output may have brought back since core's unload. Core reads size - loaded_size
            as offloaded memory."""
            h = self._handle()
            return h.size if h.resident and not h.offloaded else 0

        def model_patches_models(self):
            """core's patch models to load beside this one, less core's Fun ControlNet tower: the H3 MODEL runs
            its own copy of it (loaded from that module, in the pack's form and memory budget)."""
            skip = fun_patch_models(self.model_options.get("transformer_options", {}) or {})
            return [m for m in super().model_patches_models() if all(m is not f for f in skip)]

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            with self.use_ejected():
                self._handle().runtime()
                m = self.model
                if device_to is not None:
                    m.device = device_to
                m.model_loaded_weight_memory = self._handle().size
                m.model_lowvram, m.lowvram_patch_counter, m.model_offload_buffer_memory = False, 0, 0
                m.current_weight_patches_uuid = self.patches_uuid
                if ext is not None:
                    for cb in self.get_all_callbacks(ext.CallbacksMP.ON_LOAD):
                        cb(self, device_to, lowvram_model_memory, force_patch_weights, full_load)

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            before = self.model.model_loaded_weight_memory if self._handle().resident else 0
            self.patch_model(device_to, load_weights=before == 0)
            return self.model.model_loaded_weight_memory - before

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            return self._unload(device_to)

        def _unload(self, device_to) -> int:
            """The bytes freed: the runtime's when it was released or offloaded in place (still held elsewhere),
            0 when it stays (on the CPU, or a runtime that cannot offload: then it stays loaded in what ComfyUI is
            told as well)."""
            h = self._handle()
            freed = 0
            if h.resident and h.device.type == "cuda" and (device_to is None or torch.device(device_to).type != "cuda"):
                freed = h.release()
                if h.resident and not h.offloaded:
                    return 0
            self.model.model_loaded_weight_memory = 0
            self.model.current_weight_patches_uuid = None
            return freed

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            self.eject_model()
            if unpatch_weights:
                self._unload(device_to)
            for k, old in list(self.object_patches_backup.items()):
                utils.set_attr(self.model, k, old)
            self.object_patches_backup.clear()

        def patch_weight_to_device(self, key, *args, **kwargs):
            raise node_error(TITLE, f"core tried to patch the weight {key} of the H3 MODEL; its weights live in this "
                                    "pack's runtime (LoRAs are applied there at sampling start)")

        def get_key_patches(self, filter_prefix=None):
            raise node_error(TITLE, "model merging reads the weights in core's format, which the H3 MODEL does not "
                                    "hold; merge checkpoints with core's UNETLoader models")

        def state_dict_for_saving(self, *args, **kwargs):
            raise node_error(TITLE, "saving the H3 MODEL is not supported (its weights are the loader's file, in "
                                    "this pack's resident format); save or convert the file itself")

        def pre_run(self):
            super().pre_run()
            self._handle().begin_sampling(self)

        def cleanup(self):
            super().cleanup()
            self._handle().end_sampling()

    _CLASSES.update(model=H3CoreModel, patcher=H3ModelPatcher)
    return H3CoreModel, H3ModelPatcher


class UnavailableModel:
    """The MODEL output where the running ComfyUI has no core H3 support (or outside ComfyUI): any use says so."""

    def __init__(self, why: str):
        self._why = why

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise node_error("H3 NVFP4 Model Loader", f"its MODEL output needs ComfyUI core's MiniMax H3 support "
                                                  f"({self._why}); update ComfyUI, or use the H3_MODEL output with "
                                                  "H3 Sampler")


def make_core_model(rt, reload=None, on_release=None):
    """The MODEL of a resident runtime: an H3ModelPatcher over an H3CoreModel (or UnavailableModel)."""
    classes = _core_classes()
    if classes is None:
        return UnavailableModel("comfy.model_base has no MiniMaxH3")
    model_cls, patcher_cls = classes
    sm = optional_comfy_module("comfy.supported_models")
    mm = optional_comfy_module("comfy.model_management")
    handle = RuntimeHandle(rt, reload, on_release)
    cfg = rt.config
    config = sm.MiniMaxH3({"image_model": "minimax_h3", "disable_unet_model_creation": True})
    config.sampling_settings = {"shift": cfg.shift_video, "audio_shift": cfg.shift_audio}
    config.set_inference_dtype(rt.dtype, None)
    model = model_cls(config, handle, device=rt.device)
    offload = mm.unet_offload_device() if mm is not None else torch.device("cpu")
    return patcher_cls(model, load_device=rt.device, offload_device=offload)


def _rows(parts) -> torch.Tensor:
    """[B, N] fp32: each batch entry's streams (video, then audio) flattened, core's packed order."""
    batch = parts[0].shape[0]
    return torch.cat([p.detach().reshape(batch, -1).float().cpu() for p in parts], dim=1)


def latent_fingerprints(latent) -> frozenset:
    """sha256 of each batch entry of a sampled latent (core's packed [B, 1, N] or nested (video, audio) form), its
    streams in core's packed order, as fp32 after a round trip through each dtype core's sampler may hand a LATENT
    out in (``intermediate_dtype``)."""
    rows = _rows(list(latent.unbind()) if getattr(latent, "is_nested", False) else [latent])
    return frozenset(latent_sha256(r.to(d).float()) for r in rows for d in _INTERMEDIATE_DTYPES)


def run_report(model, latent_video, latent_audio, title: str) -> dict:
    """The last sampling run's report of a MODEL from the loader (for H3 Diagnostics)."""
    handle = getattr(getattr(model, "model", None), "h3_handle", None)
    if not isinstance(handle, RuntimeHandle):
        raise node_error(title, f"model must be the MODEL output of H3 NVFP4 Model Loader (or a patched copy of it); "
                                f"got {type(getattr(model, 'model', model)).__name__}")
    last = getattr(handle.call.last_run, "last", None)
    if last is not None and (tuple(last[1][1:]), tuple(last[2][1:])) != (tuple(latent_video.shape[1:]),
                                                                        tuple(latent_audio.shape[1:])):
        # the report pairs the run's timings and counters with these latents' hashes: they must be that run's
        raise node_error(title, f"the latent (video {list(latent_video.shape)}, audio {list(latent_audio.shape)}) is "
                                f"not the output of this model's last sampling run, which sampled video "
                                f"{list(last[1])}, audio {list(last[2])}; connect the LATENT of the sampler that "
                                "ran last on this MODEL")
    entries = {latent_sha256(r) for r in _rows([latent_video, latent_audio])}  # a LatentFromBatch slice of the run too
    if handle.outputs and not any(entries <= fp for fp in handle.outputs):
        # same shapes, other values: another run's output (of this MODEL before, or of another model)
        raise node_error(title, "the latent is not the output of this model's last sampling run: its values are "
                                "neither that run's samples nor its denoised output; connect the LATENT of the "
                                "sampler that ran last on this MODEL")
    try:
        rep = handle.call.report(latent_video, latent_audio, {"host": "comfyui core sampler"})
    except H3Error as e:
        raise node_error(title, str(e)) from e
    return rep
