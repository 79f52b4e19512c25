"""The load behind the first step (``runtime.pending_load``, ``load_model(load_behind=on)``): the pass on a worker
thread, each block used once its own tensors are loaded and checked. Against the load before the first step on the
same file: the same tensors, the same latents (resident, every block streamed, AdaLN read from the file), the same
LoRA merges when the stack is applied while the pass runs; a bad tensor raises its CheckpointError from the run
and from every later use; everything that needs the whole model waits for it."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_blackwell.runtime import RuntimeOptions, load_model
from h3_blackwell.runtime.budget import ModelMemory, Workload, smallest_budget
from h3_blackwell.runtime.errors import CheckpointError
from h3_blackwell.runtime.lora.apply import apply_loras, lora_report
from h3_blackwell.runtime.model.layout import latent_shapes
from h3_blackwell.runtime.pending_load import PendingLoad
from fixtures.reports import report_hashes
from fixtures.sampling import sample
from tests.fixtures.tiny_lora import tiny_checkpoint_and_lora

VS, AS = latent_shapes(128, 96, 22)
WL = Workload.from_shapes(VS, AS, 32, 2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_checkpoint_and_lora(tmp_path_factory.mktemp("load_behind"), seed=5)


def _load(ck, behind: bool, device: str = "cpu", **kw):
    return load_model(ck, RuntimeOptions(device=device, load_behind="on" if behind else "off", **kw), workload=WL)


def _run(rt):
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(1))
    return report_hashes(sample(rt, text, None, torch.zeros(VS), torch.zeros(AS), seed=2, steps=2))


def _tensors(rt) -> dict:
    rt.finish_load()
    sd = rt.model.state_dict(keep_vars=True)
    return {k: v.detach().clone() for k, v in sd.items() if not v.is_meta}


def _streamed_budget(ck, device: str = "cpu") -> str:
    rt = _load(ck, False, device)
    kind = "cpu" if device == "cpu" else "cuda"
    return repr(smallest_budget(ModelMemory.from_plan(rt.plan, placed=False), WL, kind) / 1e9 + 1e-9)


def check_the_load_behind(files, memory: str, device: str, kw: dict | None = None) -> None:
    """Load before and behind the first step (``memory``: resident, every block streamed, AdaLN left in the file, by
    the options ``kw``) on ``device``; a run, a merged LoRA, a run: the same hashes, then the same tensors."""
    ck, lora = files
    if kw is None:
        kw = {"resident": {}, "streamed": {"vram_budget": _streamed_budget(ck, device)},
              "adaln_in_file": {"host_budget": "0.001"}}[memory]
    before, behind = _load(ck, False, device, **kw), _load(ck, True, device, **kw)
    assert behind.backends["load"]["choice"] == "behind the first step"
    assert before.backends["load"]["choice"] == "before the first step"
    assert behind.pending is not None and isinstance(behind.model.pending, PendingLoad)
    if memory == "streamed":
        assert before.plan.memory.streamed and behind.plan.memory.streamed == before.plan.memory.streamed
    if memory == "adaln_in_file":
        assert behind.plan.adaln_from_file
    hashes = {}
    for name, rt in (("before", before), ("behind", behind)):
        got = [_run(rt)]  # the first run meets the pass (it may still run)
        apply_loras(rt, [(str(lora), 0.7, "merge")])
        got.append(_run(rt))
        hashes[name] = got
    assert behind.pending is None and behind.model.pending is None and behind.streamer.gate is None
    assert hashes["behind"] == hashes["before"] and hashes["before"][0] != hashes["before"][1]
    a, b = _tensors(before), _tensors(behind)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = behind.load_phases["behind_first_step"]
    assert summary["done"] and behind.load_phases["pass_parts"] and summary["waited_seconds"] > 0.02


@pytest.fixture
def slow_parts(monkeypatch):
    """A pass behind the first step opens its blocks only once the run has reached the block stack (then 50 ms
    apart): the run waits at its gates whatever the machine's speed (a cold first run can outlast any fixed delay)."""
    import threading
    import time

    from h3_blackwell.runtime.model.h3 import H3Model

    reached: dict[int, threading.Event] = {}
    run_blocks, opened = H3Model.run_blocks, PendingLoad.open

    def entered(self, *a, **k):
        if self.pending is not None:
            reached.setdefault(id(self.pending), threading.Event()).set()
        return run_blocks(self, *a, **k)

    def late(self, part):
        if part >= 0:
            reached.setdefault(id(self), threading.Event()).wait(60)
            time.sleep(0.05)
        opened(self, part)

    monkeypatch.setattr(H3Model, "run_blocks", entered)
    monkeypatch.setattr(PendingLoad, "open", late)


