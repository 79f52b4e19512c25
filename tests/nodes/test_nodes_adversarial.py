"""The nodes driven the way a real ComfyUI and its users drive them, without ComfyUI (the stand-ins of
tests/fixtures/comfy_standins.py): its output cache (a node runs again only when its inputs or its
``IS_CHANGED`` / V3 ``fingerprint_inputs`` value change), optional sockets left empty (None), latents from core's
batch nodes, interruption through the server's progress hook, a model file replaced or deleted between prompts,
the loader's outputs still held by the cache after the model was released, and the run report of the MODEL path.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
import torch

from fixtures.comfy_standins import (SAMPLE_ARGS, FakeNestedTensor, InterruptProcessingException,
                                     core_conditioning, core_empty_latent)

from h3_blackwell.nodes import NODES
from h3_blackwell.nodes import core_model as cm
from h3_blackwell.nodes import loader as loader_mod
from h3_blackwell.nodes import sampler as sampler_mod
from h3_blackwell.nodes._common import H3NodeError
from h3_blackwell.nodes.conditioning import H3TextStatesLoader
from h3_blackwell.nodes.loader import TINY_CHOICE, H3ModelLoader
from h3_blackwell.nodes.lora import H3LoRA
from h3_blackwell.nodes.sampler import H3Sampler
from h3_blackwell.runtime.model.tiny import save_tiny


class ComfyCache:
    """ComfyUI's output cache in miniature (``execution.py`` IsChangedCache + CacheKeySetInputSignature): a node's
    key is its class, its inputs and its IS_CHANGED value (read only when the class has it, as ComfyUI does); a
    known key returns the outputs of the earlier execution without running the node."""

    def __init__(self):
        self.outputs, self.runs = {}, 0

    def execute(self, cls, **inputs):
        changed = cls.IS_CHANGED(**inputs) if hasattr(cls, "IS_CHANGED") else False
        key = (cls.__name__, tuple(sorted((k, repr(v)) for k, v in inputs.items())), repr(changed))
        if key not in self.outputs:
            self.runs += 1
            self.outputs[key] = getattr(cls(), cls.FUNCTION)(**inputs)
        return self.outputs[key]


LOADER = dict(gemm="reference", attention="reference", fc2_lt="off", adaln_cache=True)


def _touch(path, seed):
    save_tiny(path, seed=seed)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime even on coarse clocks


class Recorder:
    """Stands in for runtime.run: keeps the validated job, returns the latents + 1 (no sampling cost)."""

    def __init__(self):
        self.jobs = []

    def __call__(self, job):
        from h3_blackwell.runtime import SampleResult

        self.jobs.append(job)
        return SampleResult(job.inputs.video + 1.0, job.inputs.audio + 1.0, {"recorded": True})


# ---------------------------------------------------------------------------------------------
# ComfyUI's cache: a file replaced or deleted between two prompts
# ---------------------------------------------------------------------------------------------

def test_loader_reloads_a_replaced_file_under_comfys_cache(comfy):
    """Before: the loader had no IS_CHANGED, so ComfyUI served its cached output and the replaced file was never
    read (the docstring's 'reloaded when the file changes' only held outside ComfyUI)."""
    path = comfy.models_dir / "h3.safetensors"
    _touch(path, seed=3)
    loader_mod.release_resident()
    cache = ComfyCache()
    a = cache.execute(H3ModelLoader, model="h3.safetensors", **LOADER)[0]
    assert cache.execute(H3ModelLoader, model="h3.safetensors", **LOADER)[0] is a and cache.runs == 1
    _touch(path, seed=4)
    b = cache.execute(H3ModelLoader, model="h3.safetensors", **LOADER)[0]
    assert cache.runs == 2 and b is not a and loader_mod.resident_model() is b
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert any(not torch.equal(sa[k], sb[k]) for k in sa if sa[k].is_floating_point())  # the new file's weights
    os.remove(path)  # deleted: the node runs again and says so, instead of serving the cached model
    with pytest.raises(H3NodeError, match="model file 'h3.safetensors' was not found"):
        cache.execute(H3ModelLoader, model="h3.safetensors", **LOADER)
    assert H3ModelLoader.IS_CHANGED(model=TINY_CHOICE) == H3ModelLoader.IS_CHANGED(model=TINY_CHOICE)
    loader_mod.release_resident()


def test_text_states_and_lora_files_bust_the_cache(comfy, monkeypatch):
    from safetensors.torch import save_file

    f = comfy.input_dir / "states.safetensors"
    save_file({"text_states": torch.zeros(1, 3, 5120)}, str(f))
    cache = ComfyCache()
    first = cache.execute(H3TextStatesLoader, text_states="states.safetensors")[0]
    assert cache.execute(H3TextStatesLoader, text_states="states.safetensors")[0] is first
    save_file({"text_states": torch.ones(1, 3, 5120)}, str(f))
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 10**9))
    again = cache.execute(H3TextStatesLoader, text_states="states.safetensors")[0]
    assert bool((again[0][0] == 1).all()), "the replaced states file was not read again"
    # the LoRA node: its IS_CHANGED follows the file in models/loras (the runtime re-applies a changed file)
    lora = comfy.root / "loras"
    lora.mkdir()
    (lora / "l.safetensors").write_bytes(b"x")
    fp = sys.modules["folder_paths"]
    monkeypatch.setattr(fp, "get_full_path", lambda key, name: str(lora / name) if (lora / name).is_file() else None)
    one = H3LoRA.IS_CHANGED(lora_name="l.safetensors", strength=1.0, mode="merge", model=None)
    (lora / "l.safetensors").write_bytes(b"xy")
    assert H3LoRA.IS_CHANGED(lora_name="l.safetensors", strength=1.0, mode="merge") != one
    assert H3LoRA.IS_CHANGED(lora_name="gone.safetensors") == "missing"


