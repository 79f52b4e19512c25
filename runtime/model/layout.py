"""The packed sequence of one H3 request: segments, (t, h, w) rotary positions, timestep classes.

Order (ComfyUI core's ``PackedLayout``)::

    [text | keyframe blocks | reference blocks | target audio | target video]

- a keyframe block is its video rows (``cond``) then its audio rows (``cond_audio``), keyframes in list order;
- references in request order: an image is ``ref_img``; standalone audio ``ref_audio``; a video its soundtrack
  rows (``ref_audio``) then its frames (``ref_img``).

Every segment is contiguous and uniform in (timestep class, modality tag) except the text span, whose
vision-token positions carry the video tag, and a masked target stream (its rows run at their own t, see
``step_times``); modulation and gating are slices of runs, not gathers.

Rotary coordinates (float64, exactly as ComfyUI core builds them):
- text token i -> (i, 0, 0)
- references sit on the time axis from ``text_len`` on, one after the other: an image spans 1, an audio
  reference its ``ref_audio_t``, a video ``max(ref_audio_t, sum 5/3 * (1,4,4,4,4)[k % 5])``; an image's
  rows all have t = its start, a video's frames and soundtrack both start there
- the target timeline starts at ``origin = text_len + sum of the reference spans``
- video latent frame k sits at ``start + sum_{j<k} 5/3 * (1,4,4,4,4)[j % 5]``; its (h, w) grid is area
  normalised over its own latent size: for an axis of ``dim`` latent pixels, n = dim // 2,
  ratio = dim / sqrt(H*W), coordinate ``(arange(n) * ratio / n + (1 - ratio) / 2) * 32``
- audio row j of a stereo channel: t = start + j, h = 0, w = the smallest video w coordinate for channel 0
  and the largest for channel 1 (rows are channel-major); the target grid's extremes, except a reference
  video's soundtrack, which takes its own video's
- a keyframe at pixel frame f is anchored at ``origin + 5/3 * f`` and uses the target's spatial grid
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import H3Error

FRAME_RESCALE = 5.0 / 3.0
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
SPATIAL_SCALE = 32.0
VISUAL_COND_T = 0.999  # cond rows run at max(t_video, 0.999) (noise-augmentation strength)
AUDIO_COND_T = 1.0    # audio cond rows at max(t_audio, 1.0); both also pin masked target rows

TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
SEGMENT_TAG = {"video": TAG_VIDEO, "cond": TAG_VIDEO, "ref_img": TAG_VIDEO,
               "audio": TAG_AUDIO, "cond_audio": TAG_AUDIO, "ref_audio": TAG_AUDIO}

CANVAS_MULTIPLE = 32
VAE_SPATIAL = 16


class LayoutError(H3Error):
    """Bad request geometry (frames off the 17k+5 grid, width not a multiple of 32, ...)."""


# ---------------------------------------------------------------------------------------------
# geometry helpers (ComfyUI core node conventions)
# ---------------------------------------------------------------------------------------------

def snap_frames(frames: int) -> int:
    """Snap a pixel frame count UP to the 17k+5 grid (minimum 5), as core's H3 nodes do."""
    if frames <= 5:
        return 5
    return 5 + 17 * math.ceil((frames - 5) / 17)


def check_frames(frames: int) -> None:
    if frames < 5 or (frames - 5) % 17:
        raise LayoutError(
            f"frames={frames} is not on H3's 17k+5 grid (5, 22, 39, ..., 124, ...); "
            f"use {snap_frames(frames)} or pass --snap")


def check_canvas(width: int, height: int) -> None:
    for name, v in (("width", width), ("height", height)):
        if v <= 0 or v % CANVAS_MULTIPLE:
            raise LayoutError(f"{name}={v} must be a positive multiple of {CANVAS_MULTIPLE} "
                              f"(nearest: {max(CANVAS_MULTIPLE, round(v / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)})")


