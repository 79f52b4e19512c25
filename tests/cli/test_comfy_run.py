"""``h3-blackwell comfy-run`` against a fake ComfyUI server in this process (http.server on 127.0.0.1:0):
/prompt, /history polling, /object_info for UI graphs, /view downloads, and /ws when websocket-client is
installed. The fake answers with the bodies ComfyUI's server.py and execution.py produce."""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import json
import struct
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from h3_blackwell.cli import comfy_run
from h3_blackwell.cli.comfy_run import main
from h3_blackwell.comfy_client import Client, ConversionError, ui_to_api

from fixtures.core_nodes import object_info

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
REPORT = {"latent_checksums": {"video_sha256": "ab" * 32}}


class FakeComfyUI:
    def __init__(self):
        self.object_info = object_info()
        self.prompts: list[dict] = []
        self.reject = None  # a 400 body for /prompt
        self.accepted_node_errors = {}  # node_errors of a 200 answer (outputs that will not run)
        self.polls_before_done = 2
        self.status = {"status_str": "success", "completed": True, "messages": [["execution_start", {}]]}
        self.outputs = {
            "5": {"text": ["summary line\n{...}"],
                  "h3_report": [{"filename": "smoke_00001_.json", "subfolder": "h3_blackwell", "type": "output"}]},
            "9": {"images": [{"filename": "frame.png", "subfolder": "", "type": "temp"}]},
        }
        self.files = {("h3_blackwell", "smoke_00001_.json", "output"): json.dumps(REPORT).encode(),
                      ("", "frame.png", "temp"): b"\x89PNG fake"}
        self.ws_messages: list[dict] = []
        self.posted = threading.Event()
        self._polls = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(url.query))
                if url.path == "/object_info":
                    return self._json(200, fake.object_info)
                if url.path.startswith("/history/"):
                    pid = url.path.rsplit("/", 1)[1]
                    fake._polls += 1
                    if not fake.prompts or fake._polls <= fake.polls_before_done:
                        return self._json(200, {})
                    return self._json(200, {pid: {"prompt": [0, pid, fake.prompts[-1]["prompt"], {}, []],
                                                  "outputs": fake.outputs, "status": fake.status}})
                if url.path == "/view":
                    data = fake.files.get((q.get("subfolder", ""), q.get("filename"), q.get("type")))
                    if data is None:
                        return self._json(404, {"error": "not found"})
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                if url.path == "/ws":
                    return self._websocket()
                return self._json(404, {})

            def _websocket(self):
                key = self.headers["Sec-WebSocket-Key"]
                accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.end_headers()
                self.wfile.flush()
                self.close_connection = True
                self._frame(json.dumps({"type": "status", "data": {"status": {}, "sid": "x"}}).encode())
                fake.posted.wait(10)
                for msg in fake.ws_messages:
                    self._frame(json.dumps(msg).encode())
                self._frame(b"\x00\x01binary preview", opcode=0x2)
                self.wfile.write(b"\x88\x00")
                self.wfile.flush()

            def _frame(self, payload: bytes, opcode=0x1):
                n = len(payload)
                head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n))
                self.wfile.write(head + payload)
                self.wfile.flush()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/prompt":
                    if fake.reject is not None:
                        return self._json(400, fake.reject)
                    fake.prompts.append(body)
                    fake.posted.set()
                    return self._json(200, {"prompt_id": "p-1", "number": 0, "node_errors": fake.accepted_node_errors})
                return self._json(404, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.posted.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    with FakeComfyUI() as s:
        yield s


def _run(server, tmp_path, workflow, *extra):
    out = tmp_path / "out"
    rc = main([str(workflow), "--server", server.url, "--output", str(out), "--poll-interval", "0.01",
               "--no-websocket", *extra])
    return rc, out


def test_api_workflow_success_fetches_outputs(server, tmp_path, capsys):
    rc, out = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    assert rc == 0
    posted = server.prompts[0]
    assert posted["prompt"] == json.loads((WORKFLOWS / "h3_smoke_tiny.api.json").read_text())
    assert posted["client_id"] and "extra_data" not in posted
    assert json.loads((out / "h3_blackwell" / "smoke_00001_.json").read_text()) == REPORT
    assert (out / "frame.png").read_bytes() == b"\x89PNG fake"
    assert (out / "node_5_text.txt").read_text().startswith("summary line")
    assert "p-1" in json.loads((out / "history.json").read_text())
    assert "prompt p-1 succeeded: 3 output file(s)" in capsys.readouterr().out


def test_rejected_prompt_prints_node_errors(server, tmp_path, capsys):
    server.reject = {
        "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                  "details": "", "extra_info": {}},
        "node_errors": {"4": {"errors": [{"type": "value_bigger_than_max",
                                          "message": "Value 500 bigger than max of 200", "details": "steps",
                                          "extra_info": {"input_name": "steps"}}],
                              "dependent_outputs": ["5"], "class_type": "H3B_Sampler"}}}
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    err = capsys.readouterr().err
    assert rc == 1
    assert "ComfyUI rejected the prompt: Prompt outputs failed validation" in err
    assert "node 4 (H3B_Sampler) [input steps]: Value 500 bigger than max of 200: steps" in err


def test_outputs_dropped_at_validation_are_warned_about(server, tmp_path, capsys):
    server.accepted_node_errors = {"12": {"errors": [{"message": "Required input is missing", "details": "video",
                                                      "extra_info": {"input_name": "video"}}],
                                          "class_type": "SaveVideo"}}
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    err = capsys.readouterr().err
    assert rc == 0
    assert "warning: some outputs will not run\n  node 12 (SaveVideo) [input video]: Required input is missing" in err


def test_node_failure_is_one_clear_line(server, tmp_path, capsys):
    server.status = {"status_str": "error", "completed": False, "messages": [
        ["execution_start", {"prompt_id": "p-1"}],
        ["execution_error", {"prompt_id": "p-1", "node_id": "4", "node_type": "H3B_Sampler",
                             "exception_type": "/x/custom_nodes/h3_blackwell.nodes._common.H3NodeError",
                             "exception_message": "H3 Sampler: the conditioning is [1, 77, 768]; H3 needs [1, L, 5120]",
                             "traceback": ["Traceback...\n", "  line\n"]}]]}
    rc, out = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    err = capsys.readouterr().err
    assert rc == 1
    assert ("error: node 4 (H3B_Sampler) failed: H3NodeError: H3 Sampler: the conditioning is [1, 77, 768]; "
            "H3 needs [1, L, 5120]\n") in err
    assert "Traceback" not in err and (out / "history.json").exists()
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json", "--verbose")
    assert rc == 1 and "Traceback..." in capsys.readouterr().err


def test_interrupted_run_fails(server, tmp_path, capsys):
    server.status = {"status_str": "error", "completed": False, "messages": [
        ["execution_interrupted", {"prompt_id": "p-1", "node_id": "4", "node_type": "H3B_Sampler",
                                   "executed": ["1", "2", "3"]}]]}
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    assert rc == 1 and "interrupted at node 4 (H3B_Sampler)" in capsys.readouterr().err


def test_missing_output_file_fails(server, tmp_path, capsys):
    server.files.pop(("", "frame.png", "temp"))
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    assert rc == 1 and "could not be fetched" in capsys.readouterr().err


def test_output_outside_the_folder_is_refused(server, tmp_path, capsys):
    server.outputs = {"5": {"h3_report": [{"filename": "x.json", "subfolder": "../../etc", "type": "output"}]}}
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json")
    assert rc == 3 and "outside --output" in capsys.readouterr().err  # a server-supplied unsafe name (issue 26)


def test_unreachable_server(tmp_path, capsys):
    with FakeComfyUI() as s:
        url = s.url
    rc = main([str(WORKFLOWS / "h3_smoke_tiny.api.json"), "--server", url, "--output", str(tmp_path),
               "--http-timeout", "2"])
    assert rc == 3 and f"cannot reach ComfyUI at {url}" in capsys.readouterr().err


def test_timeout(server, tmp_path, capsys):
    server.polls_before_done = 10**9
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json", "--timeout", "0.2")
    assert rc == 3 and "did not finish in time" in capsys.readouterr().err


def test_bad_files_and_arguments(server, tmp_path, capsys):
    assert _run(server, tmp_path, tmp_path / "nope.json")[0] == 2
    assert "workflow file not found" in capsys.readouterr().err
    (tmp_path / "x.json").write_text('{"a": 1}')
    assert _run(server, tmp_path, tmp_path / "x.json")[0] == 2
    assert "neither an API prompt" in capsys.readouterr().err
    assert _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json", "--set", "99.seed=1")[0] == 2
    assert "no node '99'" in capsys.readouterr().err
    assert main(["--bogus"]) == 2
    assert not server.prompts


def test_set_overrides_inputs(server, tmp_path):
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_smoke_tiny.api.json", "--set", "4.seed=5",
                 "--set", f"5.expected_video_sha256={'ab' * 32}", "--set", "3.frames=39")
    inputs = {k: v["inputs"] for k, v in server.prompts[0]["prompt"].items()}
    assert rc == 0 and inputs["4"]["seed"] == 5 and inputs["3"]["frames"] == 39
    assert inputs["5"]["expected_video_sha256"] == "ab" * 32