@pytest.mark.parametrize("node", [H3ModelLoader, H3TextStatesLoader, H3LoRA])
def test_is_changed_of_a_linked_input_never_raises(comfy, node):
    """ComfyUI asks IS_CHANGED without evaluating links: current core passes a linked widget input as None, older
    versions leave it out. A raise there makes ComfyUI store NaN (never equal to itself): the node, and all after
    it, ran again on every prompt. (H3LoRA's raised TypeError from folder_paths.get_full_path(None).)"""
    assert isinstance(node.IS_CHANGED(), str)
    name = {H3ModelLoader: "model", H3TextStatesLoader: "text_states", H3LoRA: "lora_name"}[node]
    assert isinstance(node.IS_CHANGED(**{name: None}), str)


def test_v3_nodes_carry_the_cache_fingerprint(comfy, monkeypatch):
    """Before: the V3 classes generated from the V1 ones had no fingerprint_inputs (V3 never reads IS_CHANGED)."""
    io = types.ModuleType("comfy_api.latest.io")

    class ComfyNode:
        pass

    def node_output(*a, ui=None):
        return ("out", a, ui)

    io.ComfyNode, io.NodeOutput = ComfyNode, node_output
    for name in ("Latent", "Conditioning", "String", "Int", "Float", "Boolean"):
        setattr(io, name, types.SimpleNamespace(name=name))
    io.Custom = lambda kind: types.SimpleNamespace(name=kind)
    latest = types.ModuleType("comfy_api.latest")
    latest.io = io
    monkeypatch.setitem(sys.modules, "comfy_api", types.ModuleType("comfy_api"))
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    from h3_blackwell.nodes.v3 import v3_node_classes

    classes = v3_node_classes(NODES)
    for node_id, v1 in NODES.items():
        assert ("fingerprint_inputs" in vars(classes[node_id])) == hasattr(v1, "IS_CHANGED"), node_id
    loader = classes["H3B_ModelLoader"]
    path = comfy.models_dir / "m.safetensors"
    _touch(path, seed=1)
    before = loader.fingerprint_inputs(model="m.safetensors", **LOADER)
    assert before == H3ModelLoader.IS_CHANGED(model="m.safetensors") != "missing"
    _touch(path, seed=2)
    assert loader.fingerprint_inputs(model="m.safetensors", **LOADER) != before


# ---------------------------------------------------------------------------------------------
# the loader: outputs still held after a release, progress, odd inputs
# ---------------------------------------------------------------------------------------------

