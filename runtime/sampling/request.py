"""A generation request validated before any work: sizes, numbers, device, output paths, text states.

Everything here reads only the request, the model's config (from the checkpoint header) and the machine's
free memory (the memory check itself asks the budget: ``runtime.budget.check_request``): no weight is read and no tensor of the request's size is allocated, so a hostile request
(``--width 100000``, ``--frames 1700005``, ``--text-tokens 10000000``) is refused in milliseconds.

The CLI and the nodes call the same checks; each raises RequestError (an H3Error: one ``error:`` line in
the CLI, the node's error in ComfyUI) saying what was expected, what was found and what to do.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import H3Error
from ..io.finite import check_finite
from ..model.config import H3Config
from ..model.layout import (CANVAS_MULTIPLE, VAE_SPATIAL, audio_frames, check_canvas, check_frames,
                            latent_frames, snap_frames)

SEED_RANGE = (0, 2 ** 64 - 1)  # ComfyUI's seed widget range; torch.Generator.manual_seed takes it whole
MAX_STEPS = 10000  # ComfyUI's KSampler widget maximum
MIN_DENOISE = 1e-6
SMALL_MODEL_HIDDEN = 512  # models this small (the embedded tiny, make-tiny files) get the small defaults


class RequestError(H3Error):
    """A request that cannot run as given (bad number, too large for the device, unwritable output)."""


# ---------------------------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """One t2va request in pixels: width/height multiples of 32, frames on the 17k+5 grid, steps >= 1."""

    width: int
    height: int
    frames: int
    steps: int
    text_tokens: int

    @property
    def packed_rows(self) -> int:
        """Rows of the packed sequence: text + 2 * audio frames + latent frames * (H/32) * (W/32)."""
        lat_h = -(-(self.height // VAE_SPATIAL) // 2)
        lat_w = -(-(self.width // VAE_SPATIAL) // 2)
        return self.text_tokens + 2 * audio_frames(self.frames) + latent_frames(self.frames) * lat_h * lat_w


def defaults_for(cfg: H3Config) -> dict[str, int]:
    """The request defaults of a model: small models run a seconds-long 256x256 / 22 frames / 8 steps canvas,
    the full model the reference 1344x768 / 124 frames / 20 steps."""
    if cfg.hidden_size <= SMALL_MODEL_HIDDEN:
        return {"width": 256, "height": 256, "frames": 22, "steps": 8}
    return {"width": 1344, "height": 768, "frames": 124, "steps": 20}


def check_int(name: str, value, low: int = 1, high: int | None = None, hint: str = "") -> int:
    """``value`` as an int in [low, high]; RequestError otherwise (booleans and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}={value!r}: expected an integer{hint}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name}={value}: expected an integer {rng}{hint}")
    return value


def check_seed(seed) -> int:
    """A seed in ComfyUI's range [0, 2**64 - 1]."""
    return check_int("seed", seed, *SEED_RANGE, hint=" (ComfyUI's seed range)")


MAX_NOISE_INDEX = 4095  # batch entries drawn before the one kept: each costs one noise draw of every stream


def check_noise_index(index) -> int:
    """A latent's batch index in [0, MAX_NOISE_INDEX] (the noise of that batch entry of the seed, as core draws it)."""
    return check_int("batch_index", index, 0, MAX_NOISE_INDEX,
                     hint=" (the noise of batch entry k is drawn after k entries of every stream)")


def check_steps(steps) -> int:
    """Sampling steps in [1, MAX_STEPS]: the schedule and the per-step tables are built before the first step, so
    an unbounded count would fill the memory before anything could be refused."""
    return check_int("steps", steps, 1, MAX_STEPS, hint=" (ComfyUI's KSampler allows at most 10000)")


def check_denoise(denoise) -> float:
    """denoise in [MIN_DENOISE, 1]: the schedule keeps the last steps of one ``steps / denoise`` steps long, whose
    positions lose their precision in float64 far below the bound."""
    d = float(denoise)
    if not math.isfinite(d) or not MIN_DENOISE <= d <= 1.0:
        raise RequestError(f"denoise={denoise!r}: expected a number in [{MIN_DENOISE:g}, 1] (1 = full generation)")
    return d


