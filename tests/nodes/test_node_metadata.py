"""What the editor shows about each node, checked without ComfyUI: every node has a description (the node's help
text) and every input a tooltip, both in the V1 classes and in the V3 schemas generated from them (a stand-in
``comfy_api.latest.io`` records what the schema is given)."""

from __future__ import annotations

import sys
import types

import pytest

from h3_blackwell.nodes import NODES


def _inputs(cls):
    spec = cls.INPUT_TYPES()
    return {name: s for section in ("required", "optional") for name, s in spec.get(section, {}).items()}


@pytest.mark.parametrize("node_id", sorted(NODES))
def test_every_node_has_a_description(node_id):
    desc = getattr(NODES[node_id], "DESCRIPTION", None)
    assert isinstance(desc, str) and len(desc.strip()) >= 20, (
        f"{node_id}.DESCRIPTION is {desc!r}: expected a sentence saying what the node does (the editor shows it "
        "as the node's help); add one to the class")


@pytest.mark.parametrize("node_id", sorted(NODES))
def test_every_input_has_a_tooltip(node_id):
    missing = [name for name, s in _inputs(NODES[node_id]).items()
               if not (len(s) > 1 and isinstance(s[1].get("tooltip"), str) and s[1]["tooltip"].strip())]
    assert not missing, (f"{node_id}: inputs {missing} have no tooltip; expected a non-empty 'tooltip' in each "
                         "input's options (the editor shows it on hover)")


def _recording_io():
    """A stand-in ``comfy_api.latest.io`` whose inputs and schema keep the keyword arguments they were given."""
    io = types.ModuleType("comfy_api.latest.io")

    class Recorded:
        def __init__(self, kind):
            self.kind = kind

        def Input(self, name, **kw):  # noqa: N802 (the V3 API's name)
            return {"name": name, "kind": self.kind, **kw}

        def Output(self, **kw):  # noqa: N802
            return {"kind": self.kind, **kw}

    io.ComfyNode = type("ComfyNode", (), {})
    io.Schema = lambda **kw: kw
    io.NodeOutput = lambda *a, ui=None: (a, ui)
    for name in ("Latent", "Conditioning", "String", "Int", "Float", "Boolean", "Combo"):
        setattr(io, name, Recorded(name))
    io.Custom = Recorded
    return io


def test_v3_schemas_carry_the_descriptions_and_tooltips(monkeypatch):
    io = _recording_io()
    latest = types.ModuleType("comfy_api.latest")
    latest.io = io
    monkeypatch.setitem(sys.modules, "comfy_api", types.ModuleType("comfy_api"))
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    from h3_blackwell.nodes.v3 import v3_node_classes

    for node_id, cls in v3_node_classes(NODES).items():
        schema = cls.define_schema()
        assert schema["description"] == NODES[node_id].DESCRIPTION, node_id
        v1 = _inputs(NODES[node_id])
        assert [i["name"] for i in schema["inputs"]] == list(v1), node_id
        for i in schema["inputs"]:
            assert i["tooltip"] == v1[i["name"]][1]["tooltip"], f"{node_id}.{i['name']}"