def test_a_released_model_still_held_is_taken_back_not_loaded_twice(comfy):
    """ComfyUI's output cache holds the loader's H3_MODEL output; when the MODEL output is unloaded (release) and
    then needed again, the reload read a second copy of the same weights while the first was still alive."""
    opts = dict(LOADER, adaln_cache=False)
    loader_mod.release_resident()
    held = H3ModelLoader().load(TINY_CHOICE, **opts)[0]  # what the cache keeps
    assert loader_mod.resident_handle().release() == 0  # the MODEL's unload: held elsewhere, nothing freed
    comfy.progress.clear()
    again = H3ModelLoader().load(TINY_CHOICE, **opts)[0]
    assert again is held and loader_mod.resident_model() is held and comfy.progress == []
    other = H3ModelLoader().load(TINY_CHOICE, **dict(opts, fc2_lt="on"))[0]  # other inputs: a real load
    assert other is not held
    loader_mod.release_resident()


def test_loader_progress_bar_reaches_the_end(comfy):
    """Before: the bar stopped one tensor short (the runtime reports the tensors done before each one)."""
    loader_mod.release_resident()
    H3ModelLoader().load(TINY_CHOICE, **dict(LOADER, fc2_lt="strict"))
    done, total = comfy.progress[-1]
    assert done == total > 1 and [d for d, _ in comfy.progress] == sorted(d for d, _ in comfy.progress)
    loader_mod.release_resident()


def test_loader_optional_and_odd_inputs(comfy):
    loader_mod.release_resident()
    rt = H3ModelLoader().load(TINY_CHOICE, **LOADER, vram_budget=None)[0]  # an empty optional socket: auto
    assert rt.plan.options.to_dict() == H3ModelLoader().load(TINY_CHOICE, **LOADER)[0].plan.options.to_dict()
    for bad in (None, 3):
        with pytest.raises(H3NodeError, match=r"^H3 NVFP4 Model Loader: model: expected a file name"):
            H3ModelLoader().load(bad, **LOADER)
    loader_mod.release_resident()


# ---------------------------------------------------------------------------------------------
# the sampler: optional sockets, core's batch nodes, denoise range
# ---------------------------------------------------------------------------------------------

def test_sampler_optional_sockets_left_empty(comfy, tiny, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(sampler_mod, "run_job", rec)
    H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **SAMPLE_ARGS, sparse_tau=None,
                       first_block_cache=None)
    (job,) = rec.jobs
    assert job.lossy.sparse_tau is None and job.lossy.first_block_cache is None  # the defaults: off on this model


def test_sampler_batch_index_from_core_batch_nodes(comfy, tiny, monkeypatch):
    """Core draws the noise of entry k of batch_index as the generator's k-th draw per stream: the H3 Sampler's job
    carries k (the runtime draws that noise: tests/runtime/sampling/test_noise.py). Not one integer in range:
    refused with what to do."""
    rec = Recorder()
    monkeypatch.setattr(sampler_mod, "run_job", rec)
    lat = core_empty_latent(64, 64, 5)
    for given, want in ((None, 0), ([0], 0), ([2], 2), (torch.tensor([7]), 7), (torch.tensor(3), 3),
                        (np.array([5]), 5), ([np.int64(6)], 6), ((4,), 4)):
        extra = {} if given is None else {"batch_index": given}
        out = H3Sampler().sample(tiny, core_conditioning(), {**lat, **extra}, **SAMPLE_ARGS)[0]
        assert rec.jobs[-1].sampling.batch_index == want
        assert ("batch_index" in out) == (given is not None)  # kept in the output, as core's KSampler keeps it
        assert out.get("batch_index") is (None if given is None else given)
    for bad, says in (([0, 1], "expected one index"), ([-1], "expected an index in [0, 4095]"),
                      ([4096], "expected an index in [0, 4095]"), ([1.5], "a list of integers"),
                      ([2.0], "a list of integers"), ([True], "a list of integers"), ([np.True_], "a list of integers"),
                      ("x", "a list of integers"), (b"2", "a list of integers"), ({3: 0}, "a list of integers"),
                      (torch.tensor([2.0]), "a list of integers"), ([[2]], "a list of integers")):
        msg = str(pytest.raises(H3NodeError, H3Sampler().sample, tiny, core_conditioning(),
                                {**lat, "batch_index": bad}, **SAMPLE_ARGS).value)
        assert msg.startswith("H3 Sampler: the latent's batch_index") and says in msg, msg
    assert len(rec.jobs) == 8
    batch2 = {"samples": FakeNestedTensor((torch.zeros(2, 24, 2, 4, 4), torch.zeros(2, 32, 2, 8)))}
    msg = str(pytest.raises(H3NodeError, H3Sampler().sample, tiny, core_conditioning(), batch2, **SAMPLE_ARGS).value)
    assert "batch 2 (video) / 2 (audio)" in msg and "RepeatLatentBatch" in msg  # what to do, too


