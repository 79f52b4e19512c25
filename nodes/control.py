"""H3 Fun ControlNet: core's ``MiniMaxH3FunControlNetApply`` for the pack's H3_MODEL (and the H3 Sampler).

Inputs and defaults are core's (``comfy_extras/nodes_minimax_h3.py`` @ 13a83ce7, fades from PR #16283): the
tower (core's ``ModelPatchLoader`` output, or a file of ``models/model_patches``), the video VAE, strength 1.0
(0..10), start/end percent 0 / 1, optional control video, mask (1 = regenerate) and source video, fade in / out
frames 0 (0..3600). Like core it returns the model unchanged for strength 0 or with neither a control video
nor a mask. The output is the same resident model seen with the control attached (``ControlledModel``); the H3
Sampler then prepares the hint for its latent and runs the runtime's tower (``runtime.model.control``).

The hint is prepared as core's ``MiniMaxH3FunControlPatch.prepare_control_latent`` does, for the target video
latent [1, 24, T, H, W] (unpadded): F = max((T - 2) // 5, 0) * 17 + 5 pixel frames at (W, H) x the VAE's
spatial compression; frame i of a clip is its frame min(i, n - 1); frames resized bilinear with a centre crop
(``comfy.utils.common_upscale(..., "bilinear", "center")``); the control video's encode is the 24-channel hint;
with a mask: binarised at 0.5, resized likewise, re-binarised, visibility = 1 - mask, the masked source
(source video or zeros, times visibility) encoded, the visibility trilinearly resized to (T, H, W), and the hint
becomes [control or zeros | visibility | masked source] = 49 channels. Every encode must give the target shape.

The sigma window is ``percent_to_sigma`` of the flow schedule at the video shift in force when sampling (the
H3 Sampler's ``shift_video``; core freezes it with the shift present when the node is applied, which is the
same when the shift is set before the control, as core's templates do).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..runtime import ControlSpec, H3Error, load_control, open_control, percent_to_sigma
from ._common import CATEGORY, comfy_module, keyword_inputs, node_error, optional_comfy_module

NO_FILE = "(use the model_patch input)"
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)


# ---------------------------------------------------------------------------------------------
# core's hint preparation
# ---------------------------------------------------------------------------------------------

def resize_center(x: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """[N, C, h, w] -> [N, C, height, width]: centre crop to the target aspect, then bilinear (no corner
    alignment), the way ``comfy.utils.common_upscale(x, width, height, "bilinear", "center")`` does it."""
    old_h, old_w = x.shape[-2], x.shape[-1]
    old_aspect, new_aspect = old_w / old_h, width / height
    dx = dy = 0
    if old_aspect > new_aspect:
        dx = round((old_w - old_w * (new_aspect / old_aspect)) / 2)
    elif old_aspect < new_aspect:
        dy = round((old_h - old_h * (old_aspect / new_aspect)) / 2)
    x = x.narrow(-2, dy, old_h - 2 * dy).narrow(-1, dx, old_w - 2 * dx)
    return F.interpolate(x, size=(height, width), mode="bilinear")


def fit_frames(frames: torch.Tensor, count: int, width: int, height: int) -> torch.Tensor:
    """[n, C, h, w] -> [count, C, height, width]: frame i is frame min(i, n - 1) (short clips hold their last
    frame, long ones are cut), resized with ``resize_center``."""
    idx = torch.arange(count, device=frames.device).clamp(max=frames.shape[0] - 1)
    return resize_center(frames[idx], width, height)


def _encode(vae, frames: torch.Tensor, target: tuple) -> torch.Tensor:
    """Core's VAE encode of [F, 3, H, W] pixels in [0, 1] -> fp32 latent, which must be the target shape."""
    lat = vae.encode(frames.movedim(1, -1)).to(torch.float32)
    if tuple(lat.shape) != tuple(target):
        raise H3Error(f"the VAE encoded the control frames to {list(lat.shape)}; the target video latent is "
                      f"{list(target)}; connect the H3 video VAE")
    return lat


def prepare_hint(vae, target_shape, control_video: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 source_video: torch.Tensor | None = None) -> torch.Tensor:
    """The hint latent [1, 24 or 49, T, H, W] fp32 for the target video latent ``target_shape`` (core's
    ``prepare_control_latent``, module docstring). control_video / source_video: [n, 3, h, w] pixels in [0, 1]
    (core's node takes IMAGE [n, h, w, C] and moves the channels first); mask: [n, h, w] or [h, w], 1 =
    regenerate. The source video is read only with a mask."""
    target = tuple(int(v) for v in target_shape)
    t, h, w = target[2:]
    count = max((t - 2) // 5, 0) * 17 + 5
    comp = int(vae.spacial_compression_encode())
    width, height = w * comp, h * comp
    hint = None
    if control_video is not None:
        hint = _encode(vae, fit_frames(control_video, count, width, height), target)
    if mask is not None:
        m = (mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]) > 0.5).to(torch.float32)
        m = fit_frames(m, count, width, height)
        vis = 1.0 - (m > 0.5).to(torch.float32)
        if source_video is None:
            source = torch.zeros(count, 3, height, width, dtype=vis.dtype, device=vis.device)
        else:
            source = fit_frames(source_video, count, width, height)
        masked = _encode(vae, source * vis.to(source.device), target)
        if hint is None:
            hint = torch.zeros_like(masked)
        vis_lat = F.interpolate(vis.squeeze(1)[None, None], size=(t, h, w), mode="trilinear", align_corners=False)
        hint = torch.cat([hint, vis_lat.to(hint.device), masked.to(hint.device)], dim=1)
    return hint


