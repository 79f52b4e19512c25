"""Where sparse attention is exact and when it runs: the routing of one packed H3 sequence and the schedule
switch (ComfyUI core's "Model Sparse Attention" H3 rule and defaults). The kernels are ``ops.sparse_attention``.

Routing (sink_conditioning ``exact_kv_and_rows``): every row before the target video (text, keyframe cond rows,
reference rows and the target audio) is a SINK: its key blocks ``[0, ceil(video_start / 64))`` are exact for
every query. The target-audio QUERY rows are dense: query blocks ``[audio_start // 64, ceil(audio_stop / 64))``
attend every key exactly. Attention is dense while the model sigma is above ``percent_to_sigma(start_percent)``
of the shifted flow schedule (core: 0.2, i.e. sigma > 0.9796 at shift 12) and for sequences shorter than
``min_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import H3Error
from ..options import SPARSE_EXTRA_TOKENS, SPARSE_MIN_TOKENS, SPARSE_START, SPARSE_TAU

__all__ = ["BLOCK", "DEFAULT_TAU", "DEFAULT_START_PERCENT", "DEFAULT_MIN_TOKENS", "DEFAULT_EXTRA_TOKENS",
           "CONDITIONING_KINDS", "SparseRouting", "SparseSchedule", "routing_for_segments", "percent_to_sigma"]

BLOCK = 64                    # Sol-Attn's block length (rows)
# core's defaults, written once in runtime.options
DEFAULT_TAU, DEFAULT_START_PERCENT = SPARSE_TAU, SPARSE_START
DEFAULT_MIN_TOKENS, DEFAULT_EXTRA_TOKENS = SPARSE_MIN_TOKENS, SPARSE_EXTRA_TOKENS
CONDITIONING_KINDS = ("text", "cond", "cond_audio", "ref_img", "ref_audio", "ref_video")


@dataclass(frozen=True)
class SparseRouting:
    """The kernel's routing inputs for one packed sequence.

    seq_len: S rows; sink_blocks / dense_q_blocks: half-open ``[start, end)`` ranges of 64-row KEY blocks
    attended exactly by every query, and of QUERY blocks that attend every key exactly; tau: the routing
    threshold; token_aug: the kernel's extra exact tokens per query block (0 or a multiple of 64 up to 256).
    """

    seq_len: int
    sink_blocks: tuple[int, int]
    dense_q_blocks: tuple[int, int]
    tau: float = DEFAULT_TAU
    token_aug: int = DEFAULT_EXTRA_TOKENS

    @property
    def n_blocks(self) -> int:
        return -(-self.seq_len // BLOCK)

    def sink_rows(self) -> tuple[int, int]:
        """Rows covered by the sink key blocks (a superset of the conditioning rows, block-rounded)."""
        return self.sink_blocks[0] * BLOCK, min(self.sink_blocks[1] * BLOCK, self.seq_len)

    def dense_rows(self) -> tuple[int, int]:
        """Query rows that attend every key exactly (a superset of the target-audio rows, block-rounded)."""
        return self.dense_q_blocks[0] * BLOCK, min(self.dense_q_blocks[1] * BLOCK, self.seq_len)

    def forced_exact(self) -> torch.Tensor:
        """[n, n] bool (query block, key block): exact whatever the scores say (diagonal +-1, sinks, dense rows)."""
        n = self.n_blocks
        idx = torch.arange(n)
        forced = (idx[:, None] - idx[None, :]).abs() <= 1
        forced[:, self.sink_blocks[0]:self.sink_blocks[1]] = True
        forced[self.dense_q_blocks[0]:self.dense_q_blocks[1], :] = True
        return forced


def _check_segments(segments: Sequence[tuple[int, int, str]]) -> int:
    row = 0
    for a, b, kind in segments:
        if a != row or b < a:
            raise H3Error(f"packed segments must be contiguous from row 0; found {kind!r} at [{a}, {b}) "
                          f"after row {row}. Build the segment list from the packed layout.")
        row = b
    return row


def routing_for_segments(segments: Sequence[tuple[int, int, str]], *, tau: float = DEFAULT_TAU,
                         token_aug: int = DEFAULT_EXTRA_TOKENS, dense_audio_rows: bool = True) -> SparseRouting:
    """Routing inputs from the packed layout's segments ``[(start, stop, kind)]`` (contiguous from row 0).

    Sinks: every row before the ``video`` segment (conditioning kinds and the target ``audio``) — these must
    form a prefix, because the kernel takes one sink range. Dense query rows: the target ``audio`` segment
    (``dense_audio_rows``; core's ``exact_kv_and_rows``), else none.
    """
    seq_len = _check_segments(segments)
    kinds = [k for _, _, k in segments]
    if kinds.count("video") != 1:
        raise H3Error(f"sparse routing needs exactly one target 'video' segment; found kinds {kinds}")
    v0, v1 = next((a, b) for a, b, k in segments if k == "video")
    if v1 != seq_len:
        raise H3Error(f"sparse routing needs the target video last (conditioning rows as one prefix); the video "
                      f"segment is [{v0}, {v1}) of {seq_len} rows. The packed order is [text | cond | refs | "
                      f"audio | video].")
    unknown = [k for k in kinds[:-1] if k not in CONDITIONING_KINDS + ("audio",)]
    if unknown:
        raise H3Error(f"segment kinds {unknown} before the video are not conditioning or target audio; expected "
                      f"kinds among {CONDITIONING_KINDS + ('audio',)}")
    if not (tau >= 0.0 and math.isfinite(tau)):
        raise H3Error(f"sparse tau={tau}: expected a finite value >= 0 (core's default {DEFAULT_TAU})")
    if token_aug < 0 or token_aug > 256 or token_aug % 64:
        raise H3Error(f"sparse extra tokens={token_aug}: expected 0, 64, 128, 192 or 256")
    sinks = (0, -(-v0 // BLOCK))
    dense_q = (0, 0)
    audio = [(a, b) for a, b, k in segments if k == "audio" and b > a]
    if dense_audio_rows and audio:
        a0, a1 = audio[0]
        dense_q = (a0 // BLOCK, -(-a1 // BLOCK))
    return SparseRouting(seq_len, sinks, dense_q, float(tau), int(token_aug))


def percent_to_sigma(percent: float, shift: float) -> float:
    """ComfyUI's discrete-flow ``percent_to_sigma``: 1 at 0 %, 0 at 100 %, else ``shift*t / (1 + (shift-1)*t)``
    with ``t = 1 - percent`` (float64)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    t = 1.0 - percent
    return shift * t / (1.0 + (shift - 1.0) * t)


@dataclass(frozen=True)
class SparseSchedule:
    """When sparse attention applies: model sigma within ``[percent_to_sigma(end), percent_to_sigma(start)]``
    of the video schedule (shift ``shift``) and at least ``min_tokens`` rows. Core's rule and defaults."""

    shift: float
    start_percent: float = DEFAULT_START_PERCENT
    end_percent: float = 1.0
    min_tokens: int = DEFAULT_MIN_TOKENS

    @property
    def sigma_start(self) -> float:
        return percent_to_sigma(self.start_percent, self.shift)

    @property
    def sigma_end(self) -> float:
        return percent_to_sigma(self.end_percent, self.shift)

    def dense_reason(self, sigma: float, seq_len: int) -> Optional[str]:
        """Why a call at model sigma ``sigma`` over ``seq_len`` rows stays dense, or None (sparse)."""
        sigma = float(sigma)
        if sigma > self.sigma_start or sigma < self.sigma_end:
            return (f"sigma {sigma:.6g} outside the sparse window [{self.sigma_end:.6g}, {self.sigma_start:.6g}] "
                    f"(start_percent {self.start_percent})")
        if seq_len < self.min_tokens:
            return f"{seq_len} rows < min_tokens {self.min_tokens}"
        return None

    def sparse_steps(self, sigmas: Sequence[float], seq_len: int) -> list[bool]:
        """Per step (model sigma of each step): True where attention runs sparse."""
        return [self.dense_reason(s, seq_len) is None for s in sigmas]
