"""The ComfyUI server as ``comfy-run`` reaches it: HTTP requests and the ``/ws`` websocket, under one deadline.

:class:`Client` speaks ComfyUI's HTTP API over http.client, one connection per request. Every socket operation
waits at most ``timeout`` (``--http-timeout``); each request's connect, headers and JSON body end within
``timeout`` of its start; everything ends by ``deadline`` (``--timeout`` after the command started), when
:class:`DeadlinePassed` says what was going on. :class:`WebSocket` is a small RFC 6455 client for the progress
feed. A server that cannot be reached, or answers what is not HTTP or not JSON, is a :class:`ServerError` with
one line that says what happened; server text in a message goes through :func:`show` first.

Standard library only; never imports ComfyUI.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import io
import ipaddress
import json
import math
import os
import re
import socket
import ssl
import struct
import threading
import time
import unicodedata
import urllib.parse

# ---------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------

class ServerError(RuntimeError):
    """The server could not be reached, or answered something that is not ComfyUI's API."""


class DeadlinePassed(ServerError):
    """``--timeout`` ran out during ``what`` (a request, or the wait between polls)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class FetchFailed(RuntimeError):
    """``/view`` answered an HTTP error for an output the history lists (exit 1)."""


class _Expired(Exception):
    """The active limit of a link (the request's or the deadline) passed before an operation could start."""


# ---------------------------------------------------------------------------------------------
# what the server says, made safe to show
# ---------------------------------------------------------------------------------------------

def unsafe_char(c: str) -> bool:
    """Control, format (but the joiners), surrogate and line/paragraph separator characters."""
    cat = unicodedata.category(c)
    return cat in ("Cc", "Cs", "Zl", "Zp") or (cat == "Cf" and c not in "\u200c\u200d")


def show(value, limit: int = 200) -> str:
    """Server text made safe for one terminal line: unsafe characters escaped (``\\x1b``), cut at ``limit``."""
    try:
        s = value if isinstance(value, str) else str(value)
    except RecursionError:
        s = f"<{json_kind(value)} nested too deeply to show>"
    cut = len(s) > limit
    s = "".join(c.encode("unicode_escape").decode("ascii") if unsafe_char(c) else c for c in s[:limit])
    return s + ("..." if cut else "")


def json_kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "a list" if isinstance(v, list) else "an object"


# ---------------------------------------------------------------------------------------------
# HTTP under a deadline
# ---------------------------------------------------------------------------------------------

MAX_JSON_BYTES = 256 << 20  # a ComfyUI answer (/object_info of a large install is tens of MB)
MAX_WS_MESSAGE = 16 << 20
CHUNK = 1 << 16


class _Link:
    """A connected socket read and written under a wall-clock ``limit`` (time.monotonic()): each operation waits
    at most ``op_timeout`` and never past ``limit``, so bytes that trickle in cannot stretch it."""

    def __init__(self, sock: socket.socket, op_timeout: float, limit: float):
        self.sock, self.op_timeout, self.limit = sock, op_timeout, limit
        self.readers, self.closing = 0, False

    def arm(self) -> None:
        left = self.limit - time.monotonic()
        if left <= 0:
            raise _Expired()
        self.sock.settimeout(min(self.op_timeout, left))

    def sendall(self, data) -> None:
        view = memoryview(data if isinstance(data, (bytes, bytearray)) else bytes(data)).cast("B")
        for i in range(0, len(view), CHUNK):
            self.arm()
            self.sock.sendall(view[i:i + CHUNK])

    def makefile(self, mode: str = "rb", *args, **kwargs):
        self.readers += 1
        return io.BufferedReader(_LinkReader(self), CHUNK)

    def close(self) -> None:
        """Like a socket with a file open on it: the socket closes once that file is closed too (http.client
        closes the connection of a response whose body is still to be read)."""
        self.closing = True
        if not self.readers:
            self.sock.close()

    def shut(self) -> None:
        """Close now: the exchange is over."""
        self.sock.close()


class _LinkReader(io.RawIOBase):
    def __init__(self, link: _Link):
        self.link = link

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.link.readers -= 1
            if self.link.closing and not self.link.readers:
                self.link.sock.close()
        super().close()

    def readinto(self, b) -> int:
        self.link.arm()
        return self.link.sock.recv_into(b)


class Client:
    """ComfyUI's HTTP API over http.client, one connection per request.

    Every request's connect, headers and JSON body end within ``timeout`` (``--http-timeout``) of its start,
    and everything ends by ``deadline`` (time.monotonic(); ``--timeout`` after the command started); each
    socket operation waits at most ``timeout``. A download's body is bounded by the deadline only."""

    def __init__(self, server: str, timeout: float = 30.0, deadline: float = math.inf, total: float | None = None):
        if "://" not in server:
            server = "http://" + server
        if not re.fullmatch(r"[\x21-\x7e]+", server):
            raise ValueError(f"--server {server!r}: expected a URL like http://127.0.0.1:8188 (no spaces or control "
                             "characters)")
        u = urllib.parse.urlsplit(server)
        try:
            port = u.port
        except ValueError:
            port = -1
        if u.scheme not in ("http", "https") or not u.hostname or port == -1 or u.username or u.query or u.fragment:
            raise ValueError(f"--server {server!r}: expected http://HOST:PORT or https://HOST[:PORT][/PATH] "
                             "(without credentials, query or fragment)")
        self.server = server.rstrip("/")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, port or (443 if self.https else 80)
        self.base = u.path.rstrip("/")
        self.timeout, self.deadline = timeout, deadline
        self.total = total

    # -- connections ---------------------------------------------------------------------------

    def _left(self, limit: float) -> float:
        left = limit - time.monotonic()
        if left <= 0:
            raise _Expired()
        return left

    def _resolve(self, limit: float) -> list:
        try:
            ipaddress.ip_address(self.host)
            return socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except ValueError:
            pass
        box: dict = {}

        def work():
            try:
                box["infos"] = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError as e:
                box["error"] = e

        t = threading.Thread(target=work, daemon=True)  # a name lookup has no timeout of its own
        t.start()
        t.join(self._left(limit))
        if t.is_alive():
            raise _Expired()
        if "error" in box:
            raise box["error"]
        return box["infos"]

    def _connect(self, limit: float) -> _Link:
        last: OSError = OSError("no address")
        for family, kind, proto, _, addr in self._resolve(limit):
            left = self._left(limit)
            s = socket.socket(family, kind, proto)
            try:
                s.settimeout(min(self.timeout, left))
                s.connect(addr)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.https:
                    s = self._tls(s, limit)
            except OSError as e:
                s.close()
                if time.monotonic() >= limit:
                    raise _Expired() from None
                last = e
                continue
            return _Link(s, self.timeout, limit)
        raise last

    def _tls(self, s: socket.socket, limit: float) -> socket.socket:
        """The TLS handshake, cut at ``limit`` (its reads each wait --http-timeout; a trickle would not end)."""
        def cut():
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self._left(limit), cut)
        timer.daemon = True
        timer.start()
        try:
            return ssl.create_default_context().wrap_socket(s, server_hostname=self.host)
        finally:
            timer.cancel()

    def _open(self, method: str, path: str, body: bytes | None, headers: dict, stage: list):
        """(connection, link, response with its headers read) for one request; ``stage[0]`` says how far it got."""
        link = self._connect(min(self.deadline, time.monotonic() + self.timeout))
        conn = (http.client.HTTPSConnection if self.https else http.client.HTTPConnection)(self.host, self.port)
        conn.sock = link  # http.client sends with sock.sendall and reads through sock.makefile: both bounded
        try:
            stage[0] = "send"
            conn.request(method, self.base + path, body=body, headers=headers)
            stage[0] = "headers"
            resp = conn.getresponse()
        except BaseException:
            link.shut()
            raise
        stage[0] = "body"
        return conn, link, resp

    @contextlib.contextmanager
    def _errors(self, method: str, path: str, stage: list):
        """Turns what a request can raise into ServerError (or DeadlinePassed) with one line that says what."""
        what = f"{method} {path.split('?')[0]}"
        try:
            yield
        except (_Expired, TimeoutError):
            if time.monotonic() >= self.deadline - 1e-3:
                raise DeadlinePassed(what) from None
            doing = {"connect": "accept a connection for", "send": "take the request", "headers": "answer",
                     "body": "finish its answer to"}[stage[0]]
            raise ServerError(f"{self.server} did not {doing} {what} within --http-timeout ({self.timeout:g} s); "
                              "it is not a ComfyUI that answers (or it is overloaded)") from None
        except http.client.IncompleteRead as e:
            more = f"{e.expected} more announced" if e.expected is not None else "a chunked body cut or malformed"
            raise ServerError(f"{self.server} closed the connection in the middle of its answer to {what} "
                              f"({len(e.partial)} bytes read, {more})") from None
        except http.client.RemoteDisconnected:
            raise ServerError(f"{self.server} closed the connection without answering {what}; it is not a ComfyUI "
                              "that answers") from None
        except http.client.HTTPException as e:  # BadStatusLine, LineTooLong, too many headers, ...
            seen = show(e.args[0] if e.args else type(e).__name__, 80)
            raise ServerError(f"{self.server} answered {what} with something that is not HTTP "
                              f"({type(e).__name__}: {seen}); check --server (ComfyUI listens on "
                              "http://127.0.0.1:8188 by default)") from None
        except ValueError as e:  # a chunk size that is not a number
            raise ServerError(f"{self.server} answered {what} with a malformed HTTP body ({show(e, 80)})") from None
        except OSError as e:
            reason = show(getattr(e, "strerror", None) or e, 120)
            if stage[0] == "connect":
                raise ServerError(f"cannot reach ComfyUI at {self.server} ({reason}); is it running? "
                                  "(python main.py --listen 127.0.0.1 --port 8188)") from None
            raise ServerError(f"{self.server} dropped the connection during {what} ({reason})") from None

    # -- requests --------------------------------------------------------------------------------

    def _read_body(self, resp, what: str) -> bytes:
        if resp.length is not None and resp.length > MAX_JSON_BYTES:
            raise ServerError(f"{self.server} announced an answer of {resp.length} bytes to {what}; a ComfyUI answer "
                              f"is at most {MAX_JSON_BYTES >> 20} MiB")
        parts, n = [], 0
        while True:
            chunk = resp.read(CHUNK)
            if not chunk:
                break
            n += len(chunk)
            if n > MAX_JSON_BYTES:
                raise ServerError(f"{self.server} sent more than {MAX_JSON_BYTES >> 20} MiB in answer to {what}; "
                                  "a ComfyUI answer is smaller")
            parts.append(chunk)
        if not resp.chunked and resp.length:  # read() returns b"" at a close short of Content-Length
            raise http.client.IncompleteRead(b"".join(parts), resp.length)
        return b"".join(parts)

    def request_json(self, path: str, payload=None) -> tuple[int, object]:
        """(HTTP status, decoded JSON) for GET (payload None) or POST; 4xx/5xx bodies are returned too. A body that
        is not JSON comes back as text."""
        method = "GET" if payload is None else "POST"
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Connection": "close", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        stage = ["connect"]
        link = None
        with self._errors(method, path, stage):
            try:
                conn, link, resp = self._open(method, path, body, headers, stage)
                status, raw = resp.status, self._read_body(resp, f"{method} {path}")
            finally:
                if link is not None:
                    link.shut()
        if not raw.strip():
            return status, ""
        try:
            return status, json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise ServerError(f"{self.server} answered {method} {path} with JSON nested too deeply to be ComfyUI's"
                              ) from None
        except (UnicodeDecodeError, ValueError):
            return status, raw.decode("utf-8", errors="replace")

    def not_comfy(self, method: str, path: str, status: int, data) -> ServerError:
        """The error for an answer that is not ComfyUI's API (an HTML page, other JSON, a 404)."""
        if isinstance(data, str):
            text = data.lstrip()[:200].lower()
            what = ("an empty body" if not text else "an HTML page" if text.startswith(("<!doctype", "<html", "<"))
                    else "text that is not JSON")
        elif isinstance(data, dict):
            keys = ", ".join(show(k, 30) for k in sorted(data)[:4])
            what = f"JSON without ComfyUI's fields ({keys or 'an empty object'})"
        else:
            what = f"JSON without ComfyUI's fields ({json_kind(data)})"
        return ServerError(f"{self.server} is not a ComfyUI server (or not its API port): {method} {path} answered "
                           f"HTTP {status} with {what}; check --server (ComfyUI listens on http://127.0.0.1:8188 "
                           "by default)")

    def get_json(self, path: str):
        status, data = self.request_json(path)
        if not isinstance(data, (dict, list)):
            raise self.not_comfy("GET", path, status, data)
        if status != 200:
            raise ServerError(f"{self.server} answered GET {path} with HTTP {status}: {show(data, 300)}; "
                              "this is not ComfyUI's API")
        return data

    def where(self, method: str, path: str) -> str:
        return f"{method} {path} on {self.server}"

    def download(self, filename: str, subfolder: str, kind: str, sink) -> int:
        """Stream ``GET /view`` into ``sink`` (a binary file; its write errors are the caller's); the byte count.
        FetchFailed when the server answers an HTTP error."""
        path = "/view?" + urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": kind})
        stage = ["connect"]
        link = None
        with self._errors("GET", path, stage):
            try:
                conn, link, resp = self._open("GET", path, None, {"Connection": "close"}, stage)
                if resp.status != 200:
                    raise FetchFailed(f"GET /view for {show(subfolder)}/{show(filename)} ({kind}) answered HTTP "
                                      f"{resp.status}")
                link.limit = self.deadline  # a large file takes what it takes, each read at most --http-timeout
                n = 0
                while True:
                    chunk = resp.read(CHUNK)
                    if not chunk:
                        break
                    sink(chunk)
                    n += len(chunk)
                if not resp.chunked and resp.length:
                    raise ServerError(f"{self.server} closed the connection in the middle of its answer to GET "
                                      f"/view ({n} bytes read, {resp.length} more announced)")
                return n
            finally:
                if link is not None:
                    link.shut()

    def sleep(self, seconds: float) -> None:
        """Sleep, or raise DeadlinePassed when the deadline comes first."""
        left = self.deadline - time.monotonic()
        if left <= seconds:
            time.sleep(max(left, 0.0))
            raise DeadlinePassed("the wait between /history polls")
        time.sleep(seconds)

    def ws_url(self, client_id: str) -> str:
        u = urllib.parse.urlsplit(self.server)
        scheme = "wss" if u.scheme == "https" else "ws"
        return urllib.parse.urlunsplit((scheme, u.netloc, u.path.rstrip("/") + "/ws",
                                        urllib.parse.urlencode({"clientId": client_id}), ""))

    def websocket(self, client_id: str) -> "WebSocket":
        return WebSocket(self, client_id)


