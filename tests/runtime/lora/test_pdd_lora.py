"""PDD head banks and turbo LoRAs through ``--lora`` and the H3 LoRA node (issue 25).

A bank in a LoRA file (``final_layer.{video,audio}_out.set_weight`` / ``set_bias``, metadata ``pdd_num_steps``)
must sample exactly like a checkpoint that carries the same bank (the PDD case of the payload tests, core's
FinalLayer), with or without a trunk LoRA beside it; removing it restores the single-head model bit for bit."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth  # noqa: E402

from h3_blackwell.cli import main as cli  # noqa: E402
from h3_blackwell.runtime import RuntimeOptions, load_model  # noqa: E402
from fixtures.sampling import sample  # noqa: E402
from h3_blackwell.runtime.lora import apply as L  # noqa: E402
from h3_blackwell.runtime.lora.key_forms import LoraError  # noqa: E402
from h3_blackwell.runtime.model.config import TINY, config_metadata  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict  # noqa: E402

N = 4


def _bank(seed=7, n=N, cfg=TINY):
    """A random bank for ``cfg``: block 0 near a head, blocks 1.. small deltas; fp32."""
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size

    def one(per):
        w = torch.randn(n * per, h, generator=g) * h ** -0.5
        w[per:] *= 0.1
        return w, 0.02 * torch.randn(n * per, generator=g)

    (vw, vb), (aw, ab) = one(cfg.video_patch_dim), one(cfg.audio_channels)
    return vw, vb, aw, ab


def _bank_file(path, bank, prefix="diffusion_model.", bias=True, meta=None, extra=None):
    vw, vb, aw, ab = bank
    t = {f"{prefix}final_layer.video_out.set_weight": vw, f"{prefix}final_layer.audio_out.set_weight": aw}
    if bias:
        t.update({f"{prefix}final_layer.video_out.set_bias": vb, f"{prefix}final_layer.audio_out.set_bias": ab})
    t.update(extra or {})
    save_file({k: v.contiguous() for k, v in t.items()}, str(path), metadata={"pdd_num_steps": str(vw.shape[0] // TINY.video_patch_dim),
                                      "pdd_block_size": "4", "converted_layout": "comfyui_minimax_h3",
                                      **(meta or {})})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The single-head tiny model and the same weights with the bank merged into the checkpoint (head_bank N)."""
    d = tmp_path_factory.mktemp("pdd")
    base = save_tiny(d / "base.safetensors", TINY, seed=3, dtype=torch.float32)
    bank = _bank()
    sd = tiny_state_dict(TINY, seed=3)
    sd["final_layer.video_out.weight"], sd["final_layer.video_out.bias"] = bank[0], bank[1]
    sd["final_layer.audio_out.weight"], sd["final_layer.audio_out.bias"] = bank[2], bank[3]
    merged = d / "merged.safetensors"
    save_file(dict(sorted(sd.items())), str(merged), metadata={"config": config_metadata(TINY.replace(head_bank=N))})
    return {"base": base, "merged": merged, "bank": bank, "dir": d}


def _gen(model, out, *extra):
    args = ["generate", "--model", str(model), "--output", str(out), "--steps", "3", "--width", "64", "--height",
            "64", "--frames", "22", "--device", "cpu", "--dense", "--seed", "5", *extra]
    assert cli.main(args) == 0
    with safe_open(str(out / "latents.safetensors"), "pt") as f:
        return f.get_tensor("video"), f.get_tensor("audio"), json.loads((out / "report.json").read_text())


def test_bank_lora_equals_the_checkpoint_with_the_bank(models, tmp_path):
    bank = _bank_file(tmp_path / "pdd_bank.safetensors", models["bank"])
    v, a, rep = _gen(models["base"], tmp_path / "lora", "--lora", f"{bank}:1.0")
    mv, ma, _ = _gen(models["merged"], tmp_path / "merged")
    assert torch.equal(v, mv) and torch.equal(a, ma)
    lo = rep["backends"]["lora"]
    assert lo["report"]["pdd_bank"]["heads"] == N and "PDD head bank of 4 heads" in lo["reason"]
    pv, _, _ = _gen(models["base"], tmp_path / "plain")
    assert not torch.equal(pv, v)


