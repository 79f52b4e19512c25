"""Offload in place (runtime.offload) on the CPU: ``park`` runs the same moves it runs on CUDA (every block's linears
into the streamer's host buffers, every other model tensor replaced by a host copy, the slots and the GEMM scratch
freed, LoRA side paths moved), here as copies. What must hold on any machine: after ``unpark`` the runtime is
placed as before and samples to the latent hashes of a runtime never parked (resident and partly streamed plans,
W4A8 and dense stacks, merged and side-path LoRAs), and a sample or a LoRA change on a parked runtime brings it
back first. The bytes freed are measured by the CUDA allocator: tests/gpu/test_streaming_gpu.py."""

import pytest
import torch

from h3_blackwell.runtime import RuntimeOptions, load_model
from fixtures.sampling import sample
from h3_blackwell.runtime.budget import ModelMemory, Workload, estimate
from h3_blackwell.runtime.load import StateDictSource
from h3_blackwell.runtime.lora import apply as L
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.layout import latent_shapes
from h3_blackwell.runtime.model.tiny import tiny_state_dict
from h3_blackwell.runtime.offload import park, unpark
from fixtures.reports import report_hashes
from tests.fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth

STEPS = 2
VSHAPE, ASHAPE = latent_shapes(128, 96, 22)
STACKS = {"w4a8": dict(gemm="fp8", act_format="fp8"), "dense": dict(quantize=False)}


def _inputs(seed=1):
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(seed))
    return text, None, torch.zeros(VSHAPE), torch.zeros(ASHAPE)


def _six_blocks():
    cfg = TINY.replace(num_layers=6)
    return StateDictSource(tiny_state_dict(cfg, 3, torch.float32), "tiny, 6 blocks", cfg)


def _load(kw, partly_streamed: bool):
    wl = Workload.from_shapes(VSHAPE, ASHAPE, 32, STEPS)
    src = _six_blocks()
    opts = RuntimeOptions(device="cpu", **kw)
    if partly_streamed:
        mm = ModelMemory.from_plan(load_model(_six_blocks(), opts, workload=wl).plan)
        opts = RuntimeOptions(device="cpu", **kw, vram_budget=repr(estimate(mm, wl, 2, 2, None, "cpu").total / 1e9))
    rt = load_model(src, opts, workload=wl)
    assert bool(rt.plan.memory.streamed) == partly_streamed
    return rt


