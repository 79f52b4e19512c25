"""The H3 MODEL's adapter contract (nodes/core_model.py, nodes/core_patches.py), without ComfyUI.

The diffusion model gets exactly what core hands ``MiniMaxH3Model.forward`` (newest core: ``comfy/model_base.py``
``MiniMaxH3.extra_conds`` builds ``minimax_payload`` and the pooled ``denoise_mask`` / ``audio_denoise_mask``;
``_apply_model`` passes ``timestep = sigma * 1000`` and ``transformer_options`` with ``sample_sigmas`` and the shifts
``MiniMaxH3SigmaShift`` sets), and must give core's output: the same evaluation as ``forward --payload`` (itself
checked against the float64 oracle of core's semantics, tests/oracles/core_h3.py, which two cases here use too),
the audio carried as core's model carries it. The ModelPatcher side runs against small stand-ins of core's classes
with core's logic for what the adapter relies on (``add_patches`` keeps only keys of ``model.state_dict()``,
``clone`` copies the patch lists and callbacks, ``pre_run`` / ``cleanup`` bracket a run and call its callbacks,
``patch_model`` applies object patches).
The real thing runs in tests/oracles/check_core_model.py (a ComfyUI with core H3; not CI).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
import uuid
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "oracles"))

import cases as case_mod  # noqa: E402
import core_h3  # noqa: E402
from fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth  # noqa: E402

from h3_blackwell.nodes import core_model as cm  # noqa: E402
from h3_blackwell.nodes import core_patches as cp  # noqa: E402
from h3_blackwell.nodes._common import H3NodeError  # noqa: E402
from h3_blackwell.runtime import RuntimeOptions, load_model  # noqa: E402
from h3_blackwell.runtime.io.payload import conditioning_from_payload  # noqa: E402
from h3_blackwell.runtime.lora.apply import apply_loras  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.layout import time_shift_sigma  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny  # noqa: E402

CASES = case_mod.make_cases()
DENSE = dict(quantize=False, attention="reference", dtype="float32", device="cpu")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _cfg(case):
    return TINY.replace(text_dim=case_mod.TEXT_DIM, head_bank=case.get("head_bank", 1),
                        adaln_curve_grid=33 if case.get("curve") else 0)


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    """Dense fp32 runtimes of the case configurations, loaded once: {config: (file, runtime)}."""
    d = tmp_path_factory.mktemp("core_model")
    out = {}

    def get(cfg):
        if cfg not in out:
            path = save_tiny(d / f"m{len(out)}.safetensors", cfg, seed=1, dtype=torch.float32)
            out[cfg] = (path, load_model(str(path), RuntimeOptions.from_env(**DENSE)))
        return out[cfg]
    return get


def core_kwargs(case, schedule=None, shifts=None, audio_scale=1.0):
    """(payload, masks, transformer_options) as core's MiniMaxH3.extra_conds / _apply_model build them."""
    p = case["payload"]
    payload = {"text_token_tags": case["token_tags"], "seed": p.get("seed", 0), "audio_scale": audio_scale,
               "layout": object()}  # core's PackedLayout: the adapter builds its own
    if "keyframes" in p:
        payload["keyframes"] = p["keyframes"]
        payload["cond_video_latents"] = [k["latent"] for k in p["keyframes"] if k.get("latent") is not None]
        payload["cond_audio_latents"] = [k["audio_latent"] for k in p["keyframes"] if k.get("audio_latent") is not None]
    if "refs" in p:
        payload["refs"] = p["refs"]
        payload["cond_video_latents"] = payload.get("cond_video_latents", []) + [r["latent"] for r in p["refs"]
                                                                              if "latent" in r]
    for k in ("visual_cond_noise_aug", "audio_cond_noise_aug"):
        if k in p:
            payload[k] = p[k]
    masks = {}
    for name, pool in (("denoise_mask", core_h3.pooled_video_mask), ("audio_denoise_mask", core_h3.pooled_audio_mask)):
        m = pool(p.get(name))
        if m is not None:
            masks[name] = m.float()
    to = {"sample_sigmas": schedule if schedule is not None else p.get("sample_sigmas")}
    if shifts is not None:
        to["minimax_h3_sigma_shift_video"], to["minimax_h3_sigma_shift_audio"] = shifts
    return payload, masks, to


def call(dm, case, sigma=None, schedule=None, shifts=None, audio_scale=1.0, audio=None):
    payload, masks, to = core_kwargs(case, schedule, shifts, audio_scale)
    sigma = case["sigma"] if sigma is None else sigma
    timestep = torch.tensor([sigma], dtype=torch.float32) * 1000  # model_sampling.timestep(sigma), .float()
    x = [case["video"], case["audio"] if audio is None else audio]
    return dm(x, timestep, case["text_states"], transformer_options=to, minimax_payload=payload, control=None, **masks)


def reference(rt, case, sigma=None, shifts=None, video=None, audio=None):
    """``forward --payload``'s evaluation (the runtime's plan, the canonical payload)."""
    cond = conditioning_from_payload(case["payload"])
    return rt.model.forward(case["video"] if video is None else video, case["audio"] if audio is None else audio,
                            case["text_states"], core_h3.core_sigma(case["sigma"] if sigma is None else sigma),
                            token_tags=case["token_tags"], cond=cond, shifts=shifts, ops=rt.ops)


def diffusion_model(rt):
    return cm.H3DiffusionModel(cm.RuntimeHandle(rt))


# ---------------------------------------------------------------------------------------------
# the conditioning kwargs core passes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_conditioning_kwargs_give_forward_payloads_result(name, runtimes):
    """Keyframes, clip guides, audio guides, references of every kind, condition noise and seed, token tags, pooled
    masks, PDD heads (schedule from transformer_options), curve form: core's kwargs give the payload's evaluation."""
    case = CASES[name]
    _, rt = runtimes(_cfg(case))
    v, a = call(diffusion_model(rt), case)
    rv, ra = reference(rt, case)
    assert v.shape == case["video"].shape and a.shape == case["audio"].shape
    assert _rel(v, rv) < 1e-6 and _rel(a, ra) < 1e-6


@pytest.mark.parametrize("name", ["fl2va_first_last", "ref2va", "video_mask_partial"])
def test_conditioning_kwargs_match_core_oracle(name, runtimes):
    """Independent of the runtime's own payload reading: the float64 oracle of core's semantics."""
    case = CASES[name]
    path, rt = runtimes(_cfg(case))
    from safetensors.torch import load_file

    v, a = call(diffusion_model(rt), case)
    ov, oa = core_h3.core_forward(load_file(str(path)), case["video"], case["audio"], case["text_states"],
                                  case["sigma"], token_tags=case["token_tags"], payload=case["payload"])
    assert _rel(v, ov) < 1e-5 and _rel(a, oa) < 1e-5


def test_unknown_payload_entry_and_bad_fields_are_named(runtimes):
    case = CASES["fl2va_first_last"]
    _, rt = runtimes(_cfg(case))
    dm = diffusion_model(rt)
    payload, _, to = core_kwargs(case)
    with pytest.raises(H3NodeError, match="minimax_fancy"):
        dm([case["video"], case["audio"]], torch.tensor([800.0]), case["text_states"], transformer_options=to,
           minimax_payload={**payload, "minimax_fancy": 1})
    bad = {**payload, "keyframes": [{"resolved_frame_index": 99, "latent": payload["keyframes"][0]["latent"]}]}
    with pytest.raises(H3NodeError, match=r"minimax_keyframes .*keyframes\[0\]\.resolved_frame_index"):
        dm([case["video"], case["audio"]], torch.tensor([800.0]), case["text_states"], transformer_options=to,
           minimax_payload=bad)


# ---------------------------------------------------------------------------------------------
# sigma and timestep conventions
# ---------------------------------------------------------------------------------------------