def test_bank_with_trunk_lora_and_unprefixed_keys(models, tmp_path):
    """A converter's file: the bank (bare names here) plus a trunk LoRA in native names (turbo-style fused qkv)."""
    truth = tiny_lora_truth(TINY, seed=4)
    trunk = save_tiny_lora(tmp_path / "trunk.safetensors", truth, "comfy")
    with safe_open(str(trunk), "pt") as f:
        trunk_t = {k: f.get_tensor(k) for k in f.keys()}
    both = _bank_file(tmp_path / "both.safetensors", models["bank"], prefix="", extra=trunk_t)
    v, a, _ = _gen(models["base"], tmp_path / "both", "--lora", f"{both}:0.7")
    mv, ma, _ = _gen(models["merged"], tmp_path / "ref", "--lora", f"{trunk}:0.7")
    assert torch.equal(v, mv) and torch.equal(a, ma)


def test_bank_without_bias_keeps_the_head_bias_and_removal_restores(models, tmp_path):
    rt = load_model(str(models["base"]), RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    before = {k: v.clone() for k, v in rt.model.state_dict().items()}
    f = _bank_file(tmp_path / "nobias.safetensors", models["bank"], bias=False)
    L.apply_loras(rt, [(str(f), 1.0, "merge")])
    fl = rt.model.final_layer
    assert rt.config.head_bank == N and rt.model.cfg.head_bank == N and fl.video_out.weight.shape[0] == N * 96
    assert torch.equal(fl.video_out.bias[:96], before["final_layer.video_out.bias"])
    assert not fl.video_out.bias[96:].any()
    text = torch.randn(1, 5, TINY.text_dim, generator=torch.Generator().manual_seed(0))
    res = sample(rt, text, None, torch.zeros(1, 24, 2, 4, 4), torch.zeros(1, 32, 2, 4), seed=1, steps=2)
    assert res.report["latents_finite"]
    L.apply_loras(rt, [])
    assert rt.config.head_bank == 1 and rt.model.final_layer.video_out.weight.shape[0] == 96
    assert all(torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())
    # strength 0 leaves the heads alone (ComfyUI's set patches ignore any other strength)
    L.apply_loras(rt, [(str(f), 0.0, "merge")])
    assert rt.config.head_bank == 1
    L.apply_loras(rt, [])


def test_bad_banks_are_refused_whole(models, tmp_path):
    rt = load_model(str(models["base"]), RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    vw, vb, aw, ab = models["bank"]
    cases = [
        (_bank_file(tmp_path / "n.safetensors", (vw, vb, aw[:3 * 32], ab[:3 * 32])), "video bank has 4 heads, the audio"),
        (_bank_file(tmp_path / "m.safetensors", models["bank"], meta={"pdd_num_steps": "32"}), "pdd_num_steps is 32"),
        (_bank_file(tmp_path / "w.safetensors", (vw[:, :50], vb, aw, ab)), "set_weight is"),
    ]
    only_video = tmp_path / "v.safetensors"
    save_file({"final_layer.video_out.set_weight": vw}, str(only_video))
    cases.append((only_video, "audio_out.set_weight is missing"))
    for f, match in cases:
        with pytest.raises(LoraError, match=match):
            L.apply_loras(rt, [(str(f), 1.0, "merge")])
        assert rt.config.head_bank == 1
    a = _bank_file(tmp_path / "a.safetensors", models["bank"])
    b = _bank_file(tmp_path / "b.safetensors", _bank(seed=9))
    with pytest.raises(LoraError, match="one PDD head bank per LoRA stack"):
        L.apply_loras(rt, [(str(a), 1.0, "merge"), (str(b), 1.0, "merge")])


def test_bank_through_the_lora_node(models, tmp_path, monkeypatch):
    from h3_blackwell.nodes.lora import H3LoRA

    bank = _bank_file(tmp_path / "pdd_bank.safetensors", models["bank"])
    fp = types.ModuleType("folder_paths")
    fp.get_filename_list = lambda key: ["pdd_bank.safetensors"] if key == "loras" else []
    fp.get_full_path = lambda key, name: str(bank) if key == "loras" and name == "pdd_bank.safetensors" else None
    fp.get_folder_paths = lambda key: [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    rt = load_model(str(models["base"]), RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    merged = load_model(str(models["merged"]), RuntimeOptions(device="cpu", dtype="float32", quantize=False))
    (view,) = H3LoRA().apply(rt, "pdd_bank.safetensors", 1.0, "merge")
    text = torch.randn(1, 5, TINY.text_dim, generator=torch.Generator().manual_seed(0))
    kw = dict(seed=1, steps=3)
    got = sample(view, text, None, torch.zeros(1, 24, 7, 4, 4), torch.zeros(1, 32, 2, 37), **kw)
    want = sample(merged, text, None, torch.zeros(1, 24, 7, 4, 4), torch.zeros(1, 32, 2, 37), **kw)
    assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)
    L.sync_loras(rt)  # the loader's own output again: no bank
    assert rt.config.head_bank == 1
