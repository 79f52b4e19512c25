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
"""

# Imported as the package (ComfyUI loads the folder as a package, pip installs it as h3_blackwell). A test
# runner that collects a checkout whose folder name is not a Python identifier imports this file on its own,
# with no parent package: then there is nothing to register and nothing is imported.
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

if __package__:
    import logging
    import sys

    from .nodes import NODE_DISPLAY_NAME_MAPPINGS, NODES

    __version__ = "0.1.0"

    NODE_CLASS_MAPPINGS = dict(NODES)

    if "comfy_api.latest" in sys.modules:
        try:
            from .nodes.v3 import v3_node_classes

            NODE_CLASS_MAPPINGS = v3_node_classes(NODES)

            async def comfy_entrypoint():
                from comfy_api.latest import ComfyExtension

                classes = list(NODE_CLASS_MAPPINGS.values())

                class H3BlackwellExtension(ComfyExtension):
                    async def get_node_list(self):
                        return classes

                return H3BlackwellExtension()
        except Exception:  # any V3 API drift must not cost the pack its nodes
            logging.getLogger("h3_blackwell").exception(
                "h3-blackwell: building the V3 node classes failed; registering the V1 classes instead")
            NODE_CLASS_MAPPINGS = dict(NODES)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
