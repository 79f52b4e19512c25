"""``h3-blackwell comfy-run`` against a misbehaving server (issue 26).

A raw-socket server in this process (threads, 127.0.0.1, a random port) plays a good ComfyUI by default; each
case replaces one answer with a hostile one: bytes that are not HTTP, headers or bodies that trickle in forever,
a connection closed mid-body, a huge Content-Length, polls slower than the deadline, JSON of the wrong type at
each level, unsafe names (NUL, control characters, separators, traversal) for prompt ids, files, subfolders and
types, and a /ws feed that misbehaves. The CLI runs as a subprocess under a timeout; every case asserts the exit
status, exactly one ``error:`` line (at the start of a line: nothing glued to it), no traceback and no internal
error, that the output folder holds exactly what it held before (no partial or temporary file), and that the
command ended within its deadline.
"""

from __future__ import annotations

import base64
import copy
import faulthandler
import hashlib
import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from h3_blackwell.cli import comfy_run
from h3_blackwell.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PID = "0b6f3c1e-4d2a-4f7e-9a51-3c2d1e0f9a8b"
PNG = b"\x89PNG\r\n\x1a\n fake frame"
GARBAGE = b"\x00\xff\xfe\x1b[2J garbage \r\n\r\n" + bytes(range(256))


def _entry() -> dict:
    return {
        "prompt": [0, PID, {"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}, {}, ["9"]],
        "outputs": {
            "9": {"images": [{"filename": "frame_00001_.png", "subfolder": "h3/run", "type": "output"}],
                  "animated": [False]},
            "5": {"text": ["summary line"]},
        },
        "status": {"status_str": "success", "completed": True,
                   "messages": [["execution_start", {"prompt_id": PID, "timestamp": 1}],
                                ["execution_success", {"prompt_id": PID, "timestamp": 2}]]},
        "meta": {"9": {"node_id": "9", "display_node": "9"}},
    }


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------

class Request:
    def __init__(self, method: str, target: str, headers: dict, body: bytes):
        self.method, self.headers, self.body = method, headers, body
        u = urllib.parse.urlsplit(target)
        self.path, self.query = u.path, dict(urllib.parse.parse_qsl(u.query))


def _read_request(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk or len(data) > 1 << 20:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return Request(method, target, headers, body)


def http(status: int, body: bytes, headers: dict | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {"Content-Length": str(len(body))}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def json_http(obj, status: int = 200) -> bytes:
    return http(status, json.dumps(obj).encode(), {"Content-Type": "application/json",
                                                   "Content-Length": str(len(json.dumps(obj).encode()))})


class Hostile:
    """A ComfyUI by default (POST /prompt, /history after one empty poll, /view, 404 for /ws); ``routes`` maps
    (method, path prefix) to a behaviour ``fn(server, conn, request)`` that writes whatever it likes."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.routes: dict = {}
        self.answer = {"prompt_id": PID, "number": 0, "node_errors": {}}
        self.history_key = PID
        self.entry = _entry()
        self.files = {("h3/run", "frame_00001_.png", "output"): PNG}
        self.polls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.sock.close()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket):
        conn.settimeout(10)
        try:
            req = _read_request(conn)
            if req is not None:
                for (method, prefix), fn in self.routes.items():
                    if req.method == method and req.path.startswith(prefix):
                        return fn(self, conn, req)
                return self.comfy(conn, req)
        except OSError:
            pass
        finally:
            conn.close()

    def comfy(self, conn: socket.socket, req: Request):
        if req.method == "POST" and req.path == "/prompt":
            return conn.sendall(json_http(self.answer))
        if req.method == "GET" and req.path.startswith("/history/"):
            self.polls += 1
            return conn.sendall(json_http({self.history_key: self.entry} if self.polls > 1 else {}))
        if req.method == "GET" and req.path == "/view":
            q = req.query
            data = self.files.get((q.get("subfolder", ""), q.get("filename"), q.get("type")))
            return conn.sendall(http(200, data) if data is not None else json_http({"error": "nope"}, 404))
        return conn.sendall(json_http({}, 404))

    def hold(self, conn: socket.socket, data: bytes = b"", every: float = 0.0):
        """Send ``data`` (byte by byte, ``every`` seconds apart, when every > 0) and keep the connection open
        until the client leaves or the server stops."""
        if every <= 0:
            conn.sendall(data)
            data = b""
        for b in data:
            if self.stop.wait(every):
                return
            conn.sendall(bytes([b]))
        while not self.stop.wait(0.05):
            try:
                if conn.recv(1, socket.MSG_DONTWAIT) == b"":
                    return
            except BlockingIOError:
                continue

    def trickle(self, conn: socket.socket, prefix: bytes, unit: bytes, every: float = 0.02):
        """``prefix`` at once, then ``unit`` forever, one byte every ``every`` seconds."""
        conn.sendall(prefix)
        while not self.stop.wait(every):
            for b in unit:
                conn.sendall(bytes([b]))


# behaviours --------------------------------------------------------------------------------------

def send(data: bytes):
    return lambda srv, conn, req: conn.sendall(data)


def hold(data: bytes = b"", every: float = 0.0):
    return lambda srv, conn, req: srv.hold(conn, data, every)


def trickle(prefix: bytes, unit: bytes, every: float = 0.02):
    return lambda srv, conn, req: srv.trickle(conn, prefix, unit, every)


def reset(srv, conn, req):
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close


def slow(seconds: float, then):
    def fn(srv, conn, req):
        if not srv.stop.wait(seconds):
            then(srv, conn, req)
    return fn


def answer(obj, status: int = 200):
    return send(json_http(obj, status))


# ---------------------------------------------------------------------------------------------
# running the CLI and checking the contract
# ---------------------------------------------------------------------------------------------

FAST = ["--http-timeout", "1", "--timeout", "6", "--poll-interval", "0.02"]


def _listing(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), *(p for p in sys.path if p)])}


def _cli(srv: Hostile, tmp: Path, args: list[str], limit: float) -> tuple[int, str, str, float]:
    wf = tmp / "wf.json"
    if not wf.exists():
        wf.write_text(json.dumps({"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}))
    cmd = [sys.executable, "-m", "h3_blackwell.cli", "comfy-run", str(wf), "--server", srv.url, "--output",
           str(tmp / "out"), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=_env(), cwd=tmp)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"comfy-run hung past {limit} s: {e.stderr!r}")
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def check_refusal(rc: int, err: str, code: int, needles=()) -> str:
    """Exit ``code``, exactly one ``error:`` line (starting its line), no traceback, no internal error."""
    lines = err.splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert rc == code, (rc, err)
    assert len(errors) == 1, err
    assert not [ln for ln in lines if "error:" in ln and not ln.startswith("error:")], err  # nothing glued
    assert "Traceback" not in err and "error: internal" not in err, err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def _inproc(srv: Hostile, tmp: Path, args: list[str]) -> tuple[int, str, str, float]:
    """The CLI in this process (``cli.main``, as the console script runs it), stdout and stderr captured."""
    err, out = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with redirect_stderr(err), redirect_stdout(out):
        rc = cli.main(["comfy-run", str(tmp / "wf.json"), "--server", srv.url, "--output", str(tmp / "out"), *args])
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def hostile(tmp: Path, setup, *needles, code: int = 3, args=(), fresh_output: bool = False, ws: bool = False,
            inproc: bool = False, workflow: dict | None = None, max_s: float = 8.0) -> str:
    """Run comfy-run (a subprocess, or in this process with ``inproc``) against a Hostile server prepared by
    ``setup`` (through /ws too with ``ws``); assert the refusal contract, that the output folder is unchanged
    (a kept file in it, or no folder at all with ``fresh_output``) and the time it took."""
    out = tmp / "out"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "wf.json").write_text(json.dumps(workflow or {"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}))
    if not fresh_output:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        (out / "h3").mkdir()
    before = _listing(tmp)
    argv = [*([] if ws else ["--no-websocket"]), *FAST, *args]
    with Hostile() as srv:
        setup(srv)
        rc, _, err, secs = _inproc(srv, tmp, argv) if inproc else _cli(srv, tmp, argv, limit=max_s + 20)
    line = check_refusal(rc, err, code, needles)
    assert _listing(tmp) == before, "the output folder changed"
    assert secs < max_s, f"took {secs:.1f} s"
    return line


def route(method: str, prefix: str, fn):
    """A setup that answers ``method prefix*`` with the behaviour ``fn``."""
    return lambda srv: srv.routes.__setitem__((method, prefix), fn)


def both(*setups):
    def setup(srv):
        for s in setups:
            s(srv)
    return setup


def parallel(fn, items: dict) -> None:
    """``fn(name, value)`` for every item at once (subprocesses in threads: the cases mostly wait on their
    clocks); every failing item is reported, by name."""
    failures = {}

    def one(item):
        try:
            fn(*item)
        except BaseException as e:  # noqa: BLE001 - pytest.fail and AssertionError alike, reported below
            failures[item[0]] = f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(one, items.items()))
    assert not failures, "\n\n".join(f"[{k}] {v}" for k, v in sorted(failures.items()))


def run_cases(tmp: Path, cases: dict, inproc: bool = False) -> None:
    """``hostile`` for every case ``name: (setup, needles, options)``: subprocesses in parallel, or one after
    the other in this process (under a watchdog: a hang ends the test run with every thread's traceback)."""
    if not inproc:
        return parallel(lambda name, c: hostile(tmp / name, c[0], *c[1], **c[2]), cases)
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        for name, (setup, needles, opts) in cases.items():
            try:
                hostile(tmp / name, setup, *needles, inproc=True, **opts)
            except AssertionError as e:
                raise AssertionError(f"[{name}] {e}") from None
    finally:
        faulthandler.cancel_dump_traceback_later()


def representatives(cases: dict, names: list[str]) -> dict:
    return {n: cases[n] for n in names}


def case(setup, *needles, **opts):
    return setup, needles, opts


# ---------------------------------------------------------------------------------------------
# not HTTP, not ComfyUI
# ---------------------------------------------------------------------------------------------

NOT_HTTP = {
    "garbage-then-close": send(GARBAGE),
    "garbage-then-hold": hold(GARBAGE),
    "ssh-banner": send(b"SSH-2.0-OpenSSH_9.6\r\n"),
    "nul-bytes": send(b"\x00" * 4096),
    "bad-status-code": send(b"HTTP/1.1 abc OK\r\n\r\n"),
    "status-999": send(b"HTTP/1.1 999 What\r\nContent-Length: 2\r\n\r\n{}"),
    "http-0.9-body": send(b'{"prompt_id": "x"}'),
    "header-line-too-long": send(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n"),
    "too-many-headers": send(b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 500 + b"\r\n"),
    "bad-chunk-size": send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    "closed-without-answer": send(b""),
    "reset": reset,
}


def test_not_http(tmp_path):
    """Bytes that are not an HTTP answer, from the first request on or only from a later one."""
    run_cases(tmp_path / "prompt", {k: case(route("POST", "/prompt", fn), "127.0.0.1") for k, fn in NOT_HTTP.items()})
    run_cases(tmp_path / "history", {k: case(route("GET", "/history/", fn), "127.0.0.1", fresh_output=True)
                                     for k, fn in NOT_HTTP.items()}, inproc=True)


NOT_COMFY = {
    "html": (send(http(200, b"<!doctype html><h1>hi</h1>")), "HTML page"),
    "other-json": (answer({"hello": "world"}), "JSON without ComfyUI's fields"),
    "json-list": (answer([1, 2]), "a list"),
    "json-null": (answer(None), "null"),
    "json-number": (send(http(200, b"42")), "a number"),
    "empty-200": (send(http(200, b"")), "empty body"),
    "bad-utf8": (send(http(200, b'{"prompt_id": "\xff\xfe"}')), "not JSON"),
    "not-json": (send(http(200, b"{oops")), "not JSON"),
    "deep-nesting": (send(http(200, b"[" * 200000)), "nested too deeply"),
    "huge-int": (send(http(200, b'{"prompt_id": ' + b"9" * 20000 + b"}")), "not JSON"),
    "redirect": (send(http(302, b"", {"Location": "http://example.invalid/", "Content-Length": "0"})), "302"),
    "500-text": (send(http(500, b"Internal Server Error")), "500"),
    "400-without-fields": (answer({"detail": "x"}, 400), "400"),
    "200-without-prompt-id": (answer({"number": 1, "node_errors": {}}), "JSON without ComfyUI's fields"),
}


def test_not_comfyui(tmp_path):
    cases = {k: case(route("POST", "/prompt", fn), needle) for k, (fn, needle) in NOT_COMFY.items()}
    cases["history-of-other-prompts"] = case(lambda s: setattr(s, "history_key", "someone-else"), "instead of")
    cases["history-list"] = case(route("GET", "/history/", answer([PID])), "the answer is a list")
    cases["history-html"] = case(route("GET", "/history/", send(http(200, b"<html>"))), "HTML page")
    cases["history-404"] = case(route("GET", "/history/", answer({"error": "x"}, 404)), "404")
    run_cases(tmp_path, cases)


# ---------------------------------------------------------------------------------------------
# time: trickles, stalls, slow polls; everything ends by the deadline
# ---------------------------------------------------------------------------------------------

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
TRICKLES = {
    "status-line": (b"", b"H"),
    "one-endless-header": (HEAD + b"X-Pad: ", b"a"),
    "endless-headers": (HEAD, b"X-Pad: 1\r\n"),
    "100-continue-forever": (b"", b"HTTP/1.1 100 Continue\r\n\r\n"),
    "json-body": (HEAD + b"Content-Length: 100000\r\n\r\n{", b" "),
    "json-body-no-length": (HEAD + b"\r\n[", b"1,"),
    "chunked-body": (HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n"),
}


def test_trickles_end_in_time(tmp_path):
    """Bytes keep coming, each well within --http-timeout: the request's own wall-clock limit (--http-timeout)
    or the deadline (--timeout), whichever is first, ends it; on the submit, a poll or a download."""
    cases = {}
    for name, (prefix, unit) in TRICKLES.items():
        cases[f"http-timeout-{name}"] = case(route("POST", "/prompt", trickle(prefix, unit)), "--http-timeout",
                                             args=["--http-timeout", "0.8", "--timeout", "60"], max_s=7)
        cases[f"deadline-{name}"] = case(route("POST", "/prompt", trickle(prefix, unit)), "--timeout",
                                         args=["--http-timeout", "60", "--timeout", "1.2"], max_s=7)
        cases[f"history-{name}"] = case(route("GET", "/history/", trickle(prefix, unit)), "did not finish in time",
                                        args=["--http-timeout", "60", "--timeout", "1.2"], max_s=7)
    # a download's body is bounded by the deadline only (a large file takes what it takes)
    view = trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n", b"x", every=0.01)
    cases["view-body"] = case(route("GET", "/view", view), "ran out while fetching", "nothing was written",
                              args=["--timeout", "1.5"], max_s=7)
    cases["view-headers"] = case(route("GET", "/view", trickle(b"HTTP/1.1 200 OK\r\n", b"X: 1\r\n")),
                                 "ran out while fetching", args=["--timeout", "1.5", "--http-timeout", "60"],
                                 fresh_output=True, max_s=7)
    # every request trickles, /ws included: the feed's handshake runs beside the submit, so one --http-timeout
    everything = both(*(route(m, "/", trickle(b"HTTP/1.1 200 OK\r\n", b"X-Pad: 1\r\n", every=0.05))
                        for m in ("GET", "POST")))
    cases["everything-with-ws"] = case(everything, "--http-timeout (2 s)", ws=True,
                                       args=["--http-timeout", "2", "--timeout", "60"], max_s=6.5)
    run_cases(tmp_path, cases)


def test_stalls_and_slow_polls(tmp_path):
    cases = {
        # accepted and never answered; headers then silence; half a body then silence
        "no-answer": case(route("POST", "/prompt", hold()), "--http-timeout (1 s)", max_s=6),
        "headers-then-silence": case(route("POST", "/prompt", hold(HEAD)), "--http-timeout (1 s)", max_s=6),
        "half-body-then-silence": case(route("POST", "/prompt", hold(HEAD + b"Content-Length: 50\r\n\r\n{\"pr")),
                                       "--http-timeout (1 s)", max_s=6),
        "download-stalls": case(route("GET", "/view", hold(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nab")),
                                "could not be fetched", "--http-timeout", max_s=6),
        "slow-polls": case(route("GET", "/history/", slow(0.7, answer({}))), "did not finish in time",
                           "POST /interrupt", args=["--timeout", "1.5", "--http-timeout", "5"], max_s=6),
        "never-done": case(route("GET", "/history/", answer({})), "did not finish in time", args=["--timeout", "1"],
                           max_s=6),
        "slow-submit": case(route("POST", "/prompt", slow(5, answer({}))), "before the prompt was queued",
                            args=["--timeout", "1", "--http-timeout", "30"], max_s=6),
    }
    run_cases(tmp_path, cases)


# ---------------------------------------------------------------------------------------------
# bodies cut short or too large
# ---------------------------------------------------------------------------------------------

def test_bodies_cut_short_or_too_large(tmp_path):
    big = str(10 ** 18).encode()
    second_fails = both(
        lambda s: s.entry["outputs"].__setitem__("10", {"audio": [{"filename": "a.flac", "subfolder": "",
                                                                   "type": "output"}]}),
        route("GET", "/view", lambda srv, conn, req: conn.sendall(
            http(200, PNG) if req.query["filename"] != "a.flac" else HEAD + b"Content-Length: 9999\r\n\r\nflac")))
    cases = {
        "json-cut": case(route("POST", "/prompt", send(HEAD + b"Content-Length: 500\r\n\r\n{\"prompt_id\": ")),
                         "in the middle"),
        "chunked-cut": case(route("POST", "/prompt", send(HEAD + b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"pro")),
                            "in the middle"),
        "view-cut": case(route("GET", "/view", send(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + PNG)),
                         "in the middle", "nothing was written"),
        "second-download-cut": case(second_fails, "in the middle", "nothing was written"),
        "second-download-cut-fresh": case(second_fails, "in the middle", fresh_output=True),
        "huge-length-json": case(route("POST", "/prompt", send(HEAD + b"Content-Length: " + big + b"\r\n\r\n{}")),
                                 "announced", max_s=6),
        "huge-length-history": case(route("GET", "/history/", hold(HEAD + b"Content-Length: " + big + b"\r\n\r\n{")),
                                    "announced", max_s=6),
        "huge-length-view": case(route("GET", "/view", send(b"HTTP/1.1 200 OK\r\nContent-Length: " + big +
                                                            b"\r\n\r\n" + PNG)), "in the middle", max_s=6),
        "huge-chunk-view": case(route("GET", "/view", send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                                           b"fffffffffffffff\r\nabc")), "in the middle", max_s=6),
    }
    run_cases(tmp_path, cases)


def test_view_http_error_is_exit_1_and_nothing_is_kept(tmp_path):
    hostile(tmp_path, lambda s: s.files.clear(), "could not be fetched", "HTTP 404", code=1)


# ---------------------------------------------------------------------------------------------
# JSON of the wrong type, at every level
# ---------------------------------------------------------------------------------------------

def _set(path: list, value):
    """A setup that puts ``value`` at ``path`` in the history entry (``path[0] == "answer"``: in the /prompt
    answer instead)."""
    def setup(srv):
        target = srv.answer if path[0] == "answer" else srv.entry
        keys = path[1:] if path[0] == "answer" else path
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value
    return setup


WRONG_TYPES = [
    (["answer", "prompt_id"], 12345, "prompt_id"),
    (["answer", "prompt_id"], ["p"], "prompt_id"),
    (["answer", "prompt_id"], True, "prompt_id"),
    (["answer", "node_errors"], [], "node_errors"),
    (["answer", "node_errors"], "oops", "node_errors"),
    (["answer", "node_errors"], {"4": []}, "node_errors.4"),
    (["answer", "node_errors"], {"4": {"errors": {}}}, "node_errors.4.errors"),
    (["answer", "node_errors"], {"4": {"errors": ["x"]}}, "node_errors.4.errors[0]"),
    (["answer", "node_errors"], {"4": {"errors": [{"message": "m", "extra_info": []}]}}, "extra_info"),
    (["answer", "node_errors"], {"4": {"errors": [{"message": {"a": 1}}]}}, "message"),
    (["answer", "node_errors"], {"4": {"class_type": ["X"], "errors": []}}, "class_type"),
    (["outputs"], [], "outputs"),
    (["outputs"], "frame.png", "outputs"),
    (["outputs", "9"], [{"filename": "x.png"}], "outputs.9"),
    (["outputs", "9", "images"], "frame.png", "outputs.9.images"),
    (["outputs", "9", "images"], {"filename": "x.png"}, "outputs.9.images"),
    (["outputs", "9", "images", 0, "filename"], 7, "outputs.9.images[0].filename"),
    (["outputs", "9", "images", 0, "filename"], ["a.png"], "outputs.9.images[0].filename"),
    (["outputs", "9", "images", 0, "filename"], None, "outputs.9.images[0].filename"),
    (["outputs", "9", "images", 0, "subfolder"], ["h3"], "outputs.9.images[0].subfolder"),
    (["outputs", "9", "images", 0, "subfolder"], 3, "outputs.9.images[0].subfolder"),
    (["outputs", "9", "images", 0, "type"], {"t": 1}, "outputs.9.images[0].type"),
    (["outputs", "5", "text"], "summary", "outputs.5.text"),
    (["status"], [], "status"),
    (["status"], "success", "status"),
    (["status", "messages"], {}, "status.messages"),
    (["status", "messages"], [["execution_start"]], "status.messages[0]"),
    (["status", "messages"], ["execution_start"], "status.messages[0]"),
    (["status", "messages"], [[1, {}]], "status.messages[0][0]"),
    (["status", "messages"], [["execution_error", []]], "status.messages[0][1]"),
    (["status", "messages"], [["execution_error", {"exception_message": ["x"]}]], "exception_message"),
    (["status", "messages"], [["execution_error", {"traceback": "tb"}]], "traceback"),
    (["status", "status_str"], 1, "status.status_str"),
    (["status", "completed"], "yes", "status.completed"),
]


def test_wrong_json_types_name_the_field(tmp_path):
    cases = {f"{i:02d}-{'.'.join(map(str, path))}": case(_set(path, value), field, "malformed JSON")
             for i, (path, value, field) in enumerate(WRONG_TYPES)}
    cases["rejection-error-list"] = case(route("POST", "/prompt", answer({"error": ["x"]}, 400)), "error is a list")
    cases["rejection-node-errors-list"] = case(
        route("POST", "/prompt", answer({"error": {"message": "bad"}, "node_errors": [1]}, 400)),
        "node_errors is a list")
    cases["entry-list"] = case(lambda s: setattr(s, "entry", [1, 2]), "is a list")
    cases["entry-string"] = case(lambda s: setattr(s, "entry", "done"), "is a string")
    run_cases(tmp_path / "in", cases, inproc=True)
    run_cases(tmp_path / "sub", representatives(cases, ["03-answer.node_errors", "11-outputs", "entry-list",
                                                         "29-status.messages"]))


UI_GRAPH = {"nodes": [{"id": 1, "type": "H3B_EmptyLatent", "mode": 0, "inputs": [], "outputs": [],
                       "widgets_values": [256, 256, 22]}], "links": [], "version": 0.4}
UI_INFO = {"H3B_EmptyLatent": {"input": {"required": {"width": ["INT", {}], "height": ["INT", {}],
                                                      "frames": ["INT", {}]}},
                               "input_order": {"required": ["width", "height", "frames"]},
                               "output": ["LATENT"], "display_name": "H3 Empty Latent"}}


def _object_info(edit):
    def setup(srv):
        info = copy.deepcopy(UI_INFO)
        info = edit(info) or info
        srv.routes[("GET", "/object_info")] = answer(info)
    return setup


def _in(info, path, value):
    for k in path[:-1]:
        info = info[k]
    info[path[-1]] = value


def test_object_info_of_the_wrong_shape(tmp_path):
    """A UI graph is converted with the server's /object_info: its parts are type-checked like any answer."""
    e = "H3B_EmptyLatent"
    cases = {
        "list": case(_object_info(lambda i: [i]), "the answer is a list"),
        "node-list": case(_object_info(lambda i: _in(i, [e], [])), f"{e} is a list"),
        "input-list": case(_object_info(lambda i: _in(i, [e, "input"], [])), f"{e}.input is a list"),
        "section-string": case(_object_info(lambda i: _in(i, [e, "input", "required"], "x")), "input.required is"),
        "spec-number": case(_object_info(lambda i: _in(i, [e, "input", "required", "width"], 5)), "required.width"),
        "spec-empty": case(_object_info(lambda i: _in(i, [e, "input", "required", "width"], [])), "empty list"),
        "spec-object": case(_object_info(lambda i: _in(i, [e, "input", "required", "width"], [{"a": 1}])),
                            "required.width[0]"),
        "order-string": case(_object_info(lambda i: _in(i, [e, "input_order", "required"], "width")),
                             "input_order.required"),
        "order-item": case(_object_info(lambda i: _in(i, [e, "input_order", "required"], [["width"]])),
                           "input_order.required[0]"),
        "display-name": case(_object_info(lambda i: _in(i, [e, "display_name"], 5)), "display_name"),
    }
    for c in cases.values():
        c[2]["workflow"] = UI_GRAPH
    run_cases(tmp_path, cases, inproc=True)
    # the same server with a good /object_info: the graph converts and runs; a malformed graph is the user's (2)
    ok = _object_info(lambda i: None)
    hostile(tmp_path / "bad-graph", ok, "malformed", code=2, inproc=True,
            workflow={"nodes": [{"id": 1, "mode": 0, "widgets_values": []}], "links": []})
    hostile(tmp_path / "bad-graph-2", ok, "convert", code=2, inproc=True, workflow={"nodes": [5], "links": []})


# ---------------------------------------------------------------------------------------------
# server-supplied names
# ---------------------------------------------------------------------------------------------

BAD_FILENAMES = ["a\x00b.png", "a\nb.png", "\x1b[31mred.png", "tab\t.png", "del\x7f.png", "c1\x85.png",
                 "bidi\u202egnp.exe", "line\u2028sep.png", "../escape.png", "..", ".", "", "/etc/passwd", "a/b.png",
                 "..\\up.png", "C:evil.png", "x" * 300, "\u00e9" * 200, "\ud800.png"]
BAD_SUBFOLDERS = ["../..", "a/../../b", "..", "/abs", "\\\\server\\share", "sub\x00", "sub\r\nX-Injected: 1", "C:",
                  "a/" * 40, "ok/\x1b[2J"]
BAD_TYPES = ["../output", "bogus", "out\x00put", "", "OUTPUT"]
BAD_PROMPT_IDS = ["p\x00", "p\n1", "p\x1b[2J", "p\r\nX: y", "../../etc", "p/1", "p\\1", "p 1", "", "a" * 500,
                  "p?x=1", "p%2F..", "p#f", "..", ".", "\u202ep", "p\u00e9"]


def test_bad_names(tmp_path):
    """Names from the server are checked before they reach a URL or the filesystem; the line names the field and
    shows the name escaped."""
    cases = {}
    for i, name in enumerate(BAD_FILENAMES):
        cases[f"filename-{i:02d}"] = case(_set(["outputs", "9", "images", 0, "filename"], name), "filename")
    for i, sub in enumerate(BAD_SUBFOLDERS):
        cases[f"subfolder-{i:02d}"] = case(_set(["outputs", "9", "images", 0, "subfolder"], sub), "subfolder")
    for i, kind in enumerate(BAD_TYPES):
        cases[f"type-{i:02d}"] = case(_set(["outputs", "9", "images", 0, "type"], kind), ".type")
    for i, pid in enumerate(BAD_PROMPT_IDS):
        cases[f"prompt-id-{i:02d}"] = case(_set(["answer", "prompt_id"], pid), "prompt_id")
    cases["text-node-id"] = case(lambda s: s.entry["outputs"].__setitem__("../../x", {"text": ["t"]}), "node id")
    cases["named-history.json"] = case(
        lambda s: s.entry["outputs"]["9"]["images"][0].update(filename="history.json", subfolder=""), "history.json")
    cases["two-outputs-one-path"] = case(lambda s: s.entry["outputs"].__setitem__("10", {"images": [
        {"filename": "frame_00001_.png", "subfolder": "h3/run", "type": "temp"}]}), "both be written")
    cases["file-over-folder"] = case(lambda s: s.entry["outputs"].__setitem__("10", {"images": [
        {"filename": "run", "subfolder": "h3", "type": "output"}]}), "folder of another output")
    run_cases(tmp_path / "in", cases, inproc=True)
    run_cases(tmp_path / "sub", representatives(cases, ["filename-00", "filename-08", "subfolder-01", "type-02",
                                                         "prompt-id-00", "prompt-id-02", "text-node-id"]))


def test_control_characters_in_messages_are_escaped(tmp_path):
    def setup(s):
        s.entry["status"] = {"status_str": "error", "completed": False, "messages": [[
            "execution_error", {"node_id": "4\x1b[2J", "node_type": "X\nerror: fake",
                                "exception_type": "E", "exception_message": "line1\nerror: line2\r\x00"}]]}
    (tmp_path / "wf.json").write_text(json.dumps({"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}))
    with Hostile() as srv:
        setup(srv)
        rc, _, err, _ = _cli(srv, tmp_path, ["--no-websocket", *FAST], limit=20)
    line = check_refusal(rc, err, 1)
    assert "\\x1b" in line and "\\n" in line and "\x00" not in err and "\x1b" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["history.json"]  # a failed run: history only


# ---------------------------------------------------------------------------------------------
# the output folder and the arguments
# ---------------------------------------------------------------------------------------------

def test_success_writes_everything_and_no_temporaries(tmp_path):
    with Hostile() as srv:
        rc, out, err, _ = _cli(srv, tmp_path, ["--no-websocket", *FAST], limit=20)
    assert rc == 0, err
    files = _listing(tmp_path / "out")
    assert files["h3/run/frame_00001_.png"] == PNG and files["node_5_text.txt"] == b"summary line\n"
    assert json.loads(files["history.json"])[PID]["outputs"]["9"]
    assert not [k for k in files if k.endswith(".part")]


def test_output_that_cannot_be_written_is_exit_2_before_any_request(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with Hostile() as srv:
        srv.routes[("POST", "/prompt")] = lambda *a: pytest.fail("submitted")
        for bad, needle in (("afile", "not a folder"), ("afile/sub", "not a folder"), ("dangling", "symlink")):
            rc, _, err, _ = _cli(srv, tmp_path, ["--no-websocket", *FAST, "--output", str(tmp_path / bad)],
                                 limit=20)
            check_refusal(rc, err, 2, ["--output", needle])


def test_a_name_that_does_not_resolve(tmp_path):
    (tmp_path / "wf.json").write_text(json.dumps({"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}))
    with Hostile() as srv:
        srv.url = "http://h3-blackwell-no-such-host.invalid:8188"
        rc, _, err, secs = _cli(srv, tmp_path, ["--no-websocket", *FAST], limit=20)
    check_refusal(rc, err, 3, ["h3-blackwell-no-such-host.invalid"])
    assert secs < 8 and not (tmp_path / "out").exists()


def test_bad_time_and_server_arguments_are_exit_2(tmp_path):
    with Hostile() as srv:
        for args in (["--timeout", "0"], ["--timeout", "nan"], ["--http-timeout", "-1"],
                     ["--poll-interval", "inf"], ["--server", "http://127.0.0.1:99999"],
                     ["--server", "ftp://127.0.0.1:1"], ["--server", "http://u:p@127.0.0.1:1"]):
            rc, _, err, _ = _cli(srv, tmp_path, ["--no-websocket", *FAST, *args], limit=20)
            check_refusal(rc, err, 2)


# ---------------------------------------------------------------------------------------------
# the /ws feed: best effort, never a hang
# ---------------------------------------------------------------------------------------------

def _upgrade(req: Request) -> bytes:
    accept = base64.b64encode(hashlib.sha1((req.headers["sec-websocket-key"] + WS_GUID).encode()).digest())
    return (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")


def _frame(payload: bytes, op: int = 1, fin: bool = True, mask: bool = False) -> bytes:
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | op])
    m = 0x80 if mask else 0
    head += bytes([m | n]) if n < 126 else bytes([m | 126]) + struct.pack(">H", n) if n < 65536 else \
        bytes([m | 127]) + struct.pack(">Q", n)
    if mask:
        key = b"\x01\x02\x03\x04"
        payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
        head += key
    return head + payload


def _msg(obj) -> bytes:
    return json.dumps(obj).encode()


WS_BAD = {
    "garbage": send(GARBAGE),
    "header-trickle": trickle(b"HTTP/1.1 101 Switching Protocols\r\n", b"X: 1\r\n"),
    "wrong-accept": send(b"HTTP/1.1 101 OK\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: nope\r\n\r\n"),
    "frame-trickle": lambda srv, conn, req: srv.trickle(conn, _upgrade(req) + b"\x81\x7e\xff\xff", b"a"),
    "huge-text-frame": lambda srv, conn, req: srv.hold(conn, _upgrade(req) + b"\x81\x7f" + struct.pack(">Q", 1 << 40)),
    "reserved-bits": lambda srv, conn, req: srv.hold(conn, _upgrade(req) + b"\xf1\x00"),
    "garbage-frames": lambda srv, conn, req: srv.hold(conn, _upgrade(req) + GARBAGE),
    "messages-forever": lambda srv, conn, req: srv.trickle(
        conn, _upgrade(req), _frame(_msg({"type": "crystools.monitor", "data": {"cpu": 1}})), every=0.001),
}


def test_misbehaving_websocket_falls_back_to_polling(tmp_path):
    """The run itself is fine: whatever /ws does, the outputs arrive through /history (exit 0) in time."""
    def one(name, behaviour):
        tmp = tmp_path / name
        tmp.mkdir()
        with Hostile() as srv:
            srv.routes[("GET", "/ws")] = behaviour
            rc, _, err, secs = _cli(srv, tmp, ["--http-timeout", "0.5", "--timeout", "10", "--poll-interval",
                                               "0.05"], limit=30)
        assert rc == 0, err
        assert "Traceback" not in err and "error:" not in err, err
        assert (tmp / "out" / "h3" / "run" / "frame_00001_.png").read_bytes() == PNG
        assert secs < 8, secs

    parallel(one, WS_BAD)


def test_websocket_trickle_past_the_deadline(tmp_path):
    """/ws keeps a frame coming slowly and /history never has the prompt: the deadline ends it."""
    def setup(s):
        s.routes[("GET", "/ws")] = lambda srv, conn, req: srv.trickle(conn, _upgrade(req), b"\x81\x05hello",
                                                                      every=0.05)
        s.routes[("GET", "/history/")] = answer({})
    hostile(tmp_path, setup, "did not finish in time", args=["--timeout", "2", "--http-timeout", "30"], ws=True,
            max_s=7)


def test_websocket_protocol_details(tmp_path):
    """Fragmented, masked and binary frames, a ping and messages of other prompts and plugins: the progress of
    this prompt is printed and the run ends at its end message."""
    def ws(srv, conn, req):
        text = _msg({"type": "progress", "data": {"prompt_id": PID, "node": "4", "value": 1, "max": 2}})
        frames = [_frame(_msg({"type": "status", "data": {"status": {}}})),
                  _frame(b"\x00\x01preview", op=2), _frame(b"hi", op=9),
                  _frame(text[:10], fin=False), _frame(b"p", op=9), _frame(text[10:], op=0),
                  _frame(_msg({"type": "executing", "data": {"prompt_id": "other", "node": "77"}}), mask=True),
                  _frame(_msg([1, 2])), _frame(b"\xff\xfe not utf-8"), _frame(_msg({"type": "x", "data": [1]})),
                  _frame(_msg({"type": "executing", "data": {"prompt_id": PID, "node": "4\x1b[2J"}})),
                  _frame(_msg({"type": "executing", "data": {"prompt_id": PID, "node": None}}))]
        srv.hold(conn, _upgrade(req) + b"".join(frames))

    with Hostile() as srv:
        srv.routes[("GET", "/ws")] = ws
        rc, _, err, _ = _cli(srv, tmp_path, FAST, limit=30)
    assert rc == 0, err
    assert "node 4: 1/2" in err and "running node 4\\x1b[2J" in err and "node 77" not in err  # (the port may hold 77)
    assert "websocket closed" not in err and "\x1b" not in err


# ---------------------------------------------------------------------------------------------
# a sweep: every field of the answers replaced by every wrong kind (in-process, under a watchdog)
# ---------------------------------------------------------------------------------------------

def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


WRONG = [[], {}, "", "x\x00/..", 7, 1.5, True, None, [[{}]], {"a": {"b": []}}]


def test_sweep_of_wrong_kinds(tmp_path):
    """No replacement crashes the runner: it succeeds (a field it may ignore), fails the run (exit 1 with
    history.json only), or refuses (exit 3) with one line and nothing written; never a temporary file left."""
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps({"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}))
    rejected = {"4": {"errors": [{"message": "m", "details": "d", "extra_info": {"input_name": "i"}}],
                      "class_type": "C"}}
    cases = [("answer",) + p for p in _paths({"prompt_id": PID, "node_errors": rejected}) if p]
    cases += [p for p in _paths(_entry()) if p and p[0] != "prompt"]
    seen = set()
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the whole run loudly
    try:
        with Hostile() as srv:
            for n, path in enumerate(cases):
                for j, value in enumerate(WRONG):
                    srv.answer = {"prompt_id": PID, "number": 0, "node_errors": copy.deepcopy(rejected)
                                  if path[1:2] == ("node_errors",) else {}}
                    srv.entry, srv.polls = _entry(), 1
                    _set(list(path), value)(srv)
                    out = tmp_path / f"o{n}-{j}"
                    err_buf = io.StringIO()
                    with redirect_stderr(err_buf), redirect_stdout(io.StringIO()):
                        rc = comfy_run.main([str(wf), "--server", srv.url, "--output", str(out), "--no-websocket",
                                             "--http-timeout", "2", "--timeout", "10", "--poll-interval", "0"])
                    err = err_buf.getvalue()
                    where = (path, value, err)
                    assert rc in (0, 1, 3), where
                    if rc:
                        check_refusal(rc, err, rc)
                    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) if out.exists() else []
                    assert not [x for x in left if x.endswith(".part")], where
                    assert left in ({0: [left], 1: [[], ["history.json"]], 3: [[]]}[rc]), where
                    seen.add(rc)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert seen == {0, 1, 3}  # the sweep reaches every outcome
