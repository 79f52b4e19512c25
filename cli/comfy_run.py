"""``h3-blackwell comfy-run WORKFLOW.json --server http://127.0.0.1:8188``: run a workflow on a ComfyUI server.

Steps: read the workflow (API format as is; a UI graph is converted to API format with the server's
``/object_info`` for widget order, or refused with the reason), ``POST /prompt``, follow the run (the
``/ws`` websocket when the ``websocket-client`` package is importable, else ``/history`` polling), print
node errors, then download every output file (``/view``) into ``--output`` beside ``history.json``.

Exit codes: 0 the prompt ran to success and its outputs were fetched; 1 the server rejected the prompt, a
node failed, the run was interrupted or an output could not be fetched; 2 bad arguments or workflow file
(including a UI graph that cannot be converted); 3 the server could not be reached, is not ComfyUI (it answered
something that is not ComfyUI's JSON API) or the run timed out.

Standard library only (urllib, json); never imports ComfyUI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Callable

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3

# Nodes that exist only in the editor: they never reach /prompt.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
MODE_MUTED, MODE_BYPASS = 2, 4
# The editor stores the "control after generate" choice right after a seed widget's value.
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}  # a dynamic combo: its key
UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload")


class ConversionError(ValueError):
    """A UI graph that cannot be turned into an API prompt reliably; the message says why and what to do."""


class ServerError(RuntimeError):
    """The server could not be reached, or answered something that is not ComfyUI's API."""


# ---------------------------------------------------------------------------------------------
# workflow files
# ---------------------------------------------------------------------------------------------

def is_api_prompt(d) -> bool:
    return (isinstance(d, dict) and bool(d)
            and all(isinstance(v, dict) and "class_type" in v and isinstance(v.get("inputs", {}), dict)
                    for v in d.values()))


def is_ui_graph(d) -> bool:
    return isinstance(d, dict) and isinstance(d.get("nodes"), list) and "links" in d


def load_workflow(path: str | Path) -> tuple[str, dict]:
    """('api', prompt) or ('ui', graph); ValueError with the reason otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"workflow file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON workflow: {e}") from None
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
        prompt[node].setdefault("inputs", {})[name] = value


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------

class Client:
    """ComfyUI's HTTP API over urllib."""

    def __init__(self, server: str, timeout: float = 30.0):
        if "://" not in server:
            server = "http://" + server
        self.server = server.rstrip("/")
        self.timeout = timeout

    def _open(self, path: str, body: bytes | None = None):
        req = urllib.request.Request(self.server + path, data=body,
                                     headers={"Content-Type": "application/json"} if body is not None else {})
        return urllib.request.urlopen(req, timeout=self.timeout)

    def request_json(self, path: str, payload=None) -> tuple[int, object]:
        """(HTTP status, decoded JSON) for GET (payload None) or POST; 4xx/5xx bodies are returned too."""
        body = None if payload is None else json.dumps(payload).encode()
        try:
            with self._open(path, body) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"cannot reach ComfyUI at {self.server} ({reason}); is it running? "
                              "(python main.py --listen 127.0.0.1 --port 8188)") from None
        try:
            return status, json.loads(raw.decode() or "null")
        except (UnicodeDecodeError, json.JSONDecodeError):
            return status, raw.decode(errors="replace")

    def not_comfy(self, method: str, path: str, status: int, data) -> ServerError:
        """The error for an answer that is not ComfyUI's API (an HTML page, other JSON, a 404)."""
        if isinstance(data, str):
            text = data.lstrip()[:200].lower()
            what = "an HTML page" if text.startswith(("<!doctype", "<html", "<")) else "text that is not JSON"
        else:
            what = f"JSON without ComfyUI's fields ({', '.join(sorted(data)[:4]) if isinstance(data, dict) else type(data).__name__})"
        return ServerError(f"{self.server} is not a ComfyUI server (or not its API port): {method} {path} answered "
                           f"HTTP {status} with {what}; check --server (ComfyUI listens on http://127.0.0.1:8188 "
                           "by default)")

    def get_json(self, path: str):
        status, data = self.request_json(path)
        if not isinstance(data, (dict, list)):
            raise self.not_comfy("GET", path, status, data)
        if status != 200:
            raise ServerError(f"GET {path} answered HTTP {status}: {str(data)[:300]}")
        return data

    def download(self, filename: str, subfolder: str, kind: str, dest: Path) -> int:
        q = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": kind})
        try:
            with self._open(f"/view?{q}") as r:
                data = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"GET /view for {subfolder}/{filename} ({kind}) answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"downloading {filename}: {getattr(e, 'reason', e)}") from None
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        return len(data)

    def ws_url(self, client_id: str) -> str:
        u = urllib.parse.urlsplit(self.server)
        scheme = "wss" if u.scheme == "https" else "ws"
        return urllib.parse.urlunsplit((scheme, u.netloc, u.path.rstrip("/") + "/ws",
                                        urllib.parse.urlencode({"clientId": client_id}), ""))


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------