def resolve_request(cfg: H3Config, width: int | None = None, height: int | None = None, frames: int | None = None,
                    steps: int | None = None, text_tokens: int = 32, snap: bool = False) -> Request:
    """Apply the model's defaults to the sizes that were not given (None) and check every size.

    An explicit 0 is an error, never "use the default". width/height: positive multiples of 32; frames:
    the 17k+5 grid (``snap`` moves it up onto the grid first); steps, text_tokens: >= 1.
    """
    d = defaults_for(cfg)
    width = d["width"] if width is None else check_int("width", width, hint=f" (a multiple of {CANVAS_MULTIPLE})")
    height = d["height"] if height is None else check_int("height", height,
                                                          hint=f" (a multiple of {CANVAS_MULTIPLE})")
    frames = d["frames"] if frames is None else check_int("frames", frames, hint=" on the 17k+5 grid (5, 22, 39, ...)")
    steps = d["steps"] if steps is None else check_steps(steps)
    text_tokens = check_int("text_tokens", text_tokens, hint=" (the length of the random text states)")
    check_canvas(width, height)
    if snap:
        frames = snap_frames(frames)
    check_frames(frames)
    return Request(width, height, frames, steps, text_tokens)


# ---------------------------------------------------------------------------------------------
# device and memory
# ---------------------------------------------------------------------------------------------

