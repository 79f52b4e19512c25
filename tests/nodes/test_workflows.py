"""Every workflow in workflows/ checked against the node definitions: links type-check, widget values are legal,
the UI graph converts (with comfy-run's converter) to exactly its API twin, and the smoke workflow runs
in-process through this pack's nodes.

Core nodes used by the workflows: tests/fixtures/core_nodes.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3_blackwell.nodes import NODES
from fixtures.sampling import sample as runtime_sample
from h3_blackwell.comfy_client.workflow import is_api_prompt, is_ui_graph, ui_to_api

from fixtures.comfy_standins import _install  # the ComfyUI stand-ins
from fixtures.core_nodes import MODEL_EXTENSIONS, OWN_FILE_LISTS, object_info
from fixtures.workflow_gen import build

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
def _types_match(out_type: str, in_type: str) -> bool:
    if "*" in (out_type, in_type):
        return True
    return bool(set(out_type.split(",")) & set(in_type.split(",")))


def check_widget(class_type: str, name: str, spec, value) -> str | None:
    """None when ``value`` is legal for the widget, else why not."""
    kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
    if opts.get("image_upload") or opts.get("audio_upload") or opts.get("video_upload"):  # an input file
        return None if isinstance(value, str) and value else f"{value!r} is not an input file name"
    if isinstance(kind, list):
        if (class_type, name) in OWN_FILE_LISTS and isinstance(value, str) and value.endswith(MODEL_EXTENSIONS):
            return None
        return None if value in kind else f"{value!r} not in {kind}"
    if kind == "COMBO" and opts.get("file_list"):
        return None if isinstance(value, str) and value.endswith(MODEL_EXTENSIONS) else f"{value!r} is not a model file"
    if kind == "COMBO" and "options" in opts:
        return None if value in opts["options"] else f"{value!r} not in {opts['options']}"
    if kind == "INT":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{value!r} is not an INT"
    elif kind == "FLOAT":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{value!r} is not a FLOAT"
    elif kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a BOOLEAN"
    elif kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not a STRING"
    else:
        return f"{kind} is a socket, got the literal {value!r}"
    if "min" in opts and value < opts["min"]:
        return f"{value} is below the minimum {opts['min']}"
    if "max" in opts and value > opts["max"]:
        return f"{value} is above the maximum {opts['max']}"
    return None


def _expand_autogrow(specs: dict) -> dict:
    """Autogrow inputs -> their sockets ("ref_images.ref_image_0", ...) with the template's type."""
    out = {}
    for name, spec in specs.items():
        if spec[0] == "COMFY_AUTOGROW_V3":
            t = spec[1]["template"]
            (sub, sub_spec), = t["input"]["required"].items()
            out.update({f"{name}.{t['prefix']}{i}": sub_spec for i in range(t["max"])})
        else:
            out[name] = spec
    return out


