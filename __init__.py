"""h3-blackwell: the MiniMax H3 audio+video DiT for ComfyUI and headless use.

This file is both the package ``h3_blackwell`` and the ComfyUI custom-node entry point. Importing it needs
no ComfyUI (ComfyUI modules are imported inside the node functions).

Registration, decided on purpose: ComfyUI reads ``NODE_CLASS_MAPPINGS`` when a module has it and then
ignores ``comfy_entrypoint``. So

* inside a running ComfyUI that has the V3 API (its ``nodes.py`` has already imported ``comfy_api.latest``
  when custom nodes load), ``NODE_CLASS_MAPPINGS`` holds V3 ``io.ComfyNode`` classes generated from the V1
  classes in ``nodes/``, and ``comfy_entrypoint`` returns the same classes; either loader path registers the
  same V3 nodes;
* everywhere else (no ComfyUI: the CLI, the tests, scripts; or a ComfyUI without ``comfy_api``),
  ``NODE_CLASS_MAPPINGS`` holds the V1 classes.

Node ids, inputs, outputs and behaviour are the same either way; if building the V3 classes fails, the V1
classes are registered and the error is logged with its traceback.

The registration is built on first access of those names (PEP 562 module ``__getattr__``; ComfyUI's loader
reads them with ``hasattr``/``getattr`` right after importing the pack, so it sees the same values). Importing
the package itself imports neither torch nor the runtime: the ``h3-blackwell`` command starts inside its own
error handling (an interrupt during the heavy imports is one line, not a traceback).
"""

import logging
import sys

__version__ = "0.1.0"
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
# the editor extension (web/*.js: the H3 Diagnostics report shown under the node), served by ComfyUI
WEB_DIRECTORY = "./web"
_REGISTRATION = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint")

# Imported as the package (ComfyUI loads the folder as a package, pip installs it as h3_blackwell). A test
# runner that collects a checkout whose folder name is not a Python identifier imports this file on its own,
# with no parent package: then there is nothing to register and nothing is imported.
if not __package__:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}


def _registration() -> dict:
    """The names ComfyUI reads: the V1 classes, or inside a ComfyUI with the V3 API the V3 classes and
    ``comfy_entrypoint``."""
    from .nodes import NODE_DISPLAY_NAME_MAPPINGS, NODES

    out = {"NODE_CLASS_MAPPINGS": dict(NODES), "NODE_DISPLAY_NAME_MAPPINGS": NODE_DISPLAY_NAME_MAPPINGS}
    if "comfy_api.latest" not in sys.modules:
        return out
    try:
        from .nodes.v3 import v3_node_classes

        classes = v3_node_classes(NODES)

        async def comfy_entrypoint():
            from comfy_api.latest import ComfyExtension

            class H3BlackwellExtension(ComfyExtension):
                async def get_node_list(self):
                    return list(classes.values())

            return H3BlackwellExtension()
    except Exception:  # any V3 API drift must not cost the pack its nodes
        logging.getLogger("h3_blackwell").exception(
            "h3-blackwell: building the V3 node classes failed; registering the V1 classes instead")
        return out
    out.update(NODE_CLASS_MAPPINGS=classes, comfy_entrypoint=comfy_entrypoint)
    return out


def __getattr__(name: str):
    if name in _REGISTRATION and "NODE_CLASS_MAPPINGS" not in globals():
        globals().update(_registration())
    if name in _REGISTRATION and name in globals():
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
