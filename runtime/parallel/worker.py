"""The entry of one worker started by :func:`.launch.launch`: join the group, run the job, hand back rank 0's
result; on any error write it for the launcher and exit at once (never wait on peers that may be gone)."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

import torch

from ..errors import H3Error
from .group import ParallelEnv, init_group


def _write_error(jobdir: Path, rank: int, e: BaseException) -> None:
    tb = traceback.format_exc()
    rec = {"rank": rank, "type": type(e).__name__, "message": str(e).strip().splitlines()[0] if str(e).strip() else "",
           "traceback": tb, "time": time.time()}
    tmp = jobdir / f".error-{rank}.json"
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, jobdir / f"error-{rank}.json")
    if not isinstance(e, H3Error):  # a bug rather than a user error: the traceback is what a developer needs
        sys.stderr.write(f"[rank {rank}] {tb}")
        sys.stderr.flush()


def main(jobdir: str, rank: int) -> int:
    """Run the job in ``jobdir`` as ``rank`` (the environment holds the torchrun variables). Exit status 0 or 1."""
    jobdir = Path(jobdir)
    try:
        with open(jobdir / "job.pkl", "rb") as f:
            job = pickle.load(f)
        penv = ParallelEnv.from_env(os.environ)
        if job["device_type"] == "cpu":  # the ranks share this machine's cores instead of each taking all of them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // penv.world_size))
        ctx = init_group(penv, job["device_type"], job["timeout_s"])
        result = job["fn"](ctx, *job["args"])
        if ctx.is_main:
            torch.save(result, jobdir / ".result.pt")
            os.replace(jobdir / ".result.pt", jobdir / "result.pt")
        ctx.barrier()  # nobody leaves before rank 0's result is on disk
        ctx.destroy()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher, then end the process
        try:
            _write_error(jobdir, rank, e)
        finally:
            os._exit(1)  # skip interpreter teardown: a peer may be gone and a collective would block
    return 0
