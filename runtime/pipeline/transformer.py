"""DiffusersTransformer: our resident H3 as the ``transformer`` of diffusers' ``MiniMaxH3ModularPipeline``.

The pipeline's denoise loop (``diffusers/modular_pipelines/minimax_h3/denoise.py``) calls its transformer once per
step as ``transformer(hidden_states=, audio_hidden_states=, encoder_hidden_states=, timestep=, timestep_indices=,
attention_kwargs=, return_dict=False, **layout)``, ``layout`` being the ``token_tags``, ``position_ids``,
``video_indices``, ``audio_indices``, ``text_indices`` that ``inspect.signature(transformer.forward)`` names, and
reads ``transformer.config.patch_size``; it expects ``(video_v, audio_v)``: the network's own (data-ward) velocity
of every video row [1, Nv, C*4] and audio row [1, Na, Ca]. This object answers that call with our block stack, loaded
with our options (NVFP4 / W4A8 blocks, Sage2, streaming, the guarded FC2, LoRAs), through the runtime's one per-call
object, ``ModelCall``: the same plan, memory fit, counters and checks as ``generate`` and ComfyUI's samplers.

    pipe = ModularPipeline.from_pretrained("MiniMaxAI/MiniMax-H3"); pipe.load_components(torch_dtype=torch.bfloat16)
    pipe.update_components(transformer=DiffusersTransformer.from_file("h3_nvfp4.safetensors", attention="sage2"))
    out = pipe(prompt="...", output=["videos", "audio"])

What a call maps (``runtime.pipeline.rows``): the rows back to latents (video [1, C, T, H, W], audio [1, Ca, 2, Ta]),
the conditioning rows to keyframes (fl2va) or references (ref2va: pass it as ``transformer_ref`` too; the pipeline
noises their visual rows, so the conditioning is marked ``augmented``), the text tags, and the video sigma 1 - t;
the layout is checked against ours on the first call of a layout and every row's timestep at each step. The
conditioning rows get no velocity (zeros): the pipeline only steps the generated rows.

Schedule: diffusers' call carries one step's timesteps, not the run's schedule, and our plan precomputes the
modulation rows of every step of a run (full-form AdaLN weights stay in host memory). A call is planned alone the
first time its sigma is seen; a run that restarts (the video sigma rises again) with the same layout is planned
whole from the previous run's sigmas, so a repeated request costs only the block stack per step. A sigma off that
schedule is still exact (planned alone). PDD head banks need the sampler's next sigma and are refused here.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch

from ..errors import H3Error
from ..model.conditioning import H3Conditioning, Keyframe
from ..model.layout import pack_audio, patchify_video, unpack_audio, unpatchify_video
from ..model_spec import open_model
from ..sampling.model_call import CallOptions, ModelCall
from .rows import CallLayout, audio_shift, read_layout

__all__ = ["DiffusersTransformer", "DiffusersConfig", "LAYOUT"]

# the packed sequence's description, passed by name (diffusers' ``denoiser_input_fields``)
LAYOUT = ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


@dataclass(frozen=True)
class DiffusersConfig:
    """The config fields diffusers' H3 blocks read of a transformer (``patch_size``), with the model's widths."""

    patch_size: tuple
    in_channels: int
    audio_in_channels: int
    text_dim: int
    hidden_size: int
    num_layers: int


@dataclass
class _Seen:
    """The layout of the calls being served: diffusers' layout tensors (by identity), our reading of them, the
    text tags and keyframe conditioning (the same objects every step, so ModelCall finds its plan)."""

    key: tuple
    layout: CallLayout
    tags: torch.Tensor
    cond_rows: tuple | None = None  # the (video, audio) condition rows cond was made from
    cond: H3Conditioning | None = None


class DiffusersTransformer:
    """The pipeline's ``transformer``, backed by a resident runtime ``rt`` (``load_model`` / ``ModelSpec.load``)."""

    def __init__(self, rt):
        if rt.config.head_bank > 1:
            raise H3Error(f"this checkpoint has a PDD head bank of {rt.config.head_bank}; its heads need the "
                          "sampler's next sigma, which diffusers' transformer call does not carry: use "
                          "h3-blackwell generate (or ComfyUI) for it")
        self.rt = rt
        self.call = ModelCall(rt)
        cfg = rt.config
        self.config = DiffusersConfig(tuple(cfg.patch_size), cfg.video_channels, cfg.audio_channels, cfg.text_dim,
                                      cfg.hidden_size, cfg.num_layers)
        self._seen: _Seen | None = None
        self._run_key: tuple | None = None  # the layout signature of the run being served
        self._sigmas: list[float] = []  # the video sigmas of the run being served, in call order
        self._previous: tuple | None = None  # (layout key, sigmas) of the last finished run

    @classmethod
    def from_file(cls, path, *, dense: bool = False, loras=(), **options) -> "DiffusersTransformer":
        """Load ``path`` (any checkpoint the runtime reads: NVFP4, bf16, ComfyUI / diffusers / release naming) with
        our options by their names (``attention``, ``vram_budget``, ``device``, ``dtype``, ``gemm``, ...: those of
        ``RuntimeOptions``; ``dense=True`` the dense reference blocks) and ``loras`` (LoraSpecs or
        ``FILE:STRENGTH[:MODE]``)."""
        if dense:
            options["quantize"] = False
        return cls(open_model(path, options, loras=loras).load())

    @property
    def device(self) -> torch.device:
        return self.rt.device

    @property
    def dtype(self) -> torch.dtype:
        return self.rt.dtype

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor, timestep: torch.Tensor, timestep_indices: torch.Tensor,
                **layout):
        """One step of the pipeline -> (video velocity [1, Nv, C*4], audio velocity [1, Na, Ca]) in
        ``hidden_states``' dtype and device: the network's output (diffusers' sign), zeros on keyframe rows.
        ``layout``: the five LAYOUT tensors by name, ``attention_kwargs`` (None or empty) and ``return_dict``
        (False); the declared signature (``inspect.signature``, which the pipeline reads) names them all."""
        extra = sorted(set(layout) - set(LAYOUT) - {"attention_kwargs", "return_dict"})
        missing = [n for n in LAYOUT if n not in layout]
        if extra or missing:
            raise H3Error(f"the H3 pipeline's call passes {', '.join(LAYOUT)} by name; found "
                          f"{'unknown ' + ', '.join(extra) if extra else ''}{' and ' if extra and missing else ''}"
                          f"{'no ' + ', '.join(missing) if missing else ''}")
        if layout.get("attention_kwargs"):
            raise H3Error(f"attention_kwargs {sorted(layout['attention_kwargs'])}: this transformer takes none (its "
                          "attention is the load option `attention`)")
        if layout.get("return_dict"):
            raise H3Error("return_dict=True: this transformer returns the (video, audio) tuple the H3 pipeline asks "
                          "for with return_dict=False")
        if hidden_states.shape[0] != 1 or audio_hidden_states.shape[0] != 1:
            raise H3Error(f"one clip per call; got hidden_states {list(hidden_states.shape)}")
        token_tags, audio_indices = layout["token_tags"], layout["audio_indices"]
        seen = self._layout(*(layout[n] for n in LAYOUT))
        lay = seen.layout
        row_t = timestep.float().cpu()[timestep_indices.cpu()]
        t_video, t_audio = float(row_t[-1]), float(row_t[int(audio_indices[-1])])
        sigma = 1.0 - t_video
        shifts = audio_shift(sigma, t_audio, (self.rt.config.shift_video, self.rt.config.shift_audio))
        lay.check_times(row_t, sigma, shifts)
        self._follow_run(lay.signature, sigma)
        cond = self._conditioning(seen, hidden_states[0, :lay.cond_rows], audio_hidden_states[0, :lay.cond_audio_rows])
        video = unpatchify_video(hidden_states[0, lay.cond_rows:].float(), lay.latent_t, lay.lat_h, lay.lat_w,
                                 self.config.in_channels)
        audio = unpack_audio(audio_hidden_states[0, lay.cond_audio_rows:].float())
        vv, va = self.call(video, audio, sigma, encoder_hidden_states, seen.tags, cond, CallOptions(shifts))
        out_v = torch.zeros_like(hidden_states)
        out_v[0, lay.cond_rows:] = -patchify_video(vv).to(hidden_states.device, hidden_states.dtype)
        out_a = torch.zeros_like(audio_hidden_states)
        out_a[0, lay.cond_audio_rows:] = -pack_audio(va).to(audio_hidden_states.device, audio_hidden_states.dtype)
        return out_v, out_a

    # -- what the calls share ------------------------------------------------------------------------
    def _layout(self, token_tags, position_ids, video_indices, audio_indices, text_indices) -> _Seen:
        """The reading of diffusers' layout tensors, made and checked once per layout (the pipeline passes the same
        tensors every step; the key holds them, so an identity is never reused while it is current)."""
        key = (token_tags, position_ids, video_indices, audio_indices, text_indices)
        seen = self._seen
        if seen is not None and all(a is b for a, b in zip(seen.key, key)):
            return seen
        lay = read_layout(*key)
        lay.check(token_tags, position_ids)
        self._seen = _Seen(key, lay, lay.tags)
        return self._seen

    def _conditioning(self, seen: _Seen, video_rows: torch.Tensor, audio_rows: torch.Tensor):
        """The keyframe (fl2va) or reference (ref2va) conditioning of these rows, noised by the pipeline; the same
        object while the rows do not change (the pipeline never writes them)."""
        lay = seen.layout
        if not lay.keyframes and not lay.refs:
            return None
        rows = (video_rows.float().cpu(), audio_rows.float().cpu())
        if seen.cond is None or not all(torch.equal(a, b) for a, b in zip(seen.cond_rows, rows)):
            seen.cond_rows, seen.cond = rows, _rows_conditioning(lay, *rows, self.config.in_channels)
        return seen.cond

    def _follow_run(self, key: tuple, sigma: float) -> None:
        """A new run starts where the video sigma rises again or the layout changes: the previous run closes and
        the new one is planned from the previous run's sigmas when its layout is the same (module docstring)."""
        sigma = float(torch.tensor(sigma, dtype=torch.float32))
        same = self.call.run is not None and self._run_key == key
        if same and self._sigmas and sigma < self._sigmas[-1]:
            self._sigmas.append(sigma)
            return
        if self.call.run is not None and self._sigmas:
            self._previous = (self._run_key, list(self._sigmas))
        prev = self._previous
        schedule = prev[1] + [0.0] if prev is not None and prev[0] == key and prev[1][0] == sigma else None
        self.call.begin_run(schedule, pin_schedule=False, round_trip=False)
        self._run_key, self._sigmas = key, [sigma]


