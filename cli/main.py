"""``h3-blackwell``: generate | forward | make-tiny | quantize | tune-fc2 | comfy-run.

Every refusal ends as one line ``error: what was expected, what was found, what to do`` on stderr and exit
status 2; nothing partial is written. An unexpected exception ends as ``error: internal: ...`` and exit
status 1 (with its traceback only under ``--debug`` or ``H3_DEBUG=1``). Ctrl-C ends as one line and exit
status 130, SIGTERM likewise with exit status 143 and SIGHUP (the terminal closed) with 129, during the imports
too: the interruption unwinds through every writer's cleanup, so no temporary file, no partial output and no
worker process is left. A signal that arrives while an output is being moved into place is held back until it is
whole; the line then names it instead of saying nothing was written. Further signals are ignored while the
first one's cleanup runs, and, for the process's own command (``main()`` without ``argv``), until it has exited,
so a second Ctrl-C cannot turn the exit status into a traceback.

A reader that goes away (``h3-blackwell ... | head -1``, a closed terminal) costs the command nothing: what it
would still print there is dropped (one note on stderr when stdout went), the work goes on and the exit status is
the work's.

Only the standard library is imported at module level: torch and the runtime are imported inside ``main``
(``cli.commands``), so an interrupt or a broken install during those imports takes the same error path.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import traceback

from . import progress
from .parser import EXIT_USAGE, build_parser

EXIT_INTERNAL, EXIT_HUNG_UP, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 129, 130, 143
_STOPS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is: every cleanup an interruption runs
    (temporary files, sequence-parallel workers) runs for it too."""


class HungUp(Terminated):
    """SIGHUP (the controlling terminal closed, an ssh session dropped): ends the command as SIGTERM does."""


def _take_stops(handler) -> dict:
    """``handler`` for SIGINT / SIGTERM / SIGHUP, except those the caller ignores (nohup, a background job: they
    stay ignored) -> the previous handlers, for :func:`_put_back`. Main thread only."""
    prev = {s: signal.getsignal(s) for s in _STOPS}
    for s, h in prev.items():
        if h is not signal.SIG_IGN:
            signal.signal(s, handler)
    return prev


def _put_back(prev: dict) -> None:
    """The handlers :func:`_take_stops` replaced (None: one set outside Python, which cannot be put back)."""
    for s, h in prev.items():
        if h is not None:
            signal.signal(s, h)


def _ignore(signum, frame) -> None:
    """A Python-level no-op (not SIG_IGN: a signal already pending when the handler changes to SIG_IGN makes
    Python print "Signal N ignored due to race condition" with a traceback)."""


def _interruption(signum: int) -> KeyboardInterrupt:
    if signum == getattr(signal, "SIGHUP", None):
        return HungUp()
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _raise_interrupt(signum, frame) -> None:
    """SIGINT -> KeyboardInterrupt, SIGTERM -> Terminated, SIGHUP -> HungUp, once: the cleanup this starts
    (temporary files, workers) must not be cut short by a second signal, so all three are ignored until the command
    has returned."""
    _take_stops(_ignore)
    raise _interruption(signum)


def _interrupt_line(e: BaseException) -> tuple[str, int]:
    what, code = (("hung up", EXIT_HUNG_UP) if isinstance(e, HungUp) else
                  ("terminated", EXIT_TERMINATED) if isinstance(e, Terminated) else ("interrupted", EXIT_INTERRUPTED))
    written = getattr(e, "written", None)  # the signal came while an output was moved in: it is whole
    return (f"{what} after {written} was written whole" if written else f"{what}; nothing was written"), code


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "tune-fc2":
        from .tune_fc2 import main as tune_main

        return int(tune_main(argv[1:]) or 0)
    if argv and argv[0] == "comfy-run":
        from .comfy_run import main as run_main

        return int(run_main(argv[1:]) or 0)
    if argv and argv[0] == "generate":  # its flags check values against the runtime's choices: import it here,
        _import_commands()               # under the interrupt handler, not inside argparse
    a = build_parser().parse_args(argv)
    a.argv = list(argv)  # the flags as given (generate's --preset fills only the ones not given)
    return getattr(_import_commands(), a.fn)(a)


def _exit_interrupted(signum, frame) -> None:
    """SIGINT, SIGTERM or SIGHUP while torch and the runtime are being imported: nothing has been written yet, and
    import code of other packages may swallow a KeyboardInterrupt (a bare ``except``), so end the process here,
    at once."""
    line, code = _interrupt_line(_interruption(signum))
    progress.end_line()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)


def _import_commands():
    """cli.commands (torch and the runtime), imported under :func:`_exit_interrupted` where this is the main
    thread (only it receives signals); the previous SIGINT handler is back before any command runs."""
    if threading.current_thread() is not threading.main_thread():
        from . import commands

        return commands
    prev = _take_stops(_exit_interrupted)
    try:
        from . import commands
    finally:
        _put_back(prev)
    return commands


def _one_line(e: BaseException) -> str:
    return " | ".join(line.strip() for line in str(e).strip().splitlines() if line.strip()) or type(e).__name__