def latent_frames(frames: int) -> int:
    """Pixel frames (17k+5) -> latent frames (5k+2); a single image or 5 frames -> 2."""
    return 2 if frames <= 5 else (frames - 5) // 17 * 5 + 2


def audio_frames(frames: int, fps: float = 24.0, audio_fps: float = 40.0) -> int:
    """Audio latent frames per stereo channel: round(frames / 24 * 40)."""
    return int(round(frames / fps * audio_fps))


def latent_shapes(width: int, height: int, frames: int, video_channels: int = 24, audio_channels: int = 32):
    """((1, C, T, H/16, W/16), (1, Ca, 2, Ta)) for a canvas; checks the canvas and frame grid."""
    check_canvas(width, height)
    check_frames(frames)
    return ((1, video_channels, latent_frames(frames), height // VAE_SPATIAL, width // VAE_SPATIAL),
            (1, audio_channels, 2, audio_frames(frames)))


# ---------------------------------------------------------------------------------------------
# rotary grids
# ---------------------------------------------------------------------------------------------

def _spatial_axis(dim: int, sqrt_area: float, patch: int = 2) -> torch.Tensor:
    n = dim // patch
    ratio = dim / sqrt_area
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * SPATIAL_SCALE


def frame_grid(lat_h: int, lat_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) coordinates of one latent frame's patch rows [h/2 * w/2, 2] (row-major), and the w axis."""
    sqrt_area = math.sqrt(lat_h * lat_w)
    hs = _spatial_axis(lat_h, sqrt_area)
    ws = _spatial_axis(lat_w, sqrt_area)
    grid = torch.stack([hs[:, None].expand(-1, ws.numel()).reshape(-1),
                        ws[None, :].expand(hs.numel(), -1).reshape(-1)], dim=-1)
    return grid, ws


def video_time_axis(n_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame: origin + exclusive cumsum of 5/3 * (1,4,4,4,4)[k % 5]."""
    spans = torch.tensor([FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(n_frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _video_positions(n_frames: int, grid: torch.Tensor, origin: float) -> torch.Tensor:
    pos = torch.empty(n_frames, grid.shape[0], 3, dtype=torch.float64)
    pos[:, :, 0] = video_time_axis(n_frames, origin)[:, None]
    pos[:, :, 1:] = grid[None]
    return pos.reshape(-1, 3)


def _audio_positions(audio_t: int, origin: float, w_lo: float, w_hi: float) -> torch.Tensor:
    pos = torch.zeros(2 * audio_t, 3, dtype=torch.float64)
    pos[:, 0] = (origin + torch.arange(audio_t, dtype=torch.float64)).repeat(2)
    pos[:audio_t, 2] = w_lo
    pos[audio_t:, 2] = w_hi
    return pos


# ---------------------------------------------------------------------------------------------
# the layout
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyframeSpec:
    """A keyframe block anchored at pixel frame ``frame_index`` (>= 0): ``latent_t`` video latent frames (0: none)
    on the target's grid, then ``audio_t`` stereo audio latent frames (0: none)."""

    frame_index: int
    latent_t: int = 1
    audio_t: int = 0


@dataclass
class PackedLayout:
    """Segments and rotary positions of one request.

    segments: [(start, stop, kind)], kind in text / cond / cond_audio / ref_img / ref_audio / audio / video,
    contiguous, covering [0, seq_len); the target audio and video are always the last two.
    position_ids: [seq_len, 3] float64 (t, h, w)
    lat_h / lat_w: the target latent height / width after padding to even (the patch grid)
    refs: the reference blocks (``conditioning.Ref``; only their kind and sizes are read here)
    """

    text_len: int
    latent_t: int
    lat_h: int
    lat_w: int
    audio_t: int
    keyframes: tuple[KeyframeSpec, ...] = ()
    segments: list = field(default_factory=list)
    position_ids: torch.Tensor | None = None
    refs: tuple = ()

    @property
    def seq_len(self) -> int:
        return self.segments[-1][1]

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The target video's token grid (T, H/2, W/2): one row per 2x2 patch of each latent frame."""
        return self.latent_t, self.lat_h // 2, self.lat_w // 2

    @property
    def rows_per_frame(self) -> int:
        return self.token_grid[1] * self.token_grid[2]

    def segment(self, kind: str) -> tuple[int, int]:
        """(start, stop) of the first segment of ``kind`` (text, audio and video occur once)."""
        for a, b, k in self.segments:
            if k == kind:
                return a, b
        raise KeyError(kind)

    @property
    def cond_rows(self) -> int:
        """Visual condition rows (keyframe and reference video rows)."""
        return sum(b - a for a, b, k in self.segments if k in ("cond", "ref_img"))

    @property
    def signature(self):
        refs = tuple((r.kind, r.latent_t, r.latent_h, r.latent_w, r.ref_audio_t) for r in self.refs)
        return (self.text_len, self.latent_t, self.lat_h, self.lat_w, self.audio_t, self.keyframes, refs)

    def describe(self) -> list[dict]:
        """The segment table as [{"kind", "start", "stop", "rows"}] (for reports and the CLI)."""
        return [{"kind": k, "start": a, "stop": b, "rows": b - a} for a, b, k in self.segments]


def build_layout(text_len: int, latent_t: int, lat_h: int, lat_w: int, audio_t: int,
                 keyframes: tuple[KeyframeSpec, ...] | list = (), refs=()) -> PackedLayout:
    """Packed layout for t2va, keyframes (fl2va / AddGuide) and references (ref2va); see the module docstring.

    lat_h / lat_w are rounded up to even (the circular padding the model applies to the latent). refs: objects
    with kind, latent_t, latent_h, latent_w, ref_audio_t and time_span (``conditioning.Ref``).
    """
    lat_h += lat_h % 2
    lat_w += lat_w % 2
    keyframes, refs = tuple(keyframes), tuple(refs)
    grid, w_axis = frame_grid(lat_h, lat_w)
    w_lo, w_hi = float(w_axis[0]), float(w_axis[-1])
    origin = float(text_len) + sum(r.time_span for r in refs)
    segments, pos, row = [], [], 0

    def add(kind, p):
        nonlocal row
        if p.shape[0]:
            segments.append((row, row + p.shape[0], kind))
            pos.append(p)
            row += p.shape[0]

    text = torch.zeros(text_len, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(text_len, dtype=torch.float64)
    add("text", text)
    if not text_len:
        segments.append((0, 0, "text"))
    for kf in keyframes:
        if kf.frame_index < 0:
            raise LayoutError(f"keyframe frame_index must be resolved to >= 0, got {kf.frame_index}")
        at = origin + FRAME_RESCALE * kf.frame_index
        add("cond", _video_positions(kf.latent_t, grid, at))
        add("cond_audio", _audio_positions(kf.audio_t, at, w_lo, w_hi))
    cursor = float(text_len)
    for r in refs:
        if r.kind == "audio":
            add("ref_audio", _audio_positions(r.ref_audio_t, cursor, w_lo, w_hi))
        else:
            rgrid, rw = frame_grid(r.latent_h, r.latent_w)
            if r.kind != "image":
                add("ref_audio", _audio_positions(r.ref_audio_t, cursor, float(rw[0]), float(rw[-1])))
            add("ref_img", _video_positions(r.latent_t, rgrid, cursor))
        cursor += r.time_span
    add("audio", _audio_positions(audio_t, origin, w_lo, w_hi))
    add("video", _video_positions(latent_t, grid, origin))
    return PackedLayout(text_len, latent_t, lat_h, lat_w, audio_t, keyframes, segments, torch.cat(pos), refs)


# ---------------------------------------------------------------------------------------------
# timesteps
# ---------------------------------------------------------------------------------------------

def time_shift_sigma(sigma: float, from_shift: float, to_shift: float) -> float:
    """Map a sigma on one shifted flow schedule to another: invert s*b/(1+(s-1)b), re-apply the other shift."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


@dataclass
class StepTimes:
    """The distinct timesteps of one model evaluation and the modulation row of every run of rows.

    t_values: sorted distinct t in [0, 1] (fp32 when embedded)
    mod_segments: [(start, stop, t_index * 3 + tag)] covering the sequence with int rows (text split into tag
    runs, a masked target stream into runs of equal t)
    video_t_index / audio_t_index: t-table rows of the target streams for the final layer's modulation: an int,
    or a LongTensor with one entry per row of a masked stream
    """

    t_values: list
    mod_segments: list
    video_t_index: int | torch.Tensor
    audio_t_index: int | torch.Tensor


def masked_row_times(mask_rows: torch.Tensor | None, sigma: float, pin: float) -> torch.Tensor | None:
    """Core's per-row t of a masked target stream: ``min(1 - m * sigma, pin)`` computed in float32 (m [n] float32,
    the pooled mask of each row; sigma the stream's sigma; pin max(t_stream, cond t)); None without a mask."""
    if mask_rows is None:
        return None
    s = torch.tensor(float(sigma), dtype=torch.float32)
    return (1.0 - mask_rows.float().cpu() * s).clamp(max=pin)


def _text_runs(a: int, b: int, base: int, text_tags) -> list:
    tags = text_tags if text_tags is not None else [TAG_TEXT] * (b - a)
    if len(tags) != b - a:
        raise LayoutError(f"token_tags has {len(tags)} entries, text has {b - a} rows")
    runs, start = [], 0
    for i in range(1, b - a + 1):
        if i == b - a or tags[i] != tags[start]:
            tag = int(tags[start])
            if tag not in (TAG_VIDEO, TAG_TEXT):
                raise LayoutError(f"token_tags must be 1 (text) or 0 (vision), found {tag}")
            runs.append((a + start, a + i, base + tag))
            start = i
    return runs


def _rows_to_index(rows_t: torch.Tensor, index: dict) -> torch.Tensor:
    """Per-row t values (float32) -> their t-table indices [n] long (vectorised over the distinct levels)."""
    levels = rows_t.unique()
    base = torch.tensor([index[v] for v in levels.tolist()], dtype=torch.long)
    return base[torch.searchsorted(levels, rows_t)]


def _row_runs(a: int, rows_index: torch.Tensor, tag: int) -> list:
    """Per-row t indices -> [(start, stop, t_index * 3 + tag)] runs of equal index."""
    vals, counts = torch.unique_consecutive(rows_index, return_counts=True)
    runs, start = [], a
    for v, n in zip(vals.tolist(), counts.tolist()):
        runs.append((start, start + n, int(v) * 3 + tag))
        start += n
    return runs


def step_times(layout: PackedLayout, sigma_v: float, shifts: tuple[float, float],
               text_tags: list | None = None, visual_cond_t: float = VISUAL_COND_T,
               audio_cond_t: float = AUDIO_COND_T, video_mask_rows: torch.Tensor | None = None,
               audio_mask_rows: torch.Tensor | None = None) -> StepTimes:
    """Timesteps of one evaluation at video sigma ``sigma_v`` (ComfyUI core's rules); shifts: (video, audio).

    text / video t_v = 1 - sigma_v; audio t_a = 1 - shift(sigma_v; shift_v -> shift_a); cond / ref_img rows
    max(t_v, visual_cond_t); cond_audio / ref_audio rows max(t_a, audio_cond_t) (the noise-augmentation values).
    video_mask_rows [n_video_rows] / audio_mask_rows [2 * Ta]: pooled denoise-mask values (float32) of a masked
    stream; its rows then run at ``masked_row_times`` (pins 0.999 / 1.0, core's constants).
    """
    shift_v, shift_a = shifts
    sigma_v = max(float(sigma_v), 1e-6)
    t_v = 1.0 - sigma_v
    t_a = 1.0 - time_shift_sigma(sigma_v, shift_v, shift_a)
    seg_t = {"text": t_v, "video": t_v, "audio": t_a, "cond": max(t_v, visual_cond_t),
             "ref_img": max(t_v, visual_cond_t), "cond_audio": max(t_a, audio_cond_t),
             "ref_audio": max(t_a, audio_cond_t)}
    rows_t = {"video": masked_row_times(video_mask_rows, sigma_v, max(t_v, VISUAL_COND_T)),
              "audio": masked_row_times(audio_mask_rows, 1.0 - t_a, max(t_a, AUDIO_COND_T))}
    for kind, rt in list(rows_t.items()):
        if rt is not None and rt.unique().numel() == 1:  # one level: the whole stream at that t (as core)
            seg_t[kind] = float(rt[0])
            rows_t[kind] = None
    # Distinct values compared as Python floats (float64), like core; they are embedded in fp32.
    values = {t_v, t_a} | {seg_t[k] for _, _, k in layout.segments}
    for rt in rows_t.values():
        if rt is not None:
            values |= set(rt.unique().tolist())
    values = sorted(values)
    index = {t: i for i, t in enumerate(values)}
    row_index = {k: None if rt is None else _rows_to_index(rt, index) for k, rt in rows_t.items()}
    mod = []
    for a, b, kind in layout.segments:
        base = index[seg_t[kind]] * 3
        if b == a:
            continue
        if kind == "text":
            mod += _text_runs(a, b, base, text_tags)
        elif kind in row_index and row_index[kind] is not None:
            if row_index[kind].numel() != b - a:
                raise LayoutError(f"the {kind} mask has {row_index[kind].numel()} rows, the stream {b - a}")
            mod += _row_runs(a, row_index[kind], SEGMENT_TAG[kind])
        else:
            mod.append((a, b, base + SEGMENT_TAG[kind]))
    final = {k: index[seg_t[k]] if row_index[k] is None else row_index[k] for k in ("video", "audio")}
    return StepTimes(values, mod, final["video"], final["audio"])


# ---------------------------------------------------------------------------------------------
# rows <-> latents
# ---------------------------------------------------------------------------------------------

def pad_video(latent: torch.Tensor) -> torch.Tensor:
    """Circular-pad H and W of [B, C, T, H, W] up to even (ComfyUI's pad_to_patch_size)."""
    ph, pw = latent.shape[3] % 2, latent.shape[4] % 2
    if ph or pw:
        latent = torch.nn.functional.pad(latent, (0, pw, 0, ph, 0, 0), mode="circular")
    return latent


def patchify_video(latent: torch.Tensor) -> torch.Tensor:
    """[1, C, T, H, W] (H, W even) -> rows [T*(H/2)*(W/2), C*1*2*2]; rows t,h,w; features (c, pt, ph, pw)."""
    _, c, t, h, w = latent.shape
    x = latent.reshape(c, t, h // 2, 2, w // 2, 2).permute(1, 2, 4, 0, 3, 5)
    return x.reshape(t * (h // 2) * (w // 2), c * 4)


def unpatchify_video(rows: torch.Tensor, t: int, h: int, w: int, c: int) -> torch.Tensor:
    """rows [t*(h/2)*(w/2), c*4] -> [1, c, t, h, w] (inverse of patchify_video)."""
    x = rows.reshape(t, h // 2, w // 2, c, 2, 2).permute(3, 0, 1, 4, 2, 5)
    return x.reshape(1, c, t, h, w)


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """[1, Ca, 2, Ta] -> rows [2*Ta, Ca], channel-major (stereo channel 0 first)."""
    return latent[0].permute(1, 2, 0).reshape(-1, latent.shape[1])


def unpack_audio(rows: torch.Tensor) -> torch.Tensor:
    """rows [2*Ta, Ca] -> [1, Ca, 2, Ta]."""
    return rows.reshape(2, rows.shape[0] // 2, rows.shape[1]).permute(2, 0, 1).unsqueeze(0)
