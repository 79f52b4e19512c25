"""A merge-mode LoRA wherever the weights live, on a real GPU (run: python3 -m pytest -m gpu
tests/gpu/test_lora_placement_gpu.py -s).

The same tiny checkpoint and LoRA, five placements: AdaLN weights on the device (``adaln_cache`` off, and the memory
plan's choice where the budget holds them beside every block, then moved off by a run whose budget does not), in
pinned host memory (a budget without room for them: the merge is applied to the copy each run brings over), left in
the checkpoint file (a host budget too small for them), and every block streamed (the block linears' NVFP4 bytes in
host memory between uses, their global scales on the device). Each gives the same latent hashes before the LoRA,
with it, and after its removal, and the LoRA changes them. The placements run the same kernels on the same bytes, so
the hashes are equal, not close.
"""

from dataclasses import replace

import pytest
import torch

from h3_blackwell.runtime import RuntimeOptions, load_model
from h3_blackwell.runtime.budget import SLOTS, ModelMemory, Workload, estimate, smallest_budget
from h3_blackwell.runtime.lora.apply import apply_loras
from h3_blackwell.runtime.model.layout import latent_shapes
from fixtures.reports import report_hashes
from fixtures.sampling import sample
from tests.fixtures.tiny_lora import tiny_checkpoint_and_lora

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VS, AS = latent_shapes(128, 96, 22)
WL = Workload.from_shapes(VS, AS, 32, 2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_checkpoint_and_lora(tmp_path_factory.mktemp("lora_placement"), seed=3)


def _run(rt):
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(1))
    return report_hashes(sample(rt, text, None, torch.randn(VS, generator=torch.Generator().manual_seed(4)),
                                torch.randn(AS, generator=torch.Generator().manual_seed(5)), seed=2, steps=2))


def _hashes(rt, lora) -> list:
    out = [_run(rt)]
    apply_loras(rt, [(str(lora), 0.8, "merge")])
    out.append(_run(rt))
    apply_loras(rt, [])
    out.append(_run(rt))
    return out


def _adaln_bytes_per_block_pair(ck) -> float:
    """A host budget (GB) between two blocks' AdaLN weights in bf16 (what a run reads from the file at once) and all
    of them: the load leaves them in the file."""
    from h3_blackwell.runtime.model.config import TINY

    per_block = (6 * 3 * TINY.hidden_size * TINY.time_embed_dim + 6 * 3 * TINY.hidden_size) * 2
    return (2 * per_block + TINY.num_layers * per_block) / 2 / 1e9


def _adaln_bytes(rt) -> int:
    return sum(t.numel() * t.element_size() for b in rt.model.blocks for t in b.adaln_proj.linear.parameters())


def test_a_merged_lora_gives_the_same_latents_wherever_the_weights_live(files):
    ck, lora = files
    on_device = load_model(ck, RuntimeOptions(device="cuda", adaln_cache=False), workload=WL)
    assert on_device.plan.choices["adaln"].choice == "resident"
    want = _hashes(on_device, lora)
    assert want[0] != want[1] and want[0] == want[2]
    mm = ModelMemory.from_plan(on_device.plan)  # AdaLN counted on the device
    # a budget that holds every block but not the AdaLN weights beside them
    mid = estimate(mm, WL, on_device.config.num_layers, SLOTS, None, "cuda").total - _adaln_bytes(on_device) // 2
    a = _adaln_bytes(on_device)  # the smallest budget with AdaLN in host memory, where streaming keeps it
    least = smallest_budget(replace(mm, other_bytes=mm.other_bytes - a, adaln_host_bytes=a, adaln_on_host=True), WL,
                            "cuda")
    del on_device
    placements = {
        "on the device by the plan": RuntimeOptions(device="cuda"),
        "pinned host memory": RuntimeOptions(device="cuda", vram_budget=repr(mid / 1e9)),
        "checkpoint file": RuntimeOptions(device="cuda", vram_budget=repr(mid / 1e9),
                                          host_budget=repr(_adaln_bytes_per_block_pair(ck))),
        "every block streamed": RuntimeOptions(device="cuda", vram_budget=repr(least / 1e9)),
    }
    for name, opts in placements.items():
        rt = load_model(ck, opts, workload=WL)
        w = rt.model.blocks[0].adaln_proj.linear.weight
        if name == "on the device by the plan":
            assert rt.plan.choices["adaln"].choice == "on the device" and w.is_cuda
        if name == "pinned host memory":
            assert rt.plan.choices["adaln"].choice == "rows per run" and w.device.type == "cpu" and w.is_pinned()
        if name == "checkpoint file":
            assert rt.plan.adaln_from_file and w.is_meta
        if name == "every block streamed":
            assert rt.plan.memory.streamed == tuple(range(rt.config.num_layers))
            assert rt.model.blocks[0].mlp.fc1.packed.device.type == "cpu"
        got = _hashes(rt, lora)
        print(name, rt.plan.choices["adaln"].choice, got[1])
        assert got == want, name
        assert not rt.model.adaln_merges
        if name == "on the device by the plan":  # a run under a budget without room for them moves them off
            rt.plan.options.vram_budget = repr(mid / 1e9)
            assert _hashes(rt, lora) == want
            w = rt.model.blocks[0].adaln_proj.linear.weight
            assert rt.plan.choices["adaln"].choice == "rows per run" and w.device.type == "cpu" and w.is_pinned()
        del rt