def validate_api(prompt: dict, info: dict) -> list[str]:
    """Every problem ComfyUI's /prompt validation would find (and a few it would not), as strings."""
    problems = []
    if not is_api_prompt(prompt):
        return ["not an API prompt"]
    outputs = 0
    for nid, node in prompt.items():
        ct = node["class_type"]
        if ct not in info:
            problems.append(f"{nid}: unknown node type {ct}")
            continue
        d = info[ct]
        outputs += bool(d.get("output_node"))
        specs = _expand_autogrow({**d["input"].get("required", {}), **d["input"].get("optional", {})})
        for name in d["input"].get("required", {}):
            if name not in node["inputs"]:
                problems.append(f"{nid} ({ct}): required input {name} missing")
        for name, value in node["inputs"].items():
            if name not in specs:
                problems.append(f"{nid} ({ct}): unknown input {name}")
                continue
            spec = specs[name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
                src = prompt.get(value[0])
                if src is None or src["class_type"] not in info:
                    problems.append(f"{nid}.{name}: link to missing node {value[0]}")
                    continue
                outs = info[src["class_type"]]["output"]
                if value[1] >= len(outs):
                    problems.append(f"{nid}.{name}: {src['class_type']} has no output {value[1]}")
                    continue
                in_type = "COMBO" if isinstance(spec[0], list) else spec[0]
                if not _types_match(outs[value[1]], in_type):
                    problems.append(f"{nid}.{name}: {outs[value[1]]} output linked to a {in_type} input")
            else:
                why = check_widget(ct, name, spec, value)
                if why:
                    problems.append(f"{nid} ({ct}).{name}: {why}")
    if not outputs:
        problems.append("no output node")
    return problems


def validate_ui(graph: dict, info: dict) -> list[str]:
    """Link bookkeeping of a UI graph: both ends agree on ids, slots and types, and match the definitions."""
    problems = []
    nodes = {n["id"]: n for n in graph["nodes"]}
    for link in graph["links"]:
        lid, a, aslot, b, bslot, ltype = link
        na, nb = nodes.get(a), nodes.get(b)
        if na is None or nb is None:
            problems.append(f"link {lid}: missing node")
            continue
        out, inp = na["outputs"][aslot], nb["inputs"][bslot]
        if lid not in (out.get("links") or []) or inp.get("link") != lid:
            problems.append(f"link {lid}: the two ends do not list it")
        if not (out["type"] == inp["type"] == ltype):
            problems.append(f"link {lid}: types {out['type']} -> {inp['type']} (link says {ltype})")
        decl_out = info[na["type"]]["output"][aslot]
        decl_in = _expand_autogrow({**info[nb["type"]]["input"]["required"],
                                    **info[nb["type"]]["input"].get("optional", {})})
        if inp["name"] not in decl_in:
            problems.append(f"link {lid}: {nb['type']} has no input {inp['name']}")
        elif not _types_match(decl_out, decl_in[inp["name"]][0]):
            problems.append(f"link {lid}: {na['type']} gives {decl_out}, {nb['type']}.{inp['name']} wants "
                            f"{decl_in[inp['name']][0]}")
    ids = [link[0] for link in graph["links"]]
    if len(ids) != len(set(ids)) or graph.get("last_link_id", 0) < max(ids, default=0):
        problems.append("link ids are not unique or exceed last_link_id")
    if graph.get("last_node_id", 0) < max(nodes, default=0):
        problems.append("node ids exceed last_node_id")
    return problems


def _load(name):
    return json.loads((WORKFLOWS / name).read_text())


def _strip(prompt):
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


UI_GRAPHS = ["h3_t2va_nvfp4", "h3_fl2va_nvfp4", "h3_ref2va_nvfp4", "h3_fl2va_control_nvfp4",
             "h3_t2va_ksampler", "h3_fl2va_ksampler", "h3_ref2va_ksampler", "h3_smoke_tiny", "h3_t2va_fasth3",
             "h3_fl2va_sla_lora"]


def test_every_workflow_is_checked():
    assert sorted(p.name for p in WORKFLOWS.glob("*.json")) == sorted(
        [f"{n}.json" for n in UI_GRAPHS] + [f"{n}.api.json" for n in UI_GRAPHS])


@pytest.mark.parametrize("name", sorted(build()))
def test_shipped_workflow_is_what_the_node_definitions_give(name):
    """Each file equals what fixtures/workflow_gen.py builds from the node definitions today: a new widget, a
    changed default or a changed layout rule reaches the shipped files only by regenerating them."""
    assert (WORKFLOWS / name).read_text(encoding="utf-8") == build()[name], (
        f"workflows/{name} differs from what the node definitions give; run "
        "`.venv/bin/python scripts/make_workflows.py` and commit the result")


def test_smoke_graph_keeps_its_seed():
    """The smoke graph exists to reproduce a hash: its seed's control after generate is 'fixed', not the
    editor's default 'randomize' (which a graph loaded from its API form gets)."""
    sampler = next(n for n in _load("h3_smoke_tiny.json")["nodes"] if n["type"] == "H3B_Sampler")
    assert sampler["widgets_values"][:2] == [440420, "fixed"]


@pytest.mark.parametrize("name", [f"{n}.api.json" for n in UI_GRAPHS])
def test_api_workflows_validate(name):
    prompt = _load(name)
    assert is_api_prompt(prompt)
    assert validate_api(prompt, object_info()) == []


@pytest.mark.parametrize("name", UI_GRAPHS)
def test_ui_workflow_validates_and_converts_to_its_api_twin(name):
    graph = _load(f"{name}.json")
    assert is_ui_graph(graph) and not is_api_prompt(graph)
    info = object_info()
    assert validate_ui(graph, info) == []
    converted = ui_to_api(graph, info)
    assert validate_api(converted, info) == []
    assert _strip(converted) == _strip(_load(f"{name}.api.json"))


def _by_type(prompt):
    by_type = {}
    for nid, n in prompt.items():
        by_type.setdefault(n["class_type"], []).append(nid)
    return by_type


def _check_decoding_tail(prompt, by_type):
    """Core decodes our sampler's LATENT: VAEDecode (video VAE) + VAEDecodeAudio (audio VAE) -> CreateVideo 24 fps."""
    sampler = by_type["H3B_Sampler"][0]
    video_vae, audio_vae = by_type["VAELoader"]
    assert prompt[by_type["VAEDecode"][0]]["inputs"] == {"samples": [sampler, 0], "vae": [video_vae, 0]}
    assert prompt[by_type["VAEDecodeAudio"][0]]["inputs"] == {"samples": [sampler, 0], "vae": [audio_vae, 0]}
    assert prompt[by_type["CreateVideo"][0]]["inputs"]["fps"] == 24.0
    assert prompt[by_type["H3B_ModelLoader"][0]]["inputs"]["model"].endswith("_nvfp4.safetensors")
    assert prompt[sampler]["inputs"]["model"] == [by_type["H3B_ModelLoader"][0], 0]


def test_fl2va_workflow_shape():
    """First and last frame through core's MiniMaxH3ImageToVideo, an audio guide through core's
    MiniMaxH3AddGuide (audio VAE, frame 0), then our loader and sampler."""
    prompt = _load("h3_fl2va_nvfp4.api.json")
    by_type = _by_type(prompt)
    i2v, guide = by_type["MiniMaxH3ImageToVideo"][0], by_type["MiniMaxH3AddGuide"][0]
    images, audio = by_type["LoadImage"], by_type["LoadAudio"][0]
    assert {tuple(prompt[i2v]["inputs"][k]) for k in ("first_frame", "last_frame")} == {(i, 0) for i in images}
    g = prompt[guide]["inputs"]
    assert g["positive"] == [i2v, 0] and g["latent"] == [i2v, 1] and g["audio"] == [audio, 0]
    assert g["audio_vae"] == [by_type["VAELoader"][1], 0] and "image" not in g
    s = prompt[by_type["H3B_Sampler"][0]]["inputs"]
    assert s["positive"] == [guide, 0] and s["latent"] == [i2v, 1]
    _check_decoding_tail(prompt, by_type)


def test_ref2va_workflow_shape():
    """Two reference images and one reference audio through core's MiniMaxH3ReferenceToVideo (autogrow inputs,
    the prompt names them <Picture 1>, <Picture 2>, <Audio 1>), then our loader and sampler."""
    prompt = _load("h3_ref2va_nvfp4.api.json")
    by_type = _by_type(prompt)
    r2v = by_type["MiniMaxH3ReferenceToVideo"][0]
    r = prompt[r2v]["inputs"]
    refs = sorted(k for k in r if k.startswith("ref_"))
    assert refs == ["ref_audios.ref_audio_0", "ref_image_size", "ref_images.ref_image_0", "ref_images.ref_image_1"]
    assert {r["ref_images.ref_image_0"][0], r["ref_images.ref_image_1"][0]} == set(by_type["LoadImage"])
    assert r["ref_audios.ref_audio_0"] == [by_type["LoadAudio"][0], 0]
    assert all(tag in r["prompt"] for tag in ("<Picture 1>", "<Picture 2>", "<Audio 1>"))
    s = prompt[by_type["H3B_Sampler"][0]]["inputs"]
    assert s["positive"] == [r2v, 0] and s["latent"] == [r2v, 1]
    _check_decoding_tail(prompt, by_type)


def test_converter_reads_the_editors_upload_values_and_autogrow_sockets():
    """The editor saves LoadImage as [file, "image"] and LoadAudio as [file, null, null]; Autogrow sockets are
    named "<input>.<prefix><i>": the converter steps over the upload values and keeps every linked socket."""
    info = object_info()
    graph = _load("h3_ref2va_nvfp4.json")
    conv = ui_to_api(graph, info)
    assert conv["6"]["inputs"] == {"audio": "h3_ref_voice.wav"} and conv["4"]["inputs"] == {"image": "h3_ref_person.png"}
    node = next(n for n in graph["nodes"] if n["type"] == "MiniMaxH3ReferenceToVideo")
    node["inputs"] = [i for i in node["inputs"] if i["name"] != "ref_images.ref_image_1"]
    assert "ref_images.ref_image_1" not in ui_to_api(graph, info)["7"]["inputs"]


def test_t2va_workflow_shape():
    prompt = _load("h3_t2va_nvfp4.api.json")
    by_type = {}
    for nid, n in prompt.items():
        by_type.setdefault(n["class_type"], []).append(nid)
    assert prompt[by_type["CLIPLoader"][0]]["inputs"]["type"] == "minimax"
    assert len(by_type["VAELoader"]) == 2
    assert prompt[by_type["CreateVideo"][0]]["inputs"]["fps"] == 24.0
    sampler = by_type["H3B_Sampler"][0]
    # the sampler's LATENT feeds both decoders, its diagnostics the diagnostics node
    assert prompt[by_type["VAEDecode"][0]]["inputs"]["samples"] == [sampler, 0]
    assert prompt[by_type["VAEDecodeAudio"][0]]["inputs"]["samples"] == [sampler, 0]
    assert prompt[by_type["H3B_Diagnostics"][0]]["inputs"]["diagnostics"] == [sampler, 1]
    assert prompt[by_type["CreateVideo"][0]]["inputs"]["audio"] == [by_type["VAEDecodeAudio"][0], 0]
    assert {"H3B_ModelLoader", "H3B_Sampler", "H3B_Diagnostics", "SaveVideo"} <= set(by_type)


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_ksampler_variant_is_the_same_graph_on_the_model_output(task):
    """The KSampler variant of each workflow: the loader's MODEL output (index 1) -> core's MiniMaxH3SigmaShift (the
    H3 Sampler's shifts) -> core's KSampler (the same seed, steps, sampler, scheduler and denoise; cfg 1, so the
    negative, wired to the positive, is not evaluated) on the same conditioning and latent; the rest of the graph
    unchanged; the run's report through H3 Model Run Report into H3 Diagnostics."""
    ours, theirs = _load(f"h3_{task}_nvfp4.api.json"), _load(f"h3_{task}_ksampler.api.json")
    by = _by_type(theirs)
    assert "H3B_Sampler" not in by
    loader, shift, ks = by["H3B_ModelLoader"][0], by["MiniMaxH3SigmaShift"][0], by["KSampler"][0]
    old = ours[_by_type(ours)["H3B_Sampler"][0]]["inputs"]
    k = theirs[ks]["inputs"]
    assert theirs[shift]["inputs"] == {"model": [loader, 1], "shift_video": old["shift_video"],
                                       "shift_audio": old["shift_audio"]}
    assert k == {"model": [shift, 0], "seed": old["seed"], "steps": old["steps"], "cfg": 1.0,
                 "sampler_name": old["sampler"], "scheduler": old["scheduler"], "positive": old["positive"],
                 "negative": old["positive"], "latent_image": old["latent"], "denoise": old["denoise"]}
    same = {n for n in ours if ours[n]["class_type"] not in ("H3B_Sampler", "H3B_Diagnostics", "H3B_ModelLoader")}
    assert all(_strip(ours)[n] == _strip(theirs)[n] for n in same)
    assert theirs[loader]["inputs"] == ours[loader]["inputs"]
    report = by["H3B_ModelReport"][0]
    assert theirs[report]["inputs"] == {"model": [shift, 0], "latent": [ks, 0]}
    assert theirs[by["H3B_Diagnostics"][0]]["inputs"]["diagnostics"] == [report, 0]


def test_core_latent_node_can_feed_the_sampler():
    prompt = _load("h3_t2va_nvfp4.api.json")
    prompt["4"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 1344, "height": 768, "length": 124}}
    assert validate_api(prompt, object_info()) == []