def test_sigma_timestep_and_shift_conventions(runtimes):
    """timestep = sigma * 1000 (the network sees timestep / 1000); a sigma of the run's schedule (planned once per
    run) and one outside it (planned alone) give the same evaluation; the shifts come from transformer_options."""
    case = CASES["image_and_audio_guide"]
    _, rt = runtimes(_cfg(case))
    sched = torch.tensor([1.0, 0.93, 0.7, 0.4, 0.0])
    on = call(diffusion_model(rt), case, sigma=0.93, schedule=sched)
    off = call(diffusion_model(rt), case, sigma=0.93, schedule=torch.tensor([1.0, 0.9, 0.5, 0.0]))
    ref = reference(rt, case, sigma=0.93)
    for got in (on, off):
        assert _rel(got[0], ref[0]) < 1e-6 and _rel(got[1], ref[1]) < 1e-6
    shifted = call(diffusion_model(rt), case, sigma=0.7, schedule=sched, shifts=(8.0, 4.0))
    ref8 = reference(rt, case, sigma=0.7, shifts=(8.0, 4.0))  # sigma_a depends on the ratio only
    ref12 = reference(rt, case, sigma=0.7)
    assert _rel(shifted[0], ref8[0]) < 1e-6 and _rel(shifted[1], ref8[1]) < 1e-6
    assert _rel(ref8[1], ref12[1]) > 1e-3  # the audio timestep follows the shifts: the test can fail


def test_one_plan_per_run_and_every_call_counted(runtimes):
    case = CASES["fl2va_first_last"]
    _, rt = runtimes(_cfg(case))
    handle = cm.RuntimeHandle(rt)
    dm = cm.H3DiffusionModel(handle)
    sched = torch.tensor([1.0, 0.8, 0.5, 0.0])

    handle.begin_sampling(_patcher())
    payload, _, to = core_kwargs(case, sched)  # one payload object per run, as core's CONDConstant hands it
    for s in (1.0, 0.8, 0.65, 0.5):  # 0.65: a sampler's intermediate point
        dm([case["video"], case["audio"]], torch.tensor([s]) * 1000, case["text_states"], transformer_options=to,
           minimax_payload=payload)
    handle.end_sampling()
    run = handle.call.last_run
    assert run.calls == 4 and len(run.summary) == 1 and run.summary[0]["off_schedule_sigmas"] == [pytest.approx(0.65)]
    assert run.plans == []  # the run's plans are freed when it ends
    rep = handle.call.report(case["video"], case["audio"])
    assert rep["workload"]["model_calls"] == 4 and rep["latents_finite"] is True
    assert len(rep["per_step_seconds"][0]) == 4 and rep["workload"]["steps"] == 3


# ---------------------------------------------------------------------------------------------
# the audio carry
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shifts", [(12.0, 3.0), (8.0, 4.0)])
def test_audio_carry(runtimes, shifts):
    """With core's packed latent (audio_scale = shift_video / shift_audio) the model gets the carried audio
    y = x_a * sigma_v / sigma_a and returns d/dsigma_v of y: (1 - s) * x_a + (1 + (s - 1) * sigma_a) * v_a(x_a)."""
    case = CASES["audio_guide"]
    _, rt = runtimes(_cfg(case))
    s = shifts[0] / shifts[1]
    sigma = 0.55
    sv = torch.tensor(core_h3.core_sigma(sigma), dtype=torch.float32)
    sa = time_shift_sigma(sv, *shifts)
    xa = case["audio"]
    y = xa * (sv / sa)
    v, vy = call(diffusion_model(rt), case, sigma=sigma, shifts=shifts, audio_scale=s, audio=y)
    rv, ra = reference(rt, case, sigma=sigma, shifts=shifts, audio=y * (sa / sv))
    expect = (1.0 - s) * (y * (sa / sv)) + (1.0 + (s - 1.0) * sa) * ra
    assert _rel(v, rv) < 1e-6 and _rel(vy, expect) < 1e-6
    assert _rel(vy, ra) > 1e-2  # the carry changes the result: the test can fail


def test_batch_runs_clip_by_clip(runtimes):
    case = CASES["ref2va"]
    _, rt = runtimes(_cfg(case))
    dm = diffusion_model(rt)
    payload, _, to = core_kwargs(case)
    x2 = [torch.cat([case["video"], -case["video"]]), torch.cat([case["audio"], case["audio"]])]
    v, a = dm(x2, torch.tensor([300.0, 300.0]), torch.cat([case["text_states"]] * 2), transformer_options=to,
              minimax_payload=payload)
    r0 = reference(rt, case)
    r1 = reference(rt, case, video=-case["video"])
    assert _rel(v[:1], r0[0]) < 1e-6 and _rel(v[1:], r1[0]) < 1e-6 and _rel(a[:1], r0[1]) < 1e-6


# ---------------------------------------------------------------------------------------------
# core's classes, in miniature
# ---------------------------------------------------------------------------------------------

class LoRAAdapter:  # comfy.weight_adapter.LoRAAdapter: weights = (up, down, alpha, mid, dora_scale, reshape)
    name = "lora"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys, self.weights = loaded_keys, weights


class LoHaAdapter:
    name = "loha"

    def __init__(self, weights):
        self.weights = weights


