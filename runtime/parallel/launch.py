"""Start N local workers for one sequence-parallel run and bring rank 0's result back.

:func:`launch` runs ``fn(ctx, *args)`` in ``world_size`` fresh Python processes (``subprocess`` on
127.0.0.1, a free TCP port, the same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables
torchrun sets, so a worker runs exactly the torchrun code path). Rank 0's return value comes back to
the caller; nothing is returned, and nothing written by the caller, unless every worker exits cleanly.

Nothing touches the disk: each worker reads the pickled job from its stdin and sends its result or its error
back on a pipe of its own. The workers die with the launcher whatever ends it:

- a worker holds its stdin open to the launcher and a watchdog thread waits on it: end of file (the launcher
  is gone, or let it go) ends the worker at once;
- on Linux a worker also asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``);
- each worker leads a process group of its own, which the launcher stops (SIGTERM, SIGKILL after a grace
  period) on any way out of :func:`launch`: success, a failure, Ctrl-C or SIGTERM in the caller.

A worker's stderr is relayed through the launcher (a pseudo-terminal when the launcher's stderr is one, so
rank 0's progress bar draws as in one process), and an unfinished line (rank 0's progress) is ended before
:func:`launch` returns or raises: an error message never lands on it.

A worker that fails ends the run: the launcher sees its exit, stops the others and raises
:class:`WorkerFailed` naming the rank and its error. The root cause wins over the errors its peers see
afterwards (a lost connection): a worker that died without sending an error (killed, ``os._exit``) is the
cause; otherwise the earliest error sent. Collectives time out (``timeout_s``), and ``join_timeout_s`` bounds
the whole run, so nothing waits forever.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .group import DEFAULT_TIMEOUT_S, ParallelError

_POLL_S = 0.05
_GRACE_S = 5.0
_JOIN_S = 2.0  # how long the launcher waits for a pipe of a worker that is gone to drain

# The worker's first lines: die with the parent (Linux), then ``h3_blackwell`` is the package folder the parent
# imported it from (an installed package or a plain checkout), never another copy that the worker's sys.path
# might find first; then the entry. argv: rank, the result pipe's fd, the parent's pid.
_BOOT = """\
import os, sys, types
if sys.platform.startswith("linux"):
    try:
        import ctypes, signal
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:
        pass
if os.getppid() != int(sys.argv[3]):  # the parent died before the request above
    os._exit(1)
