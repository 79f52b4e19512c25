"""Process-group setup for sequence parallelism: NCCL on GPUs, gloo on the CPU.

A degree is checked (:func:`check_degree`) before any work: it must be >= 1 and divide the head count,
the backend must be built into this torch, and a GPU run needs that many visible devices. Under
``torchrun`` (or this package's own launcher, which sets the same variables) :meth:`ParallelEnv.from_env`
reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the mapping it is given; the
caller (the CLI, the worker entry) passes ``os.environ``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from ..errors import H3Error

DEFAULT_TIMEOUT_S = 600.0  # a collective that waits longer than this raises (a peer is gone or stuck)


class ParallelError(H3Error):
    """A sequence-parallel run that cannot start (bad degree, missing backend, too few devices) or that
    failed in a worker."""


def backend_for(device_type: str) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` for the CPU."""
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ParallelError(f"sequence parallelism runs on cuda (NCCL) or cpu (gloo); found device type {device_type!r}")


def check_degree(degree: int, heads: int, device_type: str, device_count: int | None = None) -> str:
    """Validate a sequence-parallel degree before any work; returns the backend name.

    degree: the number of ranks; heads: the model's attention heads (the degree must divide them, each
    rank attends ``heads // degree`` heads); device_count: visible CUDA devices (default: torch's count).
    Raises ParallelError naming what was expected, what was found and what to do.
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ParallelError(f"--sequence-parallel {degree!r}: expected an integer >= 1 (1 = one process)")
    if heads % degree:
        ok = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ParallelError(f"--sequence-parallel {degree} does not divide the model's {heads} attention heads; "
                            f"use one of {ok}")
    backend = backend_for(device_type)
    if degree == 1:
        return backend
    if device_type == "cuda":
        count = torch.cuda.device_count() if device_count is None else device_count
        if count < degree:
            raise ParallelError(f"--sequence-parallel {degree} needs {degree} CUDA devices (one per rank); "
                                f"{count} visible; lower the degree or expose more GPUs (CUDA_VISIBLE_DEVICES)")
    if not dist.is_available():
        raise ParallelError("this torch build has no torch.distributed; sequence parallelism needs it "
                            "(install a torch wheel built with distributed support)")
    have = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not have:
        raise ParallelError(f"this torch build has no {backend} backend, which {device_type} ranks need; "
                            f"install a torch wheel with {backend}" + (" or run on --device cpu (gloo)"
                                                                       if backend == "nccl" else ""))
    return backend


@dataclass(frozen=True)
class ParallelEnv:
    """Where this process sits in a run: what torchrun (or :func:`..launch.launch`) put in the environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "ParallelEnv | None":
        """The torchrun variables from ``env``, or None when WORLD_SIZE is absent (not a distributed run)."""
        if "WORLD_SIZE" not in env:
            return None
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ParallelError(f"WORLD_SIZE is set but {missing} are not; start the run with torchrun "
                                "(it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or unset WORLD_SIZE")
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", env["RANK"]))
            port = int(env["MASTER_PORT"])
        except ValueError as e:
            raise ParallelError(f"torchrun environment: {e}; RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT "
                                "must be integers") from e
        if not 0 <= rank < world:
            raise ParallelError(f"RANK={rank} with WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
        return cls(rank, world, local, env["MASTER_ADDR"], port)


@dataclass
class ParallelContext:
    """This rank's view of an initialised process group.

    device: ``cuda:LOCAL_RANK`` for NCCL, ``cpu`` for gloo; group: None = the default (world) group.
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(penv: ParallelEnv, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Join the process group described by ``penv`` (tcp://MASTER_ADDR:MASTER_PORT).

    Every collective raises after ``timeout_s`` seconds instead of waiting for a peer that is gone.
    CUDA ranks bind ``cuda:LOCAL_RANK`` before the group is made.
    """
    backend = backend_for(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", penv.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://{penv.master_addr}:{penv.master_port}",
                            rank=penv.rank, world_size=penv.world_size,
                            timeout=datetime.timedelta(seconds=float(timeout_s)), **kw)
    return ParallelContext(penv.rank, penv.world_size, device, backend)