def _fake_core(monkeypatch):
    comfy = types.ModuleType("comfy")
    mb = types.ModuleType("comfy.model_base")
    mp = types.ModuleType("comfy.model_patcher")
    sm = types.ModuleType("comfy.supported_models")
    mm = types.ModuleType("comfy.model_management")
    utils = types.ModuleType("comfy.utils")
    wa = types.ModuleType("comfy.weight_adapter")
    ext = types.ModuleType("comfy.patcher_extension")
    ldm = types.ModuleType("comfy.ldm.minimax.model")

    class MiniMaxH3Model(torch.nn.Module):  # core's DiT class (its construction builds the weights; never called)
        def __init__(self, *args, **kwargs):
            raise AssertionError("core's MiniMaxH3Model.__init__ must not run for the H3 MODEL")

    ldm.MiniMaxH3Model = MiniMaxH3Model

    class MiniMaxH3(torch.nn.Module):
        def __init__(self, model_config, model_type=None, device=None):
            super().__init__()
            self.model_config, self.device = model_config, device
            self.model_sampling = torch.nn.Module()
            self.model_sampling.register_buffer("sigmas", torch.linspace(0.001, 1, 10))
            self.current_patcher = None

        def get_dtype(self):  # core's BaseModel
            return self.diffusion_model.dtype

        def process_latent_out(self, latent):  # core's BaseModel with an identity latent format
            return latent

    class Config:
        sampling_settings = {"shift": 12.0, "audio_shift": 3.0}

        def __init__(self, unet_config):
            self.unet_config = dict(unet_config)
            self.sampling_settings = dict(self.sampling_settings)

        def set_inference_dtype(self, dtype, manual_cast_dtype):
            self.unet_config["dtype"], self.manual_cast_dtype = dtype, manual_cast_dtype

    class ModelPatcher:
        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
            self.model, self.load_device, self.offload_device = model, load_device, offload_device
            self.patches, self.object_patches, self.object_patches_backup = {}, {}, {}
            self.weight_wrapper_patches, self.hook_patches, self.callbacks = {}, {}, {}
            self.model_options = {"transformer_options": {}}
            self.patches_uuid = uuid.uuid4()
            for k in ("model_loaded_weight_memory", "lowvram_patch_counter", "model_offload_buffer_memory"):
                setattr(model, k, 0)
            model.model_lowvram, model.current_weight_patches_uuid = False, None

        def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):  # core's logic
            sd = self.model.state_dict()
            taken = []
            for k in patches:
                if k in sd:
                    taken.append(k)
                    self.patches.setdefault(k, []).append((strength_patch, patches[k], strength_model, None, None))
            self.patches_uuid = uuid.uuid4()
            return taken

        def clone(self):
            n = self.__class__(self.model, self.load_device, self.offload_device, self.model_size())
            n.patches = {k: v[:] for k, v in self.patches.items()}
            n.object_patches = dict(self.object_patches)
            n.model_options = {"transformer_options": dict(self.model_options["transformer_options"])}
            n.patches_uuid = self.patches_uuid
            n.callbacks = {k: {k1: c1.copy() for k1, c1 in c.items()} for k, c in self.callbacks.items()}
            return n

        def add_callback_with_key(self, call_type, key, callback):
            self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

        def model_size(self):
            return 0

        def model_patches_models(self):  # core's logic: every patch entry's models(), to load beside the model
            to = self.model_options["transformer_options"]
            out = [m for name in to.get("patches", {}) for p in to["patches"][name] if hasattr(p, "models")
                   for m in p.models()]
            return out + [m for name in to.get("patches_replace", {}) for p in to["patches_replace"][name].values()
                          if hasattr(p, "models") for m in p.models()]

        def use_ejected(self, skip_and_inject_on_exit_only=False):
            return contextlib.nullcontext()

        def eject_model(self):
            pass

        def get_all_callbacks(self, kind):
            return [c for cs in self.callbacks.get(kind, {}).values() for c in cs]

        def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
            for k, v in self.object_patches.items():
                self.object_patches_backup.setdefault(k, getattr(self.model, k))
                setattr(self.model, k, v)
            if load_weights:
                self.load(device_to)
            return self.model

        def pre_run(self):
            self.model.current_patcher = self
            for callback in self.get_all_callbacks(CallbacksMP.ON_PRE_RUN):
                callback(self)

        def cleanup(self):
            self.model.current_patcher = None
            for callback in self.get_all_callbacks(CallbacksMP.ON_CLEANUP):
                callback(self)

    class CallbacksMP:
        ON_LOAD, ON_PRE_RUN, ON_CLEANUP = "on_load_after", "on_pre_run", "on_cleanup"

    mb.MiniMaxH3, sm.MiniMaxH3, mp.ModelPatcher, ext.CallbacksMP = MiniMaxH3, Config, ModelPatcher, CallbacksMP
    mm.unet_offload_device = lambda: torch.device("cpu")
    utils.set_attr = lambda obj, k, v: setattr(obj, k, v)
    wa.LoRAAdapter = LoRAAdapter
    mods = {"comfy": comfy, "comfy.model_base": mb, "comfy.model_patcher": mp, "comfy.supported_models": sm,
            "comfy.model_management": mm, "comfy.utils": utils, "comfy.weight_adapter": wa,
            "comfy.patcher_extension": ext, "comfy.ldm": types.ModuleType("comfy.ldm"),
            "comfy.ldm.minimax": types.ModuleType("comfy.ldm.minimax"), "comfy.ldm.minimax.model": ldm}
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
        if k.count(".") == 1:
            setattr(comfy, k.split(".", 1)[1], v)
    # core_classes subclasses core's classes at import: imported afresh over these stand-ins, dropped afterwards
    monkeypatch.setitem(sys.modules, CORE_CLASSES, None)
    del sys.modules[CORE_CLASSES]
    importlib.import_module(CORE_CLASSES)


CORE_CLASSES = cm.__package__ + ".core_classes"


def make_core_model(rt):
    """The loader's MODEL over a loaded ``rt`` (core_classes over the stand-in core)."""
    return sys.modules[CORE_CLASSES].make_core_model(cm.RuntimeHandle(rt))


def core_lora_patches(path) -> dict:
    """What core's load_lora makes of a file in the diffusion_model form: {weight key: LoRAAdapter | ("diff",)}."""
    from safetensors.torch import load_file

    sd = load_file(str(path))
    out = {}
    for k in sd:
        if k.endswith(".lora_up.weight"):
            m = k[: -len(".lora_up.weight")]
            alpha = sd.get(m + ".alpha")
            out[m + ".weight"] = LoRAAdapter({k}, (sd[k], sd[m + ".lora_down.weight"],
                                                   None if alpha is None else float(alpha), None, None, None))
        elif k.endswith(".diff"):
            out[k[: -len(".diff")] + ".weight"] = ("diff", (sd[k],))
        elif k.endswith(".diff_b"):
            out[k[: -len(".diff_b")] + ".bias"] = ("diff", (sd[k],))
    return out


@pytest.fixture()
def core(monkeypatch, tmp_path):
    _fake_core(monkeypatch)
    path = save_tiny(tmp_path / "tiny.safetensors", TINY, seed=2, dtype=torch.float32)
    rt = load_model(str(path), RuntimeOptions.from_env(**DENSE))
    return path, rt


def _t2va(rt):
    g = torch.Generator().manual_seed(4)
    return dict(video=torch.randn(1, 24, 7, 4, 6, generator=g), audio=torch.randn(1, 32, 2, 37, generator=g),
                text_states=torch.randn(1, 8, rt.config.text_dim, generator=g), token_tags=None, sigma=0.8,
                payload={"seed": 1})


def _run(patcher, case):
    """One sampling run as core brackets it: load, pre_run, the model calls, cleanup."""
    patcher.patch_model(patcher.load_device)
    patcher.pre_run()
    try:
        return call(patcher.model.diffusion_model, case, schedule=torch.tensor([1.0, 0.8, 0.0]))
    finally:
        patcher.cleanup()


def test_core_model_names_weights_as_core_and_sizes_the_resident_model(core):
    _, rt = core
    patcher = make_core_model(rt)
    sd = patcher.model.state_dict()
    inner = rt.config.num_heads * rt.config.head_dim
    assert sd["diffusion_model.blocks.0.attn.qkv_proj.weight"].shape == (3 * inner, rt.config.hidden_size)
    assert sd["diffusion_model.blocks.0.attn.qkv_proj.weight"].is_meta
    assert {"diffusion_model.final_layer.video_out.weight", "diffusion_model.token_refiner.blocks.0.mlp.fc2.weight",
            "diffusion_model.rope.inv_freq"} <= set(sd)
    assert patcher.model_size() == rt.device_bytes() > 0 and patcher.model.get_dtype() == torch.float32
    assert patcher.model.diffusion_model.preprocess_text_embeds(torch.ones(1, 3, 5)).shape == (1, 3, 5)


def test_lora_patches_read_from_the_model(core, tmp_path):
    """LoraLoaderModelOnly at 0.8 records LoRAAdapter / diff patches; the run applies them through the runtime's
    LoRA machinery: the result equals the runtime with the same file at 0.8, and the next run without them is the
    base model again, bit for bit."""
    path, rt = core
    base = make_core_model(rt)
    case = _t2va(rt)
    v0, a0 = _run(base, case)
    lora = save_tiny_lora(tmp_path / "l.safetensors", tiny_lora_truth(TINY, seed=3), "diffusion_model")
    patches = core_lora_patches(lora)
    patched = base.clone()
    assert sorted(patched.add_patches(patches, 0.8)) == sorted(patches)  # every key is a weight of the MODEL
    v1, a1 = _run(patched, case)
    rt2 = load_model(str(path), RuntimeOptions.from_env(**DENSE))
    apply_loras(rt2, [(str(lora), 0.8, "merge")])
    r1 = call(diffusion_model(rt2), case, schedule=torch.tensor([1.0, 0.8, 0.0]))
    assert _rel(v1, r1[0]) < 1e-6 and _rel(a1, r1[1]) < 1e-6
    assert _rel(v1, v0) > 1e-3
    assert "x0.8 merge" in rt.backends["lora"]["reason"]
    v2, a2 = _run(base, case)
    assert torch.equal(v2, v0) and torch.equal(a2, a0)
    # the same records again: the same file, nothing re-applied
    assert cp.lora_specs(patched.patches) == cp.lora_specs(patched.patches)


