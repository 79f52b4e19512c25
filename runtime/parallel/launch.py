"""Start N local workers for one sequence-parallel run and bring rank 0's result back.

:func:`launch` runs ``fn(ctx, *args)`` in ``world_size`` fresh Python processes (``subprocess`` on
127.0.0.1, a free TCP port, the same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables
torchrun sets, so a worker runs exactly the torchrun code path). Rank 0's return value comes back to
the caller; nothing is returned, and nothing written by the caller, unless every worker exits cleanly.

A worker that fails ends the run: the launcher sees its exit, stops the others (SIGTERM, then SIGKILL
after a grace period) and raises :class:`WorkerFailed` naming the rank and its error. The root cause
wins over the errors its peers see afterwards (a lost connection): a worker that died without writing an
error (killed, ``os._exit``) is the cause; otherwise the earliest error written. Collectives time out
(``timeout_s``), and ``join_timeout_s`` bounds the whole run, so nothing waits forever.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .group import DEFAULT_TIMEOUT_S, ParallelError

_POLL_S = 0.05
_GRACE_S = 5.0
_RESULT = "result.pt"
_JOB = "job.pkl"

# The worker's first lines: ``h3_blackwell`` is the package folder the parent imported it from (an installed
# package or a plain checkout), never another copy that the worker's sys.path might find first; then the entry.
_BOOT = """\
import sys, types
sys.path[:0] = {path!r}
pkg = types.ModuleType("h3_blackwell"); pkg.__path__ = [{root!r}]; sys.modules["h3_blackwell"] = pkg
from h3_blackwell.runtime.parallel.worker import main
sys.exit(main(sys.argv[1], int(sys.argv[2])))
"""


class WorkerFailed(ParallelError):
    """A worker of a sequence-parallel run failed; ``rank`` and ``details`` (its traceback or exit) say how."""

    def __init__(self, message: str, rank: int, details: str = ""):
        super().__init__(message)
        self.rank, self.details = rank, details


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _package_root() -> str:
    import h3_blackwell  # the package this module was imported from (installed or a plain checkout)

    return str(Path(list(h3_blackwell.__path__)[0]).resolve())


def _worker_env(rank: int, world_size: int, port: int, extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env.update(extra or {})
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate every live worker, then kill what is still alive after the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _root_cause(jobdir: Path, failed: dict[int, int]) -> WorkerFailed:
    """The failure to report among ``failed`` {rank: exit code}: a hard death first, else the earliest error."""
    errors = {}
    for r in failed:
        f = jobdir / f"error-{r}.json"
        if f.exists():
            errors[r] = json.loads(f.read_text())
    hard = [r for r in sorted(failed) if r not in errors]
    if hard:
        r = hard[0]
        return WorkerFailed(f"sequence-parallel worker rank {r} {_exit_text(failed[r])} without an error message "
                            "(out of memory or killed?); the run was stopped and nothing was written", r)
    r = min(errors, key=lambda k: errors[k]["time"])
    e = errors[r]
    return WorkerFailed(f"sequence-parallel worker rank {r} failed: {e['type']}: {e['message']}; the run was "
                        "stopped and nothing was written", r, e.get("traceback", ""))


def _wait(procs, jobdir: Path, join_timeout_s: float | None) -> None:
    deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = {r: c for r, c in enumerate(codes) if c not in (None, 0)}
        if failed:
            time.sleep(_POLL_S)  # let peers that fail at the same moment write their errors too
            failed.update({r: c for r, p in enumerate(procs) if (c := p.poll()) not in (None, 0)})
            raise _root_cause(jobdir, failed)
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
    result travel by pickle. device_type: "cuda" (NCCL, rank r on cuda:r) or "cpu" (gloo). timeout_s: the
    collective timeout; join_timeout_s: an optional bound on the whole run. env: extra variables for the
    workers. Raises WorkerFailed (a worker failed) or ParallelError (timeout); the workers are always gone
    when this returns or raises.
    """
    jobdir = Path(tempfile.mkdtemp(prefix="h3-sp-"))
    procs: list[subprocess.Popen] = []
    try:
        with open(jobdir / _JOB, "wb") as f:
            pickle.dump({"fn": fn, "args": tuple(args), "device_type": device_type, "timeout_s": timeout_s}, f)
        boot = _BOOT.format(path=[p for p in sys.path if p], root=_package_root())
        port = free_port()
        for r in range(world_size):
            procs.append(subprocess.Popen([sys.executable, "-c", boot, str(jobdir), str(r)],
                                          env=_worker_env(r, world_size, port, env)))
        _wait(procs, jobdir, join_timeout_s)
        return torch.load(jobdir / _RESULT, weights_only=False)
    finally:
        _stop(procs)
        shutil.rmtree(jobdir, ignore_errors=True)
