"""Node contract tests, without ComfyUI: INPUT_TYPES / RETURN_TYPES / FUNCTION of every node, and each node's
function run against minimal stand-ins for the ComfyUI modules it touches (``comfy``, ``comfy.utils``,
``comfy.model_management``, ``comfy.nested_tensor``, ``folder_paths``), installed through sys.modules.

The NestedTensor stand-in has core's interface (``comfy/nested_tensor.py``): ``NestedTensor(tensors)`` keeps
``list(tensors)`` in ``.tensors``, ``is_nested = True``, ``unbind()`` returns the list, ``shape`` / ``dtype`` /
``device`` are the first tensor's. Core's EmptyMiniMaxH3LatentAV builds
``{"samples": NestedTensor((zeros [B,24,T,H/16,W/16], zeros [B,32,2,Ta]))}`` on the intermediate device.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import h3_blackwell
from h3_blackwell.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, NODES
from h3_blackwell.nodes import loader as loader_mod
from h3_blackwell.nodes._common import H3NodeError, keyword_inputs
from h3_blackwell.nodes.control import H3FunControlNetApply
from h3_blackwell.nodes.conditioning import EMBEDDED_STATES, H3TextStatesLoader
from h3_blackwell.nodes.diagnostics import H3Diagnostics
from h3_blackwell.nodes.latents import H3EmptyLatent
from h3_blackwell.nodes.loader import TINY_CHOICE, H3ModelLoader
from h3_blackwell.nodes.sampler import H3Sampler
from h3_blackwell.runtime import CHOICES, RuntimeOptions
from fixtures.sampling import sample as runtime_sample

from fixtures.comfy_standins import FakeNestedTensor, InterruptProcessingException, SAMPLE_ARGS, core_conditioning, core_empty_latent

# ---------------------------------------------------------------------------------------------
# contracts
# ---------------------------------------------------------------------------------------------

def test_registration_table():
    assert set(NODE_CLASS_MAPPINGS) == {"H3B_ModelLoader", "H3B_Sampler", "H3B_Diagnostics", "H3B_EmptyLatent",
                                        "H3B_TextStatesLoader", "H3B_LoRA", "H3B_ModelReport",
                                        "H3B_FunControlNetApply"}
    assert h3_blackwell.NODE_CLASS_MAPPINGS == NODE_CLASS_MAPPINGS  # V1 outside a running ComfyUI
    assert h3_blackwell.NODE_DISPLAY_NAME_MAPPINGS == NODE_DISPLAY_NAME_MAPPINGS
    assert NODE_DISPLAY_NAME_MAPPINGS["H3B_ModelLoader"] == "H3 NVFP4 Model Loader"
    assert NODE_DISPLAY_NAME_MAPPINGS["H3B_Sampler"] == "H3 Sampler"
    assert not hasattr(h3_blackwell, "comfy_entrypoint")


@pytest.mark.parametrize("node_id", sorted(NODES))
def test_node_contract(node_id):
    cls = NODES[node_id]
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"} and spec["required"]
    assert cls.CATEGORY == "H3 Blackwell"
    assert isinstance(cls.RETURN_TYPES, tuple) and cls.RETURN_TYPES
    assert len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES)
    fn = getattr(cls, cls.FUNCTION)
    params = inspect.signature(fn).parameters
    # a FUNCTION may take inputs as keywords (**inputs), checked against INPUT_TYPES (_common.keyword_inputs)
    keywords = [p for p, v in params.items() if v.kind is inspect.Parameter.VAR_KEYWORD]
    params = {p: v for p, v in params.items() if p not in keywords}
    for section in ("required", "optional"):
        for name, s in spec.get(section, {}).items():
            assert name in params or keywords, f"{node_id}.{cls.FUNCTION} lacks parameter {name}"
            assert isinstance(s, tuple) and 1 <= len(s) <= 2
            kind, opts = s[0], (s[1] if len(s) > 1 else {})
            assert isinstance(kind, (list, str))
            assert "tooltip" in opts or kind in ("INT", "FLOAT", "STRING", "BOOLEAN") or isinstance(kind, list)
            if isinstance(kind, list):
                assert opts.get("default", kind[0]) in kind
            if kind in ("INT", "FLOAT"):
                assert opts["min"] <= opts["default"] <= opts["max"]
    required = [p for p, v in params.items() if p != "self" and v.default is inspect.Parameter.empty]
    assert set(required) <= set(spec["required"])


def test_keyword_inputs_are_checked_against_input_types(tiny):
    """Node FUNCTIONs that take their inputs as keywords refuse a missing or unknown one by name, and an optional
    socket left empty (None) takes its INPUT_TYPES default."""
    args = dict(SAMPLE_ARGS)
    del args["steps"]
    with pytest.raises(H3NodeError, match=r"^H3 Sampler: expected the inputs seed, steps.*missing \['steps'\]"):
        H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **args)
    with pytest.raises(H3NodeError, match=r"unknown \['cfg'\]"):
        H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **SAMPLE_ARGS, cfg=2.0)
    got = keyword_inputs(H3Sampler(), {**SAMPLE_ARGS, "sparse_tau": None, "first_block_cache": 0.25})
    assert got == {**SAMPLE_ARGS, "sparse_tau": H3Sampler.INPUT_TYPES()["optional"]["sparse_tau"][1]["default"],
                   "first_block_cache": 0.25, "sparse_method": "loader", "sparse_keep_percent": 10.0}
    with pytest.raises(H3NodeError, match=r"unknown \['strenght'\]"):
        H3FunControlNetApply().apply(tiny, object(), 1.0, 0.0, 1.0, strenght=2.0)


def test_types():
    assert H3ModelLoader.RETURN_TYPES == ("H3_MODEL", "MODEL")
    assert H3Sampler.RETURN_TYPES == ("LATENT", "H3_DIAGNOSTICS")
    s = H3Sampler.INPUT_TYPES()["required"]
    assert [s[k][0] for k in ("model", "positive", "latent")] == ["H3_MODEL", "CONDITIONING", "LATENT"]
    assert s["sampler"][0] == ["euler", "res_multistep"] and s["scheduler"][0] == ["simple"]
    assert s["shift_video"][1]["default"] == 12.0 and s["shift_audio"][1]["default"] == 3.0
    assert s["seed"][1]["control_after_generate"] is True
    loader = H3ModelLoader.INPUT_TYPES()["required"]
    # the widgets list the runtime's choices (runtime/options.py), default first; every value a saved workflow may
    # hold (the lists as first published) stays accepted
    assert loader["gemm"][0] == list(CHOICES["gemm"]) and loader["gemm"][1]["default"] == "auto"
    assert loader["attention"][0] == list(CHOICES["attention"]) and loader["attention"][1]["default"] == "auto"
    assert {"auto", "native", "emulated", "fp8", "bf16", "reference"} <= set(loader["gemm"][0])
    assert {"auto", "sage2", "sage1", "sdpa", "reference", "sparse", "sdpa_cudnn"} <= set(loader["attention"][0])
    lossy = H3Sampler.INPUT_TYPES()["optional"]
    assert lossy["sparse_tau"][1]["default"] == 1.3 and lossy["first_block_cache"][1]["default"] == 0.0
    assert all("LOSSY" in lossy[k][1]["tooltip"] for k in ("sparse_tau", "first_block_cache"))
    assert loader["fc2_lt"][0] == ["on", "off", "strict"] and loader["adaln_cache"][0] == "BOOLEAN"
    assert loader["fc2_lt"][1]["default"] == "on" and lossy["sparse_tau"][1]["default"] == RuntimeOptions.sparse_tau
    assert H3Diagnostics.OUTPUT_NODE is True
    assert H3Diagnostics.INPUT_TYPES()["required"]["diagnostics"][0] == "H3_DIAGNOSTICS"
    assert "expected_video_sha256" in H3Diagnostics.INPUT_TYPES()["optional"]
    assert H3EmptyLatent.RETURN_TYPES == ("LATENT",) and H3TextStatesLoader.RETURN_TYPES == ("CONDITIONING",)


def test_import_needs_no_comfyui():
    code = ("import sys, h3_blackwell; "
            "bad = [m for m in sys.modules if m == 'comfy' or m.startswith(('comfy.', 'comfy_api')) "
            "or m == 'folder_paths']; "
            "assert not bad, bad; "
            "assert len(h3_blackwell.NODE_CLASS_MAPPINGS) == 8; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ---------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------

def test_loader_lists_diffusion_models(comfy):
    (comfy.models_dir / "h3_nvfp4.safetensors").write_bytes(b"")
    choices = H3ModelLoader.INPUT_TYPES()["required"]["model"][0]
    assert choices == [TINY_CHOICE, "h3_nvfp4.safetensors"]


def test_loader_keeps_model_resident_and_reloads_on_change(comfy):
    loader_mod.release_resident()
    a = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)[0]
    b = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)[0]
    assert a is b and loader_mod.resident_model() is a
    o = a.plan.options
    assert o.fc2_lt is True and o.fc2_lt_strict is False and o.adaln_cache is True
    c = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "strict", False)[0]
    assert c is not a and c.plan.options.fc2_lt_strict is True and c.plan.options.adaln_cache is False
    assert loader_mod.resident_model() is c
    d = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "off", False)[0]
    assert d.plan.options.fc2_lt is False


def test_loader_file_reloads_when_the_file_changes(comfy):
    from h3_blackwell.runtime.model.tiny import save_tiny

    path = comfy.models_dir / "tiny.safetensors"
    save_tiny(path, seed=3)
    loader_mod.release_resident()
    a = H3ModelLoader().load("tiny.safetensors", "reference", "reference", "off", True)[0]
    assert a.source == str(path) and a.config.text_dim == 5120
    assert H3ModelLoader().load("tiny.safetensors", "reference", "reference", "off", True)[0] is a
    save_tiny(path, seed=4)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert H3ModelLoader().load("tiny.safetensors", "reference", "reference", "off", True)[0] is not a
    loader_mod.release_resident()


def test_loader_missing_file_is_one_clear_message(comfy):
    with pytest.raises(H3NodeError) as e:
        H3ModelLoader().load("gone.safetensors", "auto", "auto", "on", True)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("H3 NVFP4 Model Loader: model file 'gone.safetensors' was not found in diffusion_models")
    assert str(comfy.models_dir) in msg and TINY_CHOICE in msg


def test_loader_bad_checkpoint_is_reported_on_the_node(comfy):
    (comfy.models_dir / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(H3NodeError, match=r"^H3 NVFP4 Model Loader: .*junk\.safetensors"):
        H3ModelLoader().load("junk.safetensors", "auto", "auto", "on", True)


def test_loader_mis_shaped_nvfp4_layer_is_reported_before_loading(comfy, tmp_path):
    """An NVFP4 file whose fc2 has extra packed rows: the header check names the tensor, expected vs found."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3_blackwell.runtime.io.convert import quantize_checkpoint
    from h3_blackwell.runtime.model.tiny import save_tiny

    nv = tmp_path / "nv.safetensors"
    quantize_checkpoint(save_tiny(tmp_path / "tiny.safetensors"), nv)
    with safe_open(str(nv), "pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    w = t["blocks.0.mlp.fc2.weight"]
    t["blocks.0.mlp.fc2.weight"] = torch.cat([w, w[:16]])
    save_file(t, str(comfy.models_dir / "bad_nv.safetensors"), metadata=meta)
    with pytest.raises(H3NodeError, match=r"^H3 NVFP4 Model Loader: .*blocks\.0\.mlp\.fc2\.weight \(nvfp4.*expected"):
        H3ModelLoader().load("bad_nv.safetensors", "auto", "auto", "on", True)


# ---------------------------------------------------------------------------------------------
# latents
# ---------------------------------------------------------------------------------------------

def test_empty_latent_has_core_layout(comfy):
    (lat,) = H3EmptyLatent().create(256, 128, 22)
    assert set(lat) == {"samples"} and isinstance(lat["samples"], FakeNestedTensor)
    video, audio = lat["samples"].unbind()
    ref_v, ref_a = core_empty_latent(256, 128, 22)["samples"].unbind()
    assert video.shape == ref_v.shape == (1, 24, 7, 8, 16) and audio.shape == ref_a.shape == (1, 32, 2, 37)
    assert video.dtype == audio.dtype == torch.float32
    assert not video.any() and not audio.any()


def test_empty_latent_fallback_without_nested_tensor(old_comfy):
    (lat,) = H3EmptyLatent().create(64, 64, 5)
    assert set(lat) == {"samples", "h3_audio"}
    assert lat["samples"].shape == (1, 24, 2, 4, 4) and lat["h3_audio"].shape == (1, 32, 2, 8)


def test_empty_latent_rejects_frames_off_grid(comfy):
    with pytest.raises(H3NodeError) as e:
        H3EmptyLatent().create(256, 256, 100)
    assert str(e.value) == ("H3 Empty Latent: frames=100 is not on H3's 17k+5 grid (5, 22, 39, ..., 124, ...): "
                            "use 107 or 90")
    with pytest.raises(H3NodeError, match="width=250 must be a positive multiple of 32"):
        H3EmptyLatent().create(250, 256, 22)


# ---------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------

def test_sampler_takes_core_latent_and_returns_core_layout(comfy, tiny):
    latent = core_empty_latent(64, 64, 5)
    cond = core_conditioning()
    out, report = H3Sampler().sample(tiny, cond, latent, **SAMPLE_ARGS)
    assert set(out) == {"samples"} and isinstance(out["samples"], FakeNestedTensor)
    video, audio = out["samples"].unbind()
    assert len(out["samples"].tensors) == 2
    assert video.shape == (1, 24, 2, 4, 4) and audio.shape == (1, 32, 2, 8)
    assert video.dtype == audio.dtype == torch.float32 and video.device.type == "cpu"
    assert comfy.progress == [(1, 2), (2, 2)]
    # the adapter adds nothing: the same call on the runtime gives the same bytes
    ref = runtime_sample(tiny, cond[0][0], cond[0][1]["minimax_token_tags"], torch.zeros(1, 24, 2, 4, 4),
                         torch.zeros(1, 32, 2, 8), seed=7, steps=2, sampler="res_multistep", scheduler="simple",
                         shift_video=12.0, shift_audio=3.0)
    assert report["latent_checksums"]["video_sha256"] == ref.report["latent_checksums"]["video_sha256"]
    assert torch.equal(video, ref.video) and torch.equal(audio, ref.audio)
    assert report["workload"]["frames"] == 5 and report["workload"]["text_tokens"] == 12


def test_sampler_output_chains_into_a_second_sampler(comfy, tiny):
    """Our LATENT is accepted back (denoise < 1 refinement), in both formats."""
    out, _ = H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    again, _ = H3Sampler().sample(tiny, core_conditioning(), out, **{**SAMPLE_ARGS, "denoise": 0.5})
    assert again["samples"].unbind()[0].shape == (1, 24, 2, 4, 4)


def test_sampler_fallback_latent_between_own_nodes(old_comfy, tiny):
    (lat,) = H3EmptyLatent().create(64, 64, 5)
    out, report = H3Sampler().sample(tiny, H3TextStatesLoader().load(EMBEDDED_STATES)[0], lat, **SAMPLE_ARGS)
    assert set(out) == {"samples", "h3_audio"}
    assert out["samples"].shape == (1, 24, 2, 4, 4) and out["h3_audio"].shape == (1, 32, 2, 8)
    assert out["samples"].dtype == torch.float32
    assert report["latent_checksums"]["video"]["shape"] == [1, 24, 2, 4, 4]


def test_sampler_runs_headless_without_comfy_modules(tiny):
    (lat,) = H3EmptyLatent().create(64, 64, 5)
    out, _ = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS)
    assert "h3_audio" in out  # no comfy.nested_tensor here: the fallback form


