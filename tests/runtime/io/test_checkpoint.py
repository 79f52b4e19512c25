"""Checkpoint loading: naming schemes, header-only detection, streaming memory, clear errors."""

import json
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch
from safetensors.torch import save_file

from h3_blackwell.runtime.io import checkpoint as ckmod
from h3_blackwell.runtime.errors import CheckpointError
from h3_blackwell.runtime.io.checkpoint import detect_config, expected_keys, open_checkpoint
from h3_blackwell.runtime.io.keys import comfy_to_diffusers_state_dict, interleave_qkv
from h3_blackwell.runtime.io.detect import config_from_shapes
from h3_blackwell.runtime.model.config import FULL, TINY, H3Config
from h3_blackwell.runtime.load import load_model
from h3_blackwell.runtime.options import RuntimeOptions
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict

CPU = RuntimeOptions(device="cpu", dtype="float32", quantize=False)  # dense: these tests read weights


def _save_raw_sharded(sd, cfg, d):
    """The MiniMax release layout: original names, QKV interleaved per head, two shards + index."""
    raw = {k: (interleave_qkv(v, cfg.num_heads, cfg.head_dim) if k.endswith("qkv_proj.weight") else v)
           for k, v in sd.items()}
    keys = sorted(raw)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    wm = {}
    for f, ks in shards.items():
        save_file({k: raw[k] for k in ks}, str(d / f))
        wm.update({k: f for k in ks})
    idx = d / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return idx


def test_three_naming_schemes_load_identical_tensors(tmp_path):
    cfg = TINY
    sd = tiny_state_dict(cfg, seed=7)
    save_file(sd, str(tmp_path / "comfy.safetensors"))
    save_file({f"model.diffusion_model.{k}": v for k, v in sd.items()}, str(tmp_path / "prefixed.safetensors"))
    save_file(comfy_to_diffusers_state_dict(sd), str(tmp_path / "diffusers.safetensors"))
    idx = _save_raw_sharded(sd, cfg, tmp_path)
    loaded = {}
    for name, path in [("comfy", tmp_path / "comfy.safetensors"), ("prefixed", tmp_path / "prefixed.safetensors"),
                       ("diffusers", tmp_path / "diffusers.safetensors"), ("raw", idx)]:
        ck = open_checkpoint(path)
        assert ck.scheme == {"prefixed": "comfy"}.get(name, name)
        assert ck.config == cfg.replace(), name
        loaded[name] = dict(ck.iter_tensors())
    for name, tensors in loaded.items():
        assert sorted(tensors) == sorted(sd), name
        for k in sd:
            assert torch.equal(tensors[k], sd[k]), (name, k)
    # and the loaded models agree bit for bit
    rts = [load_model(p, CPU).model.state_dict() for p in (tmp_path / "comfy.safetensors", idx)]
    for k in rts[0]:
        assert torch.equal(rts[0][k], rts[1][k]), k


def _full_header_file(path, cfg: H3Config, metadata=None):
    """A sparse file whose header describes the full bf16 model: no tensor data is ever written."""
    shapes = expected_keys(cfg)
    hdr, off = {}, 0
    for k, s in sorted(shapes.items()):
        n = 2
        for d in s:
            n *= d
        hdr[k] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        hdr["__metadata__"] = metadata
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + off)  # sparse: 66 GB of holes
    return off


def test_detect_full_config_from_header_without_tensor_allocation(tmp_path, monkeypatch):
    p = tmp_path / "full.safetensors"
    nbytes = _full_header_file(p, FULL)
    assert nbytes > 60e9  # the whole 33B bf16 model is described
    monkeypatch.setattr(ckmod, "_read_raw", lambda *a, **k: pytest.fail("tensor data was read"))
    tracemalloc.start()
    cfg, scheme, _ = detect_config(p)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert scheme == "comfy"
    assert cfg == FULL
    assert peak < 32e6, peak  # the JSON header only (~100 KB) plus parsing overhead
    assert cfg.num_layers == 50 and cfg.inner_dim == 7168 and cfg.rope_dim == 96