# ---------------------------------------------------------------------------------------------
# the /ws progress feed (RFC 6455 client: text and binary messages, fragments, ping/pong, close)
# ---------------------------------------------------------------------------------------------

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class WsClosed(Exception):
    """The feed ended (a close frame, the connection closed, a protocol error, a stalled frame)."""


class WebSocket:
    """The progress feed of one client id. Best effort: a ServerError while connecting, or WsClosed later, means
    follow the run through /history instead; only the deadline (DeadlinePassed) ends the command."""

    def __init__(self, client: Client, client_id: str):
        self.client = client
        path = "/ws?" + urllib.parse.urlencode({"clientId": client_id})
        key = base64.b64encode(os.urandom(16)).decode()
        headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": key,
                   "Sec-WebSocket-Version": "13"}
        stage = ["connect"]
        with client._errors("GET", path, stage):
            self.conn, self.link, self.resp = client._open("GET", path, None, headers, stage)
        want = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        if self.resp.status != 101 or self.resp.getheader("Sec-WebSocket-Accept", "").strip() != want:
            self.link.shut()
            raise ServerError(f"GET /ws answered HTTP {self.resp.status}, not a websocket upgrade")
        self.fp = self.resp.fp
        self._parts: list[bytes] = []
        self._size = 0
        self._op: int | None = None

    def _read(self, n: int) -> bytes:
        data = self.fp.read(n)
        if len(data) < n:
            raise WsClosed("the server closed the websocket")
        return data

    def _payload(self, n: int, mask: bytes | None, keep: bool) -> bytes:
        out = []
        while n:
            chunk = self._read(min(n, CHUNK))
            n -= len(chunk)
            if keep:
                out.append(chunk)
        data = b"".join(out)
        if mask and data:
            m = (mask * (len(data) // 4 + 1))[:len(data)]
            data = (int.from_bytes(data, "big") ^ int.from_bytes(m, "big")).to_bytes(len(data), "big")
        return data

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        m = (mask * (len(payload) // 4 + 1))[:len(payload)]
        body = bytes(a ^ b for a, b in zip(payload, m))
        self.link.sendall(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + body)

    def _frame(self) -> tuple[int, bool, bytes] | None:
        """(opcode, fin, payload) of the next frame (the payload of an unwanted binary message is skipped)."""
        head = self._read(2)
        fin, rsv, op = head[0] & 0x80, head[0] & 0x70, head[0] & 0x0F
        masked, n = head[1] & 0x80, head[1] & 0x7F
        if rsv:
            raise WsClosed("a frame with reserved bits set")
        if n == 126:
            n = struct.unpack(">H", self._read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", self._read(8))[0]
            if n >> 63:
                raise WsClosed("a frame length with the top bit set")
        mask = self._read(4) if masked else None
        if op >= 0x8 and (n > 125 or not fin):
            raise WsClosed("a control frame that is long or fragmented")
        if op not in (0x0, 0x1, 0x2, 0x8, 0x9, 0xA):
            raise WsClosed(f"a frame of unknown opcode {op}")
        binary = op == 0x2 or (op == 0x0 and self._op == 0x2)
        if not binary and (op in (0x0, 0x1)) and self._size + n > MAX_WS_MESSAGE:
            raise WsClosed(f"a message of more than {MAX_WS_MESSAGE >> 20} MiB")
        return op, bool(fin), self._payload(n, mask, keep=not binary)

    def _message(self) -> bytes | None:
        """Reads frames until a message completes or a control frame was handled: the message's bytes when it
        is text, else None. WsClosed at the end of the feed."""
        while True:
            op, fin, data = self._frame()
            if op == 0x8:
                raise WsClosed("the server closed the websocket")
            if op == 0x9:
                self._send(0xA, data)
                return None
            if op == 0xA:
                return None
            if (op == 0x0) != (self._op is not None):
                raise WsClosed("a continuation frame out of place")
            if op != 0x0:
                self._op, self._parts, self._size = op, [], 0
            self._parts.append(data)
            self._size += len(data)
            if fin:
                kind, parts = self._op, self._parts
                self._op, self._parts, self._size = None, [], 0
                return b"".join(parts) if kind == 0x1 else None

    def recv(self, idle: float) -> dict | None:
        """The next message as a JSON object; None after ``idle`` seconds of silence; {} for anything else that
        arrived (a binary preview, a ping, text that is not a JSON object: custom nodes send their own). Once a
        frame begins, the message must complete within --http-timeout. WsClosed when the feed ends, breaks the
        protocol or trickles; DeadlinePassed at the deadline."""
        client = self.client
        self.link.op_timeout = max(idle, 1e-3)
        self.link.limit = min(client.deadline, time.monotonic() + idle)
        started = False
        try:
            first = self.fp.peek(1)[:1]  # wait for a frame to begin
            if first:
                started = True
                self.link.op_timeout = client.timeout
                self.link.limit = min(client.deadline, time.monotonic() + client.timeout)
                raw = self._message()
        except (_Expired, TimeoutError):
            if time.monotonic() >= client.deadline - 1e-3:
                raise DeadlinePassed("following the run on /ws") from None
            if not started:
                return None  # silence
            raise WsClosed(f"a message took longer than --http-timeout ({client.timeout:g} s)") from None
        except (OSError, ValueError, struct.error) as e:
            raise WsClosed(f"the connection failed ({show(e, 80)})") from None
        if not first:
            raise WsClosed("the server closed the websocket")
        if raw is None:
            return {}
        try:
            msg = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return {}
        return msg if isinstance(msg, dict) else {}

    def close(self) -> None:
        try:
            self.link.op_timeout, self.link.limit = 1.0, min(self.client.deadline, time.monotonic() + 1.0)
            self._send(0x8, struct.pack(">H", 1000))
        except Exception:  # noqa: BLE001 - best effort: the socket is closed next anyway
            pass
        self.link.shut()