def test_validator_catches_mistakes():
    info = object_info()
    prompt = _load("h3_t2va_nvfp4.api.json")
    prompt["5"]["inputs"]["steps"] = 500
    prompt["5"]["inputs"]["sampler"] = "dpmpp_2m"
    prompt["5"]["inputs"]["positive"] = ["7", 0]  # a VAE into CONDITIONING
    prompt["3"]["inputs"]["gemm"] = "int4"
    problems = validate_api(prompt, info)
    assert any("above the maximum 200" in p for p in problems)
    assert any("'dpmpp_2m' not in" in p for p in problems)
    assert any("VAE output linked to a CONDITIONING input" in p for p in problems)
    assert any("'int4' not in" in p for p in problems)
    graph = _load("h3_t2va_nvfp4.json")
    graph["links"][0][5] = "MODEL"
    assert validate_ui(graph, info)
    fl = _load("h3_fl2va_nvfp4.api.json")
    fl["8"]["inputs"]["frame_idx"] = 10000
    fl["8"]["inputs"]["audio"] = ["4", 0]  # an IMAGE into the AUDIO input
    problems = validate_api(fl, info)
    assert any("above the maximum 9999" in p for p in problems)
    assert any("IMAGE output linked to a AUDIO input" in p for p in problems)
    ref = _load("h3_ref2va_nvfp4.api.json")
    ref["7"]["inputs"]["ref_images.ref_image_9"] = ["4", 0]  # autogrow holds ref_image_0..8
    ref["7"]["inputs"]["ref_image_size"] = "huge"
    problems = validate_api(ref, info)
    assert any("unknown input ref_images.ref_image_9" in p for p in problems)
    assert any("'huge' not in" in p for p in problems)