def _say(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def format_node_errors(data) -> str:
    """The 400 body of /prompt -> readable lines."""
    lines = []
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        msg = err.get("message") or err.get("type") or "rejected"
        details = err.get("details")
        lines.append(f"ComfyUI rejected the prompt: {msg}" + (f" ({details})" if details else ""))
    elif err:
        lines.append(f"ComfyUI rejected the prompt: {err}")
    else:
        lines.append(f"ComfyUI rejected the prompt: {str(data)[:500]}")
    node_errors = data.get("node_errors") if isinstance(data, dict) else None
    for node_id, ne in sorted((node_errors or {}).items(), key=lambda kv: str(kv[0])):
        cls = ne.get("class_type", "?")
        for e in ne.get("errors") or []:
            detail = e.get("details") or ""
            name = (e.get("extra_info") or {}).get("input_name")
            where = f" [input {name}]" if name else ""
            lines.append(f"  node {node_id} ({cls}){where}: {e.get('message', '')}" + (f": {detail}" if detail else ""))
    return "\n".join(lines)


def _execution_failure(history_entry: dict, verbose: bool) -> str | None:
    """None when the run succeeded, else a readable reason from the history's status messages."""
    status = history_entry.get("status") or {}
    messages = status.get("messages") or []
    for event, data in messages:
        if event == "execution_error":
            etype = str(data.get("exception_type") or "error").rsplit(".", 1)[-1]
            text = (f"node {data.get('node_id')} ({data.get('node_type')}) failed: "
                    f"{etype}: {str(data.get('exception_message', '')).strip()}")
            if verbose and data.get("traceback"):
                text += "\n" + "".join(data["traceback"])
            return text
        if event == "execution_interrupted":
            return f"the run was interrupted at node {data.get('node_id')} ({data.get('node_type')})"
    if status.get("status_str") == "success" or (status.get("completed") and not status.get("status_str")):
        return None
    if not status:
        return None  # very old servers write no status
    return f"the run ended with status {status.get('status_str')!r}"


def wait_history(client: Client, prompt_id: str, deadline: float, interval: float) -> dict:
    """Poll /history/<id> until the prompt is recorded; ServerError at the deadline."""
    while True:
        data = client.get_json(f"/history/{prompt_id}")
        if isinstance(data, dict) and prompt_id in data:
            return data[prompt_id]
        if time.monotonic() > deadline:
            raise TimeoutError(f"prompt {prompt_id} did not finish in time; it may still be running on the server "
                               "(POST /interrupt stops it)")
        time.sleep(interval)


def _ws_connect(client: Client, client_id: str, quiet: bool):
    """An open websocket to /ws, or None (no websocket-client, or the connection failed)."""
    try:
        import websocket  # the websocket-client package
    except ImportError:
        return None
    try:
        ws = websocket.WebSocket()
        ws.connect(client.ws_url(client_id), timeout=client.timeout)
        return ws
    except Exception as e:  # noqa: BLE001 - any failure here just means: poll instead
        _say(f"websocket unavailable ({e}); following the run through /history", quiet)
        return None


def follow_ws(ws, prompt_id: str, deadline: float, titles: dict, quiet: bool) -> bool:
    """Print progress from the websocket until the prompt ends. False if the socket dropped first."""
    import websocket

    last_progress = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"prompt {prompt_id} did not finish in time; it may still be running on the server "
                               "(POST /interrupt stops it)")
        ws.settimeout(min(left, 5.0))
        try:
            raw = ws.recv()
        except websocket.WebSocketTimeoutException:
            continue
        except Exception:  # noqa: BLE001 - a dropped socket: the caller polls /history instead
            return False
        if not isinstance(raw, str):
            continue  # binary frames: previews
        try:
            msg = json.loads(raw)
        except json.JSONDecodeError:
            continue
        kind, data = msg.get("type"), msg.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        if kind == "executing":
            if data.get("node") is None:
                if data.get("prompt_id") == prompt_id:
                    return True
                continue
            node = str(data["node"])
            _say(f"  running node {node} ({titles.get(node, '?')})", quiet)
        elif kind == "progress":
            text = f"  node {data.get('node')}: {data.get('value')}/{data.get('max')}"
            if text != last_progress:
                _say(text, quiet)
                last_progress = text
        elif kind == "execution_cached" and data.get("nodes"):
            _say(f"  cached: nodes {', '.join(str(n) for n in data['nodes'])}", quiet)
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            return True


def _safe_relpath(subfolder: str, filename: str) -> Path:
    parts = [p for p in PurePosixPath((subfolder or "").replace("\\", "/")).parts if p not in ("", ".", "/")]
    name = PurePosixPath(filename.replace("\\", "/")).name
    if ".." in parts or not name or name in (".", ".."):
        raise ServerError(f"refusing to write an output outside --output: {subfolder!r}/{filename!r}")
    return Path(*parts, name)