def test_ui_workflow_is_converted_with_object_info(server, tmp_path):
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_t2va_nvfp4.json")
    assert rc == 0
    posted = server.prompts[0]
    twin = json.loads((WORKFLOWS / "h3_t2va_nvfp4.api.json").read_text())
    assert {k: v["inputs"] for k, v in posted["prompt"].items()} == {k: v["inputs"] for k, v in twin.items()}
    assert posted["extra_data"]["extra_pnginfo"]["workflow"]["nodes"]


def _v3_style(info: dict) -> dict:
    """/object_info as a V3-capable ComfyUI serves combos: ["COMBO", {"options": [...]}]."""
    info = copy.deepcopy(info)
    for node in info.values():
        for section in node["input"].values():
            for name, spec in section.items():
                if isinstance(spec[0], list):
                    section[name] = ["COMBO", {**(spec[1] if len(spec) > 1 else {}), "options": spec[0]}]
    return info


def test_ui_conversion_with_v3_style_combos():
    graph = json.loads((WORKFLOWS / "h3_t2va_nvfp4.json").read_text())
    twin = json.loads((WORKFLOWS / "h3_t2va_nvfp4.api.json").read_text())
    converted = ui_to_api(graph, _v3_style(object_info()))
    assert {k: v["inputs"] for k, v in converted.items()} == {k: v["inputs"] for k, v in twin.items()}