def test_lora_side_mode_from_transformer_options(core, tmp_path):
    """h3b_lora_mode = side in the MODEL's transformer_options: the records run as the runtime's side path."""
    path, rt = core
    m = make_core_model(rt).clone()
    lora = save_tiny_lora(tmp_path / "l.safetensors", tiny_lora_truth(TINY, seed=3), "diffusion_model")
    m.add_patches(core_lora_patches(lora), 0.8)
    m.model_options["transformer_options"][cm.LORA_MODE_KEY] = "side"
    case = _t2va(rt)
    plain = m.model_size()
    v, _ = _run(m, case)
    assert "x0.8 side" in rt.backends["lora"]["reason"] and rt.backends["lora"]["report"]["side"]
    assert m.model_size() == rt.device_bytes() > plain  # the side paths' A and B count in what ComfyUI is told
    rt2 = load_model(str(path), RuntimeOptions.from_env(**DENSE))
    apply_loras(rt2, [(str(lora), 0.8, "side")])
    assert _rel(v, call(diffusion_model(rt2), case, schedule=torch.tensor([1.0, 0.8, 0.0]))[0]) < 1e-6
    m.model_options["transformer_options"][cm.LORA_MODE_KEY] = "fast"
    with pytest.raises(H3NodeError, match="'merge' or 'side'"):
        m.pre_run()


def test_stacked_loras_and_strengths(core, tmp_path):
    path, rt = core
    base = make_core_model(rt)
    l1 = save_tiny_lora(tmp_path / "a.safetensors", tiny_lora_truth(TINY, seed=3), "diffusion_model")
    l2 = save_tiny_lora(tmp_path / "b.safetensors", tiny_lora_truth(TINY, seed=5), "diffusion_model")
    m = base.clone()
    m.add_patches(core_lora_patches(l1), 0.8)
    m = m.clone()
    m.add_patches(core_lora_patches(l2), -0.5)
    specs = cp.lora_specs(m.patches)
    assert [(s, mode) for _, s, mode in specs] == [(0.8, "merge"), (-0.5, "merge")]
    case = _t2va(rt)
    v, _ = _run(m, case)
    rt2 = load_model(str(path), RuntimeOptions.from_env(**DENSE))
    apply_loras(rt2, [(str(l1), 0.8, "merge"), (str(l2), -0.5, "merge")])
    assert _rel(v, call(diffusion_model(rt2), case, schedule=torch.tensor([1.0, 0.8, 0.0]))[0]) < 1e-6


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------

def _patches_with(key, entry):
    return {key: [entry]}


@pytest.mark.parametrize("entry, match", [
    ((1.0, LoHaAdapter((1, 2)), 1.0, None, None), "'loha'"),
    ((1.0, LoRAAdapter(set(), (torch.ones(96, 2), torch.ones(2, 96), None, None, None, None)), 1.0, (0, 0, 96), None),
     "slice"),
    ((1.0, LoRAAdapter(set(), (torch.ones(96, 2), torch.ones(2, 96), None, None, torch.ones(96), None)), 1.0, None,
      None), "DoRA"),
    ((0.5, ("diff", (torch.ones(96, 96),)), 0.5, None, None), "strength_model=0.5"),
    ((1.0, ("set", (torch.ones(96, 96),)), 1.0, None, None), "'set'"),
    ((1.0, ("diff", (torch.ones(96, 96),)), 1.0, None, lambda w: w), "weight function"),
])
def test_unknown_lora_records_are_refused_by_name(monkeypatch, entry, match):
    _fake_core(monkeypatch)
    with pytest.raises(H3NodeError, match=match) as e:
        cp.lora_specs(_patches_with("diffusion_model.blocks.0.attn.out_proj.weight", entry))
    assert "blocks.0.attn.out_proj" in str(e.value) and "H3 MODEL" in str(e.value)


@pytest.mark.parametrize("options, match", [
    ({"patches_replace": {"dit": {("double_block", 3): lambda a, b: a}}},
     r"patches_replace\['dit'\]\[\('double_block', 3\)\]"),
    ({"patches": {"attn1_patch": [lambda *a: a]}}, r"patches\['attn1_patch'\]"),
    ({"optimized_attention_override": lambda *a: a}, "attention override"),
    ({"wrappers": {"diffusion_model": {"easycache": [lambda *a: a]}}}, "diffusion-model wrapper"),
])
def test_unknown_model_patches_are_refused(runtimes, options, match):
    case = CASES["fl2va_first_last"]
    _, rt = runtimes(_cfg(case))
    payload, _, to = core_kwargs(case)
    with pytest.raises(H3NodeError, match=match) as e:
        diffusion_model(rt)([case["video"], case["audio"]], torch.tensor([800.0]), case["text_states"],
                            transformer_options={**to, **options}, minimax_payload=payload)
    assert "never dropped silently" in str(e.value)


def test_core_keys_that_are_no_patches_pass(runtimes):
    """What core itself puts in transformer_options on every call, and empty patch tables, are not refusals."""
    case = CASES["fl2va_first_last"]
    _, rt = runtimes(_cfg(case))
    payload, _, to = core_kwargs(case)
    to.update(patches={}, patches_replace={"dit": {}}, wrappers={"outer_sample": {"x": [print]}}, callbacks={},
              cond_or_uncond=[0], uuids=[uuid.uuid4()], sigmas=torch.tensor([0.8]), prefetch_dynamic_vbars=False)
    v, _ = diffusion_model(rt)([case["video"], case["audio"]], torch.tensor([800.0]), case["text_states"],
                               transformer_options=to, minimax_payload=payload, c_concat=None)
    assert _rel(v, reference(rt, case)[0]) < 1e-6


def test_controlnet_unknown_kwargs_object_patches_and_hooks_are_refused(core):
    _, rt = core
    patcher = make_core_model(rt)
    case = _t2va(rt)
    payload, _, to = core_kwargs(case)
    dm = patcher.model.diffusion_model
    x, ts, ctx = [case["video"], case["audio"]], torch.tensor([800.0]), case["text_states"]
    with pytest.raises(H3NodeError, match="ControlNet"):
        dm(x, ts, ctx, transformer_options=to, minimax_payload=payload, control={"output": []})
    with pytest.raises(H3NodeError, match="'guidance'"):
        dm(x, ts, ctx, transformer_options=to, minimax_payload=payload, guidance=torch.ones(1))
    shifted = patcher.clone()
    shifted.object_patches["model_sampling"] = torch.nn.Module()  # MiniMaxH3SigmaShift's patch: allowed
    _run(shifted, case)
    odd = patcher.clone()
    odd.object_patches["diffusion_model.forward_orig"] = print
    with pytest.raises(H3NodeError, match="object patch of 'diffusion_model.forward_orig'"):
        odd.pre_run()
    hooked = patcher.clone()
    hooked.hook_patches = {"hook": {}}
    with pytest.raises(H3NodeError, match="weight hooks"):
        hooked.pre_run()


def test_weight_paths_of_core_are_refused_and_unload_keeps_a_cpu_model(core):
    _, rt = core
    patcher = make_core_model(rt)
    with pytest.raises(H3NodeError, match="patch the weight"):
        patcher.patch_weight_to_device("diffusion_model.blocks.0.attn.qkv_proj.weight")
    with pytest.raises(H3NodeError, match="saving the H3 MODEL"):
        patcher.state_dict_for_saving()
    assert patcher.partially_load(torch.device("cpu")) == rt.device_bytes()
    assert patcher.partially_unload(torch.device("cpu"), 1) == 0  # on the CPU nothing is freed: kept resident
    assert patcher.model.h3_handle.resident


