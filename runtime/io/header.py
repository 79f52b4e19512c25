"""safetensors headers: the JSON index of a file, read without touching tensor bytes.

``read_header`` validates every extent against the file size and against its tensor's shape and dtype, so a
truncated or hostile file (a header that lies about a tensor's extent) is refused before any tensor is read;
nothing is mmapped and nothing is unpickled. ``read_tensor`` / ``read_tensors`` read tensors of such a checked
header with plain reads: every reader of a safetensors file (checkpoints, inputs, text states) goes through here.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError
from .strict_json import DuplicateKey, unique_keys

PART_BYTES = 64 << 20  # the smallest part of a tensor one thread reads (``read_tensor``'s threads)

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}

# ---------------------------------------------------------------------------------------------

_MAX_HEADER = 100 * 1024 * 1024


@dataclass
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # [begin, end) relative to the data section


@dataclass
class Header:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0


# bits per element of every safetensors dtype (F4 / F6 pack several elements per byte)
_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8,
               "U8": 8, "U16": 16, "U32": 32, "U64": 64, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8,
               "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _entry(path: Path, name: str, info, data_len: int) -> TensorInfo:
    """One header entry checked: a known dtype, a shape of non-negative integers, an extent inside the data
    section whose length is exactly what the shape and dtype need."""
    try:
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        ints = list(shape) + list(offs)
        if not isinstance(dt, str) or len(offs) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                           for v in ints):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r} (expected dtype, shape and "
                              "data_offsets); re-export the file") from None
    shape, offs = tuple(shape), tuple(offs)
    if dt not in _DTYPE_BITS:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dt!r}, which is not a safetensors dtype "
                              f"({', '.join(_DTYPE_BITS)}); the file is corrupt or from a newer writer")
    if any(s < 0 for s in shape) or offs[0] < 0 or offs[0] > offs[1]:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {list(shape)} and data_offsets {list(offs)}; "
                              "expected non-negative sizes and begin <= end; the file is corrupt")
    if offs[1] > data_len:
        raise CheckpointError(
            f"{path} is truncated: tensor {name!r} needs bytes {offs[0]}..{offs[1]} of the data section but "
            f"the file has only {data_len}; re-download the file")
    numel = 1
    for s in shape:
        numel *= s
    need = numel * _DTYPE_BITS[dt]
    if need % 8 or need // 8 != offs[1] - offs[0]:
        raise CheckpointError(f"{path}: tensor {name!r} has {offs[1] - offs[0]} bytes but shape {list(shape)} of "
                              f"{dt} needs {need / 8:g}; the header lies about the tensor's extent (the file is corrupt)")
    return TensorInfo(dt, shape, offs)


def read_header(path: str | Path, what: str = "checkpoint") -> Header:
    """Parse a safetensors header (JSON only; no tensor bytes are read).

    Raises CheckpointError naming the problem for: a missing file (``what`` names the file's role), a file too
    short or not safetensors, a truncated or corrupt header, tensor extents past the end of the file or not
    what the tensor's shape and dtype need.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{what} not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; pass a .safetensors file or a *.safetensors.index.json")
    if not path.is_file():  # a FIFO would block the read forever, a device has no safetensors layout
        raise CheckpointError(f"{path} is not a regular file (a pipe, socket or device); pass a .safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, too short for the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or n + 8 > size:
            if head[:2] == b"PK" or head[:1] == b"\x80":
                raise CheckpointError(
                    f"{path} looks like a pickle/zip checkpoint (.ckpt/.pt); only safetensors is accepted "
                    "(nothing is ever unpickled). Convert it to safetensors first.")
            raise CheckpointError(
                f"{path} is not a valid safetensors file: header length {n} exceeds the file size {size} "
                "(truncated download or not safetensors)")
        raw = f.read(n)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except DuplicateKey as d:
        raise CheckpointError(f"{path}: corrupt safetensors header (the name {d.key!r} is given twice; a reader could "
                              "take either entry); re-export the file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e}); re-download or re-export the file") from None
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt safetensors header (JSON nested too deeply; a header is a flat "
                              "object of tensor entries); re-download or re-export the file") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (expected a JSON object)")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        found = type(meta).__name__ if not isinstance(meta, dict) else "an entry that is not a string"
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ has {found}; expected an object of "
                              "strings)")
    data_len = size - 8 - n
    tensors = {name: _entry(path, name, info, data_len) for name, info in obj.items()}
    _check_disjoint(path, tensors)
    return Header(path=path, tensors=tensors, metadata=dict(meta), data_start=8 + n)


def _check_disjoint(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """Every tensor in bytes of its own, as safetensors writes them: extents that overlap would let a small file
    declare any number of tensors over the same bytes (gigabytes to read and hold from a few megabytes)."""
    extents = sorted((info.offsets, name) for name, info in tensors.items() if info.offsets[0] < info.offsets[1])
    for ((_, end), prev), ((begin, _), name) in zip(extents, extents[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {prev!r} and {name!r} share bytes of the data section (one ends "
                                  f"at {end}, the other begins at {begin}); expected each tensor in bytes of its own; "
                                  "the file is corrupt: re-download or re-export it")


def fits_into(info: TensorInfo, out: torch.Tensor) -> bool:
    """Whether a tensor stored as ``info`` can be read straight into ``out``: a contiguous CPU tensor of the stored
    dtype and shape."""
    return (ST_DTYPES.get(info.dtype) == out.dtype and tuple(out.shape) == tuple(info.shape)
            and out.device.type == "cpu" and out.is_contiguous())


def read_tensor(header: Header, name: str, out: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
    """Tensor ``name`` of a checked header, read with a plain read into a buffer of exactly its size (CPU, its
    stored dtype), or straight into ``out`` (a contiguous CPU tensor of the stored dtype and shape, e.g. pinned
    host memory: no second copy), which is returned. ``threads`` > 1: the bytes are read as that many contiguous
    parts at once (each part at least ``PART_BYTES``; reads release the GIL, so the page cache is copied in
    parallel), the same bytes. Raises CheckpointError for a dtype torch cannot hold or a file that shrank since,
    ValueError for an ``out`` that does not match."""
    info = header.tensors[name]
    if info.dtype not in ST_DTYPES:
        raise CheckpointError(f"{header.path}: tensor {name!r} has dtype {info.dtype}, which this loader does not "
                              f"read (supported: {', '.join(ST_DTYPES)})")
    dt = ST_DTYPES[info.dtype]
    n = info.offsets[1] - info.offsets[0]
    if out is not None and not fits_into(info, out):
        raise ValueError(f"{name!r} is stored as {info.dtype} {list(info.shape)}; cannot read it into a "
                         f"{'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} {list(out.shape)} tensor on "
                         f"{out.device}")
    if not n:
        return torch.empty(info.shape, dtype=dt) if out is None else out
    buf = torch.empty(n, dtype=torch.uint8) if out is None else out.reshape(-1).view(torch.uint8)
    parts = max(1, min(threads, n // PART_BYTES))
    start, view = header.data_start + info.offsets[0], memoryview(buf.numpy())
    if parts == 1:
        got = _read_part(header.path, start, view)
    else:
        edges = [n * i // parts for i in range(parts + 1)]
        with ThreadPoolExecutor(parts, thread_name_prefix="h3-read-part") as pool:
            got = sum(pool.map(lambda i: _read_part(header.path, start + edges[i], view[edges[i]:edges[i + 1]]),
                               range(parts)))
    if got != n:
        raise CheckpointError(f"{header.path} is truncated while reading {name!r}")
    return buf.view(dt).reshape(info.shape) if out is None else out


def _read_part(path: Path, offset: int, view: memoryview) -> int:
    """Read ``len(view)`` bytes of ``path`` at ``offset`` into ``view`` -> the bytes read (fewer at the file's end)."""
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < len(view):
            k = os.preadv(f.fileno(), [view[got:]], offset + got)
            if k == 0:
                break
            got += k
    return got


def read_tensors(path: str | Path, what: str, names=None) -> tuple[Header, dict[str, torch.Tensor]]:
    """(checked header, {name: tensor}) of a safetensors file: every tensor, or those of ``names`` it holds.
    ``what`` names the file's role in the errors (``--inputs file``, ``text states file``)."""
    hdr = read_header(path, what)
    keep = hdr.tensors if names is None else [k for k in names if k in hdr.tensors]
    return hdr, {k: read_tensor(hdr, k) for k in keep}


