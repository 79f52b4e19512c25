"""safetensors headers: the JSON index of a file, read without touching tensor bytes.

``read_header`` validates every extent against the file size, so a truncated or hostile file is refused
before any tensor is read; nothing is mmapped and nothing is unpickled.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError

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


_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
                "F8_E8M0": 1, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1}


def read_header(path: str | Path) -> Header:
    """Parse a safetensors header (JSON only; no tensor bytes are read).

    Raises CheckpointError naming the problem for: a missing file, a file too short or not
    safetensors, a truncated or corrupt header, tensor extents past the end of the file.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; pass a .safetensors file or a *.safetensors.index.json")
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
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e}); re-download or re-export the file") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (expected a JSON object)")
    meta = obj.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    data_len = size - 8 - n
    for name, info in obj.items():
        try:
            dt, shape, offs = info["dtype"], tuple(int(s) for s in info["shape"]), tuple(int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if offs[1] > data_len or offs[0] > offs[1]:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} needs bytes {offs[0]}..{offs[1]} of the data section but "
                f"the file has only {data_len}; re-download the file")
        tensors[name] = TensorInfo(dt, shape, offs)
    return Header(path=path, tensors=tensors, metadata=dict(meta), data_start=8 + n)


