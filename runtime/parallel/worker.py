"""The entry of one worker started by :func:`.launch.launch`: read the job from stdin, watch the launcher, join the
group, run the job, send rank 0's result back; on any error send it to the launcher and exit at once (never
wait on peers that may be gone).

The launcher keeps this worker's stdin open for the whole run; a watchdog thread waits on it and ends the
process the moment it closes (the launcher died, however it was killed, or stopped the run).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback

import torch

from ..errors import H3Error, is_out_of_memory
from .group import ParallelEnv, init_group
from .launch import frame


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError(f"the launcher closed the job pipe after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _watchdog(fd: int) -> None:
    """Block on the launcher's pipe; at its end (the launcher is gone) kill this process at once."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _send(fd: int, kind: bytes, body: bytes) -> None:
    data = memoryview(frame(kind, body))
    while data:
        data = data[os.write(fd, data):]


def _send_error(fd: int, rank: int, e: BaseException) -> None:
    tb = traceback.format_exc()
    msg = str(e).strip().splitlines()
    rec = {"rank": rank, "type": type(e).__name__, "message": msg[0] if msg else "", "traceback": tb,
           "time": time.time(), "oom": is_out_of_memory(e), "refusal": isinstance(e, H3Error)}
    _send(fd, b"E", json.dumps(rec).encode("utf-8"))  # the traceback travels too (WorkerFailed.details)


def main(rank: int, result_fd: int) -> int:
    """Run the job read from stdin as ``rank`` (the environment holds the torchrun variables); rank 0's return
    value goes to ``result_fd``. Exit status 0 or 1."""
    os.set_inheritable(result_fd, False)  # nothing this worker starts may hold the launcher's pipe open
    try:
        n = struct.unpack("<Q", _read_exact(0, 8))[0]
        job = pickle.loads(_read_exact(0, n))
        threading.Thread(target=_watchdog, args=(0,), daemon=True).start()
        penv = ParallelEnv.from_env(os.environ)
        if job["device_type"] == "cpu":  # the ranks share this machine's cores instead of each taking all of them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // penv.world_size))
        ctx = init_group(penv, job["device_type"], job["timeout_s"])
        result = job["fn"](ctx, *job["args"])
        if ctx.is_main:
            buf = io.BytesIO()
            torch.save(result, buf)
            _send(result_fd, b"R", buf.getvalue())
        ctx.barrier()  # nobody leaves before rank 0's result is sent
        ctx.destroy()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher, then end the process
        try:
            _send_error(result_fd, rank, e)
        finally:
            os._exit(1)  # skip interpreter teardown: a peer may be gone and a collective would block
    # Done: the result is sent and the group destroyed. Skip interpreter teardown here too: a native thread of the
    # collective library still being torn down at exit can abort the process ("terminate called without an active
    # exception", SIGABRT), which the launcher must treat as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
