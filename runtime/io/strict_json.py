"""JSON that a user hands the runtime (a conditioning payload), read strictly.

The document must be one JSON object. Refused, each naming the file and what was found: a file that is not
UTF-8 or not JSON, a top level that is not an object (``null`` included: "no conditioning" is no file),
a key given twice in one object (``json`` would keep the last one silently, so a bad value could hide behind
a good one), the non-standard constants ``NaN`` / ``Infinity``, nesting deeper than :data:`MAX_DEPTH`, and a
file larger than :data:`MAX_BYTES`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import H3Error

MAX_DEPTH = 64  # a payload nests four levels; this bounds the parser's recursion far below Python's limit
MAX_BYTES = 64 << 20  # a payload names tensors, it does not hold them: 64 MiB is thousands of keyframes


class JsonInputError(H3Error):
    """A JSON input that is not one well-formed object (the message names the file and the problem)."""


class DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``' object_pairs_hook that refuses a key given twice in one object (raises DuplicateKey)."""
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise DuplicateKey(k)
        seen[k] = v
    return seen


def _constant(name: str):
    raise ValueError(f"the non-standard constant {name}")


def _depth(value: Any) -> int:
    """The deepest nesting of objects and arrays in a parsed value (iterative: no recursion of our own)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def loads_object(text: str, source: str, expected: str = "a JSON object") -> dict:
    """Parse ``text`` (from ``source``, named in the errors) as one JSON object; see the module docstring.
    ``expected`` describes the object for the messages."""
    try:
        data = json.loads(text, object_pairs_hook=unique_keys, parse_constant=_constant)
    except DuplicateKey as d:
        raise JsonInputError(f"{source}: expected {expected} with each key once; found the key {d.key!r} twice in "
                             "one object (JSON readers disagree on which one wins); remove one") from None
    except json.JSONDecodeError as e:
        raise JsonInputError(f"{source}: expected {expected}; found text that is not valid JSON ({e})") from None
    except ValueError as e:  # parse_constant
        raise JsonInputError(f"{source}: expected {expected} of standard JSON; found {e}; write a number or null"
                             ) from None
    except RecursionError:
        raise JsonInputError(f"{source}: expected {expected}; found JSON nested deeper than the parser's limit "
                             f"(a payload nests a few levels; at most {MAX_DEPTH} are accepted)") from None
    if _depth(data) > MAX_DEPTH:
        raise JsonInputError(f"{source}: expected {expected}; found JSON nested deeper than {MAX_DEPTH} levels")
    if not isinstance(data, dict):
        found = "null" if data is None else f"a JSON {_kind(data)}"
        raise JsonInputError(f"{source}: expected {expected}; found {found} at the top level")
    return data


def _kind(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(v), "value")


def parse_json(text: str) -> Any:
    """``json.loads(text)`` as it is (no stricter), with nesting too deep for the parser a ValueError like any
    other malformed JSON instead of a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in the file ``path``, parsed by :func:`parse_json`: for the runtime's own side files (tile
    tables, FC2 entries and records), which are not held to :func:`load_object`'s rules. ValueError for a path that
    is not a regular file (a pipe would block the read forever, a device may never end) or not JSON; OSError as
    reading raises it."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise ValueError("not a regular file (a folder, pipe, socket or device)")
    return parse_json(p.read_text())


def load_object(path: str | os.PathLike, what: str, expected: str = "a JSON object") -> dict:
    """The JSON object in the file ``path`` (``what`` names the file's role in the errors: ``payload file``)."""
    p = Path(path)
    if not p.exists():
        raise JsonInputError(f"{what} not found: {path}")
    if not p.is_file():  # a FIFO would block the read forever
        raise JsonInputError(f"{what} {path}: expected a regular file; found a "
                             f"{'directory' if p.is_dir() else 'pipe, socket or device'}")
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise JsonInputError(f"{what} {path}: expected {expected} of at most {MAX_BYTES >> 20} MiB; found "
                             f"{size:,} bytes")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonInputError(f"{what} {path}: expected UTF-8 JSON text; found bytes that are not UTF-8 ({e.reason} at "
                             f"byte {e.start})") from None
    return loads_object(text, f"{what} {path}", expected)
