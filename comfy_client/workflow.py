"""Workflow files for ``comfy-run``: an API prompt as it is, or a UI graph (the editor's save format) converted to
an API prompt with the server's ``/object_info`` (widget order, links through reroutes, muted and bypassed nodes,
Autogrow inputs), or refused with the reason; ``--set NODE.INPUT=VALUE`` overrides. Standard library only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

# Nodes that exist only in the editor: they never reach /prompt.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
MODE_MUTED, MODE_BYPASS = 2, 4
# The editor stores the "control after generate" choice right after a seed widget's value.
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}  # a dynamic combo: its key
UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload")


class ConversionError(ValueError):
    """A UI graph that cannot be turned into an API prompt reliably; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------
# workflow files
# ---------------------------------------------------------------------------------------------

def is_api_prompt(d) -> bool:
    return (isinstance(d, dict) and bool(d)
            and all(isinstance(v, dict) and "class_type" in v and isinstance(v.get("inputs", {}), dict)
                    for v in d.values()))


def is_ui_graph(d) -> bool:
    return isinstance(d, dict) and isinstance(d.get("nodes"), list) and "links" in d


def _read_pipe(p: Path) -> str:
    """A pipe's text to its end. Opened without waiting for a writer (a plain open blocks until one comes); with
    none, the first read is the end (''), so the caller refuses an empty workflow instead of hanging."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8")


def load_workflow(path: str | Path) -> tuple[str, dict]:
    """('api', prompt) or ('ui', graph); ValueError with the reason otherwise. A pipe is read to its end
    (``comfy-run <(jq ... wf.json)``), but only when a writer holds it as it is opened (a named pipe nobody writes
    reads as empty, never blocks); a socket or a device is refused, not read: it could never end."""
    p = Path(path)
    if p.exists() and not (p.is_file() or p.is_dir() or p.is_fifo()):
        raise ValueError(f"{path} is a socket or a device, not a file; expected a JSON workflow file (or a pipe)")
    try:
        data = json.loads(_read_pipe(p) if p.is_fifo() else p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"workflow file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON workflow: {e}") from None
    except RecursionError:
        raise ValueError(f"{path} is not a JSON workflow: nested too deeply") from None
    if isinstance(data, dict) and is_api_prompt(data.get("prompt")):
        return "api", data["prompt"]  # a saved /prompt request body
    if is_api_prompt(data):
        return "api", data
    if is_ui_graph(data):
        return "ui", data
    raise ValueError(f"{path} is neither an API prompt ({{id: {{class_type, inputs}}}}) nor a UI graph "
                     "(nodes + links)")


def _links(graph: dict) -> dict:
    """link id -> (from_node, from_slot, to_node, to_slot, type); both the list and the object link forms."""
    out = {}
    for link in graph.get("links") or []:
        if isinstance(link, dict):
            out[link["id"]] = (link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"],
                               link.get("type"))
        else:
            out[link[0]] = tuple(link[1:6])
    return out


def _is_widget(spec) -> bool:
    kind = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    opts = spec[1] if isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
    if opts.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _extra_values(name: str, spec) -> int:
    """How many editor-only values follow this widget's value in widgets_values (at most)."""
    kind = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if opts.get("control_after_generate") or (kind == "INT" and name in ("seed", "noise_seed")):
        return 1
    if opts.get("audio_upload"):
        return 2  # LoadAudio: the player ("audioUI") and the upload button
    if any(opts.get(f) for f in UPLOAD_FLAGS):
        return 1
    return 0


def _check_convertible(graph: dict, object_info: dict) -> None:
    """Refuse subgraphs and node types the server lacks (ConversionError saying what to do)."""
    if (graph.get("definitions") or {}).get("subgraphs"):
        raise ConversionError("the workflow uses subgraphs, which this converter does not expand; open it in the "
                              "editor and use Workflow > Export (API), then run that file")
    unknown = sorted({n["type"] for n in graph["nodes"]
                      if n["type"] not in FRONTEND_ONLY and n["type"] not in object_info
                      and n.get("mode", 0) != MODE_MUTED})
    if unknown:
        raise ConversionError(f"the server has no node type(s) {', '.join(unknown)}: install the custom nodes "
                              "that provide them (or update ComfyUI), or export API format from an editor that has them")


def _link_source(nodes: dict, links: dict, link_id, seen=()):
    """The API input value for a link: [node id, slot], ("literal", value) from a PrimitiveNode, or None (no
    link, a muted source). Reroutes and bypassed nodes are followed to what feeds them."""
    if link_id is None or link_id not in links:
        return None
    from_id, from_slot = links[link_id][:2]
    if from_id in seen:
        raise ConversionError(f"link {link_id} loops through node {from_id}")
    src = nodes.get(from_id)
    if src is None:
        return None
    mode = src.get("mode", 0)
    if src["type"] == "Reroute":
        ins = src.get("inputs") or []
        return _link_source(nodes, links, ins[0].get("link") if ins else None, seen + (from_id,))
    if src["type"] == "PrimitiveNode":
        wv = src.get("widgets_values") or []
        if not wv:
            raise ConversionError(f"PrimitiveNode {from_id} has no value")
        return ("literal", wv[0])
    if mode == MODE_MUTED:
        return None
    if mode == MODE_BYPASS:
        out_type = None
        outs = src.get("outputs") or []
        if from_slot < len(outs):
            out_type = outs[from_slot].get("type")
        for inp in src.get("inputs") or []:
            if inp.get("link") is not None and (inp.get("type") == out_type or out_type is None):
                return _link_source(nodes, links, inp["link"], seen + (from_id,))
        return None
    return [str(from_id), from_slot]