# ---------------------------------------------------------------------------------------------
# the tower from core's MODEL_PATCH
# ---------------------------------------------------------------------------------------------

class PatchSource:
    """Core's loaded ``MiniMaxH3FunControl`` (a ModelPatchLoader MODEL_PATCH) behind the reading interface of
    ``runtime.load_control``: its state dict (float weights as they are; quantized layers dequantized, which
    core's QuantizedTensor offers), its places, form and width."""

    def __init__(self, module):
        sd = module.state_dict()
        self._sd = {}
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                continue
            if not v.is_floating_point() and hasattr(v, "dequantize"):
                v = v.dequantize()
            self._sd[k] = v
        blk = module.control_blocks[0]
        qkv = self._sd["control_blocks.0.attn.qkv_proj.weight"]
        head_dim = self._sd["control_blocks.0.attn.q_norm.weight"].shape[0]
        self.spec = ControlSpec(len(module.control_blocks), tuple(int(p) for p in module.injection_layers),
                                not blk.adaln_proj.apply_silu, int(blk.adaln_proj.linear.in_features),
                                int(self._sd["control_proj_in.weight"].shape[0]), qkv.shape[0] // (3 * head_dim),
                                head_dim, self._sd["control_blocks.0.mlp.fc1.weight"].shape[0] // 2,
                                bool(getattr(module, "inpaint_post_norm", False)))
        self.name = "MODEL_PATCH (core's MiniMaxH3FunControl)"

    def keys(self):
        return list(self._sd)

    def quant_layers(self):
        return set()

    def quant_format(self, layer):
        return None

    def tensor(self, k, device="cpu"):
        return self._sd[k].detach().to(device)


# ---------------------------------------------------------------------------------------------
# the model with a control attached, and the node
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ControlAttachment:
    """What the node attaches: the tower's source and core's apply-time inputs. ``hint(target, shift)`` gives the
    payload's control field for a target latent shape (cached per shape); ``tower(rt)`` the loaded tower for a
    resident runtime (cached per load plan)."""

    source: object
    vae: object
    strength: float
    start_percent: float
    end_percent: float
    control_video: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    source_video: torch.Tensor | None = None
    fade_in_frames: int = 0
    fade_out_frames: int = 0

    def __post_init__(self):
        self.strength, self.start_percent, self.end_percent = (float(self.strength), float(self.start_percent),
                                                               float(self.end_percent))
        self.fade_in_frames, self.fade_out_frames = int(self.fade_in_frames), int(self.fade_out_frames)
        self._hint = (None, None)
        self._tower = (None, None)

    def hint(self, target_shape, shift_video: float) -> dict:
        key = tuple(int(v) for v in target_shape)
        if self._hint[0] != key:
            with torch.no_grad():
                self._hint = (key, prepare_hint(self.vae, key, self.control_video, self.mask, self.source_video))
        return {"hint": self._hint[1], "strength": self.strength,
                "sigma_start": percent_to_sigma(self.start_percent, shift_video),
                "sigma_end": percent_to_sigma(self.end_percent, shift_video),
                "fade_in_frames": self.fade_in_frames, "fade_out_frames": self.fade_out_frames}

    def tower(self, rt, shapes: tuple | None = None, text_tokens: int = 0, steps: int = 1):
        """The tower loaded onto ``rt``'s plan (cached per plan). With the run's latent ``shapes`` (video, audio)
        the memory budget is planned with the tower first (``H3Runtime.fit_memory``), so that it loads streamed
        where the budget needs it (the sampling run plans again with its conditioning)."""
        plan = rt.plan
        if self._tower[0] is not plan:
            src = self.source if hasattr(self.source, "spec") else open_control(self.source)
            fit = getattr(rt, "fit_memory", None)
            if shapes is not None and callable(fit):
                fit(tuple(shapes[0]), tuple(shapes[1]), int(text_tokens), max(1, int(steps)), None, control=src)
            self._tower = (plan, load_control(src, plan, rt.config))
        return self._tower[1]


class ControlledModel:
    """A resident H3 model (or a LoRA view of it) seen with a Fun ControlNet attached (``fun_control``);
    everything else is the wrapped model's."""

    def __init__(self, base, fun_control: ControlAttachment):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "fun_control", fun_control)

    def __getattr__(self, name):
        if name.startswith("__") or name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name, value):  # state set on the view (rt.ops by a LoRA sync) belongs to the model
        setattr(self._base, name, value)


def _patch_files() -> list[str]:
    fp = optional_comfy_module("folder_paths")
    try:
        names = list(fp.get_filename_list("model_patches")) if fp is not None else []
    except KeyError:  # a ComfyUI without the model_patches folder
        names = []
    return [NO_FILE] + names


