"""The load behind the first step on a real GPU (run: python3 -m pytest -m gpu tests/gpu/test_load_behind_gpu.py -s):
the pass on its own CUDA stream and thread, each block's copies ordered before its use by an event. Resident, every
block streamed, AdaLN left in the file: the same hashes and tensors as the load before the first step, a merged LoRA
included (``tests/runtime/test_load_behind.py`` on the CPU). The same kernels on the same bytes: equal, not close."""

import pytest
import torch

from h3_blackwell.runtime import RuntimeOptions, load_model
from h3_blackwell.runtime.budget import SLOTS, ModelMemory, estimate
from tests.gpu.test_lora_placement_gpu import WL, _adaln_bytes, _adaln_bytes_per_block_pair
from tests.runtime.test_load_behind import check_the_load_behind, files, slow_parts  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _adaln_in_the_file(ck) -> dict:
    """test_lora_placement_gpu's checkpoint-file placement: a budget that holds every block but not the AdaLN
    weights beside them, and a host budget of two blocks' AdaLN weights."""
    rt = load_model(ck, RuntimeOptions(device="cuda", adaln_cache=False), workload=WL)
    mid = estimate(ModelMemory.from_plan(rt.plan), WL, rt.config.num_layers, SLOTS, None, "cuda").total \
        - _adaln_bytes(rt) // 2
    return {"vram_budget": repr(mid / 1e9), "host_budget": repr(_adaln_bytes_per_block_pair(ck))}


@pytest.mark.parametrize("memory", ["resident", "streamed", "adaln_in_file"])
def test_the_load_behind_on_the_device(files, memory, slow_parts):  # noqa: F811 (fixtures)
    ck, _ = files
    check_the_load_behind(files, memory, "cuda", _adaln_in_the_file(ck) if memory == "adaln_in_file" else None)


@pytest.mark.parametrize("behind", [False, True])
def test_streamed_stored_linears_built_in_host_memory_on_the_device(files, behind):  # noqa: F811 (fixture)
    """A stored NVFP4 checkpoint with every block streamed on CUDA: each shape's canary (the linear built from host
    tensors against the device's build, byte for byte) agrees, and the latents are the resident load's."""
    from h3_blackwell.runtime.io.convert import quantize_checkpoint
    from tests.runtime.test_load_behind import _load, _run, _streamed_budget

    ck = files[0].parent / "tiny-nvfp4.safetensors"
    if not ck.exists():
        quantize_checkpoint(files[0], ck)
    resident = _load(ck, False, "cuda")
    streamed = _load(ck, behind, "cuda", vram_budget=_streamed_budget(ck, "cuda"))
    assert streamed.plan.memory.streamed and streamed.plan.stored_nvfp4
    assert _run(streamed) == _run(resident)
    built = streamed.load_phases["pass_parts"]["streamed_linears_built_in_host_memory"]
    assert built and all(built.values()), built
