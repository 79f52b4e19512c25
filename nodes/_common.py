"""What every H3 node shares: the category, the user-facing error type, lazy access to ComfyUI modules.

ComfyUI modules (``comfy.*``, ``folder_paths``) are imported inside functions, never at module import, so
``import h3_blackwell`` works in a plain Python environment (the CLI, the tests) and the node classes can
be exercised there with stand-in modules. The one exception, ``core_classes`` (core's classes subclassed at
module level), is imported only by the loader and only inside a ComfyUI with core H3.
"""

from __future__ import annotations

import importlib
import inspect
import os

from ..runtime import H3Error

CATEGORY = "H3 Blackwell"


class H3NodeError(H3Error):
    """An input problem inside a node, worded for the person at the graph: the node, what was expected,
    what was found, what to do. ComfyUI shows ``str(exc)`` as the error of the failing node."""


# ComfyUI reports an exception's type as module + name, and imports a custom-node pack under its folder path;
# a fixed module keeps the type readable ("h3_blackwell.nodes.H3NodeError") wherever the pack is installed.
H3NodeError.__module__ = "h3_blackwell.nodes"


def node_error(title: str, message: str) -> H3NodeError:
    return H3NodeError(f"{title}: {message}")


def keyword_inputs(node, given: dict) -> dict:
    """The inputs a node's FUNCTION takes as keywords (``**inputs``), checked against its ``INPUT_TYPES``: each
    required one given, none unknown; an optional one absent or None (an empty socket of a V3 / API prompt) takes
    its INPUT_TYPES default (None where it has none). Inputs the FUNCTION names as parameters are not in ``given``."""
    spec = node.INPUT_TYPES()
    named = set(inspect.signature(getattr(node, node.FUNCTION)).parameters)
    required = [k for k in spec["required"] if k not in named]
    optional = {k: (v[1] if len(v) > 1 else {}).get("default") for k, v in spec.get("optional", {}).items()}
    missing, unknown = [k for k in required if k not in given], sorted(set(given) - set(required) - set(optional))
    if missing or unknown:
        raise node_error(node.TITLE, f"expected the inputs {', '.join(required + list(optional))}; missing "
                                     f"{missing}, unknown {unknown}")
    out = {k: given[k] for k in required}
    out.update({k: d if given.get(k) is None else given[k] for k, d in optional.items()})
    return out


def comfy_module(name: str):
    """Import a ComfyUI module by name when the node runs (``comfy.utils``, ``folder_paths``, ...)."""
    return importlib.import_module(name)


def optional_comfy_module(name: str):
    """The module, or None outside ComfyUI (headless use of the node classes, or an older ComfyUI)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def intermediate_device():
    """Where ComfyUI keeps latents between nodes (``model_management.intermediate_device()``); CPU outside it."""
    mm = optional_comfy_module("comfy.model_management")
    if mm is None or not hasattr(mm, "intermediate_device"):
        return "cpu"
    return mm.intermediate_device()


def file_stamp(path: str | None) -> str:
    """What identifies a file's bytes for ComfyUI's cache (``IS_CHANGED``): size and mtime, or 'missing'.

    ComfyUI re-executes a node only when its inputs or its ``IS_CHANGED`` value change; a node that reads a file
    named by a widget returns this, so a file replaced or deleted between two prompts runs the node again (core's
    LoadImage hashes its file for the same reason). Never raises: a bad path reads as 'missing' and the node's own
    function then says what is wrong."""
    try:
        st = os.stat(path) if path else None
    except (OSError, TypeError, ValueError):
        st = None
    return "missing" if st is None else f"{st.st_size}:{st.st_mtime_ns}"


def input_directory() -> str | None:
    fp = optional_comfy_module("folder_paths")
    return fp.get_input_directory() if fp is not None else None


def list_input_files(extensions: tuple[str, ...]) -> list[str]:
    """Files under ComfyUI's input folder with one of ``extensions``, as relative '/'-separated names."""
    root = input_directory()
    if not root or not os.path.isdir(root):
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in filenames:
            if f.lower().endswith(extensions):
                out.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return sorted(out)