def test_process_latent_out_remembers_the_runs_outputs(core):
    """core's process_latent_out (every sampler's result, SamplerCustomAdvanced's denoised output right after the run)
    returns core's value and records its fingerprints for H3 Model Run Report: during a run (the last few), and once
    after it; a later call (core's AddNoise) is not recorded; a new run starts afresh."""
    _, rt = core
    patcher = make_core_model(rt)
    handle = patcher.model.h3_handle
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 300, generator=g)
    assert torch.equal(patcher.model.process_latent_out(x), x) and handle.outputs == []  # outside a run
    handle.begin_sampling(_patcher())
    patcher.model.process_latent_out(x)
    assert handle.outputs == [cm.latent_fingerprints(x)] and len(handle.outputs[0]) == 3  # fp32, fp16, bf16
    for _ in range(6):
        patcher.model.process_latent_out(torch.randn(1, 1, 300, generator=g))
    assert len(handle.outputs) == 4  # the last ones only
    handle.end_sampling()
    x0 = torch.randn(1, 1, 300, generator=g)
    patcher.model.process_latent_out(x0)  # the denoised output, right after the run
    patcher.model.process_latent_out(torch.randn(1, 1, 300, generator=g))  # a later node's
    assert handle.outputs[-1] == cm.latent_fingerprints(x0) and len(handle.outputs) == 4
    handle.begin_sampling(_patcher())
    assert handle.outputs == []


def test_latent_fingerprints_take_each_batch_entry_in_core_pack_order():
    """core packs a batch-2 (video, audio) latent as [B, 1, Nv + Na] rows (each entry's video, then its audio); the
    nested form gives the same per-entry fingerprints, and each entry (a LatentFromBatch slice) is among them."""
    g = torch.Generator().manual_seed(6)
    v, a = torch.randn(2, 24, 2, 4, 4, generator=g), torch.randn(2, 32, 2, 8, generator=g)
    packed = torch.cat([v.reshape(2, 1, -1), a.reshape(2, 1, -1)], dim=-1)
    assert cm.latent_fingerprints(packed) == cm.latent_fingerprints(types.SimpleNamespace(
        is_nested=True, unbind=lambda: (v, a)))
    entry = torch.cat([v[1].reshape(-1), a[1].reshape(-1)])[None, None]  # batch entry 1, packed alone
    assert cm.latent_fingerprints(entry) <= cm.latent_fingerprints(packed)


def test_release_and_reload():
    """An unload releases the runtime when the handle held its last reference (its bytes are freed); the next
    load reads it again."""
    from h3_blackwell.runtime import RuntimeOptions, load_model

    opts = RuntimeOptions(device="cpu", quantize=False)
    loads = []
    handle = cm.RuntimeHandle(open=lambda: loads.append(1) or load_model(None, opts))
    assert loads == [1]
    size = handle.size
    model_ref = weakref.ref(handle.runtime().model)
    assert handle.release() == size and not handle.resident and loads == [1]
    assert model_ref() is None  # nothing holds the released model: its memory went
    rt2 = handle.runtime()
    assert loads == [1, 1] and handle.resident and rt2.model is not None


def test_a_runtime_held_elsewhere_is_not_said_to_be_freed(core):
    """ComfyUI caches the loader's H3_MODEL output (the runtime itself) beside the MODEL: an unload cannot free
    what that output holds, so release says 0 bytes went and keeps the runtime resident (it is not read twice)."""
    _, rt = core
    loads = []
    handle = cm.RuntimeHandle(rt, open=lambda: loads.append(1) or rt)
    assert handle.release() == 0 and handle.resident and loads == []
    assert handle.runtime() is rt and loads == []  # no reload: it never left


def test_an_unload_of_a_held_cuda_runtime_offloads_it_and_core_is_told_what_went(core, monkeypatch):
    """On CUDA the release of a runtime held elsewhere offloads it in place (``H3Runtime.offload``, measured on a GPU
    in tests/gpu/test_core_model_gpu.py): the patcher's unload returns the bytes the offload freed and reports
    nothing loaded, and core's next load brings the same runtime back (never a second read). Here the runtime is on
    the CPU, so the handle is told it is on CUDA and the offload is the CPU park with a stated byte count."""
    from h3_blackwell.runtime.offload import park

    _, rt = core
    patcher = make_core_model(rt)  # no file to read again: an offloaded runtime is never read again
    handle = patcher.model.h3_handle
    handle.device = torch.device("cuda")

    def offload():
        rt.parked = park(rt)
        return 12345
    monkeypatch.setattr(rt, "offload", offload)
    patcher.load(torch.device("cpu"))
    assert patcher.loaded_size() == handle.size > 0
    g = torch.Generator().manual_seed(2)  # one finished run, for H3 Model Run Report after the unload
    video, audio = torch.randn(1, 24, 2, 4, 4, generator=g), torch.randn(1, 32, 2, 8, generator=g)
    handle.call.begin_run(torch.tensor([1.0, 0.0]))
    handle.call(video, audio, 1.0, torch.randn(1, 4, rt.config.text_dim, generator=g))
    handle.call.end_run()
    last = handle.call.last_run
    assert patcher.partially_unload(torch.device("cpu"), 1) == 12345
    assert handle.resident and handle.offloaded and patcher.loaded_size() == 0
    assert handle.call.last_run is last  # the run report still reads the run before the unload
    patcher.load(torch.device("cpu"))
    assert rt.parked is None and not handle.offloaded and patcher.loaded_size() == handle.size
    patcher.partially_unload(torch.device("cpu"), 1)
    rt.onload()  # the H3 Sampler or an H3 LoRA output brings it back behind the patcher: core is told so
    assert patcher.loaded_size() == handle.size


def test_an_unload_that_frees_nothing_keeps_one_model_and_one_handle(core, monkeypatch):
    """The MODEL's release while ComfyUI's cache holds the loader's H3_MODEL output frees nothing (0 bytes): the
    runtime stays in the handle, and the loader keeps listing it with the same MODEL, so a rerun of the loader
    hands out that MODEL, not a second handle over the same runtime (which ComfyUI would count twice)."""
    from h3_blackwell.nodes import loader as loader_mod
    from h3_blackwell.nodes.loader import TINY_CHOICE, H3ModelLoader

    monkeypatch.setattr(loader_mod, "_load_progress", lambda: None)  # the stand-in core has no ProgressBar
    loader_mod.release_resident()
    rt, model = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)  # both cached by ComfyUI
    handle = model.model.h3_handle
    assert handle is loader_mod.resident_handle()  # one owner: the loader's and the MODEL's
    assert handle.release() == 0 and handle.resident and handle.runtime() is rt
    assert loader_mod.resident_model() is rt
    again = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)
    assert again[0] is rt and again[1] is model
    loader_mod.release_resident()


def test_a_released_model_is_read_again_by_its_one_owner(core, monkeypatch):
    """Nothing else holds the runtime: the MODEL's release frees it (the bytes it held), and the next use, through
    the MODEL (core's load) or the loader, reads the file again into the same owner: one MODEL, one handle."""
    from h3_blackwell.nodes import loader as loader_mod
    from h3_blackwell.nodes.loader import TINY_CHOICE, H3ModelLoader

    monkeypatch.setattr(loader_mod, "_load_progress", lambda: None)
    loader_mod.release_resident()
    rt, model = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "off", True)
    handle, ref = model.model.h3_handle, weakref.ref(rt)
    del rt
    assert handle.release() == handle.size > 0 and not handle.resident and ref() is None
    assert loader_mod.resident_model() is None
    model.load(torch.device("cpu"))  # core's load reads it again
    assert handle.resident and model.loaded_size() == handle.size
    again = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "off", True)
    assert again[0] is handle.loaded and again[1] is model and loader_mod.resident_handle() is handle
    del again
    handle.release()
    assert H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "off", True)[1] is model  # the loader reads it again
    assert handle.resident
    loader_mod.release_resident()