def test_sampler_first_block_cache_widget_reaches_the_report(tiny):
    (lat,) = H3EmptyLatent().create(64, 64, 5)
    _, off = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS)
    _, on = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS, sparse_tau=2.0, first_block_cache=5.0)
    assert "first_block_cache" not in off and on["first_block_cache"]["threshold"] == 5.0
    assert on["first_block_cache"]["reused_steps"]           # a huge threshold reuses every step after the first
    assert "sparse_attention" not in on                       # the tiny loader's attention is not sparse: tau unused


def test_sampler_passes_keyframes(comfy, tiny):
    cond = core_conditioning()
    key = {"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 4, generator=torch.Generator().manual_seed(1))}
    cond_kf = [[cond[0][0], {**cond[0][1], "minimax_keyframes": [key]}]]
    _, plain = H3Sampler().sample(tiny, cond, core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    _, kf = H3Sampler().sample(tiny, cond_kf, core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    assert kf["workload"]["cond_tokens"] > 0
    assert kf["latent_checksums"]["video_sha256"] != plain["latent_checksums"]["video_sha256"]


def test_sampler_token_tags_as_row_vector(comfy, tiny):
    cond = core_conditioning()
    tags = cond[0][1]["minimax_token_tags"]
    _, a = H3Sampler().sample(tiny, cond, core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    cond[0][1]["minimax_token_tags"] = tags[None]
    _, b = H3Sampler().sample(tiny, cond, core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    assert a["latent_checksums"] == b["latent_checksums"]


def _error(fn, *args, **kw) -> str:
    with pytest.raises(H3NodeError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_sampler_rejects_conditioning_of_the_wrong_width(comfy, tiny):
    msg = _error(H3Sampler().sample, tiny, core_conditioning(width=768), core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    assert msg == ("H3 Sampler: the conditioning is [1, 12, 768]; H3 needs [1, L, 5120] (Qwen3-VL-32B states). Encode "
                   "the prompt with CLIPLoader type 'minimax', or load precomputed states with H3 Text States Loader.")


def test_sampler_rejects_a_latent_that_is_not_h3(comfy, tiny):
    msg = _error(H3Sampler().sample, tiny, core_conditioning(), {"samples": torch.zeros(1, 4, 64, 64)}, **SAMPLE_ARGS)
    assert msg.startswith("H3 Sampler: expected an H3 audio+video LATENT")
    assert "got a tensor of shape [1, 4, 64, 64] (float32), which is an image or video-only latent" in msg
    wan = {"samples": torch.zeros(1, 16, 5, 8, 8)}
    assert "[1, 16, 5, 8, 8]" in _error(H3Sampler().sample, tiny, core_conditioning(), wan, **SAMPLE_ARGS)
    nested_wrong = {"samples": FakeNestedTensor((torch.zeros(1, 128, 5, 8, 8), torch.zeros(1, 8, 20)))}
    assert "its video stream is a tensor of shape [1, 128, 5, 8, 8]" in _error(
        H3Sampler().sample, tiny, core_conditioning(), nested_wrong, **SAMPLE_ARGS)
    batch2 = {"samples": FakeNestedTensor((torch.zeros(2, 24, 2, 4, 4), torch.zeros(2, 32, 2, 8)))}
    assert "batch 1" in _error(H3Sampler().sample, tiny, core_conditioning(), batch2, **SAMPLE_ARGS)
    masked = {**core_empty_latent(64, 64, 5), "noise_mask": "not a mask"}
    assert "noise_mask must be a MASK" in _error(H3Sampler().sample, tiny, core_conditioning(), masked,
                                                 **SAMPLE_ARGS)


def test_sampler_rejects_other_conditioning_shapes(comfy, tiny):
    lat = core_empty_latent(64, 64, 5)
    two = core_conditioning() + core_conditioning(seed=1)
    assert "one conditioning entry; got 2" in _error(H3Sampler().sample, tiny, two, lat, **SAMPLE_ARGS)
    bad_tags = core_conditioning()
    bad_tags[0][1]["minimax_token_tags"] = torch.ones(5, dtype=torch.long)
    assert "5 entries for 12 text tokens" in _error(H3Sampler().sample, tiny, bad_tags, lat, **SAMPLE_ARGS)
    refs = core_conditioning()
    refs[0][1]["minimax_refs"] = [{"kind": "image", "latent_h": 2, "latent_w": 2}]  # ({"kind": "image"} alone is a
    #                                                                            text-encoder-only reference)
    msg = _error(H3Sampler().sample, tiny, refs, lat, **SAMPLE_ARGS)
    assert msg.startswith("H3 Sampler: minimax_refs (MiniMaxH3ReferenceToVideo): refs[0].latent: expected"), msg
    for key, what in (("control", "ControlNet"), ("minimax_new_thing", "does not know")):
        other = core_conditioning()
        other[0][1][key] = object()
        assert what in _error(H3Sampler().sample, tiny, other, lat, **SAMPLE_ARGS)
    assert "H3 NVFP4 Model Loader" in _error(H3Sampler().sample, "not a model", core_conditioning(), lat,
                                             **SAMPLE_ARGS)


def test_sampler_runtime_errors_reach_the_node(comfy, tiny):
    msg = _error(H3Sampler().sample, tiny, core_conditioning(), core_empty_latent(64, 64, 5),
                 **{**SAMPLE_ARGS, "steps": 0})
    assert msg.startswith("H3 Sampler: ")


def test_sampler_interrupt_becomes_comfy_interrupt(comfy, tiny):
    comfy.interrupt_flag = True
    with pytest.raises(InterruptProcessingException):
        H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    assert comfy.interrupt_flag is False  # consumed, as ComfyUI's own check does
    out, _ = H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **SAMPLE_ARGS)
    assert out["samples"].unbind()[0].shape == (1, 24, 2, 4, 4)  # the resident model is still usable


# ---------------------------------------------------------------------------------------------
# diagnostics
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def report(comfy, tiny):
    return H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 5), **SAMPLE_ARGS)[1]


def test_diagnostics_shows_text_and_writes_json(comfy, report):
    out = H3Diagnostics().report(report, "h3_blackwell/diag")
    files = out["ui"]["h3_report"]
    assert files == [{"filename": "diag_00001_.json", "subfolder": "h3_blackwell", "type": "output"}]
    written = json.loads((comfy.output_dir / "h3_blackwell" / "diag_00001_.json").read_text())
    assert written["latent_checksums"] == report["latent_checksums"]
    text = out["ui"]["text"][0]
    assert report["latent_checksums"]["video_sha256"][:16] in text and "attention:" in text
    assert json.loads(out["result"][0]) == json.loads(json.dumps(report, default=str))
    second = H3Diagnostics().report(report, "h3_blackwell/diag")
    assert second["ui"]["h3_report"][0]["filename"] == "diag_00002_.json"


def test_diagnostics_expected_hash(comfy, report):
    good = report["latent_checksums"]["video_sha256"]
    H3Diagnostics().report(report, "h3_blackwell/diag", expected_video_sha256=good.upper() + " ")
    msg = _error(H3Diagnostics().report, report, "h3_blackwell/diag", expected_video_sha256="0" * 64)
    assert msg.startswith(f"H3 Diagnostics: video latent sha256 mismatch: expected {'0' * 64}, got {good}")
    assert "diag_00002_.json" in msg and (comfy.output_dir / "h3_blackwell" / "diag_00002_.json").exists()
    assert "64 hex digits" in _error(H3Diagnostics().report, report, "x", expected_video_sha256="abc")
    assert "from H3 Sampler" in _error(H3Diagnostics().report, {"nope": 1}, "x")


# ---------------------------------------------------------------------------------------------
# text states
# ---------------------------------------------------------------------------------------------

def test_text_states_loader_reads_a_file(comfy):
    from safetensors.torch import save_file

    states = torch.randn(1, 9, 5120)
    tags = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1])
    save_file({"text_states": states.to(torch.bfloat16), "token_tags": tags}, str(comfy.input_dir / "a.safetensors"))
    (comfy.input_dir / "sub").mkdir()
    save_file({"text_states": states[0]}, str(comfy.input_dir / "sub" / "b.safetensors"))
    assert H3TextStatesLoader.INPUT_TYPES()["required"]["text_states"][0] == [EMBEDDED_STATES, "a.safetensors",
                                                                               "sub/b.safetensors"]
    (cond,) = H3TextStatesLoader().load("a.safetensors")
    assert len(cond) == 1 and cond[0][0].shape == (1, 9, 5120) and cond[0][0].dtype == torch.float32
    assert torch.equal(cond[0][1]["minimax_token_tags"], tags)
    (cond_b,) = H3TextStatesLoader().load("sub/b.safetensors")
    assert cond_b[0][0].shape == (1, 9, 5120) and cond_b[0][1] == {}


def test_text_states_loader_errors(comfy):
    from safetensors.torch import save_file

    assert "was not found" in _error(H3TextStatesLoader().load, "missing.safetensors")
    save_file({"text_states": torch.zeros(1, 4, 4096)}, str(comfy.input_dir / "narrow.safetensors"))
    assert "is [1, 4, 4096]; expected [1, L, 5120]" in _error(H3TextStatesLoader().load, "narrow.safetensors")
    save_file({"hidden": torch.zeros(1, 4, 5120)}, str(comfy.input_dir / "other.safetensors"))
    assert "expected a tensor 'text_states'" in _error(H3TextStatesLoader().load, "other.safetensors")
    (comfy.input_dir / "junk.safetensors").write_bytes(b"\x00" * 16)
    assert "not a readable safetensors file" in _error(H3TextStatesLoader().load, "junk.safetensors")


def test_embedded_states_match_the_cli():
    (cond,) = H3TextStatesLoader().load(EMBEDDED_STATES)
    g = torch.Generator().manual_seed(1234)
    assert torch.equal(cond[0][0], torch.randn(1, 32, 5120, generator=g))
    assert cond[0][1] == {}


# ---------------------------------------------------------------------------------------------
# core's H3 conditioning nodes -> the runtime's conditioning contract
# ---------------------------------------------------------------------------------------------
# Builders that return exactly what core's nodes (comfy_extras/nodes_minimax_h3.py) put into CONDITIONING,
# with random latents in place of VAE encodes: MiniMaxH3ImageToVideo (first frame at 0, last at F-1),
# MiniMaxH3AddGuide (negative frame_idx from the end, clips cropped to 17k+5 frames, audio cropped to
# floor(Ta - 5/3 * index)), MiniMaxH3ReferenceToVideo (images, then videos with soundtracks, then audio).

def _pixel_frames(latent_t):
    return sum((1, 4, 4, 4, 4)[k % 5] for k in range(latent_t))


def _clip_t(frames):
    return 1 if frames == 1 else (frames - 5) // 17 * 5 + 2


def core_image_to_video(latent, first=True, last=True, tokens=12, seed=0):
    video = latent["samples"].tensors[0]
    g = torch.Generator().manual_seed(seed + 100)
    kfs = []
    if first:
        kfs.append({"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, *video.shape[3:], generator=g)})
    if last:
        kfs.append({"resolved_frame_index": _pixel_frames(video.shape[2]) - 1,
                    "latent": torch.randn(1, 24, 1, *video.shape[3:], generator=g)})
    cond = core_conditioning(tokens=tokens, seed=seed)
    return [[cond[0][0], {**cond[0][1], "minimax_keyframes": kfs}]]


def core_add_guide(positive, latent, frame_idx, image_frames=0, audio_t=0, seed=0):
    import math

    video, audio = latent["samples"].tensors
    frame_count = _pixel_frames(video.shape[2])
    guide = 1
    if image_frames >= 5:
        guide = image_frames
        while guide % 17 != 5:
            guide -= 1
    resolved = frame_idx if frame_idx >= 0 else frame_count + frame_idx
    assert 0 <= resolved and resolved + guide <= frame_count  # core raises otherwise
    g = torch.Generator().manual_seed(seed + 200)
    kf = {"resolved_frame_index": resolved}
    if image_frames:
        kf["latent"] = torch.randn(1, 24, _clip_t(guide), *video.shape[3:], generator=g)
    if audio_t:
        al = torch.randn(1, 32, 2, audio_t, generator=g)
        max_rt = math.floor(audio.shape[-1] - 5 / 3 * resolved)
        kf["audio_latent"] = al[..., :max_rt].clone() if audio_t > max_rt else al
    keyframes = list(positive[0][1].get("minimax_keyframes", [])) + [kf]
    return [[positive[0][0], {**positive[0][1], "minimax_keyframes": keyframes}]]


def core_reference_to_video(images=(), videos=(), audios=(), seed=0):
    """images: (h_px, w_px); videos: (frames, h_px, w_px, ref_audio_t or 0); audios: ref_audio_t."""
    g = torch.Generator().manual_seed(seed + 300)
    refs = []
    for i, (h, w) in enumerate(images):
        refs.append({"kind": "image", "picture_index": i, "latent_h": h // 16, "latent_w": w // 16,
                     "latent": torch.randn(1, 24, 1, h // 16, w // 16, generator=g)})
    for n, h, w, at in videos:
        z = torch.randn(1, 24, _clip_t(n), h // 16, w // 16, generator=g)
        refs.append({"kind": "video_audio" if at else "video", "latent_t": z.shape[2], "latent_h": h // 16,
                     "latent_w": w // 16, "ref_audio_t": at, "latent": z,
                     "audio_latent": torch.randn(1, 32, 2, at, generator=g) if at else None})
    for at in audios:
        refs.append({"kind": "audio", "ref_audio_t": at, "audio_latent": torch.randn(1, 32, 2, at, generator=g)})
    cond = core_conditioning(seed=seed)
    return [[cond[0][0], {**cond[0][1], "minimax_refs": refs}]]


class RecordingRuntime:
    """Stands in for runtime.run: records the validated job the node hands over (its conditioning is the
    contract argument) and returns latents + 1."""

    def __init__(self):
        self.calls = []

    def __call__(self, job):
        from h3_blackwell.runtime import SampleResult

        self.calls.append({"text": job.inputs.text, "video": job.inputs.video, "audio": job.inputs.audio,
                           "conditioning": job.inputs.conditioning, "steps": job.sampling.steps,
                           "sampler": job.sampling.sampler})
        return SampleResult(job.inputs.video + 1.0, job.inputs.audio + 1.0, {"recorded": True})


def _cases():
    lat = core_empty_latent(96, 64, 39)  # T 12, 4x6 latent, Ta 65, 39 pixel frames
    fl = core_image_to_video(lat)
    audio_alone = core_add_guide(core_conditioning(), lat, -10, audio_t=40)  # cropped: floor(65 - 5/3*29) = 16
    img_audio = core_add_guide(core_conditioning(), lat, 5, image_frames=1, audio_t=20)
    clip = core_add_guide(fl, lat, 10, image_frames=24)  # 24 frames -> a 22-frame clip, t = 7
    ref = core_reference_to_video(images=((64, 96), (128, 64)), videos=((30, 64, 64, 15),), audios=(9,))
    return lat, {"fl2va": fl, "audio_guide": audio_alone, "image_audio_guide": img_audio, "clip_guide": clip,
                 "ref2va": ref}


@pytest.mark.parametrize("case", ["fl2va", "audio_guide", "image_audio_guide", "clip_guide", "ref2va"])
def test_sampler_hands_core_node_payloads_to_the_runtime(comfy, tiny, monkeypatch, case):
    """Every entry of the core node's conditioning reaches the runtime's contract unchanged, in order."""
    from h3_blackwell.nodes import sampler as sampler_mod

    rec = RecordingRuntime()
    monkeypatch.setattr(sampler_mod, "run_job", rec)
    lat, cases = _cases()
    positive = cases[case]
    out, report = H3Sampler().sample(tiny, positive, lat, **SAMPLE_ARGS)
    assert report == {"recorded": True} and torch.equal(out["samples"].tensors[0], lat["samples"].tensors[0] + 1)
    (call,) = rec.calls
    c = call["conditioning"]
    extra = positive[0][1]
    kfs, refs = extra.get("minimax_keyframes", []), extra.get("minimax_refs", [])
    assert len(c.keyframes) == len(kfs) and len(c.refs) == len(refs)
    for got, want in zip(c.keyframes, kfs):
        assert got.resolved_frame_index == want["resolved_frame_index"]
        for k in ("latent", "audio_latent"):
            assert (getattr(got, k) is None) == (want.get(k) is None)
            if want.get(k) is not None:
                assert torch.equal(getattr(got, k), want[k])
    for got, want in zip(c.refs, refs):
        assert got.kind == want["kind"]
        for k in ("latent_h", "latent_w", "latent_t", "ref_audio_t", "picture_index"):
            if k in want:
                assert getattr(got, k) == want[k], k
        for k in ("latent", "audio_latent"):
            if want.get(k) is not None:
                assert torch.equal(getattr(got, k), want[k])
    if case == "audio_guide":
        assert c.keyframes[0].resolved_frame_index == 29 and c.keyframes[0].audio_latent.shape[-1] == 16
    assert c.seed == SAMPLE_ARGS["seed"] and c.denoise_mask is None and c.audio_denoise_mask is None
    assert (c.visual_cond_noise_aug, c.audio_cond_noise_aug) == (0.999, 1.0)
    assert call["steps"] == 2 and call["sampler"] == "res_multistep"


def test_sampler_noise_masks_as_core_resizes_them(comfy, tiny, monkeypatch):
    """SetLatentNoiseMask on core's nested latent: a pixel mask [1, 1, H, W] becomes the video stream's mask at
    latent resolution (linear resize; 16-pixel-aligned halves stay exactly 0 / 1), the audio is generated
    whole; a nested mask (video, audio) gives both streams' masks. Noise-aug overrides reach the runtime."""
    from h3_blackwell.nodes import sampler as sampler_mod

    rec = RecordingRuntime()
    monkeypatch.setattr(sampler_mod, "run_job", rec)
    lat = core_empty_latent(96, 64, 22)  # T 7, 4x6, Ta 37
    pix = torch.zeros(1, 1, 64, 96)
    pix[..., 48:] = 1.0  # generate the right half (latent columns 3..5), keep the left
    positive = core_conditioning()
    positive[0][1]["minimax_visual_cond_noise_aug"] = 0.9
    H3Sampler().sample(tiny, positive, {**lat, "noise_mask": pix}, **SAMPLE_ARGS)
    c = rec.calls[-1]["conditioning"]
    want = torch.zeros(1, 1, 7, 4, 6)
    want[..., 3:] = 1.0
    assert torch.equal(c.denoise_mask, want) and c.audio_denoise_mask is None and c.visual_cond_noise_aug == 0.9
    am = torch.ones(1, 1, 2, 37)
    am[..., :10] = 0.0  # keep the first 10 audio frames
    vm = torch.ones(1, 1, 7, 4, 6)
    H3Sampler().sample(tiny, core_conditioning(), {**lat, "noise_mask": FakeNestedTensor((vm, am))}, **SAMPLE_ARGS)
    c = rec.calls[-1]["conditioning"]
    assert torch.equal(c.denoise_mask, vm) and torch.equal(c.audio_denoise_mask, am)


@pytest.mark.parametrize("case", ["fl2va", "audio_guide", "image_audio_guide", "ref2va"])
def test_sampler_output_is_the_runtimes_for_that_conditioning(comfy, tiny, case):
    """Through the real runtime: the node's latent equals runtime.sample given core's payload directly."""
    from h3_blackwell.runtime.io.payload import conditioning_from_payload

    lat, cases = _cases()
    positive = cases[case]
    out, rep = H3Sampler().sample(tiny, positive, lat, **SAMPLE_ARGS)
    extra = positive[0][1]
    payload = {"keyframes": extra.get("minimax_keyframes"), "refs": extra.get("minimax_refs"),
               "seed": SAMPLE_ARGS["seed"]}
    video, audio = lat["samples"].tensors
    want = runtime_sample(tiny, positive[0][0], extra["minimax_token_tags"], video, audio,
                          conditioning=conditioning_from_payload(payload),
                          **{k: v for k, v in SAMPLE_ARGS.items()})
    got_v, got_a = out["samples"].tensors
    assert torch.equal(got_v, want.video) and torch.equal(got_a, want.audio)
    # the report lists the packed layout: the condition segments each core node asked for
    kinds = {seg[0] for seg in rep["workload"]["segments"]} - {"text", "audio", "video"}
    assert kinds == {"fl2va": {"cond"}, "audio_guide": {"cond_audio"}, "image_audio_guide": {"cond", "cond_audio"},
                     "ref2va": {"ref_img", "ref_audio"}}[case], kinds


def test_sampler_noise_mask_keeps_the_masked_out_latent(comfy, tiny):
    """SetLatentNoiseMask: where the mask is 0 the input latent comes back (core's inpainting), where it is 1
    the model generates; a plain mask leaves the audio generated."""
    lat = core_empty_latent(96, 64, 22)
    g = torch.Generator().manual_seed(5)
    video = torch.randn(1, 24, 7, 4, 6, generator=g)
    audio = torch.randn(1, 32, 2, 37, generator=g)
    lat = {"samples": FakeNestedTensor((video, audio))}
    pix = torch.zeros(1, 1, 64, 96)
    pix[..., 48:] = 1.0  # generate latent columns 3..5, keep 0..2
    out, _ = H3Sampler().sample(tiny, core_conditioning(), {**lat, "noise_mask": pix}, **SAMPLE_ARGS)
    ov, oa = out["samples"].tensors
    # patch column 0 (latent columns 0-1) is kept: the sampler's last step lands on the re-blended denoised
    # latent, equal to the input there up to the step's fp32 rounding (x + (den - x) / s * (0 - s))
    assert float((ov[..., :2] - video[..., :2]).abs().max()) < 1e-5
    # the mask is pooled per 2x2 DiT patch (amax): latent column 2 shares a patch with generated column 3
    assert not torch.allclose(ov[..., 2:], video[..., 2:], atol=1e-3)  # generated
    assert not torch.allclose(oa, audio, atol=1e-3)  # the audio stream had no mask: generated whole
    plain, _ = H3Sampler().sample(tiny, core_conditioning(), lat, **SAMPLE_ARGS)
    assert not torch.equal(plain["samples"].tensors[0][..., :2], ov[..., :2])


def test_sampler_conditioning_errors_name_the_core_entry(comfy, tiny):
    lat = core_empty_latent(96, 64, 22)
    late = core_add_guide(core_conditioning(), lat, 0, image_frames=1)
    late[0][1]["minimax_keyframes"][0]["resolved_frame_index"] = 22  # past the 22 frames
    msg = _error(H3Sampler().sample, tiny, late, lat, **SAMPLE_ARGS)
    assert msg.startswith("H3 Sampler: minimax_keyframes (MiniMaxH3ImageToVideo / MiniMaxH3AddGuide): "
                          "keyframes[0].resolved_frame_index"), msg
    bad = {**lat, "noise_mask": torch.full((1, 1, 64, 96), 2.0)}
    assert "the latent's noise_mask (video stream): denoise_mask" in _error(H3Sampler().sample, tiny,
                                                                           core_conditioning(), bad, **SAMPLE_ARGS)


def _fake_latent_preview(monkeypatch, core_format: bool):
    """latent_preview as ComfyUI has it (args.preview_method, MAX_PREVIEW_RESOLUTION, get_previewer), and
    comfy.latent_formats with or without core's MiniMaxH3Video."""
    lp = types.ModuleType("latent_preview")
    lp.args = types.SimpleNamespace(preview_method=types.SimpleNamespace(value="latent2rgb"))
    lp.MAX_PREVIEW_RESOLUTION = 512
    calls = []

    class CorePreviewer:
        def decode_latent_to_preview_image(self, fmt, x0):
            calls.append(tuple(x0.shape))
            return (fmt, "core image", 512)

    lp.get_previewer = lambda device, fmt: CorePreviewer() if type(fmt).__name__ == "MiniMaxH3Video" else None
    formats = types.ModuleType("comfy.latent_formats")
    if core_format:
        formats.MiniMaxH3Video = type("MiniMaxH3Video", (), {})
    monkeypatch.setitem(sys.modules, "latent_preview", lp)
    monkeypatch.setitem(sys.modules, "comfy.latent_formats", formats)
    return lp, calls


def test_sampler_live_previews_through_comfy_progress_bar(comfy, tiny, monkeypatch):
    """Without core's H3 latent format: our projection of each step's denoised video, first latent frame, one
    pixel per latent pixel (W/16 x H/16), as ComfyUI's ("JPEG", image, max size) preview tuple."""
    pytest.importorskip("PIL")
    from h3_blackwell.runtime.sampling.preview import latent_to_rgb

    _fake_latent_preview(monkeypatch, core_format=False)
    lat = core_empty_latent(96, 64, 22)
    out, _ = H3Sampler().sample(tiny, core_conditioning(), lat, **{**SAMPLE_ARGS, "sampler": "euler"})
    assert comfy.progress == [(1, 2), (2, 2)] and len(comfy.previews) == 2
    for fmt, img, size in comfy.previews:
        assert fmt == "JPEG" and size == 512 and img.size == (6, 4) and img.mode == "RGB"
    first, last = (torch.from_numpy(np.asarray(p[1]).copy()) for p in comfy.previews)
    assert len(torch.unique(first.reshape(-1, 3), dim=0)) > 1  # a picture, not one colour
    # euler's last step lands on sigma 0, where the output is that step's denoised video: the last preview is
    # the projection of the output's first latent frame (1 level for fp rounding at a uint8 boundary)
    want = latent_to_rgb(out["samples"].tensors[0][:, :, :1])[0]
    assert float((last.int() - want.int()).abs().max()) <= 1


def test_sampler_previews_use_cores_previewer_when_core_has_the_h3_format(comfy, tiny, monkeypatch):
    _, calls = _fake_latent_preview(monkeypatch, core_format=True)
    H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(96, 64, 22), **SAMPLE_ARGS)
    assert calls == [(1, 24, 7, 4, 6)] * 2 and comfy.previews == [("JPEG", "core image", 512)] * 2


def test_sampler_no_previews_when_comfy_shows_none(comfy, tiny, monkeypatch):
    lp, _ = _fake_latent_preview(monkeypatch, core_format=False)
    lp.args.preview_method = types.SimpleNamespace(value="none")
    H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(96, 64, 22), **SAMPLE_ARGS)
    assert comfy.progress == [(1, 2), (2, 2)] and comfy.previews == [None, None]


def test_the_loader_and_sampler_with_the_load_behind_the_first_step(monkeypatch):
    """H3_LOAD_BEHIND=on through the nodes (the resident handle asks the runtime's size as the loader returns): the
    sampler's latents are those of the load before the first step, and the report says which load ran."""
    reports = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("H3_LOAD_BEHIND", mode)
        loader_mod.release_resident()
        rt = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)[0]
        (lat,) = H3EmptyLatent().create(64, 64, 5)
        _, reports[mode] = H3Sampler().sample(rt, core_conditioning(), lat, **SAMPLE_ARGS)
    loader_mod.release_resident()
    assert reports["on"]["backends"]["load"]["choice"] == "behind the first step"
    assert reports["off"]["backends"]["load"]["choice"] == "before the first step"
    assert reports["on"]["latent_checksums"]["video_sha256"] == reports["off"]["latent_checksums"]["video_sha256"]
