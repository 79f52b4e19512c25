"""Sequence parallelism (Ulysses) over torch.distributed.

Each rank holds the whole model and a contiguous share of the packed rows (:mod:`.shard`); around
attention one all-to-all turns the row split into a head split and one turns it back (:mod:`.ulysses`).
:mod:`.group` sets up the process group (NCCL on GPUs, gloo on the CPU, torchrun's environment when
present) and checks a degree before any work; :mod:`.launch` starts N local workers itself; :mod:`.amax`
all-reduces W4A4's dynamic activation amaxes, so the NVFP4 bytes do not depend on the split.
"""

from .amax import AmaxAllReduce
from .group import ParallelContext, ParallelEnv, ParallelError, backend_for, check_degree, init_group
from .launch import WorkerFailed, launch
from .shard import RowShard
from .ulysses import CommStats, UlyssesAttention

__all__ = ["AmaxAllReduce", "CommStats", "ParallelContext", "ParallelEnv", "ParallelError", "RowShard", "UlyssesAttention",
           "WorkerFailed", "backend_for", "check_degree", "init_group", "launch"]
