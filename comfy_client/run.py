"""The ``comfy-run`` runner: one workflow run on a ComfyUI server, from the parsed arguments (``run(args)``; the
command line itself is ``cli/comfy_run.py``, whose help and module docstring give the steps, exit codes, time
limits and naming rules this module implements).

Steps: read the workflow (``comfy_client.workflow``), ``POST /prompt``, follow the run (``/ws`` with ``/history``
polling), print node errors, download every output (``/view``) into ``args.output`` beside ``history.json``,
all under one deadline. The connection (HTTP, the websocket, the deadline) is ``comfy_client.connection``.
Standard library only (http.client, json); never imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable

from .connection import (Client, DeadlinePassed, FetchFailed, ServerError, WebSocket, WsClosed, json_kind, show,
                         unsafe_char)
from .workflow import ConversionError, apply_overrides, load_workflow, ui_to_api

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------

class Malformed(ServerError):
    """The server answered JSON of the wrong shape, or a name that is not safe to use."""


class LocalWriteError(RuntimeError):
    """``--output`` cannot be written (exit 2)."""


# ---------------------------------------------------------------------------------------------
# what the server says: read with its types checked, names checked (shown through connection.show)
# ---------------------------------------------------------------------------------------------

def _field(parent: str, key) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{show(key, 60)}" if parent else show(key, 60)


class _Reader:
    """Reads one decoded answer (``where``: ``GET /history/ID from URL``); a value of the wrong JSON type is a
    :class:`Malformed` naming its field, what was expected and what was found."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str):
        raise Malformed(f"{self.where} answered malformed JSON: {field or 'the answer'} {problem}; this is not the "
                        "ComfyUI API this runner speaks (check --server, or update ComfyUI)")

    def need(self, value, types, field: str, expected: str):
        types = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            self.fail(field, f"is {json_kind(value)}, expected {expected}")
        return value

    def obj(self, value, field: str) -> dict:
        return self.need(value, dict, field, "an object")

    def lst(self, value, field: str) -> list:
        return self.need(value, list, field, "a list")

    def opt(self, obj: dict, key: str, types, field: str, expected: str):
        """``obj[key]`` when present and not null, checked; None otherwise."""
        value = obj.get(key)
        return None if value is None else self.need(value, types, _field(field, key), expected)

    def text(self, obj: dict, key: str, field: str, default: str = "") -> str:
        value = self.opt(obj, key, (str, int, float), field, "a string")
        return default if value is None else show(value, 500)


_WIN_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def _name_problem(name: str) -> str | None:
    """Why ``name`` (a file or folder name from the server) cannot be one path component on this OS and in a
    URL, or None."""
    if not name:
        return "is empty"
    if name in (".", ".."):
        return "is a relative path step"
    bad = next((c for c in name if unsafe_char(c)), None)
    if bad is not None:
        return f"contains the control character {bad.encode('unicode_escape').decode('ascii')}"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if ":" in name:
        return "contains ':' (a drive or stream name on Windows)"
    if len(name.encode("utf-8")) > 255:
        return "is longer than 255 bytes"
    if os.name == "nt" and (set(name) & set('<>"|?*') or name.rstrip(" .") != name
                            or name.split(".")[0].upper() in _WIN_RESERVED):
        return "is not a valid Windows file name"
    return None


def _subfolder_parts(sub: str) -> tuple[list[str], str | None]:
    """(the folder names of a server ``subfolder``, or why it is unsafe); ``/`` and ``\\`` both separate."""
    if sub.startswith(("/", "\\")):
        return [], "is an absolute path"
    parts = [p for p in re.split(r"[/\\]", sub) if p]
    if len(parts) > 32:
        return [], "is nested deeper than 32 folders"
    for p in parts:
        problem = _name_problem(p)
        if problem:
            return [], f"has a part {show(p, 60)!r} that {problem}"
    return parts, None


_PROMPT_ID = re.compile(r"[A-Za-z0-9._~:-]{1,128}")