def test_loader_model_output_without_core_h3():
    """Outside a ComfyUI with core H3 the MODEL output says what it needs when used."""
    from h3_blackwell.nodes.loader import TINY_CHOICE, H3ModelLoader, release_resident

    release_resident()
    rt, model = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)
    with pytest.raises(H3NodeError, match="core's MiniMax H3 support"):
        model.clone()
    release_resident()


def _patcher(to_extra=None):
    """What begin_sampling reads from core's ModelPatcher: no patches, these transformer_options."""
    class Patcher:
        patches, object_patches, hook_patches, weight_wrapper_patches = {}, {}, {}, {}
        model_options = {"transformer_options": dict(to_extra or {})}

    return Patcher()


# ---------------------------------------------------------------------------------------------
# the LOSSY options follow the calls
# ---------------------------------------------------------------------------------------------

def _sample_run(handle, case, sched, to_extra):
    dm = cm.H3DiffusionModel(handle)
    handle.begin_sampling(_patcher(to_extra))
    payload, _, to = core_kwargs(case, sched)
    outs = [dm([case["video"], case["audio"]], torch.tensor([float(s)]) * 1000, case["text_states"],
               transformer_options=to, minimax_payload=payload) for s in sched[:-1]]
    handle.end_sampling()
    return outs, handle.call.report(case["video"], case["audio"])


def test_first_block_cache_per_call(runtimes):
    """h3b_first_block_cache in the MODEL's transformer_options: 0 reuses nothing (exactly the uncached outputs);
    a large threshold skips the blocks after the first computed call; the report says which calls."""
    case = CASES["fl2va_first_last"]
    _, rt = runtimes(_cfg(case))
    sched = torch.tensor([1.0, 0.95, 0.9, 0.85, 0.0])
    plain, _ = _sample_run(cm.RuntimeHandle(rt), case, sched, {})
    zero, rep0 = _sample_run(cm.RuntimeHandle(rt), case, sched, {cm.FIRST_BLOCK_CACHE_KEY: 0.0})
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, zero))
    assert rep0["first_block_cache"]["reused_steps"] == []
    big, rep = _sample_run(cm.RuntimeHandle(rt), case, sched, {cm.FIRST_BLOCK_CACHE_KEY: 1e9})
    assert rep["first_block_cache"]["reused_steps"] == [1, 2, 3] and rep["first_block_cache"]["lossy"]
    assert torch.equal(big[0][0], plain[0][0]) and not torch.equal(big[2][0], plain[2][0])


def test_sparse_attention_window_per_call(tmp_path):
    """attention=sparse at load: each call's sigma decides sparse or dense (dense above the window and for short
    sequences, as core's rule); the run report has the per-call record."""
    case = CASES["fl2va_first_last"]
    path = save_tiny(tmp_path / "s.safetensors", _cfg(case), seed=1, dtype=torch.float32)
    rt = load_model(str(path), RuntimeOptions.from_env(**{**DENSE, "attention": "sparse", "sparse_min_tokens": 0}))
    sched = torch.tensor([1.0, 0.99, 0.5, 0.0])
    _, rep = _sample_run(cm.RuntimeHandle(rt), case, sched, {cm.SPARSE_TAU_KEY: 1.5})
    sa = rep["sparse_attention"]
    assert sa["tau"] == 1.5 and sa["sparse_steps"] == [2] and sa["dense_steps"] == [0, 1]  # window: sigma <= 0.98
    assert sa["calls"] == {"dense": 2 * rt.config.num_layers, "sparse": rt.config.num_layers}


# ---------------------------------------------------------------------------------------------
# core's Fun ControlNet on the H3 MODEL
# ---------------------------------------------------------------------------------------------

class MiniMaxH3FunControlPatch:
    """Stand-in with core's class name and fields (comfy_extras/nodes_minimax_h3.py): what
    MiniMaxH3FunControlNetApply records; its wrapper only calls through, as core's does after preparing its
    hint latent (``control_latent`` for ``control_latent_shape``), which is given here."""

    def __init__(self, module, ctl, target_shape, latent=True):
        self.model_patch = types.SimpleNamespace(model=module)
        self.vae, self.control_video, self.mask, self.source_video = None, None, None, None
        self.strength, self.sigma_start, self.sigma_end = ctl["strength"], ctl["sigma_start"], ctl["sigma_end"]
        self.fade_in_frames, self.fade_out_frames = ctl.get("fade_in_frames", 0), ctl.get("fade_out_frames", 0)
        self.control_latent = ctl["hint"] if latent else None
        self.control_latent_shape = tuple(target_shape) if latent else None

    def diffusion_model_wrapper(self, executor, *args, **kwargs):
        return executor(*args, **kwargs)


class MiniMaxH3FunControlBlockPatch:
    def __init__(self, control_patch, block_index, previous=None):
        self.control_patch, self.block_index, self.previous = control_patch, block_index, previous

    def models(self):  # core's: the tower's ModelPatcher, for load_models_gpu to load beside the model
        return [self.control_patch.model_patch]


def _fun_options(patch, places, sigma):
    return {"wrappers": {"diffusion_model": {"minimax_h3_fun": [patch.diffusion_model_wrapper]}},
            "patches_replace": {"dit": {("double_block", p): MiniMaxH3FunControlBlockPatch(patch, p) for p in places}},
            "sigmas": torch.tensor([sigma])}


def _core_tower(cfg, places, csd):
    """Core's loaded MiniMaxH3FunControl as the adapter reads it: native state dict, injection_layers, blocks."""
    from h3_blackwell.runtime import FunControl
    from h3_blackwell.runtime.model.control import block_config

    m = FunControl(block_config(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_hidden_size,
                                cfg.time_embed_dim, cfg.curve_form), tuple(places), torch.float32)
    m.load_state_dict(csd)
    m.injection_layers = tuple(places)
    return m


def _fun_call(runtimes, name):
    """One control case recorded as MiniMaxH3FunControlNetApply records it -> (case, model path, runtime, the
    tower's state dict, (payload, masks, transformer_options) of the call)."""
    import control_cases
    from fixtures.tiny_control import tiny_control_state_dict

    case = control_cases.make_cases()[name]
    cfg = TINY.replace(text_dim=control_cases.TEXT_DIM)
    path, rt = runtimes(cfg)
    csd = tiny_control_state_dict(cfg, len(case["places"]), seed=11)
    patch = MiniMaxH3FunControlPatch(_core_tower(cfg, case["places"], csd), case["control"], case["video"].shape)
    payload, masks, to = core_kwargs(case)
    to.update(_fun_options(patch, case["places"], case["sigma"]))
    return case, path, rt, csd, (payload, masks, to)


@pytest.mark.parametrize("name", ["hint24_keyframes", "narrow_window_fades", "outside_window"])
def test_core_fun_controlnet_runs_as_the_pack_tower(name, runtimes):
    """MiniMaxH3FunControlNetApply's records on the H3 MODEL: the pack runs core's tower weights with core's hint,
    window, strength and fades; the result is core's (the float64 oracle of core's control semantics,
    tests/oracles/core_control.py), outside the window exactly the uncontrolled evaluation."""
    import core_control
    from safetensors.torch import load_file

    case, path, rt, csd, (payload, masks, to) = _fun_call(runtimes, name)
    dm = diffusion_model(rt)
    x = [case["video"], case["audio"]]
    t = torch.tensor([case["sigma"]], dtype=torch.float32) * 1000
    v, a = dm(x, t, case["text_states"], transformer_options=to, minimax_payload=payload, **masks)
    ov, oa = core_control.core_forward_control(load_file(str(path)), csd, case["places"], case["video"],
                                               case["audio"], case["text_states"], case["sigma"], case["control"],
                                               token_tags=case["token_tags"], payload=case["payload"])
    assert _rel(v, ov) < 1e-5 and _rel(a, oa) < 1e-5, (_rel(v, ov), _rel(a, oa))
    plain_payload, plain_masks, plain_to = core_kwargs(case)
    pv, pa = diffusion_model(rt)(x, t, case["text_states"], transformer_options=plain_to,
                                 minimax_payload=plain_payload, **plain_masks)
    if name == "outside_window":
        assert torch.equal(v, pv) and torch.equal(a, pa)
        assert dm.handle.towers == {}  # never in the window: the tower is not even loaded (core: not encoded)
    else:
        assert _rel(pv, ov) > 1e-3  # the tower moved the output
        assert len(dm.handle.towers) == 1 and dm.handle.size > rt.device_bytes()  # counted in the MODEL's size