@pytest.mark.parametrize("memory", ["resident", "streamed", "adaln_in_file"])
def test_the_load_behind_gives_the_loads_tensors_and_latents(files, memory, slow_parts):
    check_the_load_behind(files, memory, "cpu")


def test_a_lora_applied_while_the_pass_runs_merges_block_by_block(files, slow_parts):
    """The stack is read and checked at once; the prelude's merges run then, each block's when its part opens (the
    run reaches it, or finish_load): the same tensors and latents as the stack applied after the load."""
    ck, lora = files
    before = _load(ck, False)
    apply_loras(before, [(str(lora), 0.9, "merge")])
    behind = _load(ck, True)
    rep = apply_loras(behind, [(str(lora), 0.9, "merge")])
    assert any("when the first step reached it" in n for n in rep["notes"])
    assert _run(behind) == _run(before)
    done = lora_report(behind)
    assert sorted(done["merged_nvfp4"]) == sorted(lora_report(before)["merged_nvfp4"])
    assert sorted(done["merged_dense"]) == sorted(lora_report(before)["merged_dense"])
    a, b = _tensors(before), _tensors(behind)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # removal restores the loaded tensors exactly
    apply_loras(behind, [])
    fresh = _tensors(_load(ck, False))
    got = _tensors(behind)
    assert all(torch.equal(fresh[k], got[k]) for k in fresh)


def test_a_second_stack_before_any_run_waits_for_the_first(files):
    ck, lora = files
    rt = _load(ck, True)
    apply_loras(rt, [(str(lora), 0.9, "merge")])
    apply_loras(rt, [(str(lora), 0.4, "side")])  # finishes the pass and the queued merges, then restores them
    assert rt.pending is None
    ref = _load(ck, False)
    apply_loras(ref, [(str(lora), 0.4, "side")])
    assert _run(rt) == _run(ref)


def test_uses_that_need_the_whole_model_wait_for_it(files):
    """device_bytes answers from the plan without waiting (ComfyUI's model management asks as the loader returns):
    what the loaded model then holds. An offload waits for the pass."""
    ck, _ = files
    rt = _load(ck, True)
    planned = rt.device_bytes()
    assert rt.pending is not None
    rt.finish_load()
    measured = rt.device_bytes()
    assert measured == _load(ck, False).device_bytes()
    assert abs(planned - measured) <= 0.01 * measured  # the plan's count of the same tensors (its own rounding)
    rt = _load(ck, True)
    rt.offload()  # a no-op off CUDA, after the pass
    assert rt.pending is None
    import sys

    assert sys.getswitchinterval() == pytest.approx(0.005)  # the pass's shorter thread switch interval is undone


