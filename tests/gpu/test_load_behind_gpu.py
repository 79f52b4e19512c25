"""The load behind the first step on a real GPU (run: python3 -m pytest -m gpu tests/gpu/test_load_behind_gpu.py -s):
the pass on its own CUDA stream and thread, each block's copies ordered before its use by an event. Resident, every
block streamed, AdaLN left in the file: the same hashes and tensors as the load before the first step, a merged LoRA
included (``tests/runtime/test_load_behind.py`` on the CPU). The same kernels on the same bytes: equal, not close."""

import pytest
import torch

from tests.gpu.test_lora_placement_gpu import _adaln_bytes_per_block_pair
from tests.runtime.test_load_behind import _streamed_budget, check_the_load_behind, files, slow_parts  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("memory", ["resident", "streamed", "adaln_in_file"])
def test_the_load_behind_on_the_device(files, memory, slow_parts):  # noqa: F811 (fixtures)
    ck, _ = files
    kw = None
    if memory == "adaln_in_file":  # every block streamed, and a host budget without room for the AdaLN weights
        kw = {"vram_budget": _streamed_budget(ck, "cuda"), "host_budget": repr(_adaln_bytes_per_block_pair(ck))}
    check_the_load_behind(files, memory, "cuda", kw)
