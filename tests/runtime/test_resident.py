"""runtime.ResidentModel, the one owner of a resident runtime: a release frees the runtime when the owner held the
last reference and the next use reads it again; a runtime held elsewhere stays the owner's and is offloaded in place
(the offload itself is measured on a GPU in tests/gpu/test_core_model_gpu.py); an owner made over a loaded runtime
without a way to open it says so when asked for it after a release. The node tests cover the ComfyUI side
(tests/nodes/test_core_model.py)."""

import gc
import weakref

import pytest
import torch

from h3_blackwell.runtime import H3Error, ResidentModel, RuntimeOptions, load_model

OPTS = RuntimeOptions(device="cpu", quantize=False)


def test_release_frees_the_last_reference_and_the_next_use_reads_again():
    opened = []
    owner = ResidentModel(open=lambda: opened.append(1) or load_model(None, OPTS))
    assert opened == [1] and owner.resident and not owner.offloaded and owner.size > 0
    model_ref = weakref.ref(owner.loaded.model)
    assert owner.release() == owner.size and not owner.resident and owner.loaded is None
    gc.collect()
    assert model_ref() is None  # nothing kept the released model
    assert owner.release() == 0  # nothing left to release
    rt = owner.runtime()
    assert opened == [1, 1] and owner.loaded is rt and owner.call.rt is rt  # a fresh evaluator over the new runtime


def test_a_runtime_held_elsewhere_is_offloaded_in_place_and_keeps_its_last_run(monkeypatch):
    rt = load_model(None, OPTS)
    owner = ResidentModel(rt, open=lambda: pytest.fail("a runtime held elsewhere is never read again"))
    g = torch.Generator().manual_seed(3)
    video, audio = torch.randn(1, 24, 2, 4, 4, generator=g), torch.randn(1, 32, 2, 8, generator=g)
    owner.call.begin_run(torch.tensor([1.0, 0.0]))
    owner.call(video, audio, 1.0, torch.randn(1, 4, rt.config.text_dim, generator=g))
    offloads = []
    monkeypatch.setattr(rt, "offload", lambda: offloads.append(1) or 0)  # the CPU offload frees nothing
    owner.towers = {"tower": object()}
    assert owner.release() == 0 and offloads == [1]
    assert owner.loaded is rt and owner.towers == {} and owner.call.run is None
    assert owner.call.last_run is not None  # the open run, closed by the release and kept for its report
    assert owner.runtime() is rt


def test_an_owner_without_a_file_cannot_read_a_released_model_again():
    owner = ResidentModel(load_model(None, OPTS))
    owner.release()
    with pytest.raises(H3Error, match="cannot read it again"):
        owner.runtime()
    with pytest.raises(H3Error, match="needs a loaded runtime or a way to open one"):
        ResidentModel()
