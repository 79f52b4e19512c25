"""Full-form AdaLN weights left in the checkpoint file (the memory plan's ``adaln_from_file``, issue 37).

The 50 blocks' ``adaln_proj.linear`` weights of a full-form H3 are 26 GB in bf16: more than a 32 GB machine can
keep beside the streamed blocks. When the plan's host figure does not fit (``runtime.budget._check_host``), the
load leaves them in the file (the modules keep meta tensors) and each sampling run computes its modulation rows
(``H3Model._block_mods``) from the weights read here block by block, the next block read ahead in a worker thread
(``BLOCKS_IN_FLIGHT`` in host memory at once): a plain read into a buffer of the tensor's size
(``Checkpoint.tensor``: no mmap, nothing kept), converted to the model's AdaLN dtype exactly as the load converts it
into host memory, checked finite and moved to the device. A LoRA merged into an AdaLN weight (merge mode) is
applied by the model to what this returns (``H3Model.adaln_merges``), as for AdaLN weights kept in host memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
import torch

from ..model.config import ADALN_KEY
from .finite import check_finite

BLOCKS_IN_FLIGHT = 2  # blocks a run holds in host memory at once: the one in use and the next being read
READ_THREADS = 8  # one weight is read as this many parts at once (the page cache copies in parallel)


class AdalnFromFile:
    """The AdaLN weights of ``model``'s blocks read from ``checkpoint`` (a ``runtime.io.checkpoint.Checkpoint``)."""

    def __init__(self, checkpoint, model):
        self.checkpoint = checkpoint
        self.dtypes = {j: (b.adaln_proj.linear.weight.dtype, b.adaln_proj.linear.bias.dtype)
                       for j, b in enumerate(model.blocks)}
        self.reads = 0  # tensors read (a test counts them)
        self._pool: ThreadPoolExecutor | None = None  # the read-ahead worker, made at the first read
        self._ahead: dict[int, Future] = {}  # block -> its host tensors being read

    def names(self, j: int) -> tuple[str, str]:
        return f"blocks.{j}.adaln_proj.linear.weight", f"blocks.{j}.adaln_proj.linear.bias"

    def holds(self, name: str) -> bool:
        """Whether ``name`` (a block AdaLN weight or bias) is read from the file rather than held by the model."""
        return ADALN_KEY.match(name) is not None

    def _host(self, j: int) -> list[torch.Tensor]:
        """Block j's AdaLN weight and bias read from the file into host memory at the model's AdaLN dtypes, checked
        finite (the exception names the tensor). A tensor stored whole at its model dtype is read in
        ``READ_THREADS`` parts at once, straight into its buffer (``Checkpoint.read_host``)."""
        return [check_finite(name, self.checkpoint.read_host(name, dtype, threads=READ_THREADS))
                for name, dtype in zip(self.names(j), self.dtypes[j])]

    def read(self, j: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block j's AdaLN (weight [6*3*hidden, t_dim], bias) as stored, on ``device`` at the model's AdaLN dtypes.
        While block j is moved and used, block j + 1 is read in a worker thread (the file read,
        the run's largest cost at this step, overlaps the copy to the device and the rows' GEMMs): host memory
        holds ``BLOCKS_IN_FLIGHT`` blocks at most. The bytes are the same as reading block j here."""
        ahead = self._ahead.pop(j, None)
        host = ahead.result() if ahead is not None else self._host(j)
        if j + 1 < len(self.dtypes) and j + 1 not in self._ahead:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="h3-adaln-read")
            self._ahead[j + 1] = self._pool.submit(self._host, j + 1)
        self.reads += len(host)
        return host[0].to(device), host[1].to(device)