def _pixels(image, title: str, what: str) -> torch.Tensor | None:
    """core's IMAGE [n, h, w, C] -> [n, 3, h, w] (channels cut to 3 and moved first, as core's node does)."""
    if image is None:
        return None
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] < 3:
        raise node_error(title, f"{what} must be an IMAGE [frames, height, width, 3]; got "
                                f"{list(getattr(image, 'shape', []))}")
    return image[..., :3].movedim(-1, 1).float()


def _control_source(model_patch, control_name: str):
    """The tower's source: core's ModelPatchLoader output (``PatchSource``) or a file of models/model_patches."""
    if model_patch is not None:
        module = getattr(model_patch, "model", model_patch)
        if not hasattr(module, "control_blocks") or not hasattr(module, "injection_layers"):
            raise H3Error(f"model_patch holds {type(module).__name__}, not a MiniMax H3 Fun ControlNet")
        return PatchSource(module)
    path = comfy_module("folder_paths").get_full_path("model_patches", control_name)
    if path is None:
        raise H3Error(f"'{control_name}' was not found in models/model_patches")
    return open_control(path)


class H3FunControlNetApply:
    TITLE = "H3 Fun ControlNet"
    DESCRIPTION = ("MiniMax H3 Fun ControlNet-Union (v1 / v2) for the H3 model, with core's inputs: a control video "
                   "and/or an inpaint mask with its source video, strength, the start/end window and fades. The "
                   "tower runs in the pack's runtime (NVFP4 like the base when the loader quantizes); the H3 "
                   "Sampler encodes the hint with the VAE for its latent, as core does.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("H3_MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("the same resident model with the ControlNet attached",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("H3_MODEL", {"tooltip": "from H3 NVFP4 Model Loader or H3 LoRA"}),
            "vae": ("VAE", {"tooltip": "the H3 video VAE (encodes the control video and the masked source)"}),
            "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0, "step": 0.01,
                                   "tooltip": "scale of the control signal; 0 leaves the model unchanged"}),
            "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001, "advanced": True,
                                        "tooltip": "fraction of the schedule where the control starts (0 = first "
                                                   "step)"}),
            "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.001, "advanced": True,
                                      "tooltip": "fraction of the schedule where the control stops (1 = last step)"}),
        }, "optional": {
            "model_patch": ("MODEL_PATCH", {"tooltip": "core's ModelPatchLoader with a MiniMax H3 Fun ControlNet"}),
            "control_name": (_patch_files(), {"default": NO_FILE, "tooltip": "or a Fun ControlNet file of "
                                                                             "models/model_patches"}),
            "control_video": ("IMAGE", {"tooltip": "Control frames (pose, depth, edges...); short clips hold their "
                                                    "last frame, long ones are cut."}),
            "mask": ("MASK", {"tooltip": "1 marks the regions to regenerate."}),
            "source_video": ("IMAGE", {"tooltip": "Video behind the mask; only read when a mask is given."}),
            "fade_in_frames": ("INT", {"default": 0, "min": 0, "max": 3600, "advanced": True,
                                       "tooltip": "output-video frames over which the control eases in from 0 "
                                                  "at the start"}),
            "fade_out_frames": ("INT", {"default": 0, "min": 0, "max": 3600, "advanced": True,
                                        "tooltip": "output-video frames over which the control eases out to 0 "
                                                   "at the end"}),
        }}

    def apply(self, model, vae, strength, start_percent, end_percent, **optional):
        """ComfyUI's FUNCTION: the optional inputs of INPUT_TYPES (model_patch, control_name, control_video, mask,
        source_video, fade_in_frames, fade_out_frames) as keywords; absent or None: their defaults."""
        opt = keyword_inputs(self, optional)
        if not hasattr(model, "config") or not hasattr(model, "model"):
            raise node_error(self.TITLE, f"model must come from H3 NVFP4 Model Loader; got {type(model).__name__}")
        if getattr(model, "fun_control", None) is not None:
            raise node_error(self.TITLE, "the model already has a Fun ControlNet; this pack applies one per model")
        if (opt["model_patch"] is None) == (opt["control_name"] in ("", NO_FILE)):
            raise node_error(self.TITLE, "connect a model_patch (ModelPatchLoader) or choose a control_name file, "
                                         "exactly one of the two")
        mask = opt["mask"]
        if strength == 0 or (opt["control_video"] is None and mask is None):
            return (model,)  # core returns the model unchanged
        try:
            source = _control_source(opt["model_patch"], opt["control_name"])
            source.spec.check_base(model.config)  # form, adaLN width, dimensions, places: refused here
        except H3Error as e:
            raise node_error(self.TITLE, str(e)) from e
        fc = ControlAttachment(source, vae, strength, start_percent, end_percent,
                               _pixels(opt["control_video"], self.TITLE, "control_video"), mask,
                               _pixels(opt["source_video"], self.TITLE, "source_video") if mask is not None else None,
                               opt["fade_in_frames"], opt["fade_out_frames"])
        return (ControlledModel(model, fc),)

