"""``h3-blackwell``: generate | forward | make-tiny | quantize | tune-fc2 | comfy-run.

Every refusal ends as one line ``error: what was expected, what was found, what to do`` on stderr and exit
status 2; nothing partial is written. An unexpected exception ends as ``error: internal: ...`` and exit
status 1 (with its traceback only under ``--debug`` or ``H3_DEBUG=1``). Ctrl-C ends as one line and exit
status 130, SIGTERM likewise with exit status 143, during the imports too: the interruption unwinds through
every writer's cleanup, so no temporary file, no partial output and no worker process is left.

Only the standard library is imported at module level: torch and the runtime are imported inside ``main``
(``cli.commands``), so an interrupt or a broken install during those imports takes the same error path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

from . import progress
from .parser import EXIT_USAGE, build_parser

EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is: every cleanup an interruption runs
    (temporary files, sequence-parallel workers) runs for it too."""


def _ignore(signum, frame) -> None:
    """A Python-level no-op (not SIG_IGN: a signal already pending when the handler changes to SIG_IGN makes
    Python print "Signal N ignored due to race condition" with a traceback)."""


def _raise_interrupt(signum, frame) -> None:
    """SIGINT -> KeyboardInterrupt, SIGTERM -> Terminated, once: the cleanup this starts (temporary files, workers)
    must not be cut short by a second signal, so both are ignored until the command has returned."""
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _interrupt_line(e: BaseException) -> tuple[str, int]:
    if isinstance(e, Terminated):
        return "terminated; nothing was written", EXIT_TERMINATED
    return "interrupted; nothing was written", EXIT_INTERRUPTED


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
    return getattr(_import_commands(), a.fn)(a)


def _exit_interrupted(signum, frame) -> None:
    """SIGINT or SIGTERM while torch and the runtime are being imported: nothing has been written yet, and
    import code of other packages may swallow a KeyboardInterrupt (a bare ``except``), so end the process here,
    at once."""
    line, code = _interrupt_line(Terminated() if signum == signal.SIGTERM else KeyboardInterrupt())
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
    prev = signal.signal(signal.SIGINT, _exit_interrupted)
    prev_term = signal.signal(signal.SIGTERM, _exit_interrupted)
    try:
        from . import commands
    finally:
        signal.signal(signal.SIGINT, prev)
        signal.signal(signal.SIGTERM, prev_term)
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
    """SIGINT and SIGTERM raise KeyboardInterrupt / :class:`Terminated` in the main thread while a command runs
    (:func:`_raise_interrupt`); returns what puts the previous handlers back (nothing to do off the main thread,
    where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, h in prev.items():
        if h is not signal.SIG_IGN:  # a signal the caller ignores (nohup, a background job) stays ignored
            signal.signal(s, _raise_interrupt)
    return lambda: [signal.signal(s, h) for s, h in prev.items() if h is not None]


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 internal error, 2 refused, 130 interrupted, 143
    terminated)."""
    debug = False
    restore = _handle_signals()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv or os.environ.get("H3_DEBUG", "").strip() not in ("", "0")
        if argv and argv[0] not in ("tune-fc2", "comfy-run"):
            argv = [x for x in argv if x != "--debug"]
        return _dispatch(argv)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        progress.end_line()
        line, code = _interrupt_line(e)
        print(line, file=sys.stderr)
        return code
    except SystemExit as e:  # argparse: --help (0) or a usage error already printed as "error: ..." (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except Exception as e:
        return _report(e, debug)
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