def _cgroup_free() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def host_available_bytes() -> int:
    """Host memory a new allocation can get: MemAvailable (Linux), capped by the cgroup limit when set."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cg = _cgroup_free()
    return free if cg is None else min(free, cg)


def approx_param_bytes(cfg: H3Config, bytes_per_param: int = 4) -> int:
    """Weights of a model of ``cfg`` from its dimensions alone (no model is built): the block and refiner
    linears and AdaLN, the text projection, the patch projections and heads, the time embedder."""
    h = cfg.hidden_size
    block = h * 4 * cfg.inner_dim + 3 * cfg.ffn_hidden_size * h + 6 * h * cfg.time_embed_dim
    io = cfg.text_dim * h + 2 * h * (cfg.video_patch_dim * cfg.head_bank + cfg.audio_channels)
    time = cfg.timestep_input_dim * cfg.time_embed_hidden_size + cfg.time_embed_hidden_size * cfg.time_embed_dim
    return bytes_per_param * ((cfg.num_layers + cfg.num_refiner_layers) * block + io + time)


def _video_rows(shape) -> int:
    """Patch rows of a video latent [1, C, T, H, W]: T * ceil(H / 2) * ceil(W / 2)."""
    return int(shape[2]) * -(-int(shape[3]) // 2) * -(-int(shape[4]) // 2)


def condition_rows(cond) -> int:
    """Packed rows a conditioning adds (an ``H3Conditioning``, or None): every keyframe's and reference's video
    rows (T * H/2 * W/2) and stereo audio rows (2 * ta), each counted as often as the payload lists it (a
    thousand keyframes naming one tensor are a thousand blocks of rows)."""
    if cond is None:
        return 0
    rows = 0
    for block in (*cond.keyframes, *cond.refs):
        if block.latent is not None:
            rows += _video_rows(block.latent.shape)
        if block.audio_latent is not None:
            rows += 2 * int(block.audio_latent.shape[3])
    return rows


def latent_rows(video_shape, audio_shape, text_tokens: int, cond=None) -> int:
    """Packed rows of an evaluation from its latent shapes: video [1, C, T, H, W] (H, W padded to even),
    audio [1, Ca, 2, Ta], the text tokens, and the condition rows of ``cond`` (``condition_rows``)."""
    return text_tokens + 2 * int(audio_shape[3]) + _video_rows(video_shape) + condition_rows(cond)


# ---------------------------------------------------------------------------------------------
# output paths
# ---------------------------------------------------------------------------------------------

def _probe_writable(directory: Path, what: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".h3-probe-", dir=directory)
    except OSError as e:
        raise RequestError(f"{what}: cannot write into {directory} ({e.strerror or e}); choose a writable "
                           "location") from None
    try:
        os.close(fd)
    finally:  # an interruption here must not leave the probe behind
        os.unlink(probe)


def _resolved(p: Path, path: Path, what: str) -> Path:
    """``p`` (an existing name on the way to ``path``) with every symbolic link resolved; a dangling link or a
    link loop is refused naming the link."""
    try:
        return Path(os.path.realpath(p, strict=True))
    except OSError as e:
        link = next((q for q in (p, *p.parents) if q.is_symlink()), p)
        if e.errno == errno.ELOOP:
            found = f"{link} is a symbolic link loop"
        else:
            found = f"{link} is a symbolic link to {os.readlink(link) if link.is_symlink() else link}, which does " \
                    "not exist"
        raise RequestError(f"{what} {path}: expected a path that exists or can be created; {found}; remove the "
                           "link or choose another path") from None


def _nearest_existing(path: Path, what: str) -> tuple[Path, Path]:
    """(the closest existing name at or above ``path``, that name with its links resolved). Dangling links and
    link loops on the way are refused; an existing ancestor must be a directory (a file in the way is an
    error)."""
    p = path
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    real = _resolved(p, path, what)
    if p != path and not real.is_dir():
        raise RequestError(f"{what}: {p} is a file, so {path} cannot be created under it; choose another path")
    return p, real


def check_output_dir(path: str | os.PathLike, what: str = "--output") -> Path:
    """A directory that exists or can be created, and that can be written. Symbolic links on the way are
    resolved first (a dangling link or a loop is refused). Nothing is left behind. Returns the resolved path."""
    path = Path(path)
    near, real = _nearest_existing(path, what)
    if near == path and not real.is_dir():
        raise RequestError(f"{what} {path} is a file; expected a directory (it will hold latents.safetensors "
                           "and report.json); choose a directory path")
    _probe_writable(real, what)
    return real / path.relative_to(near) if near != path else real


def check_output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """A file path whose directory exists or can be created and can be written; an existing directory at
    ``path`` is an error (a file is replaced atomically). Symbolic links are resolved first: a link to a file
    is written through (the link keeps pointing at the new file), a dangling link or a loop is refused.
    Nothing is left behind. Returns the resolved path to write."""
    path = Path(path)
    if not path.name:
        raise RequestError(f"{what} {str(path)!r}: expected a file path")
    near, real = _nearest_existing(path, what)
    if near == path:
        if real.is_dir():
            raise RequestError(f"{what} {path} is a directory; expected a file path such as "
                               f"{path / 'out.safetensors'}")
        if not real.is_file():
            raise RequestError(f"{what} {path} is not a regular file ({'a link to ' if real != path else ''}"
                               f"{real}); expected a file path to write")
        _probe_writable(real.parent, what)
        return real
    _probe_writable(real, what)
    return real / path.relative_to(near)


# ---------------------------------------------------------------------------------------------
# tensors of the request
# ---------------------------------------------------------------------------------------------

def check_text_states(text_states: torch.Tensor, token_tags: torch.Tensor | None, cfg: H3Config,
                      source: str = "text states") -> None:
    """text_states [1, L, text_dim] (or [L, text_dim]) with L >= 1, every value finite; token_tags None or
    L entries of 0 (vision) / 1 (text)."""
    shape = list(text_states.shape)
    if text_states.dim() not in (2, 3) or (text_states.dim() == 3 and shape[0] != 1) \
            or shape[-1] != cfg.text_dim:
        raise RequestError(f"{source}: text_states has shape {shape}; expected [1, L, {cfg.text_dim}] "
                           f"(Qwen3-VL states for H3 are [1, L, 5120])")
    if shape[-2] == 0:
        raise RequestError(f"{source}: text_states is empty ([1, 0, {cfg.text_dim}]); expected at least one token")
    if not text_states.is_floating_point():
        raise RequestError(f"{source}: text_states has dtype {text_states.dtype}; expected a float tensor")
    check_finite("text_states", text_states, RequestError, source,
                 "the text encoder output is broken; re-encode the prompt")
    if token_tags is not None:
        if token_tags.numel() != shape[-2]:
            raise RequestError(f"{source}: token_tags has {token_tags.numel()} entries for {shape[-2]} text tokens; "
                               "expected one tag per token")
        bad = set(token_tags.flatten().tolist()) - {0, 1}
        if bad:
            raise RequestError(f"{source}: token_tags must be 1 (text) or 0 (vision); found {sorted(bad)[:5]}")


def check_latents(video: torch.Tensor, audio: torch.Tensor, cfg: H3Config, source: str = "inputs") -> None:
    """video [1, C, T, H, W] and audio [1, Ca, 2, Ta] with the model's channels, non-empty and finite."""
    c, ca = cfg.video_channels, cfg.audio_channels
    if video.dim() != 5 or video.shape[0] != 1 or video.shape[1] != c or 0 in video.shape:
        raise RequestError(f"{source}: video has shape {list(video.shape)}; this model expects [1, {c}, T, H, W]")
    if audio.dim() != 4 or audio.shape[0] != 1 or audio.shape[1] != ca or audio.shape[2] != 2 or 0 in audio.shape:
        raise RequestError(f"{source}: audio has shape {list(audio.shape)}; this model expects [1, {ca}, 2, Ta]")
    for name, t in (("video", video), ("audio", audio)):
        if not t.is_floating_point():  # any float dtype is converted to float32; integers are not latents
            raise RequestError(f"{source}: {name} has dtype {str(t.dtype).replace('torch.', '')}; expected a float "
                               "tensor (any float dtype, fp8 included, is converted)")
        check_finite(name, t, RequestError, source, "pass finite latents")
