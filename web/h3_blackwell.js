// h3-blackwell's editor extension. The H3 Diagnostics node shows its report (the `text` of its UI output) in a
// read-only text box under its widgets (ComfyUI's editor displays `ui.text` only for core's own text nodes, so
// without this the report the node promises "under the node" never appears on the page); every H3B node starts
// wide enough for its title and choices.
//
// The box is made with the node (empty, with a hint), so the node's size includes it from the start and a run
// does not grow the node over its neighbours; it is not serialized (widgets_values stay the node's inputs).
import { app } from "../../scripts/app.js";

const REPORT_NODES = new Set(["H3B_Diagnostics"]);
const WIDGET = "h3_report";
const MIN_WIDTH = 360;
const HINT = "The run's report appears here once the graph has run.";

function addReportBox(node) {
  const box = document.createElement("textarea");
  box.readOnly = true;
  box.spellcheck = false;
  box.placeholder = HINT;
  box.className = "h3b-report comfy-multiline-input";
  Object.assign(box.style, { width: "100%", height: "100%", resize: "none", fontFamily: "monospace",
                             fontSize: "11px", whiteSpace: "pre-wrap", overflowWrap: "anywhere", overflow: "auto",
                             boxSizing: "border-box" });
  const widget = node.addDOMWidget(WIDGET, "h3b_report", box, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => 220,
    getValue: () => box.value,
    setValue: (v) => { box.value = typeof v === "string" ? v : ""; },
  });
  widget.serialize = false;
  return widget;
}

function showReport(node, message) {
  const text = Array.isArray(message?.text) ? message.text.join("\n") : message?.text;
  if (typeof text !== "string") return;
  const widget = node.widgets?.find((w) => w.name === WIDGET) ?? addReportBox(node);
  widget.value = text;
  widget.element.dataset.h3bNode = String(node.id); // the node's id in the graph (not yet known at creation)
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "h3_blackwell.Nodes",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith("H3B_")) return;
    const report = REPORT_NODES.has(nodeData.name);
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      if (report) addReportBox(this);
      // wide enough for the longest title and the embedded choices ("embedded random (seed 1234, 32 tokens)"),
      // which the editor's own measure would cut; a saved workflow's sizes still apply when it loads
      this.setSize([Math.max(this.size[0], MIN_WIDTH), this.size[1]]);
      return r;
    };
    if (!report) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      showReport(this, message);
    };
  },
});