def _declared_signature() -> inspect.Signature:
    """forward's signature as diffusers' denoise loop reads it: the step's tensors, then the layout tensors,
    ``attention_kwargs`` and ``return_dict`` by name (the loop passes exactly the layout names listed here)."""
    P = inspect.Parameter
    names = ["hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices"]
    params = [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(n, P.POSITIONAL_OR_KEYWORD) for n in names]
    params += [P(n, P.KEYWORD_ONLY) for n in LAYOUT]
    params += [P("attention_kwargs", P.KEYWORD_ONLY, default=None), P("return_dict", P.KEYWORD_ONLY, default=False)]
    return inspect.Signature(params)


DiffusersTransformer.forward.__signature__ = _declared_signature()


def _rows_conditioning(lay: CallLayout, video: torch.Tensor, audio: torch.Tensor, channels: int) -> H3Conditioning:
    """Condition rows (video [n, C*4], audio [m, Ca], packed order) -> keyframes or references with their latents,
    marked ``augmented`` (the pipeline noised the visual ones; the audio ones run clean, as ours do)."""
    if lay.keyframes:
        n = lay.rows_per_frame
        kfs = tuple(Keyframe(f, latent=unpatchify_video(video[k * n:(k + 1) * n], 1, lay.lat_h, lay.lat_w, channels))
                    for k, f in enumerate(lay.keyframes))
        return H3Conditioning(keyframes=kfs, augmented=True)
    refs, v, a = [], 0, 0
    for r in lay.refs:
        latent = audio_latent = None
        if r.kind != "audio":
            n = r.latent_t * (r.latent_h // 2) * (r.latent_w // 2)
            latent = unpatchify_video(video[v:v + n], r.latent_t, r.latent_h, r.latent_w, channels)
            v += n
        if r.ref_audio_t:
            audio_latent = unpack_audio(audio[a:a + 2 * r.ref_audio_t])
            a += 2 * r.ref_audio_t
        refs.append(dataclasses.replace(r, latent=latent, audio_latent=audio_latent))
    return H3Conditioning(refs=tuple(refs), augmented=True)