def test_smoke_workflow_uses_only_this_pack():
    prompt = _load("h3_smoke_tiny.api.json")
    assert {n["class_type"] for n in prompt.values()} <= set(NODES)
    assert prompt["1"]["inputs"]["model"] == "embedded tiny (seed 0)"


def _execute(prompt: dict) -> dict:
    """ComfyUI's execution in miniature: output nodes and what they depend on, each node once."""
    results, ui = {}, {}

    def run(nid):
        if nid in results:
            return results[nid]
        node = prompt[nid]
        cls = NODES[node["class_type"]]
        kwargs = {k: (run(v[0])[v[1]] if isinstance(v, list) else v) for k, v in node["inputs"].items()}
        out = getattr(cls(), cls.FUNCTION)(**kwargs)
        if isinstance(out, dict):
            ui[nid] = out.get("ui")
            out = out["result"]
        results[nid] = out
        return out

    for nid, node in prompt.items():
        if getattr(NODES[node["class_type"]], "OUTPUT_NODE", False):
            run(nid)
    return {"results": results, "ui": ui}


def test_smoke_workflow_runs_in_process(monkeypatch, tmp_path):
    """The smoke prompt through the node classes gives the bytes `h3-blackwell generate` gives by default
    (tiny model, random states seed 1234, 256x256, 22 frames, 8 steps, seed 440420)."""
    fake = _install(monkeypatch, tmp_path, nested=True)
    prompt = _load("h3_smoke_tiny.api.json")
    run = _execute(prompt)
    (entry,) = run["ui"]["5"]["h3_report"]
    written = json.loads((fake.output_dir / entry["subfolder"] / entry["filename"]).read_text())
    video, audio = run["results"]["4"][0]["samples"].unbind()
    assert video.shape == (1, 24, 7, 16, 16) and audio.shape == (1, 32, 2, 37)
    rt = run["results"]["1"][0]
    ref = runtime_sample(rt, torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(1234)), None,
                         torch.zeros(1, 24, 7, 16, 16), torch.zeros(1, 32, 2, 37), seed=440420, steps=8)
    assert written["latent_checksums"]["video_sha256"] == ref.report["latent_checksums"]["video_sha256"]
    assert written["latent_checksums"]["audio_sha256"] == ref.report["latent_checksums"]["audio_sha256"]


