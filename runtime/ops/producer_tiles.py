"""ProducerTiles: the activation producers' tile table, read once by the load plan and handed to the bound ops.

A table is a JSON object written by ``bench/producers_h200.py --tiles-out`` (the plan reads the file named by
``producer_tiles``; "" = the built-in tiles)::

    {"device": "...", "quantize": [scheme, BM, BK, num_warps], "rms": [...], "swiglu": [...],
     "swiglu_fast": [...], "to_fp8_rowwise": [BM, BK, num_warps]}

``scheme`` is ``loop`` or ``row`` (``fp8_producers``' two tilings) and every number a power of two; other keys
(``device``) are notes. The fp8 producers consult ``fp8`` for ``scheme="auto"`` on CUDA, ``to_fp8_rowwise``
(``nvfp4_producers``) its one entry. Tiles change speed only: every configuration writes the same bytes.
Nothing here is global: a table reaches a kernel only as the ``tiles`` argument of the call that launches it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import H3Error

FP8_OPS = ("quantize", "rms", "swiglu", "swiglu_fast")  # fp8_producers' ops with a table entry


def _pow2s(v) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0 for n in v)


@dataclass(frozen=True)
class ProducerTiles:
    """fp8: {op: (scheme, BM, BK, num_warps)} for op in FP8_OPS; to_fp8_rowwise: (BM, BK, num_warps) or None
    (the built-in tiles); source: where the table came from ("" = built in); device: the table's note of the
    device it was measured on."""

    fp8: Mapping[str, tuple] = field(default_factory=dict)
    to_fp8_rowwise: tuple | None = None
    source: str = ""
    device: str = ""

    @classmethod
    def from_table(cls, table: Mapping, source: str = "") -> "ProducerTiles":
        """Validate a parsed table (module docstring); ValueError names the bad entry."""
        if not isinstance(table, Mapping):
            raise ValueError(f"expected a JSON object, found {type(table).__name__}")
        fp8 = {}
        for op in FP8_OPS:
            if op not in table:
                continue
            v = table[op]
            if not (isinstance(v, (list, tuple)) and len(v) == 4 and v[0] in ("loop", "row") and _pow2s(v[1:])):
                raise ValueError(f"tile table entry {op}={v!r}: expected [scheme (loop|row), BM, BK, num_warps] "
                                 "with powers of two")
            fp8[op] = tuple(v)
        rw = table.get("to_fp8_rowwise")
        if rw is not None and not (isinstance(rw, (list, tuple)) and len(rw) == 3 and _pow2s(rw) and rw[1] >= 64):
            raise ValueError(f"tile table entry to_fp8_rowwise={rw!r}: expected [BM, BK, num_warps], powers of two, "
                             "BK >= 64")
        return cls(fp8, None if rw is None else tuple(rw), source, str(table.get("device", "?")))

    @classmethod
    def load(cls, path: str | Path) -> "ProducerTiles":
        """The table at ``path``; a missing or malformed file raises H3Error naming it."""
        try:
            if Path(path).exists() and not Path(path).is_file():  # a pipe would block the read forever
                raise ValueError("not a regular file (a folder, pipe, socket or device)")
            return cls.from_table(json.loads(Path(path).read_text()), str(path))
        except (OSError, ValueError, RecursionError) as e:
            why = "JSON nested too deeply" if isinstance(e, RecursionError) else e
            raise H3Error(f"producer tile table {path}: {why}; write one with bench/producers_h200.py --tiles-out, "
                          "or unset H3_PRODUCER_TILES for the built-in tiles") from e

    def entries(self) -> dict:
        """{op: [tiles]} of every entry in the table (the plan's reason)."""
        out = {op: list(v) for op, v in self.fp8.items()}
        if self.to_fp8_rowwise is not None:
            out["to_fp8_rowwise"] = list(self.to_fp8_rowwise)
        return out


BUILTIN = ProducerTiles()