sys.path[:0] = {path!r}
pkg = types.ModuleType("h3_blackwell"); pkg.__path__ = [{root!r}]; sys.modules["h3_blackwell"] = pkg
from h3_blackwell.runtime.parallel.worker import main
sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
"""


class WorkerFailed(ParallelError):
    """A worker of a sequence-parallel run failed; ``rank`` and ``details`` (its traceback or exit) say how;
    ``internal``: the worker's error was a bug (not an H3Error refusal, not out of memory), which the CLI reports
    as an internal error."""

    def __init__(self, message: str, rank: int, details: str = "", internal: bool = False):
        super().__init__(message)
        self.rank, self.details, self.internal = rank, details, internal


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _package_root() -> str:
    """The folder of the package this module belongs to (installed or a plain checkout): runtime/parallel/ is two
    levels below it. (Importing the bare package here would close an import cycle through the ComfyUI entry.)"""
    return str(Path(__file__).resolve().parents[2])


def _worker_env(rank: int, world_size: int, port: int, extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------------------------
# the pipes: job in, result or error out, stderr relayed
# ---------------------------------------------------------------------------------------------

def frame(kind: bytes, body: bytes) -> bytes:
    """One message on a worker's result pipe: a kind byte (``R`` result, ``E`` error), the body's length, the body."""
    return kind + struct.pack("<Q", len(body)) + body


class _Inbox(threading.Thread):
    """Reads one worker's result pipe: ``result`` (the torch-saved bytes) or ``error`` (a dict) once a whole
    message has arrived (``got`` is set then), until the pipe's end."""

    def __init__(self, fd: int):
        super().__init__(daemon=True)
        self.fd, self.result, self.error = fd, None, None
        self.got = threading.Event()

    def _parse(self, buf: bytearray) -> None:
        if self.got.is_set() or len(buf) < 9:
            return
        n = struct.unpack("<Q", buf[1:9])[0]
        if len(buf) < 9 + n:
            return
        body = bytes(buf[9:9 + n])
        if buf[:1] == b"R":
            self.result = body
        else:
            self.error = json.loads(body.decode("utf-8", "replace"))
        self.got.set()

    def settle(self, timeout: float) -> None:
        """Wait until a whole message has arrived or the pipe has ended (at most ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while self.is_alive() and not self.got.is_set() and time.monotonic() < end:
            self.got.wait(0.01)

    def run(self) -> None:
        buf = bytearray()
        try:
            while chunk := os.read(self.fd, 1 << 20):
                buf += chunk
                self._parse(buf)
        except Exception:  # noqa: BLE001 - a broken pipe or no memory: the worker's exit status tells what happened
            pass
        finally:
            os.close(self.fd)


class _Console:
    """The launcher's stderr shared by the relays: knows whether a relayed line is still open (rank 0's progress
    bar), starts another relay's text on a line of its own, and ends the open line when asked. Once the run is
    being stopped (``mute``), what the workers still write (their peers' lost connections) is dropped."""

    def __init__(self, stream):
        self.stream, self.lock = stream, threading.Lock()
        self.open_by = None  # the relay whose line is unfinished
        self.muted = False

    def _put(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the launcher's stderr is gone: nothing to show the output on
            pass

    def write(self, who: int, text: str) -> None:
        with self.lock:
            if not text or self.muted:
                return
            if self.open_by not in (None, who):
                self._put("\n")
            self._put(text)
            self.open_by = None if text.endswith("\n") else who

    def mute(self) -> None:
        with self.lock:
            self.muted = True

    def end_line(self) -> None:
        with self.lock:
            if self.open_by is not None:
                self._put("\n")
                self.open_by = None


class _Relay(threading.Thread):
    """Copies one worker's stderr (a pipe or a pseudo-terminal) to the console until its end."""

    def __init__(self, fd: int, rank: int, console: _Console):
        super().__init__(daemon=True)
        self.fd, self.rank, self.console = fd, rank, console

    def run(self) -> None:
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            while chunk := os.read(self.fd, 65536):
                self.console.write(self.rank, dec.decode(chunk))
        except Exception:  # noqa: BLE001 - EIO: the pseudo-terminal's last writer is gone (or no memory left)
            pass
        finally:
            os.close(self.fd)


def _stderr_pair() -> tuple[int, int]:
    """(read end, write end) for a worker's stderr: a pseudo-terminal when ours is a terminal, else a pipe."""
    try:
        if sys.stderr.isatty():
            return os.openpty()
    except (AttributeError, ValueError, OSError):
        pass
    return os.pipe()


def _send(stdin, blob: bytes) -> None:
    """Write the job to a worker's stdin and keep it open (the worker's watchdog waits on it)."""
    try:
        stdin.write(struct.pack("<Q", len(blob)))
        stdin.write(blob)
        stdin.flush()
    except Exception:  # noqa: BLE001 - the worker is already gone (or no memory left): its exit status tells why
        pass


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------

def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its own group: anything it started goes too
    except (ProcessLookupError, PermissionError):
        pass
    except OSError:
        p.send_signal(sig)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate every live worker's process group, then kill what is still alive after the grace period (a
    worker already reaped is never signalled: its pid may belong to another process by now)."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _root_cause(inboxes: list[_Inbox], failed: dict[int, int]) -> WorkerFailed:
    """The failure to report among ``failed`` {rank: exit code}: a hard death first, else the earliest error."""
    for r in failed:  # an error is sent before the worker exits: let the pipe drain
        inboxes[r].settle(_JOIN_S)
    errors = {r: inboxes[r].error for r in failed if inboxes[r].error is not None}
    hard = [r for r in sorted(failed) if r not in errors]
    if hard:
        r = hard[0]
        return WorkerFailed(f"sequence-parallel worker rank {r} {_exit_text(failed[r])} without an error message "
                            "(out of memory or killed?); the run was stopped and nothing was written", r)
    r = min(errors, key=lambda k: errors[k]["time"])
    e = errors[r]
    if e.get("oom"):
        return WorkerFailed(f"sequence-parallel worker rank {r} ran out of memory ({e['type']}: {e['message']}); "
                            "lower the width, height, frames or text length, or use devices with more memory; the "
                            "run was stopped and nothing was written", r, e.get("traceback", ""))
    return WorkerFailed(f"sequence-parallel worker rank {r} failed: {e['type']}: {e['message']}; the run was "
                        "stopped and nothing was written", r, e.get("traceback", ""), internal=not e.get("refusal"))


_STOPPED_NOTE_S = 5.0  # a worker stopped this long (SIGSTOP, Ctrl-Z in its own terminal, a debugger) gets a note


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc; False where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        i = data.rindex(b")")  # the state follows the command name, which may itself hold ") "
        return data[i + 2:i + 3] in (b"T", b"t")
    except (OSError, ValueError):
        return False


class _StopWatch:
    """Notes on the console a worker that stays stopped: the others wait for it in a collective, which ends the
    run only after the collective timeout. It names the rank, the pid and what to do (SIGCONT, or end the run)."""

    def __init__(self, console, timeout_s: float):
        self.console, self.timeout_s = console, timeout_s
        self.since: dict[int, float] = {}
        self.noted: set[int] = set()

    def check(self, procs) -> None:
        now = time.monotonic()
        for r, p in enumerate(procs):
            if p.poll() is not None or not _stopped(p.pid):
                self.since.pop(r, None)
                self.noted.discard(r)
                continue
            t0 = self.since.setdefault(r, now)
            if now - t0 >= _STOPPED_NOTE_S and r not in self.noted:
                self.noted.add(r)
                self.console.write(-1, f"note: sequence-parallel worker rank {r} (pid {p.pid}) is stopped (SIGSTOP, "
                                       f"or a debugger); the other ranks wait for it. Send SIGCONT to pid {p.pid} to "
                                       f"resume, or interrupt the run (Ctrl-C) to end it; a collective waits at most "
                                       f"{self.timeout_s:.0f} s\n")


def _wait(procs, inboxes, join_timeout_s: float | None, watch: _StopWatch | None = None) -> None:
    deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
    while True:
        if watch is not None:
            watch.check(procs)
        codes = [p.poll() for p in procs]
        failed = {r: c for r, c in enumerate(codes) if c not in (None, 0)}
        if failed:
            time.sleep(_POLL_S)  # let peers that fail at the same moment send their errors too
            failed.update({r: c for r, p in enumerate(procs) if (c := p.poll()) not in (None, 0)})
            raise _root_cause(inboxes, failed)
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise ParallelError(f"the sequence-parallel run did not finish within {join_timeout_s:.0f} s; its "
                                f"{len(procs)} workers were stopped and nothing was written")
        time.sleep(_POLL_S)


def launch(fn: Callable[..., Any], args: tuple = (), world_size: int = 2, device_type: str = "cpu",
           timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float | None = None,
           env: dict | None = None) -> Any:
    """Run ``fn(ctx, *args)`` on ``world_size`` local ranks; returns rank 0's return value.

    fn: a module-level function (pickled by reference); ctx: the rank's ParallelContext. args and rank 0's
    result travel by pickle over pipes. device_type: "cuda" (NCCL, rank r on cuda:r) or "cpu" (gloo).
    timeout_s: the collective timeout; join_timeout_s: an optional bound on the whole run. env: extra variables
    for the workers. Raises WorkerFailed (a worker failed) or ParallelError (timeout); the workers are always
    gone, and their output lines ended, when this returns or raises.
    """
    blob = pickle.dumps({"fn": fn, "args": tuple(args), "device_type": device_type, "timeout_s": timeout_s})
    boot = _BOOT.format(path=[p for p in sys.path if p], root=_package_root())
    port = free_port()
    console = _Console(sys.stderr)
    procs: list[subprocess.Popen] = []
    inboxes: list[_Inbox] = []
    relays: list[_Relay] = []
    try:
        for r in range(world_size):
            res_r, res_w = os.pipe()
            err_r, err_w = _stderr_pair()
            try:
                p = subprocess.Popen([sys.executable, "-c", boot, str(r), str(res_w), str(os.getpid())],
                                     stdin=subprocess.PIPE, stderr=err_w, pass_fds=(res_w,), start_new_session=True,
                                     env=_worker_env(r, world_size, port, env))
            except BaseException:
                for fd in (res_r, err_r):
                    os.close(fd)
                raise
            finally:
                os.close(res_w)
                os.close(err_w)
            procs.append(p)
            inboxes.append(_Inbox(res_r))
            relays.append(_Relay(err_r, r, console))
            inboxes[-1].start()
            relays[-1].start()
        for p in procs:
            threading.Thread(target=_send, args=(p.stdin, blob), daemon=True).start()
        try:
            _wait(procs, inboxes, join_timeout_s, _StopWatch(console, timeout_s))
        except BaseException:  # a failure, a timeout, Ctrl-C or SIGTERM: the rest of the workers' output is noise
            console.mute()
            raise
        inboxes[0].settle(_JOIN_S)  # sent before rank 0 entered its last barrier
        if inboxes[0].result is None:
            raise WorkerFailed("sequence-parallel worker rank 0 exited without sending its result; nothing was "
                               "written", 0)
        return torch.load(io.BytesIO(inboxes[0].result), weights_only=False)
    finally:
        _stop(procs)
        for p in procs:
            try:
                p.stdin.close()
            except (OSError, ValueError):
                pass
        for t in relays + inboxes:
            t.join(_JOIN_S)
        console.end_line()