def test_ui_workflow_refused_when_the_server_lacks_a_node(server, tmp_path, capsys):
    del server.object_info["VAEDecodeAudio"]
    rc, _ = _run(server, tmp_path, WORKFLOWS / "h3_t2va_nvfp4.json")
    err = capsys.readouterr().err
    assert rc == 2 and not server.prompts
    assert "cannot convert the UI workflow" in err and "the server has no node type(s) VAEDecodeAudio" in err


def test_ui_workflow_refused_when_widgets_do_not_line_up(server, tmp_path, capsys):
    graph = json.loads((WORKFLOWS / "h3_t2va_nvfp4.json").read_text())
    sampler = next(n for n in graph["nodes"] if n["type"] == "H3B_Sampler")
    # the file stores every widget the server defines (optional ones included): one extra value is one more
    # than it can account for
    stored = len(sampler["widgets_values"])
    sampler["widgets_values"] += [0.25]
    path = tmp_path / "ui.json"
    path.write_text(json.dumps(graph))
    rc, _ = _run(server, tmp_path, path)
    assert rc == 2
    assert (f"node 5 (H3B_Sampler): the workflow stores {stored + 1} widget values but the server's definition "
            f"accounts for {stored}") in capsys.readouterr().err


def _graph(nodes, links):
    return {"nodes": nodes, "links": links, "last_node_id": 99, "last_link_id": 99, "version": 0.4}


def test_converter_handles_editor_only_nodes():
    info = object_info()
    nodes = [
        {"id": 1, "type": "H3B_EmptyLatent", "mode": 0, "inputs": [], "outputs": [{"name": "latent", "type": "LATENT",
                                                                                   "links": [1]}],
         "widgets_values": [256, 256, 22]},
        {"id": 2, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 1}],
         "outputs": [{"name": "", "type": "LATENT", "links": [2]}]},
        {"id": 3, "type": "PrimitiveNode", "mode": 0, "inputs": [],
         "outputs": [{"name": "INT", "type": "INT", "links": [3], "widget": {"name": "seed"}}],
         "widgets_values": [99, "randomize"]},
        {"id": 4, "type": "H3B_Sampler", "mode": 0,
         "inputs": [{"name": "latent", "type": "LATENT", "link": 2},
                    {"name": "seed", "type": "INT", "link": 3, "widget": {"name": "seed"}}],
         "outputs": [], "widgets_values": [0, "randomize", 4, "euler", "simple", 12.0, 3.0, 1.0]},
        {"id": 5, "type": "H3B_Diagnostics", "mode": 4, "inputs": [], "outputs": [],
         "widgets_values": ["x", ""]},
        {"id": 6, "type": "Note", "mode": 0, "inputs": [], "outputs": [], "widgets_values": ["hello"]},
        {"id": 7, "type": "NotInstalled", "mode": 2, "inputs": [], "outputs": []},
    ]
    links = [[1, 1, 0, 2, 0, "LATENT"], [2, 2, 0, 4, 0, "LATENT"], [3, 3, 0, 4, 1, "INT"]]
    api = ui_to_api(_graph(nodes, links), info)
    assert set(api) == {"1", "4"}
    assert api["4"]["inputs"] == {"latent": ["1", 0], "seed": 99, "steps": 4, "sampler": "euler",
                                  "scheduler": "simple", "shift_video": 12.0, "shift_audio": 3.0, "denoise": 1.0}


