"""A real ComfyUI server for the tests marked ``comfyui`` (and ``browser``): the vendored ComfyUI that
``scripts/comfyui_env.sh`` unpacks and installs, started on the CPU with this checkout in ``custom_nodes/``.

API (no pytest needed here; ``tests/comfyui/conftest.py`` wraps it in fixtures)::

    paths = comfyui_paths()            # (src, python), or pytest.skip / pytest.fail with the reason
    with ComfyServer(base_dir, src, python, env={...}) as srv:   # starts, waits, stops (process group, bounded)
        srv.url                         # "http://127.0.0.1:PORT"
        srv.get_json("/object_info")    # GET, JSON
        srv.queue(prompt)               # POST /prompt -> (status, body); 400 + node_errors for a refused prompt
        srv.run(prompt, timeout=300)    # queue, then poll /history until done -> the history entry (raises on refusal)
        srv.log_text()                  # the server's stdout+stderr so far

``make_base_dir(tmp)`` lays out a base directory OUTSIDE the repository: ``custom_nodes/h3-blackwell`` (a symlink
to this checkout, the folder name the README uses), ``custom_nodes/h3b_test_probe`` (tests/comfyui/probe_nodes.py:
nodes that save a LATENT to a file and make test inputs), core's newer ``nodes_sparse_attention.py`` where it is cached
(tests/fixtures/core_src.py; never in git), and ``models/``, ``input/``, ``output/``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK_DIR_NAME = "h3-blackwell"
PROBE_DIR_NAME = "h3b_test_probe"
START_TIMEOUT_S = 240.0  # a cold start on a busy 2-core machine imports torch, transformers and every core node


def comfyui_paths():
    """(src, python) of the vendored ComfyUI: from ``H3_COMFYUI_SRC`` / ``H3_COMFYUI_PYTHON`` (set by
    scripts/test.sh), else from ``$H3_COMFY_HOME/paths.env`` (default ``<repo>/.comfyui``). Skips where the archive
    is absent (``H3_COMFYUI_SKIP``; fails instead under ``H3_COMFYUI_REQUIRED=1``, as .ci/run sets), fails where the
    build failed (``H3_COMFYUI_ERROR``)."""
    import pytest

    if os.environ.get("H3_COMFYUI_ERROR"):
        pytest.fail(f"the ComfyUI for the comfyui tests is not usable: {os.environ['H3_COMFYUI_ERROR']}")
    # .ci/run sets H3_COMFYUI_REQUIRED=1: there the comfyui tests must run, never skip
    skip = pytest.fail if os.environ.get("H3_COMFYUI_REQUIRED") == "1" else pytest.skip
    if os.environ.get("H3_COMFYUI_SKIP"):
        skip(os.environ["H3_COMFYUI_SKIP"])
    src, py = os.environ.get("H3_COMFYUI_SRC"), os.environ.get("H3_COMFYUI_PYTHON")
    if not (src and py):
        env_file = Path(os.environ.get("H3_COMFY_HOME") or REPO / ".comfyui") / "paths.env"
        if env_file.is_file():
            found = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
            src, py = found.get("H3_COMFYUI_SRC"), found.get("H3_COMFYUI_PYTHON")
    if not (src and py and Path(src, "main.py").is_file() and Path(py).is_file()):
        skip("no ComfyUI set up for the comfyui tests: run them through `bash scripts/test.sh -m comfyui` "
                    "(it unpacks ../shared/vendor/comfyui-0f1fa67a.tar.gz and builds its venv)")
    return Path(src), Path(py)


def make_base_dir(base: Path, pack: Path = REPO) -> Path:
    """A ComfyUI base directory at ``base`` (must lie outside the repository) with the pack and the probe nodes."""
    base = Path(base)
    if base.resolve().is_relative_to(REPO):
        raise ValueError(f"the ComfyUI base directory must lie outside the repository ({REPO}); got {base}")
    for sub in ("custom_nodes", "models/diffusion_models", "models/model_patches", "models/loras", "input",
                "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / PACK_DIR_NAME).symlink_to(Path(pack).resolve(), target_is_directory=True)
    probe = base / "custom_nodes" / PROBE_DIR_NAME
    probe.mkdir()
    shutil.copy(Path(__file__).with_name("probe_nodes.py"), probe / "__init__.py")
    from fixtures.core_src import core_file  # tests/ is on the path (tests/conftest.py)

    sparse = core_file()
    if sparse is not None:  # core's Model Sparse Attention (newer than the vendored core), as a custom node file
        shutil.copy(sparse, base / "custom_nodes" / "core_nodes_sparse_attention.py")
    return base


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """One ComfyUI process on 127.0.0.1; a context manager (start on enter, stop on exit)."""

    def __init__(self, base_dir: Path, src: Path, python: Path, env: dict | None = None, extra_args=()):
        self.base_dir, self.src, self.python = Path(base_dir), Path(src), Path(python)
        self.env = {**os.environ, **(env or {})}
        for var in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET"):  # the test venv's, not ComfyUI's
            if var not in (env or {}):
                self.env.pop(var, None)
        self.extra_args = list(extra_args)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base_dir / "comfyui.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ComfyServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port()
        cmd = [str(self.python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(self.base_dir), "--database-url", "sqlite:///:memory:",
               "--disable-auto-launch", *self.extra_args]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, cwd=self.src, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited during start (rc {self.proc.returncode}); expected it to serve "
                                   f"{self.url}. Its log:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats", timeout=5)
                break
            except (OSError, ValueError):
                time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"ComfyUI did not answer on {self.url} within {START_TIMEOUT_S:.0f} s. Its log:\n"
                               f"{self.log_tail()}")
        failed = [line for line in self.log_text().splitlines() if "IMPORT FAILED" in line and PACK_DIR_NAME in line]
        if failed:
            raise RuntimeError(f"the pack did not import into ComfyUI: {failed[0]}. Its log:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # --- HTTP ---------------------------------------------------------------------------------------------------
    def request(self, path: str, body=None, timeout: float = 30.0):
        """(status, parsed JSON or text) of GET (body None) or POST (body JSON-encoded)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def get_json(self, path: str, timeout: float = 30.0):
        status, body = self.request(path, timeout=timeout)
        if status != 200:
            raise ValueError(f"GET {path}: HTTP {status}: {body}")
        return body

    def queue(self, prompt: dict, client_id: str = "h3b-tests"):
        return self.request("/prompt", {"prompt": prompt, "client_id": client_id})

    def wait(self, prompt_id: str, timeout: float = 300.0) -> dict:
        """The /history entry of ``prompt_id`` once it is finished (success or error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get_json(f"/history/{prompt_id}")
            entry = hist.get(prompt_id) if isinstance(hist, dict) else None
            if entry and entry.get("status", {}).get("completed") is not None and (
                    entry["status"].get("status_str") in ("success", "error")):
                return entry
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited while running prompt {prompt_id}. Its log:\n{self.log_tail()}")
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s. Server log:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 300.0) -> dict:
        """Queue ``prompt`` and wait for it; raises where /prompt refuses it."""
        status, body = self.queue(prompt)
        if status != 200 or not isinstance(body, dict) or "prompt_id" not in body:
            raise RuntimeError(f"/prompt refused the prompt (HTTP {status}): {json.dumps(body)[:2000]}")
        return self.wait(body["prompt_id"], timeout)


def messages(entry: dict) -> dict:
    """{event name: data} of a history entry's status messages (execution_error, execution_interrupted, ...)."""
    return {name: data for name, data in entry.get("status", {}).get("messages", [])}


def require_success(entry: dict, srv: ComfyServer | None = None) -> dict:
    status = entry.get("status", {})
    if status.get("status_str") != "success":
        err = messages(entry).get("execution_error") or messages(entry)
        tail = f"\nServer log:\n{srv.log_tail()}" if srv is not None else ""
        raise AssertionError(f"expected the prompt to succeed; it ended {status.get('status_str')!r}: "
                             f"{json.dumps(err)[:3000]}{tail}")
    return entry
