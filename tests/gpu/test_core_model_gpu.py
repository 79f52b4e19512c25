"""The H3 MODEL's adapter on a real GPU, without ComfyUI (run: python3 -m pytest -m gpu tests/gpu/test_core_model_gpu.py -s).

The runtime on CUDA with the loader's defaults (the fast stack the plan picks: W4A8 on Hopper, NVFP4 elsewhere):
one sampling run of model calls as core's sampler makes them equals the same fast stack evaluated one forward at a
time; the run's report times the calls with CUDA events and counts FC2 as configured; releasing the runtime (what
an unload of the MODEL from the GPU does) frees its device memory, and the next load reads it again.
"""

import gc
import weakref

import pytest
import torch

from h3_blackwell.nodes import core_model as cm
from h3_blackwell.runtime import H3Conditioning, RuntimeOptions, load_model
from fixtures.sampling import sample
from h3_blackwell.runtime.load import StateDictSource
from h3_blackwell.runtime.model.config import H3Config
from h3_blackwell.runtime.model.layout import latent_shapes
from h3_blackwell.runtime.model.tiny import tiny_state_dict
from h3_blackwell.runtime.ops.streaming import module_device_bytes
from fixtures.reports import report_hashes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


class _Patcher:  # what begin_sampling reads from core's ModelPatcher
    patches, object_patches, hook_patches, weight_wrapper_patches = {}, {}, {}, {}
    model_options = {"transformer_options": {}}


def test_model_calls_on_the_fast_stack_and_release():
    opts = RuntimeOptions.from_env(device="cuda")
    rt = load_model(None, opts)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, 24, 7, 16, 16, generator=g).cuda()
    audio = torch.randn(1, 32, 2, 37, generator=g).cuda()
    text = torch.randn(1, 32, rt.config.text_dim, generator=g).cuda()
    sched = torch.tensor([1.0, 0.9, 0.6, 0.3, 0.0], device="cuda")
    handle = cm.RuntimeHandle(rt, open=lambda: load_model(None, opts))
    dm = cm.H3DiffusionModel(handle)
    handle.begin_sampling(_Patcher())
    payload = {"seed": 3, "audio_scale": 1.0}
    outs = [dm([video, audio], (s * 1000).reshape(1), text, transformer_options={"sample_sigmas": sched},
               minimax_payload=payload) for s in sched[:-1]]
    handle.end_sampling()
    for s, (v, a) in zip(sched[:-1], outs):
        rv, ra = rt.model.forward(video, audio, text, float((s * 1000) / 1000), ops=rt.ops,
                                  cond=H3Conditioning(seed=3))
        assert v.device.type == "cuda" and _rel(v, rv) < 1e-3 and _rel(a, ra) < 1e-3  # same stack, same plan math
    rep = handle.call.report(outs[-1][0], outs[-1][1])
    print(rep["backends"].get("gemm"), rep["per_step_seconds"][0], rep["fc2_dispatch"]["runs"])
    assert len(rep["per_step_seconds"][0]) == 4 and all(s["seconds"] > 0 for s in rep["per_step_seconds"][0])
    assert rep["fc2_dispatch"]["consistent_with_configuration"] and rep["latents_finite"]
    del outs, rv, ra, v, a
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    size = handle.size
    model_ref = weakref.ref(rt.model)
    del rt
    assert handle.release() == size
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    print(f"resident {size} bytes, freed {freed} bytes on release; model collected: {model_ref() is None}")
    assert model_ref() is None  # nothing holds the released model
    assert freed >= 0.9 * size
    rt2 = handle.runtime()  # the next load reads it again
    assert rt2.device.type == "cuda" and handle.resident


def test_an_unload_while_the_runtime_is_held_elsewhere_offloads_it_in_place():
    """ComfyUI's cache holds the loader's outputs, so the MODEL's unload cannot drop the runtime: the handle offloads
    it in place instead. The bytes release returns are the allocator's, at least 90 % of what the runtime held; every
    model tensor is then in host memory; the next use puts it back and samples to the same latent hashes."""
    cfg = H3Config(hidden_size=1024, num_layers=4, num_refiner_layers=1, num_heads=8, head_dim=128,
                   ffn_hidden_size=2816, time_embed_hidden_size=1024, time_embed_dim=512)
    rt = load_model(StateDictSource(tiny_state_dict(cfg, 5, torch.bfloat16), "random 4-block H3", cfg),
                    RuntimeOptions.from_env(device="cuda"))
    vshape, ashape = latent_shapes(256, 256, 22)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 32, cfg.text_dim, generator=g), None, torch.zeros(vshape), torch.zeros(ashape))
    want = report_hashes(sample(rt, *inputs, seed=9, steps=3))
    handle = cm.RuntimeHandle(rt, open=lambda: pytest.fail("an offloaded runtime is never read again"))
    # ``rt`` stays held here, as ComfyUI's output cache holds it
    gc.collect()
    torch.cuda.synchronize()
    size, before = handle.size, torch.cuda.memory_allocated()
    weights = module_device_bytes(rt.model, rt.device)
    freed = handle.release()
    print(f"held {size} bytes; offload freed {freed} (allocator: {before - torch.cuda.memory_allocated()})")
    assert handle.resident and handle.offloaded and rt.parked is not None
    assert freed == before - torch.cuda.memory_allocated() and freed >= 0.9 * size
    assert all(t.device.type == "cpu" for t in list(rt.model.parameters()) + list(rt.model.buffers()))
    assert cm.RuntimeHandle(rt).size == size  # a MODEL made over the offloaded runtime counts what it will hold
    assert handle.runtime() is rt and not handle.offloaded
    assert module_device_bytes(rt.model, rt.device) == weights  # the GEMM scratch grows again in the next run
    assert report_hashes(sample(rt, *inputs, seed=9, steps=3)) == want