def _bound(rt) -> dict:
    """name -> the tensor object each module table holds now."""
    out = {}
    for mname, mod in rt.model.named_modules():
        for table in ("_parameters", "_buffers"):
            for name, t in getattr(mod, table).items():
                if t is not None:
                    out[f"{mname}.{name}"] = t
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (any dtype, fp8 and NVFP4 bytes included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("partly_streamed", [False, True], ids=["resident", "partly-streamed"])
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_park_then_unpark_samples_to_the_same_hashes(stack, partly_streamed):
    rt = _load(STACKS[stack], partly_streamed)
    want = report_hashes(sample(rt, *_inputs(), seed=3, steps=STEPS))
    streamed, resident = rt.streamer.streamed, rt.plan.memory.resident
    before = _bound(rt)
    parked = park(rt)
    st = rt.streamer
    assert st.streamed == frozenset(range(6)) and st.slots == [] and st.device_bytes == 0
    assert rt.plan.scratch.nbytes() == 0
    for j in range(6):  # every block linear holds its host buffer's views
        for name, hl in st.host[j].items():
            assert hl.holds(rt.model.blocks[j].get_submodule(name)), (j, name)
    after = _bound(rt)
    moved = [k for k in before if after[k] is not before[k]]
    kept = [k for k in before if after[k] is before[k]]
    # what stayed bound is exactly the streamed blocks' host views (already in host memory before the park)
    views = {id(v) for parts in st.host.values() for hl in parts.values() for v in hl.views.values()}
    assert all(id(before[k]) in views for k in kept) and moved
    for k in moved:  # a copy with the same values, dtype and kind (Parameter or not)
        assert _same(after[k], before[k])
        assert isinstance(after[k], torch.nn.Parameter) == isinstance(before[k], torch.nn.Parameter)
    unpark(rt, parked)
    assert rt.streamer.streamed == streamed and rt.plan.memory.resident == resident
    assert report_hashes(sample(rt, *_inputs(), seed=3, steps=STEPS)) == want


def test_a_tensor_shared_by_two_modules_stays_shared():
    rt = _load(STACKS["dense"], False)
    a, b = rt.model.blocks[0], rt.model.blocks[1]
    name = next(n for n, _ in a.named_parameters() if "norm" in n)
    mod_a, leaf = a.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
    mod_b = b.get_submodule(name.rsplit(".", 1)[0])
    mod_b._parameters[leaf] = mod_a._parameters[leaf]  # tie them
    parked = park(rt)
    assert mod_a._parameters[leaf] is mod_b._parameters[leaf]
    unpark(rt, parked)
    assert mod_a._parameters[leaf] is mod_b._parameters[leaf]


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    cfg = TINY.replace(num_layers=6)
    return save_tiny_lora(tmp_path_factory.mktemp("lora") / "l.safetensors", tiny_lora_truth(cfg, seed=1), "comfy")


@pytest.mark.parametrize("mode", ["merge", "side"])
def test_loras_survive_park_and_a_change_while_parked_brings_the_weights_back_first(lora_file, mode):
    """A LoRA applied before the park is carried after it (merged bytes, side paths moved with the model); one
    applied while parked (``apply_loras`` onloads first) gives the hashes of one applied to a runtime never parked."""
    kw = STACKS["w4a8"]
    streams = mode == "merge"  # (side paths would not fit beside the partly streamed budget: resident there)
    ref = _load(kw, streams)
    L.apply_loras(ref, [(str(lora_file), 0.7, mode)])
    want = report_hashes(sample(ref, *_inputs(), seed=2, steps=STEPS))
    rt = _load(kw, streams)
    L.apply_loras(rt, [(str(lora_file), 0.7, mode)])
    unpark(rt, park(rt))
    assert report_hashes(sample(rt, *_inputs(), seed=2, steps=STEPS)) == want
    L.remove_loras(rt)
    plain = report_hashes(sample(rt, *_inputs(), seed=2, steps=STEPS))
    assert plain != want
    rt.parked = park(rt)  # as H3Runtime.offload leaves it on CUDA
    L.apply_loras(rt, [(str(lora_file), 0.7, mode)])
    assert rt.parked is None
    assert report_hashes(sample(rt, *_inputs(), seed=2, steps=STEPS)) == want


def test_sampling_a_parked_runtime_brings_it_back_first():
    rt = _load(STACKS["w4a8"], True)
    want = report_hashes(sample(rt, *_inputs(), seed=4, steps=STEPS))
    rt.parked = park(rt)
    assert report_hashes(sample(rt, *_inputs(), seed=4, steps=STEPS)) == want and rt.parked is None
    assert rt.offload() == 0 and rt.parked is None  # off CUDA offload does nothing: no device memory to give back


@pytest.mark.parametrize("where", ["block linears", "other tensors"])
def test_a_park_that_runs_out_of_host_memory_puts_everything_back(where, monkeypatch):
    """Host memory running out part way through a park (the fourth block linear's buffer, or the host copies of the
    other tensors) leaves the runtime as it was: the same placement, bound tensors, and latent hashes."""
    from h3_blackwell.runtime import offload as off
    from h3_blackwell.runtime.ops import streaming

    rt = _load(STACKS["w4a8"], True)
    want = report_hashes(sample(rt, *_inputs(), seed=6, steps=STEPS))
    streamed, before = rt.streamer.streamed, _bound(rt)
    made = []

    class Failing(streaming.HostLinear):
        def __init__(self, *a, **k):
            if len(made) == 3:
                raise MemoryError("host memory exhausted (test)")
            made.append(1)
            super().__init__(*a, **k)

    if where == "block linears":
        monkeypatch.setattr(streaming, "HostLinear", Failing)
    else:
        def failing(*a):
            raise MemoryError("host memory exhausted (test)")
        monkeypatch.setattr(off, "_host_copies", failing)
    with pytest.raises(MemoryError):
        park(rt)
    monkeypatch.undo()
    assert rt.streamer.streamed == streamed and rt.streamer.slots and set(rt.streamer.host) == set(streamed)
    after = _bound(rt)
    resident = [k for k in before if k.startswith("blocks.") and int(k.split(".")[1]) not in streamed]
    assert all(_same(after[k], before[k]) for k in before)
    assert all(after[k] is before[k] for k in before if k not in resident)  # only the moved blocks were rebuilt
    assert report_hashes(sample(rt, *_inputs(), seed=6, steps=STEPS)) == want


def test_an_onload_that_runs_out_of_device_memory_leaves_it_offloaded_and_a_retry_works(monkeypatch):
    """Out of device memory part way through bringing the weights back: what had moved goes back to host memory,
    the runtime stays offloaded (``parked`` kept), the error propagates, and a later onload brings it back whole."""
    from h3_blackwell.runtime import offload as off

    rt = _load(STACKS["w4a8"], True)
    want = report_hashes(sample(rt, *_inputs(), seed=8, steps=STEPS))
    rt.parked = park(rt)
    parked_bound = _bound(rt)
    real_put = off._put

    def failing_put(entries, device):
        if device is not None:
            real_put(entries[: len(entries) // 2], device)
            raise torch.OutOfMemoryError("device memory exhausted (test)")
        real_put(entries, device)
    monkeypatch.setattr(off, "_put", failing_put)
    with pytest.raises(torch.OutOfMemoryError):
        rt.onload()
    monkeypatch.undo()
    assert rt.parked is not None and rt.streamer.slots == [] and rt.streamer.streamed == frozenset(range(6))
    now = _bound(rt)  # every host copy (or streamer view) bound again: the same storage as after the park
    assert all(now[k].data_ptr() == t.data_ptr() for k, t in parked_bound.items())
    rt.onload()
    assert rt.parked is None and report_hashes(sample(rt, *_inputs(), seed=8, steps=STEPS)) == want


def test_an_offloaded_runtime_is_planned_from_host_memory():
    """fit_memory on an offloaded runtime plans it as holding nothing on the device: a budget it cannot run is
    refused with the runtime left offloaded; one it can run brings it back straight into that plan's placement."""
    from h3_blackwell.runtime.budget import BudgetError

    rt = _load(STACKS["w4a8"], False)
    want = report_hashes(sample(rt, *_inputs(), seed=9, steps=STEPS))
    rt.parked = park(rt)
    rt.plan.options.vram_budget = "0.000001"
    with pytest.raises(BudgetError, match="nothing moved"):
        sample(rt, *_inputs(), seed=9, steps=STEPS)
    assert rt.parked is not None
    wl = Workload.from_shapes(VSHAPE, ASHAPE, 32, STEPS)
    rt.plan.options.vram_budget = repr(estimate(ModelMemory.from_plan(rt.plan), wl, 2, 2, None, "cpu").total / 1e9)
    got = sample(rt, *_inputs(), seed=9, steps=STEPS)
    assert rt.parked is None and len(rt.plan.memory.resident) == 2 and report_hashes(got) == want
    assert rt.streamer.streamed == frozenset(rt.plan.memory.streamed)


def test_why_an_offload_is_not_done():
    """Off CUDA, on an integrated GPU (GB10: device memory is host memory) and where the host cannot spare the bytes
    (page-locked memory is never swapped out) the offload is not done, with the reason; otherwise it is."""
    from h3_blackwell.runtime.offload import HOST_LEFT_FREE, why_not_offload

    gb = 10 ** 9
    assert "not on a CUDA device" in why_not_offload("cpu", False, gb, 100 * gb)
    assert "integrated" in why_not_offload("cuda", True, gb, 100 * gb)
    assert "12.60 GB of host memory and 13.00 GB is free" in why_not_offload("cuda", False, 12.6 * gb, 13 * gb)
    assert why_not_offload("cuda", False, 12.6 * gb, 12.6 * gb + HOST_LEFT_FREE) is None
