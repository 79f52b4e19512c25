"""The same nodes through ComfyUI's V3 schema (``comfy_api.latest.io``), generated from the V1 classes.

The V1 classes in this package are the single definition (inputs, outputs, the function); this module turns
each into an ``io.ComfyNode`` whose schema carries the same ids, types, widget options and display names, and
whose ``execute`` calls the V1 function. It imports ``comfy_api`` when called, so it is only used inside a
ComfyUI that ships the V3 API (see the top-level ``__init__.py`` for when).
"""

from __future__ import annotations


def _v3_input(io, custom, name: str, spec: tuple, optional: bool):
    kind = spec[0]
    opts = dict(spec[1]) if len(spec) > 1 and spec[1] else {}
    common = {"optional": optional, "tooltip": opts.get("tooltip")}
    if isinstance(kind, (list, tuple)):
        return io.Combo.Input(name, options=list(kind), default=opts.get("default"), **common)
    if kind == "INT":
        return io.Int.Input(name, default=opts.get("default"), min=opts.get("min"), max=opts.get("max"),
                            step=opts.get("step"), control_after_generate=opts.get("control_after_generate"), **common)
    if kind == "FLOAT":
        return io.Float.Input(name, default=opts.get("default"), min=opts.get("min"), max=opts.get("max"),
                              step=opts.get("step"), round=opts.get("round"), **common)
    if kind == "BOOLEAN":
        return io.Boolean.Input(name, default=opts.get("default"), label_on=opts.get("label_on"),
                                label_off=opts.get("label_off"), **common)
    if kind == "STRING":
        return io.String.Input(name, default=opts.get("default"), multiline=bool(opts.get("multiline", False)),
                               **common)
    return custom(kind).Input(name, **common)


def _custom_types(io):
    known = {"LATENT": io.Latent, "CONDITIONING": io.Conditioning, "STRING": io.String, "INT": io.Int,
             "FLOAT": io.Float, "BOOLEAN": io.Boolean}
    made: dict = {}

    def custom(kind: str):
        if kind in known:
            return known[kind]
        if kind not in made:
            made[kind] = io.Custom(kind)
        return made[kind]

    return custom


def v3_node(node_id: str, v1):
    """An ``io.ComfyNode`` subclass equivalent to the V1 node class ``v1`` under ``node_id``."""
    from comfy_api.latest import io

    custom = _custom_types(io)

    class Node(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            spec = v1.INPUT_TYPES()
            inputs = [_v3_input(io, custom, name, s, section == "optional")
                      for section in ("required", "optional") for name, s in spec.get(section, {}).items()]
            names = getattr(v1, "RETURN_NAMES", None) or v1.RETURN_TYPES
            tips = getattr(v1, "OUTPUT_TOOLTIPS", None) or (None,) * len(v1.RETURN_TYPES)
            outputs = [custom(t).Output(display_name=n, tooltip=tip)
                       for t, n, tip in zip(v1.RETURN_TYPES, names, tips)]
            return io.Schema(node_id=node_id, display_name=v1.TITLE, category=v1.CATEGORY,
                             description=getattr(v1, "DESCRIPTION", ""), inputs=inputs, outputs=outputs,
                             is_output_node=bool(getattr(v1, "OUTPUT_NODE", False)))

        @classmethod
        def execute(cls, **kwargs):
            out = getattr(v1(), v1.FUNCTION)(**kwargs)
            if isinstance(out, dict):
                return io.NodeOutput(*out.get("result", ()), ui=out.get("ui"))
            return io.NodeOutput(*out)

    if hasattr(v1, "IS_CHANGED"):  # V3 reads the cache-busting value from fingerprint_inputs, never IS_CHANGED
        def fingerprint_inputs(cls, **kwargs):
            return v1.IS_CHANGED(**kwargs)

        Node.fingerprint_inputs = classmethod(fingerprint_inputs)
    Node.__name__ = Node.__qualname__ = f"{v1.__name__}V3"
    Node.__module__ = __name__
    return Node


def v3_node_classes(nodes: dict) -> dict:
    """{node id: V1 class} -> {node id: V3 class}."""
    return {node_id: v3_node(node_id, cls) for node_id, cls in nodes.items()}