def test_core_fun_controlnet_refusals(runtimes):
    """Two Fun ControlNets, a missing or chained block patch: one clear refusal each (never a silent drop)."""
    import control_cases
    from fixtures.tiny_control import tiny_control_state_dict

    case = control_cases.make_cases()["hint24_keyframes"]
    cfg = TINY.replace(text_dim=control_cases.TEXT_DIM)
    _, rt = runtimes(cfg)
    tower = _core_tower(cfg, case["places"], tiny_control_state_dict(cfg, len(case["places"]), seed=11))
    payload, _, base = core_kwargs(case)

    def run(options):
        with pytest.raises(H3NodeError) as e:
            diffusion_model(rt)([case["video"], case["audio"]], torch.tensor([800.0]), case["text_states"],
                                transformer_options={**base, **options}, minimax_payload=payload)
        return str(e.value)

    p1 = MiniMaxH3FunControlPatch(tower, case["control"], case["video"].shape)
    p2 = MiniMaxH3FunControlPatch(tower, case["control"], case["video"].shape)
    two = _fun_options(p1, case["places"], 0.8)
    two["wrappers"]["diffusion_model"]["second"] = [p2.diffusion_model_wrapper]
    assert "2 Fun ControlNets" in run(two)
    missing = _fun_options(p1, case["places"], 0.8)
    del missing["patches_replace"]["dit"][("double_block", case["places"][-1])]
    assert "no matching patches_replace" in run(missing)
    chained = _fun_options(p1, case["places"], 0.8)
    chained["patches_replace"]["dit"][("double_block", 0)].previous = lambda a, b: a
    assert "chains onto another block patch" in run(chained)


def test_fun_controlnet_on_the_patcher_passes_the_sampling_start_check():
    """At sampling start the patcher's own wrapper table (ModelPatcher.add_wrapper_with_key keeps wrappers there,
    not in model_options) is read with its transformer_options: core's Fun ControlNet passes, any other
    diffusion-model wrapper is still refused."""
    import control_cases
    from fixtures.tiny_control import tiny_control_state_dict

    case = control_cases.make_cases()["hint24_keyframes"]
    cfg = TINY.replace(text_dim=control_cases.TEXT_DIM)
    tower = _core_tower(cfg, case["places"], tiny_control_state_dict(cfg, len(case["places"]), seed=11))
    patch = MiniMaxH3FunControlPatch(tower, case["control"], case["video"].shape)
    opts = _fun_options(patch, case["places"], 0.8)
    wrappers = opts.pop("wrappers")
    patcher = types.SimpleNamespace(object_patches={}, hook_patches=None, weight_wrapper_patches={},
                                    model_options={"transformer_options": opts}, wrappers=wrappers)
    cp.check_patcher(patcher)
    assert cp.fun_control_patch({**opts, "wrappers": wrappers}) is patch
    patcher.wrappers = {"diffusion_model": {**wrappers["diffusion_model"], "easycache": [lambda *a: a]}}
    with pytest.raises(H3NodeError, match="diffusion-model wrapper"):
        cp.check_patcher(patcher)
    patcher.wrappers = {}  # the block patches without core's wrapper: not a Fun ControlNet the MODEL can run
    with pytest.raises(H3NodeError, match="block replacement"):
        cp.check_patcher(patcher)


def test_fun_controlnet_prepares_the_hint_when_core_has_not(runtimes):
    """Where core's wrapper has not prepared its latent yet (the first call outside the window), the MODEL prepares
    the hint from the patch's VAE and control video as core would (``nodes.control.prepare_hint``): the same
    evaluation as with that latent given."""
    import control_cases
    from fixtures.tiny_control import tiny_control_state_dict
    from h3_blackwell.nodes.control import prepare_hint

    class VAE:  # 16x16 mean pooling, core's 17k+5 -> 5k+2 frames, a fixed 3 -> 24 map
        proj = torch.randn(24, 3, generator=torch.Generator().manual_seed(2))

        def spacial_compression_encode(self):
            return 16

        def encode(self, pixels):
            x = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float(), 16)
            t = 2 if x.shape[0] <= 5 else (x.shape[0] - 5) // 17 * 5 + 2
            x = torch.stack([c.mean(0) for c in torch.tensor_split(x, t)])
            return torch.einsum("oc,tchw->othw", self.proj, x)[None]

    case = control_cases.make_cases()["hint24_keyframes"]
    cfg = TINY.replace(text_dim=control_cases.TEXT_DIM)
    _, rt = runtimes(cfg)
    tower = _core_tower(cfg, case["places"], tiny_control_state_dict(cfg, len(case["places"]), seed=11))
    video = torch.rand(6, 3, 70, 90, generator=torch.Generator().manual_seed(4))
    target = tuple(case["video"].shape)
    outs = []
    for given in (False, True):
        ctl = dict(case["control"], hint=prepare_hint(VAE(), target, video))
        patch = MiniMaxH3FunControlPatch(tower, ctl, target, latent=given)
        patch.vae, patch.control_video = VAE(), video
        payload, masks, to = core_kwargs(case)
        to.update(_fun_options(patch, case["places"], case["sigma"]))
        t = torch.tensor([case["sigma"]], dtype=torch.float32) * 1000
        outs.append(diffusion_model(rt)([case["video"], case["audio"]], t, case["text_states"], transformer_options=to,
                                        minimax_payload=payload, **masks))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_core_does_not_load_the_fun_tower_beside_the_h3_model(core):
    """core loads every patch entry's models() beside the model (load_models_gpu); for core's Fun ControlNet the
    H3 MODEL runs its own copy of the tower, so its patcher leaves that one out (another patch's models stay)."""
    import control_cases
    from fixtures.tiny_control import tiny_control_state_dict

    _, rt = core
    patcher = make_core_model(rt)
    case = control_cases.make_cases()["hint24_keyframes"]
    cfg = TINY.replace(text_dim=control_cases.TEXT_DIM)
    tower = _core_tower(cfg, case["places"], tiny_control_state_dict(cfg, len(case["places"]), seed=11))
    patch = MiniMaxH3FunControlPatch(tower, case["control"], case["video"].shape)
    other = types.SimpleNamespace(models=lambda: ["another patch's model"])
    opts = _fun_options(patch, case["places"], 0.8)
    patcher.model_options["transformer_options"] = {"patches_replace": opts["patches_replace"],
                                                    "patches": {"x": [other]}}
    assert patcher.model_patches_models() == ["another patch's model"]


def test_the_size_comfyui_is_told_follows_the_runtime(runtimes):
    """What the MODEL tells ComfyUI it holds (``model_size`` / ``loaded_size``) is the runtime's device bytes after
    every run, including runs whose budget moved blocks between the device and host memory at their first call."""
    from h3_blackwell.runtime.budget import ModelMemory, smallest_budget

    case = CASES["fl2va_first_last"]
    _, rt = runtimes(_cfg(case))
    handle = cm.RuntimeHandle(rt)
    sched = torch.tensor([1.0, 0.8, 0.0])
    budgets = []
    try:
        for budget in ("auto", None, "auto"):  # None: the smallest budget of this run (every block streams)
            if budget is None:
                least = smallest_budget(ModelMemory.from_plan(rt.plan), rt.plan.memory.workload, "cpu")
                budget = repr(least / 1e9)
            rt.plan.options.vram_budget = budget
            _sample_run(handle, case, sched, {})
            budgets.append((len(rt.plan.memory.streamed), handle.size))
            assert handle.size == rt.device_bytes(), (budget, handle.size, rt.device_bytes())
    finally:
        rt.plan.options.vram_budget = "auto"
    assert budgets[1][0] > 0 == budgets[0][0] and budgets[1][1] != budgets[0][1]  # the middle run streamed