def test_converter_passes_through_bypassed_nodes():
    info = object_info()
    nodes = [
        {"id": 1, "type": "H3B_EmptyLatent", "mode": 0, "inputs": [],
         "outputs": [{"name": "latent", "type": "LATENT", "links": [1]}], "widgets_values": [64, 64, 5]},
        {"id": 2, "type": "H3B_Sampler", "mode": 4, "inputs": [{"name": "latent", "type": "LATENT", "link": 1}],
         "outputs": [{"name": "latent", "type": "LATENT", "links": [2]}],
         "widgets_values": [0, "fixed", 4, "euler", "simple", 12.0, 3.0, 1.0]},
        {"id": 3, "type": "H3B_Sampler", "mode": 0, "inputs": [{"name": "latent", "type": "LATENT", "link": 2}],
         "outputs": [], "widgets_values": [1, "fixed", 4, "euler", "simple", 12.0, 3.0, 1.0]},
    ]
    api = ui_to_api(_graph(nodes, [[1, 1, 0, 2, 0, "LATENT"], [2, 2, 0, 3, 0, "LATENT"]]), info)
    assert api["3"]["inputs"]["latent"] == ["1", 0] and "2" not in api


def test_converter_refuses_subgraphs():
    with pytest.raises(ConversionError, match="subgraphs"):
        ui_to_api({"nodes": [], "links": [], "definitions": {"subgraphs": [{"id": "x"}]}}, object_info())


needs_websocket = pytest.mark.skipif(importlib.util.find_spec("websocket") is None,
                                     reason="websocket-client is not installed: the /ws path is not tested")


@needs_websocket
def test_progress_through_the_websocket(server, tmp_path, capsys):
    server.polls_before_done = 0
    server.ws_messages = [
        {"type": "execution_start", "data": {"prompt_id": "p-1"}},
        {"type": "execution_cached", "data": {"nodes": ["1", "2"], "prompt_id": "p-1"}},
        {"type": "executing", "data": {"node": "4", "display_node": "4", "prompt_id": "p-1"}},
        {"type": "progress", "data": {"value": 1, "max": 2, "prompt_id": "p-1", "node": "4"}},
        {"type": "progress", "data": {"value": 2, "max": 2, "prompt_id": "p-1", "node": "4"}},
        {"type": "executing", "data": {"node": "9", "prompt_id": "other"}},
        {"type": "execution_success", "data": {"prompt_id": "p-1"}},
    ]
    out = tmp_path / "out"
    rc = main([str(WORKFLOWS / "h3_smoke_tiny.api.json"), "--server", server.url, "--output", str(out),
               "--poll-interval", "0.01"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "cached: nodes 1, 2" in err and "running node 4 (H3B_Sampler)" in err
    assert "node 4: 1/2" in err and "node 4: 2/2" in err and "running node 9" not in err
    assert (out / "h3_blackwell" / "smoke_00001_.json").exists()


@needs_websocket
def test_websocket_that_drops_falls_back_to_polling(server, tmp_path, capsys):
    server.ws_messages = []  # the socket closes without an end message
    rc = main([str(WORKFLOWS / "h3_smoke_tiny.api.json"), "--server", server.url, "--output", str(tmp_path / "o"),
               "--poll-interval", "0.01"])
    assert rc == 0 and "websocket closed; following the run through /history" in capsys.readouterr().err


def test_ws_url():
    assert Client("127.0.0.1:8188").ws_url("abc") == "ws://127.0.0.1:8188/ws?clientId=abc"
    assert Client("https://h/base/").ws_url("a") == "wss://h/base/ws?clientId=a"


def test_converter_skips_upload_widget_values():
    info = {"LoadImage": {"input": {"required": {"image": [["a.png", "b.png"], {"image_upload": True}]}},
                          "output": ["IMAGE", "MASK"]},
            "PreviewImage": {"input": {"required": {"images": ["IMAGE"]}}, "output": [], "output_node": True}}
    nodes = [{"id": 1, "type": "LoadImage", "mode": 0, "inputs": [],
              "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}], "widgets_values": ["b.png", "image"]},
             {"id": 2, "type": "PreviewImage", "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 1}],
              "outputs": []}]
    api = ui_to_api(_graph(nodes, [[1, 1, 0, 2, 0, "IMAGE"]]), info)
    assert api["1"]["inputs"] == {"image": "b.png"} and api["2"]["inputs"] == {"images": ["1", 0]}