def test_fl2va_control_workflow_shape():
    """fl2va plus a Fun ControlNet: the control video (Load Video -> Get Video Components' frames) and the video VAE
    into H3 Fun ControlNet on the loader's model, whose output is the sampler's model; core's defaults (strength 1,
    window 0-1, no fades); the rest is the fl2va graph."""
    prompt = _load("h3_fl2va_control_nvfp4.api.json")
    by_type = _by_type(prompt)
    ctl, comps, video = by_type["H3B_FunControlNetApply"][0], by_type["GetVideoComponents"][0], by_type["LoadVideo"][0]
    c = prompt[ctl]["inputs"]
    assert c["model"] == [by_type["H3B_ModelLoader"][0], 0] and c["vae"] == [by_type["VAELoader"][0], 0]
    assert c["control_video"] == [comps, 0] and prompt[comps]["inputs"]["video"] == [video, 0]
    assert (c["strength"], c["start_percent"], c["end_percent"], c["fade_in_frames"], c["fade_out_frames"]) == \
        (1.0, 0.0, 1.0, 0, 0)
    assert "mask" not in c and "model_patch" not in c
    sampler = by_type["H3B_Sampler"][0]
    assert prompt[sampler]["inputs"]["model"] == [ctl, 0]
    plain = _load("h3_fl2va_nvfp4.api.json")
    for nid, node in plain.items():  # everything else is the fl2va workflow
        if node["class_type"] != "H3B_Sampler" and not node["class_type"].startswith(("H3B_Diag", "SaveVideo")):
            assert prompt[nid]["inputs"] == node["inputs"], nid


def test_fasth3_and_sla_workflows_select_their_method():
    """FastH3 runs core's vsa at 10 % in 4 steps at shifts 12 / 3; the SLA LoRA graph runs sla with the LoRA."""
    fast = _load("h3_t2va_fasth3.api.json")
    loader = next(n["inputs"] for n in fast.values() if n["class_type"] == "H3B_ModelLoader")
    sampler = next(n["inputs"] for n in fast.values() if n["class_type"] == "H3B_Sampler")
    assert (loader["attention"], loader["sparse_method"], loader["sparse_keep_percent"]) == ("sparse", "vsa", 10.0)
    assert (sampler["steps"], sampler["shift_video"], sampler["shift_audio"]) == (4, 12.0, 3.0)
    sla = _load("h3_fl2va_sla_lora.api.json")
    loader = next(n["inputs"] for n in sla.values() if n["class_type"] == "H3B_ModelLoader")
    assert (loader["attention"], loader["sparse_method"]) == ("sparse", "sla")
    assert any(n["class_type"] == "H3B_LoRA" for n in sla.values())
