"""The resident H3 runtime as ComfyUI core's MODEL (H3 NVFP4 Model Loader's second output): the diffusion model
and the per-run state. Importing this module needs no ComfyUI; core's classes, subclassed, are in ``core_classes``.

Core's samplers (KSampler, KSamplerAdvanced, SamplerCustomAdvanced: every sampler and scheduler), its sigma shift
(``MiniMaxH3SigmaShift``), its H3 conditioning nodes and its LoRA loaders drive this pack's fast stack, as they drive
a model loaded by ``UNETLoader``.

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
- ``RuntimeHandle`` is the runtime's ``ResidentModel`` (the one owner of the resident model: load, release,
  reload, offload in place), shared by the loader and every clone of the MODEL's patcher, with what a ComfyUI
  sampling run keeps: at sampling start (``begin_sampling``) the LoRA records on the patcher are applied through
  the runtime's LoRA machinery (``core_patches.lora_specs``) and anything it cannot honour is refused
  (``core_patches``); ``end_sampling`` closes the run, whose report ``H3 Model Run Report`` reads.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..runtime import (CallOptions, ControlHint, H3Conditioning, H3Error, LossySettings, ResidentModel,
                       conditioning_from_payload, latent_sha256, load_control, sync_loras, weight_shapes)
from ._common import H3NodeError, node_error, optional_comfy_module
from .conditioning import PAYLOAD_SOURCES, with_source
from .control import PatchSource, prepare_hint
from .core_patches import (LORA_MODE, SPARSE_NODE, TITLE, check_patcher, check_transformer_options,
                           core_sparse_settings, lora_specs, patcher_transformer_options)

log = logging.getLogger("h3_blackwell")

# what core's _apply_model passes besides the documented arguments, all None in an H3 graph
_EMPTY_KWARGS = ("y", "c_concat", "crossattn_controlnet")
# what core's MiniMaxH3.extra_conds passes the diffusion model
_CONDS = ("minimax_payload", "denoise_mask", "audio_denoise_mask")
# payload entries MiniMaxH3.extra_conds writes that carry no information of their own (derived, or core's caches)
_DERIVED = ("cond_video_latents", "cond_audio_latents", "layout", "audio_scale", "_text_token_tags_list")
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
    unknown = sorted(k for k in payload if k not in PAYLOAD_SOURCES)
    if unknown:
        raise node_error(TITLE, f"the conditioning payload carries {unknown[0]!r}, an H3 entry this pack does not "
                                f"know (it takes {', '.join(sorted(PAYLOAD_SOURCES))}); update h3-blackwell or "
                                "remove the node that adds it")
    payload["denoise_mask"], payload["audio_denoise_mask"] = denoise_mask, audio_denoise_mask
    try:
        cond = conditioning_from_payload(payload)
        if target is not None:
            cond.check_target(*target)
    except H3Error as e:
        raise node_error(TITLE, with_source(str(e))) from e
    if tags is not None:
        tags = torch.as_tensor(tags).reshape(-1).long().cpu()
    return tags, cond


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a, b.to(a.device, a.dtype))


# ---------------------------------------------------------------------------------------------
# the resident runtime behind every MODEL of one loader, and its per-run state
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Tower:
    """core's control module, the load plan its tower was loaded on, and the runtime's tower (``FunControl``)."""

    module: object
    plan: object
    control: object

    def device_bytes(self, device) -> int:
        return self.control.device_bytes(device)


class RuntimeHandle(ResidentModel):
    """The resident runtime a MODEL evaluates (the runtime's ``ResidentModel``: load, release, reload, offload;
    shared by every clone of its patcher and by the loader that made it), plus what a ComfyUI sampling run keeps:
    the run's conditionings, the outputs core handed out, core's Fun ControlNet hints and the run's LOSSY
    settings from ``transformer_options``."""

    def __init__(self, rt=None, open=None):
        super().__init__(rt, open)
        self.names = weight_shapes(self.loaded)
        self.pending = False  # a run started (pre_run): the first call begins it with the schedule it sees
        self._fitted_rows = 0  # the run's planned size when ``size`` was last measured (``after_call``)
        self.conds: list = []  # (payload, masks, batch index) -> (tags, H3Conditioning), per run
        self.outputs: list = []  # latent_fingerprints of what core's process_latent_out handed out in the last run
        self.sampling, self._late_outputs = False, 0
        self.lossy = LossySettings()
        self.sparse_node: dict | None = None  # core's Model Sparse Attention of the last run: its settings, what ran
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

    def release(self) -> int:
        self.controlled = {}
        return super().release()

    def unload(self, device_to) -> tuple[int, bool]:
        """core unloads the MODEL to ``device_to`` -> (bytes freed, whether core must still count the runtime as
        loaded). Only an unload of a CUDA runtime off CUDA releases it (``release``: freed, or offloaded in place
        while held elsewhere; a runtime that could do neither stays loaded); a CPU runtime frees nothing and
        stays resident, outside what core counts."""
        if not (self.resident and self.device.type == "cuda"
                and (device_to is None or torch.device(device_to).type != "cuda")):
            return 0, False
        freed = self.release()
        return (0, True) if self.resident and not self.offloaded else (freed, False)

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
        self.lossy = LossySettings(to.get(SPARSE_TAU_KEY), to.get(FIRST_BLOCK_CACHE_KEY),
                                   self._core_sparse(rt, patcher_transformer_options(patcher)))
        self.pending, self.conds, self.controlled, self.outputs = True, [], {}, []
        self.sampling, self._late_outputs = True, 0
        if fun is None:
            self.towers, self.controlled = {}, {}  # a run without core's Fun ControlNet: its tower's memory goes
        self.measure()  # and side-path LoRAs hold device bytes of their own

    def _core_sparse(self, rt, options):
        """core's Model Sparse Attention on this MODEL -> the run's sparse settings, or None. As in core, the sparse
        path needs bf16 on CUDA: on the CPU the node's settings are recorded and dense runs (unless the loader chose
        attention=sparse, whose eager reference then runs them). On CUDA the kernels are bound at load, so a MODEL
        loaded without attention=sparse is refused here, in one line."""
        settings = core_sparse_settings(options)
        self.sparse_node = None if settings is None else {**dataclasses.asdict(settings), "ran": "sparse"}
        if settings is None or rt.sparse is not None:
            return settings
        if rt.device.type == "cpu":
            self.sparse_node["ran"] = "dense: the sparse path is not eligible on the CPU (core's rule: bf16 on CUDA)"
            return None
        raise node_error(TITLE, f"{SPARSE_NODE} on the H3 MODEL needs H3 NVFP4 Model Loader with attention=sparse "
                                f"(its kernels are bound at load; this model was loaded with attention="
                                f"{rt.plan.attention}); set the loader's attention to sparse, or remove the node")

    def end_sampling(self) -> None:
        self.pending, self.sampling, self._late_outputs = False, False, 1
        if self.resident:
            self.call.end_run()
            self.measure()

    def after_call(self) -> None:
        """After a model call: the run's first call (or a larger clip) plans the memory budget again and may move
        blocks (``ModelCall._fit``), so ``size`` is measured again when the planned size changed."""
        run = self.call.run
        rows = 0 if run is None else run.fitted_rows
        if rows != self._fitted_rows:
            self._fitted_rows = rows
            self.measure()

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
        if entry is None or entry.module is not module or entry.plan is not rt.plan:
            try:
                source = PatchSource(module)
                rt.fit_memory(shapes[0], shapes[1], text_tokens, max(1, len(sigmas)), cond, control=source)
                entry = _Tower(module, rt.plan, load_control(source, rt.plan, rt.config))
            except H3Error as e:
                raise node_error(TITLE, f"the Fun ControlNet of MiniMaxH3FunControlNetApply: {e}") from e
            self.towers = {id(module): entry}
            self.measure()
        key = (id(patch), id(cond), shapes[0])
        if key not in self.controlled:
            latent = getattr(patch, "control_latent", None)
            if latent is None or tuple(getattr(patch, "control_latent_shape", None) or ()) != shapes[0]:
                latent = _guarded(lambda: prepare_hint(patch.vae, shapes[0], patch.control_video, patch.mask,
                                                       patch.source_video))
            hint = ControlHint(latent.detach().float().cpu(), float(patch.strength), hi, lo,
                               int(getattr(patch, "fade_in_frames", 0)), int(getattr(patch, "fade_out_frames", 0)))
            self.controlled[key] = (patch, cond, dataclasses.replace(cond or H3Conditioning(), control=hint))
        return entry.control, self.controlled[key][2]


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


@dataclasses.dataclass(frozen=True)
class _AttnView:
    to_gate_compress: object


@dataclasses.dataclass(frozen=True)
class _BlockView:
    attn: _AttnView


class H3DiffusionModel(torch.nn.Module):
    """core's ``diffusion_model`` slot over the runtime (module docstring). Holds no parameters."""

    patch_size = (1, 2, 2)

    def __init__(self, handle: RuntimeHandle):
        torch.nn.Module.__init__(self)  # explicitly: core_classes' subclass also derives from core's MiniMaxH3Model
        self.handle = handle
        cfg = handle.config
        self.hidden_size, self.latents_dim, self.audio_latents_dim = (cfg.hidden_size, cfg.video_channels,
                                                                      cfg.audio_channels)
        self.sigma_shift_video, self.sigma_shift_audio = cfg.shift_video, cfg.shift_audio

    @property
    def dtype(self) -> torch.dtype:
        return self.handle.dtype

    @property
    def blocks(self) -> tuple:
        """What nodes that patch core's H3 blocks read of them (core's Model Sparse Attention: one block patch per
        block, and whether ``blocks[0].attn.to_gate_compress`` exists); the weights live in the runtime."""
        gate = True if self.handle.config.gate_compress else None
        return tuple(_BlockView(_AttnView(gate)) for _ in range(self.handle.config.num_layers))

    def preprocess_text_embeds(self, text_states: torch.Tensor) -> torch.Tensor:
        """core refines the text once in ``extra_conds``; the runtime refines it once per run in its plan (through
        the LoRA the run carries), so the states pass through unchanged."""
        return text_states

    def forward(self, x, timestep, context, transformer_options=None, control=None, **conds):
        """core's ``MiniMaxH3Model.forward`` (module docstring); ``conds``: what core's ``extra_conds`` adds
        (``minimax_payload``, ``denoise_mask``, ``audio_denoise_mask``) and the entries ``_apply_model`` passes as
        None."""
        options = transformer_options or {}
        if control is not None:
            raise node_error(TITLE, "a ControlNet on the conditioning (Apply ControlNet) cannot run on the H3 MODEL; "
                                    "remove it, or use core's UNETLoader model for ControlNet graphs")
        extra = sorted(k for k, v in conds.items() if k not in _CONDS and not (k in _EMPTY_KWARGS and v is None))
        if extra:
            raise node_error(TITLE, f"the model call carries {extra[0]!r} (from a conditioning or model node), which "
                                    "the H3 MODEL does not take; remove that node")
        conds = {k: conds.get(k) for k in _CONDS}
        fun = check_transformer_options(options)  # core's Fun ControlNet (or None): run as this pack's tower
        pe = optional_comfy_module("comfy.patcher_extension") if fun is not None else None
        if pe is None:
            return self._forward(x, timestep, context, options, fun=fun, **conds)

        def inner(x, timestep, context, transformer_options, **kw):
            return self._forward(x, timestep, context, transformer_options, fun=fun, **kw)

        # core's model runs its diffusion-model wrappers around the network (its Fun patch prepares its hint
        # latent there, under its memory guard); the only ones that pass the checks above are the Fun patch's
        wrappers = pe.get_all_wrappers(pe.WrappersMP.DIFFUSION_MODEL, options)
        return pe.WrapperExecutor.new_class_executor(inner, self, wrappers).execute(
            x, timestep, context, options, **conds)

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
    if handle.sparse_node is not None:
        rep["core_sparse_node"] = dict(handle.sparse_node)
    return rep