def fetch_outputs(client: Client, entry: dict, out_dir: Path, quiet: bool) -> list[Path]:
    """Download every file the prompt's output nodes report; write their text outputs beside them."""
    written = []
    for node_id, ui in sorted((entry.get("outputs") or {}).items(), key=lambda kv: str(kv[0])):
        for key, items in (ui or {}).items():
            if not isinstance(items, list):
                continue
            texts = [x for x in items if isinstance(x, str)]
            if texts and key == "text":
                p = out_dir / f"node_{node_id}_text.txt"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("\n".join(texts) + "\n", encoding="utf-8")
                written.append(p)
            for item in items:
                if isinstance(item, dict) and item.get("filename"):
                    rel = _safe_relpath(item.get("subfolder", ""), item["filename"])
                    n = client.download(item["filename"], item.get("subfolder", ""), item.get("type", "output"),
                                        out_dir / rel)
                    _say(f"  fetched {rel} ({n} bytes) from node {node_id} [{key}]", quiet)
                    written.append(out_dir / rel)
    return written


def run(args) -> int:
    try:
        kind, data = load_workflow(args.workflow)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    client = Client(args.server, timeout=args.http_timeout)
    extra = {}
    try:
        if kind == "ui":
            object_info = client.get_json("/object_info")
            try:
                prompt = ui_to_api(data, object_info)
            except ConversionError as e:
                print(f"error: cannot convert the UI workflow {args.workflow} to API format: {e}", file=sys.stderr)
                return EXIT_USAGE
            extra = {"extra_pnginfo": {"workflow": data}}
            _say(f"converted the UI workflow to an API prompt of {len(prompt)} nodes", args.quiet)
        else:
            prompt = data
        try:
            apply_overrides(prompt, args.set or [])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        titles = {k: v.get("class_type", "?") for k, v in prompt.items()}
        client_id = args.client_id or uuid.uuid4().hex
        ws = None if args.no_websocket else _ws_connect(client, client_id, args.quiet)
        body = {"prompt": prompt, "client_id": client_id}
        if extra:
            body["extra_data"] = extra
        status, answer = client.request_json("/prompt", body)
        if not isinstance(answer, dict) or not ({"prompt_id", "error", "node_errors"} & set(answer)):
            raise client.not_comfy("POST", "/prompt", status, answer)
        if status != 200 or not isinstance(answer, dict) or "prompt_id" not in answer:
            print("error: " + format_node_errors(answer if isinstance(answer, dict) else {"error": answer}),
                  file=sys.stderr)
            return EXIT_FAILED
        prompt_id = answer["prompt_id"]
        if answer.get("node_errors"):  # queued, but some output nodes failed validation and will not run
            lines = format_node_errors({"error": "some outputs will not run", "node_errors": answer["node_errors"]})
            print("warning: " + lines.replace("ComfyUI rejected the prompt: ", "", 1), file=sys.stderr)
        _say(f"queued prompt {prompt_id} on {client.server}", args.quiet)
        deadline = time.monotonic() + args.timeout
        try:
            if ws is not None:
                try:
                    if not follow_ws(ws, prompt_id, deadline, titles, args.quiet):
                        _say("websocket closed; following the run through /history", args.quiet)
                finally:
                    ws.close()
            entry = wait_history(client, prompt_id, deadline, args.poll_interval)
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
        out_dir = Path(args.output)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "history.json").write_text(json.dumps({prompt_id: entry}, indent=2, default=str) + "\n",
                                              encoding="utf-8")
        failure = _execution_failure(entry, args.verbose)
        if failure:
            print(f"error: {failure}", file=sys.stderr)
            return EXIT_FAILED
        try:
            files = fetch_outputs(client, entry, out_dir, args.quiet)
        except ServerError as e:
            print(f"error: the prompt succeeded but an output could not be fetched: {e}", file=sys.stderr)
            return EXIT_FAILED
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"prompt {prompt_id} succeeded: {len(files)} output file(s) in {out_dir}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h3-blackwell comfy-run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workflow", help="workflow JSON: API format, or a UI graph (converted with /object_info)")
    p.add_argument("--server", default="http://127.0.0.1:8188", help="ComfyUI address (default %(default)s)")
    p.add_argument("--output", default="comfy-output", help="folder for fetched outputs and history.json "
                                                            "(default %(default)s)")
    p.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE",
                   help="override an input before submitting (VALUE is JSON, else a string); repeatable")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run (default %(default)s)")
    p.add_argument("--http-timeout", type=float, default=30.0, help="seconds per HTTP request (default %(default)s)")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /history polls")
    p.add_argument("--no-websocket", action="store_true", help="poll /history even if websocket-client is installed")
    p.add_argument("--client-id", help="client id for /prompt and /ws (default: a random one)")
    p.add_argument("--verbose", action="store_true", help="print node tracebacks")
    p.add_argument("--quiet", action="store_true", help="print only the result line and errors")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help, or an argument error already printed by argparse
        return EXIT_OK if not e.code else EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