def _refusal_types() -> tuple:
    """The exceptions that are the user's to fix (exit 2): H3Error and the OS's file errors."""
    try:
        from ..runtime import H3Error
    except Exception:  # a broken install: everything is internal then
        return (OSError, MemoryError)
    return (H3Error, OSError, MemoryError, NotImplementedError)


def _is_out_of_memory(e: BaseException) -> bool:
    try:
        from ..runtime import is_out_of_memory
    except Exception:  # a broken install
        return isinstance(e, MemoryError)
    return is_out_of_memory(e)


def _report(e: Exception, debug: bool) -> int:
    progress.end_line()
    try:
        from ..runtime import Interrupted
    except Exception:
        Interrupted = ()
    if isinstance(e, Interrupted):
        print(f"interrupted: {_one_line(e)}; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    oom = _is_out_of_memory(e)  # CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, MemoryError, ...
    if debug:
        traceback.print_exc(file=sys.stderr)
        details = getattr(e, "details", None)  # a sequence-parallel worker's own traceback (WorkerFailed)
        if isinstance(details, str) and details.strip():
            sys.stderr.write(f"the worker's traceback:\n{details.rstrip()}\n")
    if oom:
        print(f"error: out of memory ({_one_line(e)}); lower --width/--height/--frames or use a device with more "
              "memory", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, _refusal_types()) and not getattr(e, "internal", False):  # a worker's bug is internal too
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"error: internal: {type(e).__name__}: {_one_line(e)} (run with --debug or H3_DEBUG=1 for the "
          "traceback and report it)", file=sys.stderr)
    return EXIT_INTERNAL


def _handle_signals():
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt / :class:`Terminated` / :class:`HungUp` in the main
    thread while a command runs (:func:`_raise_interrupt`); returns what puts the previous handlers back (nothing
    to do off the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    prev = _take_stops(_raise_interrupt)
    return lambda: _put_back(prev)




class _Sink:
    """sys.stdout / sys.stderr while a command runs: the stream, except that once its reader is gone (a broken pipe,
    a hung-up terminal) every later write is dropped instead of raising. Its file descriptor then points at
    /dev/null, so what the stream still buffers, and the interpreter's flush at exit, go nowhere quietly."""

    def __init__(self, stream, on_gone=None):
        self._stream, self._on_gone, self.gone = stream, on_gone, False
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError, OSError):
            tty = False
        # the reader closed the pipe; a terminal that hung up answers EIO (elsewhere EIO is a real I/O error)
        self._gone_errnos = {errno.EPIPE, errno.EIO} if tty else {errno.EPIPE}

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _call(self, fn, *args):
        if self.gone:
            return None
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in self._gone_errnos:
                raise
        self.gone = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()
        except Exception:  # noqa: BLE001 - no file descriptor (a test's capture): nothing more to quiet
            pass
        if self._on_gone is not None:
            self._on_gone()
        return None

    def write(self, text):
        n = self._call(self._stream.write, text)
        return len(text) if n is None else n

    def writelines(self, lines):
        for ln in lines:
            self.write(ln)

    def flush(self):
        self._call(self._stream.flush)


def _stdout_gone() -> None:
    progress.end_line()
    sys.stderr.write("note: standard output was closed (its reader exited); what the command prints there is "
                     "dropped and the command goes on\n")
    sys.stderr.flush()


def _sinks():
    """Wrap sys.stdout and sys.stderr in :class:`_Sink` for a command; returns what puts them back."""
    out, err = sys.stdout, sys.stderr
    if threading.current_thread() is not threading.main_thread():  # the streams are the process's: not ours there
        return lambda: None
    if out is not None:
        sys.stdout = _Sink(out, _stdout_gone)
    if err is not None:
        sys.stderr = _Sink(err)

    def restore():
        sys.stdout, sys.stderr = out, err
    return restore


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 internal error, 2 refused, 129 hung up, 130 interrupted,
    143 terminated). ``argv`` None: the process's own command line (the module docstring says what changes)."""
    debug = False
    own_process = argv is None  # the console script, python -m h3_blackwell.cli
    interrupted = False
    restore = _handle_signals()
    restore_streams = _sinks()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv or os.environ.get("H3_DEBUG", "").strip() not in ("", "0")
        if argv and argv[0] not in ("tune-fc2", "comfy-run"):
            argv = [x for x in argv if x != "--debug"]
        return _dispatch(argv)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (Terminated)
        interrupted = True
        progress.end_line()
        line, code = _interrupt_line(e)
        print(line, file=sys.stderr)
        sys.stderr.flush()
        return code
    except SystemExit as e:  # argparse: --help (0) or a usage error already printed as "error: ..." (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except Exception as e:
        return _report(e, debug)
    finally:
        for stream in (sys.stdout, sys.stderr):  # what is still buffered, while a gone reader is still quiet
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        restore_streams()
        if interrupted and own_process and threading.current_thread() is threading.main_thread():
            # the process is ending: a later signal must not end it another way
            _take_stops(_ignore)
            # and blocked in this thread until it exits: the interpreter's finalization puts SIG_DFL back for Python
            # handlers. This narrows, not closes, that window: a thread started earlier (torch's) that does not
            # block them can still take one then, and the process then ends by that signal
            if hasattr(signal, "pthread_sigmask"):
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        else:
            restore()


if __name__ == "__main__":
    sys.exit(main())
