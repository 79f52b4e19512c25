"""The request files of ``generate --inputs`` / ``forward --inputs`` and ``--payload``: a safetensors file of
tensors and a JSON conditioning that names some of them.

The payload is the JSON of ``runtime.model.conditioning`` (core's field names); every tensor it names is a
tensor of the inputs file, which also holds the evaluation's own tensors (``video``, ``audio``,
``text_states``, optional ``token_tags``; ``sigma`` for ``forward``). What the tensors must be is checked by
the job (``runtime.job``) against the model's config; this module only reads.
"""

from __future__ import annotations

import torch

from ..errors import H3Error
from ..model.conditioning import H3Conditioning
from .header import read_tensors
from .strict_json import load_object


class PayloadError(H3Error):
    """The inputs or payload file cannot be read (the message names the file and what to do)."""


def read_inputs(path: str, need: list[str], what: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; ``need`` must be among them (``what`` describes them for the error)."""
    hdr, tensors = read_tensors(path, "inputs file")  # the checked header: every extent, shape and dtype
    missing = [k for k in need if k not in hdr.tensors]
    if missing:
        raise PayloadError(f"{path}: missing {missing}; expected {what}")
    return tensors


def load_payload(path: str | None, tensors: dict[str, torch.Tensor], default_seed: int | None = None
                 ) -> H3Conditioning:
    """Parse and validate ``path`` (None: no conditioning) against the inputs' tensors; a payload without ``seed``
    takes ``default_seed`` when given (core's default 0 otherwise)."""
    if path is None:
        return H3Conditioning(seed=0 if default_seed is None else int(default_seed))
    # strictly one object: null, duplicate keys, NaN constants and runaway nesting are refused naming the file
    data = load_object(path, "payload file", "an object with core's fields (keyframes, refs, denoise_mask, ...)")
    if "seed" not in data and default_seed is not None:
        data["seed"] = int(default_seed)
    return H3Conditioning.from_payload(data, tensors)


def check_control_args(control: str | None, cond: H3Conditioning) -> None:
    """``--control FILE`` and the payload's ``control`` field come together (the file is the tower, the field its
    hint and settings); either alone is refused."""
    if control is not None and cond.control is None:
        raise PayloadError(f"--control {control}: expected the payload's control field (hint, strength, sigma_start, "
                           "sigma_end, fade_in_frames, fade_out_frames); found none; add it to --payload or drop "
                           "--control")
    if control is None and cond.control is not None:
        raise PayloadError("payload field control: expected --control CONTROL.safetensors (the Fun ControlNet the "
                           "hint is for); found no --control; pass the tower or drop the field")