def test_metadata_config_override_and_structural_features(tmp_path):
    cfg = TINY.replace(adaln_curve_grid=33, time_embed_dim=8, head_bank=4, gate_compress=True)
    shapes = expected_keys(cfg)
    assert "adaln_t_table" in shapes and "time_embedder.proj_in.weight" not in shapes
    got = config_from_shapes(shapes)
    # curve form has no time embedder, so its hidden width is not in the file (unused)
    assert got == cfg.replace(time_embed_hidden_size=FULL.time_embed_hidden_size)
    over = config_from_shapes(shapes, metadata={"config": json.dumps({"transformer": {"norm_eps": 1e-6}})})
    assert over.eps == 1e-6


# the keys core's detection writes for H3 (comfy/model_detection.py) and passes to its model as arguments
CORE_H3_KEYS = {"image_model", "num_layers", "token_refiner_num_layers", "hidden_size", "latents_dim",
                "audio_latents_dim", "attention_head_dim", "num_attention_heads", "ffn_hidden_size", "text_dim",
                "adaln_curve_grid", "time_embed_dim", "timestep_input_dim", "time_embed_hidden_size",
                "rope_inv_freq_len", "gate_compress"}


def _meta_config(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["config"])


def test_written_config_metadata_uses_only_core_names_under_transformer(tmp_path):
    """core merges metadata config["transformer"] into its model's arguments: make-tiny and quantize write
    only core's names there (an `adaln_curve_grid: 0` of ours turned core's curve form on and crashed
    KSampler); our config rides under our own key and reads back whole; a file of the old form still reads
    and quantize rewrites its entry."""
    from h3_blackwell.runtime.io.convert import quantize_checkpoint
    from h3_blackwell.runtime.model.config import config_metadata

    tiny = save_tiny(tmp_path / "tiny.safetensors", seed=2)
    meta = _meta_config(tiny)
    assert set(meta["transformer"]) <= CORE_H3_KEYS and meta["transformer"]["latents_dim"] == 24
    assert meta["h3_blackwell_tiny_seed"] == 2 and H3Config.from_dict(meta["h3_blackwell"]) == TINY
    assert detect_config(tiny)[0] == TINY
    # a config that detection alone would get wrong comes back from our entry
    odd = TINY.replace(eps=1e-6, shift_video=7.0)
    assert config_from_shapes(expected_keys(TINY), metadata={"config": config_metadata(odd)}) == odd
    # the old form (our names under "transformer") still reads, and quantize repairs it
    old = tmp_path / "old.safetensors"
    save_file(tiny_state_dict(TINY, 2, torch.bfloat16), str(old),
              metadata={"config": json.dumps({"transformer": odd.to_dict(), "h3_blackwell_tiny_seed": 2})})
    assert detect_config(old)[0] == odd
    quantize_checkpoint(old, tmp_path / "q.safetensors")
    q = _meta_config(tmp_path / "q.safetensors")
    assert set(q["transformer"]) <= CORE_H3_KEYS and H3Config.from_dict(q["h3_blackwell"]) == odd
    assert q["h3_blackwell_tiny_seed"] == 2 and detect_config(tmp_path / "q.safetensors")[0] == odd