def test_sampler_denoise_widget_stays_inside_what_the_runtime_takes():
    """Before: the widget allowed 0.0, which the runtime always refused at run time."""
    from h3_blackwell.runtime.sampling.schedule import simple_sigmas

    opts = H3Sampler.INPUT_TYPES()["required"]["denoise"][1]
    assert opts["min"] > 0
    assert simple_sigmas(2, 12.0, opts["min"]).shape == (3,)


def test_sampler_latent_dtypes_layouts_and_extra_keys(comfy, tiny, monkeypatch):
    """fp16 / bf16 / non-contiguous streams and keys other nodes add reach the runtime as fp32 values."""
    rec = Recorder()
    monkeypatch.setattr(sampler_mod, "run_job", rec)
    g = torch.Generator().manual_seed(0)
    v, a = torch.randn(1, 24, 2, 4, 4, generator=g), torch.randn(1, 32, 2, 8, generator=g)
    for lat in ({"samples": FakeNestedTensor((v.half(), a.bfloat16()))},
                {"samples": FakeNestedTensor((v.transpose(3, 4).contiguous().transpose(3, 4), a[..., ::1])),
                 "type": "video", "downscale_ratio_spacial": 16}):
        out, _ = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS)
        ov, oa = out["samples"].tensors
        assert ov.dtype == oa.dtype == torch.float32  # core's latent dtype out, whatever came in
        job = rec.jobs[-1]
        assert torch.equal(job.inputs.video.float(), lat["samples"].tensors[0].float())
        assert torch.equal(job.inputs.audio.float(), lat["samples"].tensors[1].float())
    nan = v.clone()
    nan[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(H3NodeError, match="must be finite"):
        H3Sampler().sample(tiny, core_conditioning(), {"samples": FakeNestedTensor((nan, a))}, **SAMPLE_ARGS)


# ---------------------------------------------------------------------------------------------
# interruption
# ---------------------------------------------------------------------------------------------

def test_interrupt_through_the_servers_progress_hook_leaves_the_model_usable(comfy, tiny, monkeypatch):
    """Under the server every progress update runs ComfyUI's interrupt check, which raises from inside the step
    callback: the run stops there, and the next prompt on the resident model gives the uninterrupted latents."""
    bar = sys.modules["comfy.utils"].ProgressBar
    mm = sys.modules["comfy.model_management"]
    plain = bar.update_absolute

    def hooked(self, value, total=None, preview=None):
        plain(self, value, total, preview)
        if value == 1:
            comfy.interrupt_flag = True  # /interrupt during step 1
        mm.throw_exception_if_processing_interrupted()

    lat = core_empty_latent(64, 64, 5)
    monkeypatch.setattr(bar, "update_absolute", hooked)
    with pytest.raises(InterruptProcessingException):
        H3Sampler().sample(tiny, core_conditioning(), lat, **{**SAMPLE_ARGS, "steps": 3})
    assert comfy.progress == [(1, 3)] and comfy.interrupt_flag is False
    monkeypatch.setattr(bar, "update_absolute", plain)
    comfy.progress.clear()
    out, rep = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS)
    assert comfy.progress == [(1, 2), (2, 2)] and len(rep["per_step_seconds"][0]) == 2
    again, rep2 = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS)
    assert rep["latent_checksums"] == rep2["latent_checksums"]