def _widget_value(values, pos: int, by_name: bool, name: str, spec) -> tuple[Any, bool, int]:
    """(value, whether the workflow has one, the next position) of widget ``name``: by name when the workflow
    stores a dict, else the next positional value, stepping over the editor's extra control/upload value."""
    if by_name:
        return values.get(name), name in values, pos
    if pos >= len(values):
        return None, False, pos
    value = values[pos]
    pos += 1
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    extra = _extra_values(name, spec)
    if any(opts.get(f) for f in UPLOAD_FLAGS):
        pos = min(len(values), pos + extra)
    elif extra and pos < len(values) and values[pos] in CONTROL_VALUES:
        pos += 1
    return value, True, pos


# A V3 Autogrow input (core's MiniMaxH3ReferenceToVideo ref_images, ...): a growing list of sockets named
# "<input>.<prefix><i>" in both the editor's graph and the API prompt.
AUTOGROW = "COMFY_AUTOGROW_V3"


def _autogrow_inputs(name: str, sockets: dict, source: Callable[[Any], Any]) -> dict:
    out = {}
    for sock_name, sock in sockets.items():
        if sock_name.startswith(name + ".") and sock.get("link") is not None:
            src = source(sock["link"])
            if isinstance(src, tuple):
                out[sock_name] = src[1]
            elif src is not None:
                out[sock_name] = src
    return out


def _node_inputs(node: dict, info: dict, source: Callable[[Any], Any]) -> dict:
    """The API inputs of one node: linked sockets through ``source``, widgets from the saved values, in the
    order of the server's definition ``info``; refuses values that do not line up with it."""
    node_id, kind = node["id"], node["type"]
    spec_all = info.get("input") or {}
    order = info.get("input_order") or {sec: list((spec_all.get(sec) or {}).keys()) for sec in ("required", "optional")}
    wv = node.get("widgets_values")
    by_name = isinstance(wv, dict)
    values = [] if wv is None else wv
    pos = 0
    sockets = {i["name"]: i for i in node.get("inputs") or []}
    inputs = {}
    for sec in ("required", "optional"):
        for name in order.get(sec) or []:
            spec = (spec_all.get(sec) or {}).get(name)
            if spec is None:
                continue
            spec = spec if isinstance(spec, (list, tuple)) else [spec]
            if spec[0] == AUTOGROW:
                inputs.update(_autogrow_inputs(name, sockets, source))
                continue
            widget = _is_widget(spec)
            value, have_value = None, False
            if widget:
                value, have_value, pos = _widget_value(values, pos, by_name, name, spec)
            link = (sockets.get(name) or {}).get("link")
            if link is not None:
                src = source(link)
                if isinstance(src, tuple):
                    inputs[name] = src[1]
                elif src is not None:
                    inputs[name] = src
            elif widget and have_value:
                inputs[name] = value
            elif widget and sec == "required":
                raise ConversionError(f"node {node_id} ({kind}): no value for widget '{name}'; the node's "
                                      "definition on the server has more widgets than the saved workflow")
    if not by_name and pos != len(values):
        raise ConversionError(
            f"node {node_id} ({kind}): the workflow stores {len(values)} widget values but the server's "
            f"definition accounts for {pos}; the node changed since the workflow was saved. Re-save it in the "
            "editor, or export API format (Workflow > Export (API))")
    return inputs


def ui_to_api(graph: dict, object_info: dict) -> dict:
    """A UI graph (the editor's saved workflow) -> an API prompt, using the server's node definitions.

    Handles links, Reroute, PrimitiveNode, muted (mode 2) and bypassed (mode 4) nodes, the editor's
    control-after-generate values, and widget inputs turned into sockets. Refuses (ConversionError) group
    nodes / subgraphs, node types the server lacks, and nodes whose widget values do not line up with the
    server's definition.
    """
    _check_convertible(graph, object_info)
    nodes = {n["id"]: n for n in graph["nodes"]}
    links = _links(graph)
    prompt = {}
    for node in graph["nodes"]:
        kind = node["type"]
        if kind in FRONTEND_ONLY or node.get("mode", 0) in (MODE_MUTED, MODE_BYPASS):
            continue
        info = object_info[kind]
        inputs = _node_inputs(node, info, lambda link: _link_source(nodes, links, link))
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs,
                                   "_meta": {"title": node.get("title") or info.get("display_name") or kind}}
    return prompt


def apply_overrides(prompt: dict, sets: list[str]) -> None:
    """``NODE.INPUT=VALUE`` (VALUE parsed as JSON when it parses, else a string)."""
    for s in sets:
        target, sep, raw = s.partition("=")
        node, dot, name = target.partition(".")
        if not sep or not dot or not node or not name:
            raise ValueError(f"--set {s!r}: expected NODE_ID.INPUT=VALUE")
        if node not in prompt:
            raise ValueError(f"--set {s!r}: the prompt has no node {node!r} (nodes: {', '.join(sorted(prompt))})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        except RecursionError:
            raise ValueError(f"--set {target}=...: VALUE is JSON nested too deeply; expected a value such as 20, "
                             "\"text\" or [\"4\", 0]") from None
        prompt[node].setdefault("inputs", {})[name] = value
