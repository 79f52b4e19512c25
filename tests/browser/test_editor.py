"""The pack as a user meets it: ComfyUI's editor (frontend 1.49.6) in chromium, with this pack loaded.

Every UI workflow in workflows/ loads through the editor with no missing node type and no error logged; no two nodes
overlap; the editor's own prompt of the graph (``app.graphToPrompt``) equals the ``.api.json`` twin and its saved
widget values equal the file's; every H3B node renders with its widgets at their declared defaults; the tiny graph,
queued from the page, runs to success and its H3 Diagnostics report is shown under the node. Screenshots of each
graph go to out/browser/.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3_blackwell.nodes import NODES

from fixtures.core_nodes import CORE_NODES

pytestmark = pytest.mark.browser

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
UI_FILES = sorted(p.name for p in WORKFLOWS.glob("*.json") if not p.name.endswith(".api.json"))

LOAD = """async (g) => {
  await app.loadGraphData(g, true, true, null);
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const nodes = app.graph.nodes.map(n => ({
    id: n.id, type: n.type, title: n.title, known: !!LiteGraph.registered_node_types[n.type],
    bound: Array.from(n.getBounding()), size: Array.from(n.size)}));
  const prompt = (await app.graphToPrompt()).output;
  const saved = app.graph.serialize().nodes.map(n => ({id: n.id, widgets_values: n.widgets_values ?? []}));
  return {nodes, prompt, saved};
}"""

FIT_VIEW = """() => {
  // the whole graph in view, clear of the sidebar (left), the tabs and the Run bar (top) and the error toast
  const b = app.graph.nodes.map(n => n.getBounding());
  const x0 = Math.min(...b.map(r => r[0])), y0 = Math.min(...b.map(r => r[1]));
  const x1 = Math.max(...b.map(r => r[0] + r[2])), y1 = Math.max(...b.map(r => r[1] + r[3]));
  app.canvas.ds.fitToBounds([x0 - 120, y0 - 260, x1 - x0 + 560, y1 - y0 + 300], {zoom: 1.0});
  app.canvas.setDirty(true, true);
  return new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
}"""


# Inputs the editor adds to a prompt on its own, depending on timing: core's Load Video gets its player widget
# ("video-preview", value "") once the clip has loaded, and graphToPrompt then sends it; the server ignores it, and
# a graph whose clip is absent (or not yet loaded) has none. The API twins hold only the node's real inputs.
FRONTEND_ONLY_INPUTS = {"LoadVideo": ("video-preview",)}


def _overlaps(nodes: list[dict]) -> list[str]:
    """Pairs of nodes whose bounding boxes (title bar included) share area."""
    out = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            (ax, ay, aw, ah), (bx, by, bw, bh) = a["bound"], b["bound"]
            if min(ax + aw, bx + bw) > max(ax, bx) and min(ay + ah, by + bh) > max(ay, by):
                out.append(f"{a['title']} (#{a['id']}) overlaps {b['title']} (#{b['id']})")
    return out


def _show(editor, name: str) -> Path:
    editor.js(FIT_VIEW)
    return editor.screenshot(name)


def test_page_loads_the_pack_and_its_extension(editor, comfyui_server):
    """The editor started with our nodes and our extension script, and nothing but the editor's own offline
    start-up noise was logged as an error."""
    assert "/extensions/h3-blackwell/h3_blackwell.js" in comfyui_server.get_json("/extensions")
    registered = editor.js("() => Object.keys(LiteGraph.registered_node_types).filter(t => t.startsWith('H3B_'))")
    assert sorted(registered) == sorted(NODES)
    assert not editor.unexpected_startup(), f"errors while the editor started: {editor.unexpected_startup()}"
    assert not any("h3" in e.lower() for e in editor.startup), editor.startup


@pytest.mark.parametrize("name", UI_FILES)
def test_workflow_loads_clean_and_matches_its_api_twin(editor, name):
    graph = json.loads((WORKFLOWS / name).read_text())
    editor.errors.clear()
    got = editor.js(LOAD, graph)
    shot = _show(editor, Path(name).stem)
    missing = sorted({n["type"] for n in got["nodes"] if not n["known"]})
    assert not missing, f"{name}: the editor lacks node types {missing}"
    assert len(got["nodes"]) == len(graph["nodes"])
    assert not editor.errors, f"{name}: errors while loading: {editor.errors}"
    assert not _overlaps(got["nodes"]), f"{name} (see {shot}): {_overlaps(got['nodes'])}"
    saved_size = {n["id"]: n["size"] for n in graph["nodes"]}
    grown = [f"{n['title']}: saved {saved_size[int(n['id'])]}, drawn {n['size']}" for n in got["nodes"]
             if any(d > s + 0.5 for d, s in zip(n["size"], saved_size[int(n["id"])]))]
    assert not grown, f"{name}: the editor enlarged nodes past their saved size (the layout may overlap): {grown}"
    twin = json.loads((WORKFLOWS / name.replace(".json", ".api.json")).read_text())
    for node in got["prompt"].values():  # see FRONTEND_ONLY_INPUTS
        for key in FRONTEND_ONLY_INPUTS.get(node["class_type"], ()):
            node["inputs"].pop(key, None)
    assert got["prompt"] == twin, f"{name}: the editor's prompt differs from {name.replace('.json', '.api.json')}"
    values = {n["id"]: n["widgets_values"] or [] for n in graph["nodes"]}
    assert {n["id"]: n["widgets_values"] for n in got["saved"]} == values


def _expected_widgets(node_id: str, served: dict) -> list[tuple[str, object]]:
    """(widget name, value) of a new node: every widget input at its declared default, in order, the seed's
    control after it, and for H3 Diagnostics the report box (empty until a run). A choice without a declared
    default starts at the first of the choices the server lists (``served``: its /object_info entry; file lists
    such as models/loras/ are the server's)."""
    cls = NODES[node_id]
    out = []
    for section in ("required", "optional"):
        for name, spec in cls.INPUT_TYPES().get(section, {}).items():
            kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
            if not (isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN")):
                continue
            choices = served["input"][section][name]  # [[choices...], opts] or ["COMBO", {"options": [...]}]
            first = None
            if isinstance(kind, list):
                first = choices[0][0] if isinstance(choices[0], list) else choices[1]["options"][0]
            out.append((name, opts["default"] if "default" in opts else first))
            if opts.get("control_after_generate"):
                out.append(("control_after_generate", None))  # the editor's setting decides it
    if node_id == "H3B_Diagnostics":
        out.append(("h3_report", ""))
    return out


def test_every_h3b_node_renders_its_widgets_at_their_defaults(editor, comfyui_server):
    editor.errors.clear()
    got = editor.js("""async (types) => {
      await app.loadGraphData({nodes: [], links: [], groups: [], config: {}, extra: {}, version: 0.4});
      const out = {};
      types.forEach((t, i) => {
        const n = LiteGraph.createNode(t);
        n.pos = [40 + (i % 4) * 460, 60 + Math.floor(i / 4) * 520];
        app.graph.add(n);
        out[t] = {title: n.title, width: n.size[0], widgets: (n.widgets || []).map(w => [w.name, w.value])};
      });
      return out;
    }""", sorted(NODES))
    _show(editor, "h3b_nodes")
    assert not editor.errors, editor.errors
    info = comfyui_server.get_json("/object_info")
    for node_id, cls in NODES.items():
        assert got[node_id]["title"] == cls.TITLE
        assert got[node_id]["width"] >= 360, f"{node_id}: web/h3_blackwell.js widens new H3B nodes to 360 px"
        widgets = [(n, None if n == "control_after_generate" else v) for n, v in got[node_id]["widgets"]]
        assert widgets == _expected_widgets(node_id, info[node_id]), node_id


RUN = """async () => {
  const api = window.comfyAPI.api.api;
  const done = new Promise(resolve => {
    api.addEventListener('execution_success', () => resolve('success'), {once: true});
    api.addEventListener('execution_error', e => resolve('error: ' + JSON.stringify(e.detail)), {once: true});
  });
  await app.queuePrompt(0, 1);
  return await done;
}"""


def test_tiny_graph_runs_from_the_page_and_shows_its_report(editor, comfyui_server):
    """Queued with the editor's Run (app.queuePrompt) on the CPU; the report box under H3 Diagnostics then holds the
    report the server returned, visible on the page; the seed stays (control 'fixed')."""
    graph = json.loads((WORKFLOWS / "h3_smoke_tiny.json").read_text())
    editor.errors.clear()
    editor.js(LOAD, graph)
    editor.page.set_default_timeout(300_000)
    assert editor.js(RUN) == "success"
    (entry,) = comfyui_server.get_json("/history?max_items=1").values()
    assert entry["status"]["status_str"] == "success"
    diag = next(n["id"] for n in graph["nodes"] if n["type"] == "H3B_Diagnostics")
    (text,) = entry["outputs"][str(diag)]["text"]
    box = editor.page.locator(f"textarea.h3b-report[data-h3b-node='{diag}']")
    _show(editor, "h3_smoke_tiny_after_run")
    assert box.is_visible()
    assert box.input_value() == text and "video_sha256" in text
    seed = editor.js("() => app.graph.nodes.find(n => n.type === 'H3B_Sampler').widgets.slice(0, 2)"
                     ".map(w => w.value)")
    assert seed == [440420, "fixed"]
    assert not editor.errors, editor.errors


def test_core_definitions_used_by_the_workflows_match_the_server(comfyui_server):
    """fixtures/core_nodes.py (what the workflows are generated from) against the vendored ComfyUI's /object_info:
    the same inputs in the same order, the same defaults, the same outputs."""
    info = comfyui_server.get_json("/object_info")
    for name, ours in CORE_NODES.items():
        theirs = info[name]
        order = theirs["input_order"]
        assert ours["input_order"]["required"] == order.get("required", []), name
        assert ours["input_order"]["optional"] == order.get("optional", []), name
        assert ours["output"] == theirs["output"], name
        for section in ("required", "optional"):
            for inp, spec in ours["input"].get(section, {}).items():
                default = spec[1].get("default") if len(spec) > 1 else None
                if default is not None:
                    assert theirs["input"][section][inp][1].get("default") == default, f"{name}.{inp}"