def _prompt_id(value, reader: _Reader, field: str = "prompt_id") -> str:
    """The prompt id of an answer: a string of 1-128 URL-safe characters (ComfyUI's are UUIDs)."""
    reader.need(value, str, field, "a string")
    if not _PROMPT_ID.fullmatch(value) or set(value) == {"."}:
        raise Malformed(f"{reader.where} answered an unsafe {field} {show(value, 80)!r}: expected 1-128 letters, "
                        "digits, '.', '_', '~', ':' or '-' (ComfyUI's are UUIDs); refusing to use it in a URL")
    return value


# ---------------------------------------------------------------------------------------------
# reading ComfyUI's answers
# ---------------------------------------------------------------------------------------------

def _say(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def _node_error_lines(node_errors: dict, reader: _Reader, field: str) -> list[str]:
    """``node_errors`` of a /prompt answer -> one indented line per error (types checked)."""
    lines = []
    for node_id in sorted(node_errors, key=str):
        fld = _field(field, node_id)
        ne = reader.obj(node_errors[node_id], fld)
        cls = reader.text(ne, "class_type", fld, "?")
        errors = reader.opt(ne, "errors", list, fld, "a list") or []
        for i, e in enumerate(errors):
            efld = f"{_field(fld, 'errors')}[{i}]"
            reader.obj(e, efld)
            message, detail = reader.text(e, "message", efld), reader.text(e, "details", efld)
            extra = reader.opt(e, "extra_info", dict, efld, "an object") or {}
            name = reader.text(extra, "input_name", _field(efld, "extra_info"))
            where = f" [input {name}]" if name else ""
            lines.append(f"  node {show(node_id, 40)} ({cls}){where}: {message}" + (f": {detail}" if detail else ""))
    return lines


def format_node_errors(data: dict, reader: _Reader) -> str:
    """The 400 body of /prompt -> readable lines (Malformed when a field has the wrong type)."""
    err = data.get("error")
    if isinstance(err, dict):
        msg = reader.text(err, "message", "error") or reader.text(err, "type", "error") or "rejected"
        details = reader.text(err, "details", "error")
        head = f"ComfyUI rejected the prompt: {msg}" + (f" ({details})" if details else "")
    elif isinstance(err, str) or err is None:
        head = f"ComfyUI rejected the prompt: {show(err or 'rejected', 500)}"
    else:
        reader.fail("error", f"is {json_kind(err)}, expected an object or a string")
    node_errors = reader.opt(data, "node_errors", dict, "", "an object") or {}
    return "\n".join([head, *_node_error_lines(node_errors, reader, "node_errors")])


def _execution_failure(entry: dict, reader: _Reader, verbose: bool) -> str | None:
    """None when the run succeeded, else a readable reason from the history's status messages (every message
    is type-checked, not only up to the first failure)."""
    status = reader.opt(entry, "status", dict, "", "an object")
    if not status:
        return None  # very old servers write no status
    failure = None
    for i, m in enumerate(reader.opt(status, "messages", list, "status", "a list") or []):
        fld = f"status.messages[{i}]"
        reader.need(m, list, fld, "an [event, data] pair")
        if len(m) != 2:
            reader.fail(fld, f"has {len(m)} items, expected [event, data]")
        event = reader.need(m[0], str, fld + "[0]", "an event name")
        data = reader.need(m[1], dict, fld + "[1]", "an object")
        fld += "[1]"
        if event not in ("execution_error", "execution_interrupted"):
            continue
        node = f"node {reader.text(data, 'node_id', fld, '?')} ({reader.text(data, 'node_type', fld, '?')})"
        if event == "execution_error":
            etype = reader.text(data, "exception_type", fld, "error").rsplit(".", 1)[-1]
            raw = reader.opt(data, "exception_message", (str, int, float), fld, "a string")
            text = f"{node} failed: {etype}: {show(str(raw if raw is not None else '').strip(), 500)}"
            tb = reader.opt(data, "traceback", list, fld, "a list of lines") or []
            for j, line in enumerate(tb):
                reader.need(line, str, f"{_field(fld, 'traceback')}[{j}]", "a string")
            if verbose and tb:
                text += "".join(f"\n    {show(ln, 500)}" for chunk in tb for ln in chunk.splitlines())
            failure = failure or text
        elif event == "execution_interrupted":
            failure = failure or f"the run was interrupted at {node}"
    status_str = reader.opt(status, "status_str", str, "status", "a string")
    completed = reader.opt(status, "completed", bool, "status", "true/false")
    if failure:
        return failure
    if status_str == "success" or (completed and status_str is None):
        return None
    return f"the run ended with status {show(status_str)!r}"


class Output:
    """One output to write under --output: a file from /view (``filename``, ``subfolder``, ``kind``) or the text
    outputs of a node (``text``)."""

    def __init__(self, rel: Path, node: str, key: str, filename: str = "", subfolder: str = "", kind: str = "",
                 text: str | None = None):
        self.rel, self.node, self.key = rel, node, key
        self.filename, self.subfolder, self.kind, self.text = filename, subfolder, kind, text

    def ident(self) -> tuple:
        return ("text", self.node) if self.text is not None else (self.subfolder, self.filename, self.kind)


VIEW_TYPES = ("output", "temp", "input")  # the folders ComfyUI's /view serves


def plan_outputs(entry: dict, reader: _Reader) -> list[Output]:
    """Every output file and text the history entry reports, each name checked, each target path distinct."""
    outputs = reader.opt(entry, "outputs", dict, "", "an object") or {}
    plan = []
    for node_id in sorted(outputs, key=str):
        nfld = _field("outputs", node_id)
        ui = reader.obj(outputs[node_id], nfld)
        for key, items in ui.items():
            fld = _field(nfld, key)
            texts = []
            for i, item in enumerate(reader.lst(items, fld)):
                if isinstance(item, str):
                    texts.append(item)
                if not isinstance(item, dict) or "filename" not in item:
                    continue  # other values (animated: [false], ...) are not files
                ifld = f"{fld}[{i}]"
                name = reader.need(item["filename"], str, _field(ifld, "filename"), "a string")
                sub = reader.opt(item, "subfolder", str, ifld, "a string") or ""
                kind = reader.opt(item, "type", str, ifld, "a string")
                kind = "output" if kind is None else kind
                problem = _name_problem(name)
                if problem:
                    raise Malformed(f"{reader.where}: {_field(ifld, 'filename')} {show(name, 80)!r} {problem}; "
                                    "refusing to write it under --output")
                parts, problem = _subfolder_parts(sub)
                if problem:
                    raise Malformed(f"{reader.where}: {_field(ifld, 'subfolder')} {show(sub, 80)!r} {problem}; "
                                    "refusing to write outside --output")
                if kind not in VIEW_TYPES:
                    raise Malformed(f"{reader.where}: {_field(ifld, 'type')} {show(kind, 40)!r} is not one of "
                                    f"{', '.join(VIEW_TYPES)} (the folders ComfyUI's /view serves)")
                plan.append(Output(Path(*parts, name), str(node_id), str(key), name, sub, kind))
            if texts and key == "text":
                fname = f"node_{str(node_id).replace(':', '-')}_text.txt"
                problem = _name_problem(fname)
                if problem:
                    raise Malformed(f"{reader.where}: the node id {show(node_id, 80)!r} of {nfld} makes the file "
                                    f"name {show(fname, 80)!r}, which {problem}; refusing to write it")
                plan.append(Output(Path(fname), str(node_id), str(key), text="\n".join(texts) + "\n"))
    return _distinct(plan, reader)


def _distinct(plan: list[Output], reader: _Reader) -> list[Output]:
    """The plan without exact repeats; Malformed when two different outputs (or history.json) would share a
    path, or one output's path is another's folder."""
    files: dict[str, Output] = {}
    out = []
    for o in plan:
        key = o.rel.as_posix()
        if key == "history.json":
            raise Malformed(f"{reader.where}: an output of node {show(o.node, 40)} is named history.json, which "
                            "this runner writes itself; refusing to overwrite it")
        if key in files:
            if files[key].ident() != o.ident():
                raise Malformed(f"{reader.where}: two different outputs (nodes {show(files[key].node, 40)} and "
                                f"{show(o.node, 40)}) would both be written to {show(key, 120)}")
            continue
        files[key] = o
        out.append(o)
    folders = {p.as_posix() for o in out for p in o.rel.parents if p != Path(".")}
    clash = sorted(folders & set(files))
    if clash:
        raise Malformed(f"{reader.where}: {show(clash[0], 120)} is both an output file and the folder of another "
                        "output")
    return out


def _history_entry(client: Client, prompt_id: str) -> dict | None:
    """The prompt's history entry, or None while it is not recorded yet."""
    path = f"/history/{urllib.parse.quote(prompt_id, safe='')}"
    data = client.get_json(path)
    reader = _Reader(client.where("GET", path))
    reader.obj(data, "")
    if not data:
        return None
    if prompt_id not in data:
        keys = ", ".join(show(k, 40) for k in sorted(data)[:3])
        raise Malformed(f"{reader.where} answered the history of other prompts ({keys}) instead of {prompt_id}'s; "
                        "this is not ComfyUI's /history")
    return reader.obj(data[prompt_id], f"the entry of {prompt_id}")


def wait_history(client: Client, prompt_id: str, interval: float) -> dict:
    """Poll /history/<id> until the prompt is recorded; DeadlinePassed at the deadline."""
    while True:
        entry = _history_entry(client, prompt_id)
        if entry is not None:
            return entry
        client.sleep(interval)


def follow_ws(ws: WebSocket, client: Client, prompt_id: str, titles: dict, quiet: bool, idle: float) -> bool:
    """Print progress from the websocket until the prompt ends (True); every ``idle`` seconds, whatever the feed
    says, ask /history whether it ended (a feed can miss the end). False when the feed closed or broke first."""
    last_progress = ""
    next_poll = time.monotonic() + idle
    while True:
        wait = next_poll - time.monotonic()
        if wait <= 0:
            if _history_entry(client, prompt_id) is not None:
                return True
            next_poll = time.monotonic() + idle
            continue
        try:
            msg = ws.recv(wait)
        except WsClosed:
            return False
        if not msg:
            continue
        kind, data = msg.get("type"), msg.get("data")
        if not isinstance(data, dict):
            continue
        pid = data.get("prompt_id")
        if pid is not None and pid != prompt_id:
            continue
        if kind == "executing":
            node = data.get("node")
            if node is None:
                if pid == prompt_id:
                    return True
                continue
            title = titles.get(node, "?") if isinstance(node, str) else "?"
            _say(f"  running node {show(node, 40)} ({show(title, 60)})", quiet)
        elif kind == "progress":
            text = f"  node {show(data.get('node'), 40)}: {show(data.get('value'), 20)}/{show(data.get('max'), 20)}"
            if text != last_progress:
                _say(text, quiet)
                last_progress = text
        elif kind == "execution_cached" and isinstance(data.get("nodes"), list) and data["nodes"]:
            _say(f"  cached: nodes {', '.join(show(n, 40) for n in data['nodes'][:64])}", quiet)
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            return True


class _WsOpening:
    """The /ws handshake in a thread, begun before the prompt is submitted (so the feed is open when the run
    starts) without holding the submit up: the submit waits for it at most ``HEAD_START`` seconds, and a
    handshake still going when the prompt is queued is given up (the run is then followed through /history).
    A server that stalls both costs one --http-timeout, not two."""

    HEAD_START = 1.0

    def __init__(self, client: Client, client_id: str):
        self._lock = threading.Lock()
        self._ws: WebSocket | None = None
        self._why = "the handshake did not finish in time"
        self._given_up = False
        self._thread = threading.Thread(target=self._open, args=(client, client_id), daemon=True)
        self._thread.start()
        self._thread.join(min(self.HEAD_START, client.timeout))

    def _open(self, client: Client, client_id: str) -> None:
        try:
            ws = client.websocket(client_id)
        except Exception as e:  # noqa: BLE001 - any failure means: follow /history (the deadline is the main thread's)
            self._why = show(e, 300)
            return
        with self._lock:
            if self._given_up:
                ws.close()
            else:
                self._ws = ws

    def result(self) -> tuple[WebSocket | None, str]:
        """(the open feed, or None and why); never waits."""
        with self._lock:
            self._given_up = self._ws is None
            return self._ws, self._why

    def abandon(self) -> None:
        with self._lock:
            self._given_up = True
            ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()


def _check_object_info(graph: dict, object_info, reader: _Reader) -> None:
    """The parts of /object_info the converter reads, for the node types the graph uses, type-checked."""
    reader.obj(object_info, "")
    used = {n.get("type") for n in graph.get("nodes") or [] if isinstance(n, dict) and isinstance(n.get("type"), str)}
    for kind in sorted(used & set(object_info)):
        info = reader.obj(object_info[kind], _field("", kind))
        inputs = reader.opt(info, "input", dict, kind, "an object") or {}
        for sec in ("required", "optional"):
            sfld = _field(_field(kind, "input"), sec)
            for name, spec in (reader.opt(inputs, sec, dict, _field(kind, "input"), "an object") or {}).items():
                fld = _field(sfld, name)
                if isinstance(spec, list):
                    if not spec:
                        reader.fail(fld, "is an empty list, expected [type, options]")
                    reader.need(spec[0], (str, list), fld + "[0]", "a type name or a list of choices")
                else:
                    reader.need(spec, str, fld, "[type, options] or a type name")
        for sec, names in (reader.opt(info, "input_order", dict, kind, "an object") or {}).items():
            ofld = _field(_field(kind, "input_order"), sec)
            for i, n in enumerate(reader.lst(names, ofld)):
                reader.need(n, str, f"{ofld}[{i}]", "an input name")
        reader.opt(info, "display_name", str, kind, "a string")


# ---------------------------------------------------------------------------------------------
# writing: nothing partial
# ---------------------------------------------------------------------------------------------

class _Staging:
    """Files written under unique temporary names beside their targets. commit() renames them all into place;
    discard() removes the temporaries and the folders this run created, so a failure leaves nothing partial."""

    def __init__(self, root: Path):
        self.root = root
        self.made: list[Path] = []
        self.temps: list[tuple[Path, Path]] = []

    @contextlib.contextmanager
    def _local(self, path: Path):
        try:
            yield
        except OSError as e:
            raise LocalWriteError(f"cannot write {path}: {e.strerror or e}; check --output") from None

    def _folder(self, rel_dir: Path) -> Path:
        target = self.root / rel_dir
        missing, p = [], target
        while not p.is_dir() and p != p.parent:
            missing.append(p)
            p = p.parent
        with self._local(target):
            for d in reversed(missing):
                d.mkdir()
                self.made.append(d)
        return target

    def write(self, rel: Path, fill: Callable[[Callable[[bytes], Any]], Any]):
        """Create a temporary beside ``root/rel`` and call ``fill(write)``; returns what fill returns."""
        dst = self.root / rel
        with self._local(dst):
            for attempt in range(3):  # another run may remove a folder it made between our check and our open
                folder = self._folder(rel.parent)
                tmp = folder / f".comfy-run-{uuid.uuid4().hex}.part"
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
            self.temps.append((tmp, dst))
            f = os.fdopen(fd, "wb")
        with f:
            def write(data: bytes):
                with self._local(dst):
                    f.write(data)

            result = fill(write)
            with self._local(dst):
                f.flush()
                os.fsync(f.fileno())
        return result

    def commit(self) -> None:
        for _, dst in self.temps:
            if dst.is_dir() and not dst.is_symlink():
                raise LocalWriteError(f"cannot write {dst}: a folder of that name is in the way; check --output")
        for tmp, dst in self.temps:
            with self._local(dst):
                os.replace(tmp, dst)
        self.temps, self.made = [], []

    def discard(self) -> None:
        for tmp, _ in self.temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        for d in reversed(self.made):
            with contextlib.suppress(OSError):
                d.rmdir()
        self.temps, self.made = [], []


def _output_problem(out: Path) -> str | None:
    """Why --output cannot be written (checked before anything is sent), or None."""
    if out.is_symlink() and not out.exists():
        return f"--output {out} is a symlink to nothing (or a symlink loop)"
    if out.exists():
        if not out.is_dir():
            return f"--output {out} exists and is not a folder"
        return None if os.access(out, os.W_OK | os.X_OK) else f"--output {out} is not writable"
    for p in out.absolute().parents:
        if os.path.lexists(p):
            if not p.is_dir():
                return f"--output {out}: {p} is not a folder"
            return None if os.access(p, os.W_OK | os.X_OK) else f"--output {out}: {p} is not writable"
    return None


def fetch_outputs(client: Client, plan: list[Output], staging: _Staging, quiet: bool) -> None:
    """Download every planned file and write every text into ``staging`` (not yet committed)."""
    for o in plan:
        if o.text is not None:
            staging.write(o.rel, lambda write, o=o: write(o.text.encode("utf-8", errors="backslashreplace")))
            continue
        n = staging.write(o.rel, lambda write, o=o: client.download(o.filename, o.subfolder, o.kind, write))
        _say(f"  fetched {o.rel.as_posix()} ({n} bytes) from node {show(o.node, 40)} [{show(o.key, 40)}]", quiet)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------

def _time_problem(args) -> str | None:
    for flag, value, low in (("--timeout", args.timeout, 0.0), ("--http-timeout", args.http_timeout, 0.0),
                             ("--poll-interval", args.poll_interval, None)):
        if not math.isfinite(value) or (value <= low if low is not None else value < 0):
            return f"{flag} {value:g}: expected a finite number of seconds" + (" above 0" if low is not None else "")
    return None


def _deadline_message(e: DeadlinePassed, client: Client, state: dict) -> str:
    t = f"--timeout ({client.total:g} s)"
    pid = state.get("prompt_id")
    if state["phase"] == "submit":
        return f"{t} ran out during {e.what} on {client.server}, before the prompt was queued"
    if state["phase"] == "wait":
        return (f"prompt {pid} did not finish in time: {t} ran out during {e.what}; it may still be running on the "
                "server (POST /interrupt stops it)")
    return f"prompt {pid} succeeded but {t} ran out while fetching its outputs ({e.what}); nothing was written"


def _submit(client: Client, prompt: dict, extra: dict, state: dict) -> int | None:
    """POST /prompt; None when queued (state['prompt_id'] set), else the exit status of a rejection."""
    client_id = state["client_id"]
    body = {"prompt": prompt, "client_id": client_id}
    if extra:
        body["extra_data"] = extra
    status, answer = client.request_json("/prompt", body)
    reader = _Reader(client.where("POST", "/prompt"))
    if status == 200 and isinstance(answer, dict) and "prompt_id" in answer:
        state["prompt_id"] = _prompt_id(answer["prompt_id"], reader)
        node_errors = reader.opt(answer, "node_errors", dict, "", "an object")
        if node_errors:  # queued, but some output nodes failed validation and will not run
            lines = _node_error_lines(node_errors, reader, "node_errors")
            print("\n".join(["warning: some outputs will not run", *lines]), file=sys.stderr)
        return None
    if status == 400 and isinstance(answer, dict) and {"error", "node_errors"} & set(answer):
        _error(format_node_errors(answer, reader))
        return EXIT_FAILED
    raise client.not_comfy("POST", "/prompt", status, answer)


class _Usage(Exception):
    """A refusal of the user's input found while preparing the prompt (exit 2); already worded."""


def _prompt_of(args, client: Client, kind: str, data: dict) -> tuple[dict, dict]:
    """(the API prompt with --set applied, extra_data): a UI graph converted with the server's /object_info."""
    extra = {}
    if kind == "ui":
        object_info = client.get_json("/object_info")
        _check_object_info(data, object_info, _Reader(client.where("GET", "/object_info")))
        try:
            prompt = ui_to_api(data, object_info)
        except ConversionError as e:
            raise _Usage(f"cannot convert the UI workflow {args.workflow} to API format: {e}") from None
        except (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError) as e:
            raise _Usage(f"cannot convert the UI workflow {args.workflow} to API format: the graph is malformed "
                         f"({type(e).__name__}: {show(e, 120)}); re-save it in the editor or export API format"
                         ) from None
        extra = {"extra_pnginfo": {"workflow": data}}
        _say(f"converted the UI workflow to an API prompt of {len(prompt)} nodes", args.quiet)
    else:
        prompt = data
    try:
        apply_overrides(prompt, args.set or [])
    except ValueError as e:
        raise _Usage(str(e)) from None
    return prompt, extra


def _queue_and_follow(args, client: Client, prompt: dict, extra: dict, state: dict) -> int | None:
    """Submit the prompt and follow it (the /ws feed when it opens, else nothing) until it ends or the feed
    drops; None when queued (state['prompt_id']), else the exit status of a rejection."""
    titles = {k: v.get("class_type", "?") for k, v in prompt.items()}
    state["client_id"] = args.client_id or uuid.uuid4().hex
    opening = None if args.no_websocket else _WsOpening(client, state["client_id"])
    try:
        rejected = _submit(client, prompt, extra, state)
        if rejected is not None:
            return rejected
        _say(f"queued prompt {state['prompt_id']} on {client.server}", args.quiet)
        state["phase"] = "wait"
        ws, why = opening.result() if opening is not None else (None, "")
        if opening is not None and ws is None:
            _say(f"websocket unavailable ({why}); following the run through /history", args.quiet)
        if ws is not None and not follow_ws(ws, client, state["prompt_id"], titles, args.quiet,
                                            idle=max(args.poll_interval, 2.0)):
            _say("websocket closed; following the run through /history", args.quiet)
        return None
    finally:
        if opening is not None:
            opening.abandon()


def _write_results(args, client: Client, entry: dict, out_dir: Path, staging: _Staging, state: dict) -> int:
    """Check the whole history entry, then write history.json alone (a failed run) or with every output."""
    prompt_id = state["prompt_id"]
    reader = _Reader(client.where("GET", f"/history/{prompt_id}"))
    failure = _execution_failure(entry, reader, args.verbose)  # everything is checked before anything is written
    plan = plan_outputs(entry, reader)
    try:
        history = (json.dumps({prompt_id: entry}, indent=2) + "\n").encode("utf-8", errors="backslashreplace")
    except (RecursionError, ValueError):
        raise Malformed(f"{reader.where} answered a history entry nested too deeply to be ComfyUI's") from None
    if failure:
        staging.write(Path("history.json"), lambda write: write(history))
        staging.commit()
        _error(failure)
        return EXIT_FAILED
    state["phase"] = "fetch"
    try:
        fetch_outputs(client, plan, staging, args.quiet)
    except FetchFailed as e:
        _error(f"the prompt succeeded but an output could not be fetched: {e}; nothing was written")
        return EXIT_FAILED
    except DeadlinePassed:
        raise
    except ServerError as e:
        raise ServerError(f"the prompt succeeded but an output could not be fetched: {e}; nothing was written"
                          ) from None
    staging.write(Path("history.json"), lambda write: write(history))
    staging.commit()
    print(f"prompt {prompt_id} succeeded: {len(plan)} output file(s) in {out_dir}")
    return EXIT_OK


def _run(args, client: Client, kind: str, data: dict, out_dir: Path, staging: _Staging, state: dict) -> int:
    try:
        prompt, extra = _prompt_of(args, client, kind, data)
    except _Usage as e:
        _error(str(e))
        return EXIT_USAGE
    rejected = _queue_and_follow(args, client, prompt, extra, state)
    if rejected is not None:
        return rejected
    entry = wait_history(client, state["prompt_id"], args.poll_interval)
    return _write_results(args, client, entry, out_dir, staging, state)


def run(args) -> int:
    start = time.monotonic()
    problem = _time_problem(args)
    if problem:
        _error(problem)
        return EXIT_USAGE
    try:
        kind, data = load_workflow(args.workflow)
        client = Client(args.server, timeout=args.http_timeout, deadline=start + args.timeout, total=args.timeout)
    except ValueError as e:
        _error(str(e))
        return EXIT_USAGE
    out_dir = Path(args.output)
    problem = _output_problem(out_dir)
    if problem:
        _error(f"{problem}; choose a folder that can be written")
        return EXIT_USAGE
    staging = _Staging(out_dir)
    state = {"phase": "submit", "prompt_id": None}
    try:
        return _run(args, client, kind, data, out_dir, staging, state)
    except DeadlinePassed as e:
        _error(_deadline_message(e, client, state))
        return EXIT_UNREACHABLE
    except ServerError as e:
        _error(str(e))
        return EXIT_UNREACHABLE
    except LocalWriteError as e:
        _error(str(e))
        return EXIT_USAGE
    finally:
        staging.discard()
