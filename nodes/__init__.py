"""ComfyUI nodes of h3-blackwell: thin adapters from ComfyUI's types to ``h3_blackwell.runtime``.

One table gives each node its id (prefixed ``H3B_``, since clashing ids are dropped silently by ComfyUI),
its class and its menu name. Importing this package needs no ComfyUI: ComfyUI modules are imported inside
the node functions, and ``core_classes`` (core's model classes subclassed at import) only by the loader, inside a
ComfyUI with core H3.
"""

from .conditioning import H3TextStatesLoader
from .control import H3FunControlNetApply
from .diagnostics import H3Diagnostics
from .latents import H3EmptyLatent
from .loader import H3ModelLoader
from .lora import H3LoRA
from .model_report import H3ModelReport
from .sampler import H3Sampler

NODES = {
    "H3B_ModelLoader": H3ModelLoader,
    "H3B_Sampler": H3Sampler,
    "H3B_Diagnostics": H3Diagnostics,
    "H3B_EmptyLatent": H3EmptyLatent,
    "H3B_TextStatesLoader": H3TextStatesLoader,
    "H3B_LoRA": H3LoRA,
    "H3B_FunControlNetApply": H3FunControlNetApply,
    "H3B_ModelReport": H3ModelReport,
}

NODE_CLASS_MAPPINGS = dict(NODES)
NODE_DISPLAY_NAME_MAPPINGS = {node_id: cls.TITLE for node_id, cls in NODES.items()}

__all__ = ["NODES", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