def _bad_file(ck, tmp_path, name: str):
    sd = load_file(str(ck))
    t = sd[name].clone()
    t.view(-1)[t.numel() // 2] = float("nan")
    sd[name] = t
    out = tmp_path / "bad.safetensors"
    save_file(sd, str(out))
    return out


def test_a_bad_tensor_is_raised_by_the_run_and_every_later_use(files, tmp_path):
    ck, _ = files
    name = next(k for k in load_file(str(ck)) if k.startswith("blocks.1.") and k.endswith("norm1.weight")
                or k.startswith("blocks.1.") and "adaln_proj.linear.weight" in k)
    bad = _bad_file(ck, tmp_path, name)
    with pytest.raises(CheckpointError, match="blocks.1."):
        _load(bad, False)
    rt = _load(bad, True)  # returns at once: the pass finds the tensor on its thread
    with pytest.raises(CheckpointError, match="blocks.1."):
        _run(rt)
    with pytest.raises(CheckpointError, match="blocks.1."):
        rt.finish_load()
    with pytest.raises(CheckpointError, match="blocks.1."):
        rt.device_bytes()


def test_the_tiny_model_and_auto_off_cuda_load_before(files):
    ck, _ = files
    assert load_model(None, RuntimeOptions(device="cpu")).backends["load"]["choice"] == "before the first step"
    rt = load_model(ck, RuntimeOptions(device="cpu"), workload=WL, for_sampling=True)
    assert rt.pending is None and "not CUDA" in rt.backends["load"]["reason"]
    rt = load_model(ck, RuntimeOptions(device="cpu"), workload=WL)
    assert rt.pending is None and "called directly" in rt.backends["load"]["reason"]
    with pytest.raises(ValueError, match="load_behind"):
        RuntimeOptions(load_behind="sometimes")


def test_a_merge_failing_at_a_gate_leaves_no_lora_behind(files, monkeypatch, slow_parts):
    """A block's deferred merge that fails raises from the run; every merge done so far is restored and the stack is
    dropped: the model is the loaded one, and a later run of the same stack applies it again from the start."""
    from h3_blackwell.runtime.lora import apply as lora_apply

    ck, lora = files
    rt = _load(ck, True)
    apply_loras(rt, [(str(lora), 0.9, "merge")])
    real = lora_apply.merge_nvfp4

    def failing(st, mname, *a, **k):
        if mname.startswith("blocks.1."):
            raise RuntimeError("merge failed on purpose")
        return real(st, mname, *a, **k)

    monkeypatch.setattr(lora_apply, "merge_nvfp4", failing)
    with pytest.raises(RuntimeError, match="on purpose"):
        _run(rt)
    assert lora_report(rt) is None and rt.lora_stack == ()
    rt.finish_load()
    fresh = _tensors(_load(ck, False))
    got = _tensors(rt)
    assert all(torch.equal(fresh[k], got[k]) for k in fresh)
    monkeypatch.setattr(lora_apply, "merge_nvfp4", real)
    ref = _load(ck, False)
    apply_loras(ref, [(str(lora), 0.9, "merge")])
    apply_loras(rt, [(str(lora), 0.9, "merge")])
    assert _run(rt) == _run(ref)


@pytest.fixture(scope="module")
def nvfp4_file(files, tmp_path_factory):
    from h3_blackwell.runtime.io.convert import quantize_checkpoint

    out = tmp_path_factory.mktemp("nvfp4") / "tiny-nvfp4.safetensors"
    quantize_checkpoint(files[0], out)
    return out


@pytest.mark.parametrize("behind", [False, True])
def test_streamed_stored_linears_are_built_in_host_memory(nvfp4_file, behind):
    """A stored NVFP4 checkpoint with every block streamed: the streamed linears are built from host tensors (no trip
    to the device and back), the canary of each shape agrees, and the latents are the resident load's."""
    resident = _load(nvfp4_file, False)
    streamed = _load(nvfp4_file, behind, vram_budget=_streamed_budget(nvfp4_file))
    assert streamed.plan.memory.streamed and streamed.plan.stored_nvfp4
    assert _run(streamed) == _run(resident)
    built = streamed.load_phases["pass_parts"]["streamed_linears_built_in_host_memory"]
    assert built and all(built.values())
    assert not resident.load_phases["pass_parts"]["streamed_linears_built_in_host_memory"]


def test_a_canary_that_disagrees_keeps_the_device_path(nvfp4_file, monkeypatch):
    from h3_blackwell.runtime import load as load_mod

    build = load_mod._Loader._device_linear

    def off_by_one(self, layer, shape, tensors):
        lin = build(self, layer, shape, tensors)
        if layer.endswith("mlp.fc1"):
            lin.packed.view(-1)[0] ^= 1  # a different build of that shape
        return lin

    monkeypatch.setattr(load_mod._Loader, "_device_linear", off_by_one)
    rt = _load(nvfp4_file, False, vram_budget=_streamed_budget(nvfp4_file))
    built = rt.load_phases["pass_parts"]["streamed_linears_built_in_host_memory"]
    assert False in built.values() and True in built.values()  # fc1's shape went down the device path