# ---------------------------------------------------------------------------------------------
# the MODEL path's run report
# ---------------------------------------------------------------------------------------------

def _one_run(rt, seed: int):
    """A handle over ``rt`` with one finished run of one model call -> (handle, video, audio) of that call."""
    handle = cm.RuntimeHandle(rt)
    g = torch.Generator().manual_seed(seed)
    video, audio = torch.randn(1, 24, 2, 4, 4, generator=g), torch.randn(1, 32, 2, 8, generator=g)
    handle.call.begin_run(torch.tensor([1.0, 0.0]))
    handle.call(video, audio, 1.0, torch.randn(1, 4, rt.config.text_dim, generator=g))
    handle.call.end_run()
    return handle, video, audio


def test_model_run_report_refuses_a_latent_of_another_run(tiny):
    """The report pairs the last run's timings and counters with the hashes of the latent it is given; a latent of
    another shape is not that run's output. Before: the report mixed the two."""
    handle, video, audio = _one_run(tiny, 2)
    model = types.SimpleNamespace(model=types.SimpleNamespace(h3_handle=handle))
    rep = cm.run_report(model, video, audio, "H3 Model Run Report")
    assert rep["latent_checksums"]["video"]["shape"] == [1, 24, 2, 4, 4] and rep["workload"]["model_calls"] == 1
    with pytest.raises(H3NodeError, match=r"not the output of this model's last sampling run"):
        cm.run_report(model, torch.zeros(1, 24, 7, 4, 6), torch.zeros(1, 32, 2, 37), "H3 Model Run Report")



def test_model_run_report_tells_a_same_shape_latent_of_another_run_by_its_values(tiny):
    """Core hands the run's samples (and a custom sampler's denoised output) out through the model's
    process_latent_out, which remembers their values: a latent of the same shapes with other values (an earlier run
    of this MODEL, another model's) is refused; the run's own, also after core's fp16 / bf16 intermediates, is
    reported. Before: only the shapes were compared, so such a report paired one run's timings with another's
    latent."""
    handle, video, audio = _one_run(tiny, 3)
    packed = torch.cat([video.reshape(1, 1, -1), audio.reshape(1, 1, -1)], dim=-1)  # core's flat pack
    handle.sampling = True  # as between core's pre_run and cleanup
    handle.record_output(packed)  # what H3CoreModel.process_latent_out records
    model = types.SimpleNamespace(model=types.SimpleNamespace(h3_handle=handle))
    title = "H3 Model Run Report"
    assert cm.run_report(model, video, audio, title)["latent_checksums"]["video"]["shape"] == [1, 24, 2, 4, 4]
    for dt in (torch.float16, torch.bfloat16):
        cm.run_report(model, video.to(dt), audio.to(dt), title)
    other = video.clone()
    other[0, 0, 0, 0, 0] += 1.0
    for v, a in ((other, audio), (video, audio * 2), (other.to(torch.float16), audio.to(torch.float16))):
        with pytest.raises(H3NodeError, match=r"its values are neither that run's samples nor its denoised output"):
            cm.run_report(model, v, a, title)


def test_fun_control_fades_left_empty(comfy, tiny, tmp_path):
    """Before: an empty fade socket (None) crashed the node with a TypeError from int(None)."""
    from fixtures.tiny_control import save_tiny_control

    from h3_blackwell.nodes.control import H3FunControlNetApply
    from h3_blackwell.runtime import load_control
    from h3_blackwell.runtime.model.config import TINY

    tower = load_control(save_tiny_control(tmp_path / "t.safetensors", TINY, (0, 2), seed=5), types.SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.float32, quantize=False, adaln_on_host=False), TINY)
    tower.injection_layers = tower.places
    out = H3FunControlNetApply().apply(tiny, object(), 1.0, 0.0, 1.0, model_patch=types.SimpleNamespace(model=tower),
                                       control_video=torch.rand(5, 64, 64, 3), fade_in_frames=None,
                                       fade_out_frames=None)[0]
    assert (out.fun_control.fade_in_frames, out.fun_control.fade_out_frames) == (0, 0)