def test_a_dropped_fun_tower_is_freed(runtimes):
    """A run without core's Fun ControlNet after one with it drops the tower: nothing keeps it alive (the last
    run's report keeps its summary, not the tower), so a later budget does not count it as held."""
    import gc

    case, _, rt, _, (payload, masks, to) = _fun_call(runtimes, "hint24_keyframes")
    handle = cm.RuntimeHandle(rt)
    dm = cm.H3DiffusionModel(handle)
    t = torch.tensor([case["sigma"]], dtype=torch.float32) * 1000
    dm([case["video"], case["audio"]], t, case["text_states"], transformer_options=to, minimax_payload=payload,
       **masks)
    handle.end_sampling()
    assert len(rt.plan.towers) == 1 and handle.call.report(case["video"], case["audio"])["control"]

    handle.begin_sampling(_patcher())
    gc.collect()
    assert len(rt.plan.towers) == 0 and handle.size == rt.device_bytes()


# ---------------------------------------------------------------------------------------------
# core's Model Sparse Attention on the H3 MODEL (the stand-in: tests/fixtures/core_sparse.py)
# ---------------------------------------------------------------------------------------------

def _core_h3_class():
    return sys.modules["comfy.ldm.minimax.model"].MiniMaxH3Model


def test_core_sparse_node_on_the_cpu_records_its_settings_and_runs_dense(core):
    """On the CPU the sparse path is not eligible (core: bf16 on CUDA), so dense runs, as in core; the MODEL records
    the node's settings (its window frozen at apply) and the run report says what ran. The node finds core's H3
    class (its block patches are installed) and vsa is accepted."""
    from fixtures import core_sparse

    _, rt = core
    patcher = make_core_model(rt)
    assert isinstance(patcher.model.diffusion_model, _core_h3_class())
    plain = _run(patcher, _t2va(rt))
    for method in ("sla", "vsa"):
        m, patch = core_sparse.apply(patcher, _core_h3_class(), method=method, keep_percent=12.5,
                                     dense_blocks="0, 2", start_percent=0.3)
        dit = m.model_options["transformer_options"]["patches_replace"]["dit"]
        assert sorted(dit) == [("double_block", i) for i in range(rt.config.num_layers)]
        out = _run(m, _t2va(rt))
        assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])       # dense, exactly
        node = m.model.h3_handle.sparse_node
        assert (node["method"], node["keep_percent"], node["dense_blocks"]) == (method, 12.5, (0, 2))
        assert node["sigma_start"] == patch.sigma_start and node["extra_tokens"] == (0 if method == "vsa" else 256)
        assert node["ran"].startswith("dense") and "CPU" in node["ran"]
    rep = cm.run_report(m, out[0], out[1], "t")
    assert rep["core_sparse_node"]["method"] == "vsa"


def test_core_sparse_node_runs_the_runtime_sparse_path_with_its_settings(tmp_path, monkeypatch):
    """A MODEL loaded with attention=sparse: the node's settings (not the loader's) are the run's: method, frozen
    window, dense blocks; neither ignored nor applied twice (one sparse call per sparse block, by the runtime)."""
    from fixtures import core_sparse

    _fake_core(monkeypatch)
    path = save_tiny(tmp_path / "s.safetensors", TINY, seed=2, dtype=torch.float32)
    rt = load_model(str(path), RuntimeOptions.from_env(**{**DENSE, "attention": "sparse", "sparse_min_tokens": 0}))
    patcher = make_core_model(rt)
    m, patch = core_sparse.apply(patcher, _core_h3_class(), method="sla", keep_percent=20.0, dense_blocks="1",
                                 min_tokens=0, start_percent=0.1)
    _run(m, _t2va(rt))
    sa = rt.sparse.summary()
    assert (sa["method"], sa["keep_percent"], sa["dense_blocks"]) == ("sla", 20.0, [1])
    assert sa["sparse_at_or_below_sigma"] == patch.sigma_start and sa["calls"]["sparse"] == 2   # blocks 0, 2; 1 call
    assert m.model.h3_handle.sparse_node["ran"] == "sparse"


def test_core_sparse_node_refusals_and_order_with_the_fun_controlnet(core, monkeypatch):
    """Refused in one line: on CUDA without attention=sparse at load; after core's Fun ControlNet (mainline
    overwrites its block patches: core would drop the control silently); over another attention override. Applied
    before the Fun ControlNet (whose block patch chains it), the two compose."""
    from fixtures import core_sparse

    _, rt = core
    patcher = make_core_model(rt)
    m, patch = core_sparse.apply(patcher, _core_h3_class(), method="sol-attn")
    to = m.model_options["transformer_options"]
    assert cp.check_transformer_options(to) is None and cp.core_sparse_settings(to).sigma_start == patch.sigma_start
    handle = m.model.h3_handle
    fake_gpu = types.SimpleNamespace(device=torch.device("cuda"), sparse=None, plan=types.SimpleNamespace(
        attention="sage2"))
    with pytest.raises(H3NodeError, match="needs H3 NVFP4 Model Loader with attention=sparse"):
        handle._core_sparse(fake_gpu, to)
    other = {"optimized_attention_override": core_sparse.make_attention_override(patch, lambda *a: None)}
    with pytest.raises(H3NodeError, match="another attention override"):
        cp.check_transformer_options(other)
    fun = MiniMaxH3FunControlPatch(types.SimpleNamespace(injection_layers=[0, 2]), {"strength": 1.0, "sigma_start": 1.0,
                                                                                    "sigma_end": 0.0, "hint": None},
                                   (1, 24, 7, 4, 6))
    after = _fun_options(fun, [0, 2], 0.8)
    patcher.model_options = {"transformer_options": after}
    m2, _ = core_sparse.apply(patcher, _core_h3_class())
    with pytest.raises(H3NodeError, match="applied after MiniMaxH3FunControlNetApply"):
        cp.check_transformer_options(m2.model_options["transformer_options"])
    before = dict(to)
    dit = dict(before["patches_replace"]["dit"])
    for p in (0, 2):                                       # core's Fun apply chains the block patch it replaces
        dit[("double_block", p)] = MiniMaxH3FunControlBlockPatch(fun, p, previous=dit[("double_block", p)])
    before.update(patches_replace={"dit": dit}, wrappers=after["wrappers"])
    assert cp.check_transformer_options(before) is fun and cp.core_sparse_patch(before) is patch


def test_lora_files_go_to_comfyuis_temp_folder(tmp_path, monkeypatch):
    """Where ComfyUI runs, the LoRA files the MODEL writes live in ComfyUI's temp folder (emptied at every start, so
    a killed server leaves nothing for long); without ComfyUI, in the system's temp folder."""
    import os
    import sys
    import tempfile
    import types

    monkeypatch.setitem(cp._tmp, "dir", None)
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    assert cp._tmp_dir().startswith(tempfile.gettempdir()) and "h3b-core-loras-" in cp._tmp_dir()
    fp = types.ModuleType("folder_paths")
    fp.get_temp_directory = lambda: str(tmp_path / "comfy-temp")
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.setitem(cp._tmp, "dir", None)
    d = cp._tmp_dir()
    assert d.startswith(str(tmp_path / "comfy-temp")) and os.path.isdir(d)
