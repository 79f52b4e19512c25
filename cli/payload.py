"""``--payload PAYLOAD.json --inputs IN.safetensors``: core's conditioning for the CLI.

The payload is the JSON of ``runtime.model.conditioning`` (core's field names); every tensor it names is a
tensor of the ``--inputs`` safetensors file, which also holds the evaluation's own tensors (``video``,
``audio``, ``text_states``, optional ``token_tags``; ``sigma`` for ``forward``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..runtime.errors import H3Error
from ..runtime.io.header import read_header
from ..runtime.model.conditioning import H3Conditioning


class PayloadError(H3Error):
    """The payload file cannot be read (the message names the file and what to do)."""


def read_inputs(path: str, need: list[str], what: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; ``need`` must be among them (``what`` describes them for the error)."""
    from safetensors import safe_open

    hdr = read_header(path)  # clear errors for a missing file or not safetensors
    missing = [k for k in need if k not in hdr.tensors]
    if missing:
        raise PayloadError(f"{path}: missing {missing}; expected {what}")
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in hdr.tensors}


def load_payload(path: str | None, tensors: dict[str, torch.Tensor], default_seed: int | None = None
                 ) -> H3Conditioning:
    """Parse and validate ``path`` (None: no conditioning) against the inputs' tensors; a payload without ``seed``
    takes ``default_seed`` when given (core's default 0 otherwise)."""
    if path is None:
        return H3Conditioning(seed=0 if default_seed is None else int(default_seed))
    p = Path(path)
    if not p.is_file():
        raise PayloadError(f"payload file not found: {path}; pass the JSON written for the conditioning")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"{path}: not valid JSON ({e}); expected an object with core's fields "
                           "(keyframes, refs, denoise_mask, ...)") from None
    if isinstance(data, dict) and "seed" not in data and default_seed is not None:
        data["seed"] = int(default_seed)
    return H3Conditioning.from_payload(data, tensors)


def check_pdd_schedule(cond: H3Conditioning, head_bank: int) -> None:
    """Core refuses a PDD head bank without the sampler's schedule; so do we, naming the field."""
    if head_bank > 1 and cond.sample_sigmas is None:
        raise PayloadError(f"sample_sigmas: expected the run's full sigma schedule (this checkpoint has a PDD head "
                           f"bank of {head_bank} heads, which needs it); found null; add it to the payload")


def segments_line(layout) -> str:
    """``segments: text[0:6] cond[6:12] ...``: the packed layout in one line."""
    return "segments: " + " ".join(f"{s['kind']}[{s['start']}:{s['stop']}]" for s in layout.describe())
