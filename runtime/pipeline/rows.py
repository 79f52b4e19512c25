"""diffusers' packed H3 call -> our inputs: the geometry, keyframes and tags behind one ``transformer(...)`` call of
``MiniMaxH3ModularPipeline`` (``diffusers/modular_pipelines/minimax_h3/``), checked against our own layout.

diffusers hands the transformer rows, not latents: ``hidden_states`` [1, Nv, C*4] (the video rows, keyframe rows
first), ``audio_hidden_states`` [1, Na, Ca] (channel-major stereo rows), the text states, and the layout that says
where each row sits in the packed sequence ``[text | conditioning | target audio | target video]``: ``token_tags`` [S]
(0 video, 1 text, 2 audio), ``position_ids`` [S, 3] (t, h, w), ``video_indices`` / ``audio_indices`` /
``text_indices``, and the timesteps (``timestep`` the distinct t = 1 - sigma values, ``timestep_indices`` [S] each
row's). Our model builds the same layout from latent shapes and its conditioning, so this reads those back: the
target video rows are the last contiguous run of ``video_indices`` (T frames of rows, T from the distinct time
coordinates, the patch grid from the distinct h / w), the target audio rows the rows before them from the targets'
time origin on. Conditioning rows ahead of targets whose origin is the text length are keyframes (fl2va: blocks of
one target frame, each anchored at the pixel frame its time coordinate names); an origin past it means references
(ref2va: a video run with one time an image, with several a video, an audio run at the same time right before it
its soundtrack, an audio run alone an audio reference).

The reading is then proved, not trusted: :meth:`CallLayout.check` builds our layout (``runtime.model.layout``) for it
and compares every row's position and modality tag with diffusers', and :meth:`CallLayout.check_times` every row's
timestep at each step. A layout this module cannot express is refused there with what differed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import H3Error
from ..model.conditioning import FRAME_PER_TOKEN, FRAME_RESCALE, Ref
from ..model.layout import TAG_AUDIO, TAG_VIDEO, KeyframeSpec, build_layout, step_times, time_shift_sigma

__all__ = ["CallLayout", "read_layout"]

POSITION_TOL = 1e-4  # diffusers' positions are float64 (fp32 on MPS); ours float64: equal up to the dtype
TIME_TOL = 2e-6  # a row's t: diffusers' fp32 schedule vs ours from 1 - sigma in float64, then fp32


@dataclass(frozen=True)
class CallLayout:
    """One diffusers call's layout in our terms: text rows L, keyframe video rows (``cond_rows``, in blocks of one
    frame at ``keyframes`` pixel frames), the target latent T x H x W (even) and Ta, and the target rows' offsets in
    ``hidden_states`` / ``audio_hidden_states`` (``cond_rows`` / ``cond_audio_rows``)."""

    text_len: int
    latent_t: int
    lat_h: int
    lat_w: int
    audio_t: int
    keyframes: tuple[int, ...]
    cond_rows: int
    cond_audio_rows: int
    tags: torch.Tensor  # [L] the text rows' tags (1 text, 0 a vision block's rows)
    refs: tuple = ()  # the reference blocks (ref2va): Refs with their geometry, no latents

    @property
    def rows_per_frame(self) -> int:
        return (self.lat_h // 2) * (self.lat_w // 2)

    @property
    def pixel_frames(self) -> int:
        return sum(FRAME_PER_TOKEN[k % 5] for k in range(self.latent_t))

    @functools.cached_property
    def ours(self):
        """Our PackedLayout for this geometry (built once)."""
        return build_layout(self.text_len, self.latent_t, self.lat_h, self.lat_w, self.audio_t,
                            [KeyframeSpec(f) for f in self.keyframes], self.refs)

    @property
    def signature(self) -> tuple:
        """The layout as a value (two pipeline runs of one request have equal signatures)."""
        refs = tuple((r.kind, r.latent_t, r.latent_h, r.latent_w, r.ref_audio_t) for r in self.refs)
        return (self.text_len, self.latent_t, self.lat_h, self.lat_w, self.audio_t, self.keyframes, refs,
                tuple(self.tags.tolist()))

    def check(self, token_tags: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Our layout's rows equal diffusers': positions within POSITION_TOL, modality tags exactly; else H3Error."""
        lay = self.ours
        if lay.seq_len != token_tags.numel():
            raise H3Error(f"diffusers' packed sequence has {token_tags.numel()} rows; read as {self._what()} it "
                          f"would have {lay.seq_len}: a layout this transformer does not take (ref2va references?)")
        diff = (lay.position_ids - position_ids.double().cpu()).abs().max().item() if lay.seq_len else 0.0
        if diff > POSITION_TOL:
            raise H3Error(f"diffusers' rotary positions differ from ours by {diff:.3g} for {self._what()}: a "
                          "layout this transformer does not take (ref2va references, or another pipeline version)")
        ours_tag = self._rows(0.5, (12.0, 3.0))[1]
        if not torch.equal(ours_tag, token_tags.long().cpu()):
            bad = int((ours_tag != token_tags.long().cpu()).nonzero()[0])
            raise H3Error(f"row {bad}: diffusers tags it {int(token_tags[bad])}, our layout {int(ours_tag[bad])}")

    def check_times(self, row_t: torch.Tensor, sigma: float, shifts: tuple) -> None:
        """Every row's t of our step at ``sigma`` equals diffusers' ``row_t`` [S] (within TIME_TOL); else H3Error."""
        ours_t = self._rows(sigma, shifts)[0]
        diff = (ours_t - row_t.double().cpu()).abs()
        if diff.max().item() > TIME_TOL:
            bad = int(diff.argmax())
            raise H3Error(f"row {bad}: diffusers runs it at t = {float(row_t[bad]):.7f}, our step at video sigma "
                          f"{sigma:.7f} and shifts {shifts} at {float(ours_t[bad]):.7f}; the audio / keyframe "
                          "timesteps are not H3's rules for that sigma")

    def _rows(self, sigma: float, shifts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(t [S] float64, modality tag [S]) of every row of our step at ``sigma``."""
        lay = self.ours
        st = step_times(lay, sigma, shifts, [int(v) for v in self.tags])
        t = torch.empty(lay.seq_len, dtype=torch.float64)
        tag = torch.empty(lay.seq_len, dtype=torch.long)
        for a, b, idx in st.mod_segments:
            t[a:b] = st.t_values[idx // 3]
            tag[a:b] = idx % 3
        return t, tag

    def _what(self) -> str:
        kf = f", keyframes at pixel frames {list(self.keyframes)}" if self.keyframes else ""
        kf += f", references {[r.kind for r in self.refs]}" if self.refs else ""
        return (f"{self.text_len} text rows, a {self.latent_t}x{self.lat_h}x{self.lat_w} video latent and "
                f"{self.audio_t} audio frames{kf}")


def _last_run(indices: torch.Tensor, stop: int) -> int:
    """Length of the run of consecutive indices ending at ``stop - 1`` at the end of ``indices`` (sorted rows)."""
    n = indices.numel()
    k = 0
    while k < n and int(indices[n - 1 - k]) == stop - 1 - k:
        k += 1
    return k


def _grid(pos: torch.Tensor) -> tuple[int, int, int]:
    """(distinct t, distinct h, distinct w) of a block of video rows' positions [n, 3]."""
    return tuple(int(torch.unique(pos[:, k]).numel()) for k in range(3))


def _runs(tags: torch.Tensor, start: int, stop: int) -> list[tuple[int, int, int]]:
    """[(start, stop, tag)] maximal runs of equal modality tag in rows [start, stop)."""
    runs, a = [], start
    for i in range(start + 1, stop + 1):
        if i == stop or int(tags[i]) != int(tags[a]):
            runs.append((a, i, int(tags[a])))
            a = i
    return runs


def _refs(tags, pos, start: int, stop: int) -> tuple[Ref, ...]:
    """The reference blocks (ref2va, packed order) in rows [start, stop): a video run with one time is an image, with
    several a video, the audio run right before it at the same time its soundtrack; an audio run alone an audio
    reference. Their latents are the caller's (these carry the geometry only)."""
    refs, runs, k = [], _runs(tags, start, stop), 0
    while k < len(runs):
        a, b, tag = runs[k]
        if tag == TAG_AUDIO:
            nxt = runs[k + 1] if k + 1 < len(runs) else None
            if nxt is not None and nxt[2] == TAG_VIDEO and float(pos[nxt[0], 0]) == float(pos[a, 0]):
                t, hp, wp = _grid(pos[nxt[0]:nxt[1]])
                refs.append(Ref("video_audio", latent_t=t, latent_h=2 * hp, latent_w=2 * wp, ref_audio_t=(b - a) // 2))
                k += 2
                continue
            refs.append(Ref("audio", ref_audio_t=(b - a) // 2))
        elif tag == TAG_VIDEO:
            t, hp, wp = _grid(pos[a:b])
            refs.append(Ref("image" if t == 1 else "video", latent_t=t, latent_h=2 * hp, latent_w=2 * wp))
        else:
            raise H3Error(f"rows {a}..{b}: modality tag {tag} between the text and the target rows; expected video "
                          "(0) or audio (2) conditioning rows")
        k += 1
    return tuple(refs)


def read_layout(token_tags, position_ids, video_indices, audio_indices, text_indices) -> CallLayout:
    """The CallLayout behind diffusers' layout tensors (any device; read on the CPU). Keyframes (fl2va) leave the
    targets' time origin at the text length; references (ref2va) move it past their spans."""
    tags, pos = token_tags.cpu(), position_ids.double().cpu()
    vidx, aidx, tidx = video_indices.cpu(), audio_indices.cpu(), text_indices.cpu()
    s = tags.numel()
    n_target = _last_run(vidx, s)
    if n_target == 0:
        raise H3Error("diffusers' video_indices do not end with the target video rows (the last rows of the "
                      "packed sequence); not an H3 layout")
    vstart = s - n_target
    run = _last_run(aidx, vstart)  # target audio, and an audio reference's rows when one is packed last
    origin = float(pos[vstart, 0])
    n_audio = int((pos[vstart - run:vstart, 0] >= origin).sum()) if run else 0
    if n_audio == 0 or n_audio % 2:
        raise H3Error(f"expected an even run of target audio rows right before the video rows; found {n_audio}")
    t, hp, wp = _grid(pos[vstart:])
    if t * hp * wp != n_target:
        raise H3Error(f"the {n_target} target video rows are not a T x H/2 x W/2 grid (found {t} times, {hp} rows, "
                      f"{wp} columns)")
    text_len, astart = tidx.numel(), vstart - n_audio
    n_cond = vidx.numel() - n_target
    refs, keyframes = (), []
    if origin != float(text_len):  # the references' spans moved the targets' time origin
        refs = _refs(tags, pos, text_len, astart)
    else:
        rpf = hp * wp
        frames = sum(FRAME_PER_TOKEN[k % 5] for k in range(t))
        for k in range(n_cond // rpf if n_cond % rpf == 0 else 0):
            at = float(pos[int(vidx[k * rpf]), 0]) - text_len
            keyframes.append(min(max(int(round(at / FRAME_RESCALE)), 0), frames - 1))
        if len(keyframes) * rpf != n_cond or aidx.numel() != n_audio:
            raise H3Error(f"{n_cond} conditioning video rows and {aidx.numel() - n_audio} audio rows ahead of "
                          "targets at the text's time: expected keyframes, whole frames of the target's grid")
    return CallLayout(text_len, t, 2 * hp, 2 * wp, n_audio // 2, tuple(keyframes), n_cond,
                      aidx.numel() - n_audio, tags[tidx].long().clone(), refs)


def audio_shift(sigma_v: float, t_audio: float, shifts: tuple[float, float]) -> tuple[float, float]:
    """The (video, audio) shifts that give the pipeline's audio t at video sigma ``sigma_v``: ``shifts`` when they
    do (the released schedulers: 12 and 3), else the audio shift that maps sigma_v to 1 - t_audio (only the ratio
    of the shifts matters; rounded so every step of a run finds the same plan)."""
    sigma_a = 1.0 - t_audio
    if abs(time_shift_sigma(sigma_v, *shifts) - sigma_a) <= TIME_TOL or not (0 < sigma_v < 1 and 0 < sigma_a < 1):
        return shifts
    ratio = sigma_a * (1 - sigma_v) / (sigma_v * (1 - sigma_a))
    return shifts[0], round(shifts[0] * ratio, 6)