def test_streaming_load_keeps_rss_near_largest_tensor(tmp_path):
    """~1 GB fp32 checkpoint; reading every tensor one at a time must not grow RSS past ~3 largest tensors."""
    cfg = H3Config(hidden_size=1536, num_layers=6, num_refiner_layers=1, num_heads=12, head_dim=128,
                   ffn_hidden_size=4096, text_dim=1024, time_embed_hidden_size=512, time_embed_dim=256)
    shapes = expected_keys(cfg)
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.empty(s).uniform_(-1, 1, generator=g) for k, s in shapes.items()}
    path = tmp_path / "big.safetensors"
    save_file(sd, str(path))
    largest = max(v.numel() * 4 for v in sd.values())
    total = path.stat().st_size
    del sd
    assert total > 0.9e9
    code = textwrap.dedent(f"""
        import resource, torch
        from h3_blackwell.runtime.io.checkpoint import open_checkpoint
        def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
        ck = open_checkpoint({str(path)!r})
        base = rss(); peak = base; s = 0.0
        for name, t in ck.iter_tensors():
            s += float(t.flatten()[0]); peak = max(peak, rss()); del t
        print(peak - base)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip().splitlines()[-1])
    assert growth <= 3 * largest, (growth, largest, total)


# ---------------------------------------------------------------------------------------------
# errors name the problem
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_file(tmp_path):
    return save_tiny(tmp_path / "tiny.safetensors", seed=1)


def _err(path, **kw):
    with pytest.raises(CheckpointError) as e:
        load_model(path, CPU, **kw)
    return str(e.value)


def test_error_not_safetensors(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(os.urandom(4096))
    assert "not a valid safetensors" in _err(p) or "not a safetensors" in _err(p)


def test_error_pickle_refused(tmp_path):
    p = tmp_path / "x.ckpt"
    p.write_bytes(b"PK\x03\x04" + os.urandom(64))
    assert "pickle" in _err(p)


def test_error_truncated(tiny_file, tmp_path):
    data = tiny_file.read_bytes()
    p = tmp_path / "trunc.safetensors"
    p.write_bytes(data[: len(data) // 2])
    assert "truncated" in _err(p)


def test_error_corrupt_header(tmp_path):
    p = tmp_path / "bad.safetensors"
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offs'
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    assert "corrupt safetensors header" in _err(p)


def test_error_missing_keys_named(tmp_path):
    sd = tiny_state_dict(TINY, seed=1)
    del sd["blocks.1.mlp.fc2.weight"]
    p = tmp_path / "missing.safetensors"
    save_file(sd, str(p))
    msg = _err(p)
    assert "missing" in msg and "blocks.1.mlp.fc2.weight" in msg


def test_error_wrong_shape_expected_vs_found(tmp_path):
    sd = tiny_state_dict(TINY, seed=1)
    sd["blocks.0.attn.out_proj.weight"] = torch.randn(96, 100)
    p = tmp_path / "shape.safetensors"
    save_file(sd, str(p))
    msg = _err(p)
    assert "blocks.0.attn.out_proj.weight" in msg and "expected [96, 128]" in msg and "found [96, 100]" in msg


def test_error_unknown_naming_scheme(tmp_path):
    p = tmp_path / "vae.safetensors"
    save_file({"decoder.conv_in.weight": torch.randn(4, 4), "encoder.down.0.weight": torch.randn(4)}, str(p))
    msg = _err(p)
    assert "unknown naming scheme" in msg and "decoder.conv_in.weight" in msg


def test_error_missing_file(tmp_path):
    assert "not found" in _err(tmp_path / "nope.safetensors")


def test_fp8_source_dequantizes(tmp_path):
    """An fp8 (comfy_quant float8_e4m3fn) source loads to weight * scale."""
    sd = tiny_state_dict(TINY, seed=2)
    w = sd["blocks.0.mlp.fc1.weight"]
    scale = w.abs().max() / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    sd["blocks.0.mlp.fc1.weight"] = q
    sd["blocks.0.mlp.fc1.weight_scale"] = scale.reshape(())
    sd["blocks.0.mlp.fc1.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    p = tmp_path / "fp8.safetensors"
    save_file(sd, str(p))
    m = load_model(p, CPU).model
    assert torch.equal(m.blocks[0].mlp.fc1.weight, q.float() * scale)


def test_int8_convrot_source_dequantizes(tmp_path):
    """int8_tensorwise with convrot: W' = W H^T per 16-wide group, per-row scales; load undoes both."""
    from h3_blackwell.runtime.io.checkpoint import hadamard

    sd = tiny_state_dict(TINY, seed=3)
    w = sd["blocks.1.attn.qkv_proj.weight"].double()
    g = 16
    h = hadamard(g)
    rot = (w.reshape(w.shape[0], -1, g) @ h.T).reshape(w.shape)
    scale = rot.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(rot / scale).clamp(-127, 127).to(torch.int8)
    sd["blocks.1.attn.qkv_proj.weight"] = q
    sd["blocks.1.attn.qkv_proj.weight_scale"] = scale.float()
    sd["blocks.1.attn.qkv_proj.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": g}).encode()),
        dtype=torch.uint8)
    p = tmp_path / "int8.safetensors"
    save_file(sd, str(p))
    m = load_model(p, CPU).model
    expect = ((q.double() * scale.float().double()).reshape(w.shape[0], -1, g) @ h).reshape(w.shape)
    got = m.blocks[1].attn.qkv_proj.weight.double()
    assert (got - expect).abs().max() < 1e-5
    # and it is close to the original (int8 rounding only)
    assert float((got - w).norm() / w.norm()) < 0.02
