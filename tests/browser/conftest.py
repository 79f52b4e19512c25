"""The editor in a real browser: Debian's chromium driven by Playwright (the ``playwright`` package; never a browser
that Playwright downloads), on the page of a real ComfyUI that has this pack loaded.

- ``comfyui_server`` (tests/comfyui/fixtures.py, shared with the tests marked comfyui): a ComfyUI on the CPU with the
  pack in ``custom_nodes/``.
- ``editor``: one page for the session, opened once the editor is ready; ``editor.errors`` collects console errors
  and page errors from then on (tests read and clear it).
Skips, saying why, where ComfyUI, Playwright or chromium is missing; fails instead where ``H3_COMFYUI_REQUIRED=1``
(CI: `.ci/run`), so a missing piece is never a quiet skip there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import struct
import urllib.request
import wave
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "out" / "browser"
CHROMIUM = os.environ.get("H3_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
READY = ("() => window.app && app.vueAppReady && app.isGraphReady && window.LiteGraph"
         " && Object.keys(LiteGraph.registered_node_types).some(t => t.startsWith('H3B_'))")
# What the editor itself logs as errors on a fresh, offline start, whatever the packs: a user folder without
# user.css, workflows or templates (404), the release check that cannot reach its host, and the editor touching its
# graph before creating it. Anything else is an error the test reports.
STARTUP_NOISE = ("/user.css", "/api/userdata", "graph accessed before initialization")
# The editor's calls to outside hosts (release notes, templates), which fail on an offline machine at any time.
OFFLINE_NOISE = ("ERR_NAME_NOT_RESOLVED", "ERR_INTERNET_DISCONNECTED", "https://api.comfy.org/")
MP4 = """
import sys, av, numpy as np
with av.open(sys.argv[1], "w") as f:
    s = f.add_stream("libx264", rate=24)
    s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
    for i in range(24):
        img = np.zeros((64, 64, 3), np.uint8); img[:, :, 0] = i * 10; img[:, i:i + 8, 1] = 255
        f.mux(s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
    f.mux(s.encode())
"""


def _png(path: Path, width: int = 64, height: int = 64) -> None:
    """A small RGB gradient PNG (standard library only)."""
    rows = b"".join(b"\0" + b"".join(bytes((x * 4 % 256, y * 4 % 256, 128)) for x in range(width))
                    for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _wav(path: Path, seconds: float = 1.0, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(i * 0.05))) for i in range(int(seconds * rate))))


def add_input_files(server, python: Path) -> list[str]:
    """The input files the shipped workflows name (images, audio, the control video), made small, in the server's
    input folder: the editor then previews them instead of logging 404s, as it would for a user who added them."""
    from fixtures.workflow_specs import GRAPHS

    folder, made = Path(server.base_dir) / "input", []
    folder.mkdir(parents=True, exist_ok=True)
    for graph in GRAPHS.values():
        for node in graph.nodes.values():
            name = node.values.get({"LoadImage": "image", "LoadAudio": "audio", "LoadVideo": "file"}.get(node.type, ""))
            if not isinstance(name, str) or (folder / name).exists():
                continue
            if node.type == "LoadImage":
                _png(folder / name)
            elif node.type == "LoadAudio":
                _wav(folder / name)
            else:  # ComfyUI's venv has PyAV
                subprocess.run([str(python), "-c", MP4, str(folder / name)], check=True, timeout=120)
            made.append(name)
    return made


class Editor:
    """The page, what it logged, and helpers to run the editor's JavaScript."""

    def __init__(self, page, startup: list):
        self.page, self.startup, self.errors = page, startup, []

    def unexpected_startup(self) -> list[str]:
        """What was logged as an error while the editor started, less its own offline start-up noise."""
        return [e for e in self.startup if not any(noise in e for noise in STARTUP_NOISE)]

    def js(self, script: str, arg=None):
        return self.page.evaluate(script, arg)

    def screenshot(self, name: str) -> Path:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path


@pytest.fixture(scope="session")
def editor(comfyui_server):
    add_input_files(comfyui_server, comfyui_server.python)
    missing = pytest.fail if os.environ.get("H3_COMFYUI_REQUIRED") == "1" else pytest.skip
    try:
        from playwright import sync_api
    except ImportError:
        missing("the browser tests need the playwright package (scripts/test.sh installs it)")
    if not Path(CHROMIUM).is_file():
        missing(f"no chromium at {CHROMIUM}: scripts/test.sh installs Debian's (apt-get install chromium); "
                "or set H3_CHROMIUM")
    # a first start would open the template browser over the graph; the minimap would cover part of it; text is
    # drawn at every zoom (the screenshots show whole graphs)
    settings = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False, "LiteGraph.Canvas.MinFontSizeForLOD": 0}
    urllib.request.urlopen(urllib.request.Request(comfyui_server.url + "/settings", json.dumps(settings).encode(),
                                                  {"Content-Type": "application/json"}, method="POST"), timeout=30)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 2400, "height": 1350})
        startup: list = []
        sink = {"list": startup}

        def log(text: str) -> None:
            if not any(noise in text for noise in OFFLINE_NOISE):
                sink["list"].append(text)

        page.on("console", lambda m: m.type == "error" and log(f"console: {m.text} ({m.location.get('url', '')})"))
        page.on("pageerror", lambda e: log(f"page error: {e}"))
        page.on("response", lambda r: r.status >= 400 and log(f"HTTP {r.status}: {r.url}"))
        page.goto(comfyui_server.url + "/")
        page.wait_for_function(READY, timeout=180_000)
        ed = Editor(page, startup)
        sink["list"] = ed.errors
        yield ed
        browser.close()
