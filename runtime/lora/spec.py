"""A LoRA stack's entries: ``LoraSpec`` (file, strength, mode), what the API accepts as one (``as_spec``),
and the CLI's ``FILE:STRENGTH[:MODE]`` (``parse_lora_arg``). Nothing here touches a model."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .key_forms import LoraError

MODES = ("merge", "side")


@dataclass(frozen=True)
class LoraSpec:
    """One entry of a LoRA stack: a ``.safetensors`` file, its strength, ``merge`` or ``side``."""

    path: str
    strength: float = 1.0
    mode: str = "merge"

    def __post_init__(self):
        if self.mode not in MODES:
            raise LoraError(f"LoRA mode {self.mode!r}: expected one of {', '.join(MODES)}")
        s = float(self.strength)
        if not math.isfinite(s):
            raise LoraError(f"LoRA strength {self.strength!r} is not a finite number")
        object.__setattr__(self, "strength", s)
        object.__setattr__(self, "path", str(self.path))

    def signature(self) -> tuple:
        """Identifies this entry and the file's bytes (size, mtime) for ``sync_loras``."""
        p = Path(self.path)
        try:
            st = p.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None
        return (str(p.resolve()), stamp, self.strength, self.mode)


def as_spec(s) -> LoraSpec:
    if isinstance(s, LoraSpec):
        return s
    if isinstance(s, (str, os.PathLike)):
        return LoraSpec(str(s))
    if isinstance(s, (tuple, list)) and 1 <= len(s) <= 3:
        return LoraSpec(*s)
    raise LoraError(f"a LoRA entry must be (path, strength, mode) or a LoraSpec; found {s!r}")


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def parse_lora_arg(text: str) -> LoraSpec:
    """``FILE:STRENGTH[:MODE]`` (the CLI's ``--lora``) -> LoraSpec. FILE may itself contain ':' (``C:\\...``);
    the fields are taken from the right. The file must exist."""
    parts = text.split(":")
    mode = "merge"
    if len(parts) >= 3 and parts[-1] in MODES:
        mode = parts.pop()
    elif len(parts) >= 3 and _is_number(parts[-2]) and not _is_number(parts[-1]):
        raise LoraError(f"--lora {text!r}: mode {parts[-1]!r} is not a LoRA mode; expected FILE:STRENGTH[:MODE] "
                        f"with MODE one of {', '.join(MODES)}")
    if len(parts) < 2:
        raise LoraError(f"--lora {text!r}: expected FILE:STRENGTH[:MODE], e.g. turbo.safetensors:1.0:merge "
                        f"(MODE one of {', '.join(MODES)})")
    try:
        strength = float(parts[-1])
    except ValueError:
        raise LoraError(f"--lora {text!r}: strength {parts[-1]!r} is not a number (expected FILE:STRENGTH[:MODE], "
                        f"MODE one of {', '.join(MODES)})") from None
    path = ":".join(parts[:-1])
    if not Path(path).is_file():
        raise LoraError(f"--lora {text!r}: LoRA file not found: {path}")
    return LoraSpec(path, strength, mode)
