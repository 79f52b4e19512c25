"""The NVFP4 converter: ComfyUI comfy_quant output that comfy-kitchen reads back to our values, streaming
in one tensor's worth of host memory, any source naming, clear refusals."""

import json
import os
import subprocess
import sys
import textwrap

import torch

if not torch.cuda.is_available():  # before anything imports triton (comfy_kitchen does, at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import comfy_kitchen as ck  # noqa: E402
import pytest  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from h3_blackwell.runtime.io.checkpoint import dequantize_layer, open_checkpoint  # noqa: E402
from h3_blackwell.runtime.io.keys import comfy_to_diffusers_state_dict  # noqa: E402
from h3_blackwell.runtime.errors import H3Error  # noqa: E402
from h3_blackwell.runtime.ops import nvfp4 as nv  # noqa: E402
from h3_blackwell.runtime.io.convert import QUANTIZED_LINEAR, quantize_checkpoint, quantize_state_dict_streaming  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict  # noqa: E402


def _read(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _layers(sd):
    return sorted(k[: -len(".weight")] for k in sd if k.endswith(".weight") and QUANTIZED_LINEAR.match(k[:-7]))


def test_tiny_checkpoint_converts_to_comfy_quant(tmp_path):
    src = save_tiny(tmp_path / "tiny.safetensors", seed=3)
    out = tmp_path / "tiny_nvfp4.safetensors"
    calls = []
    summary = quantize_checkpoint(src, out, progress=lambda i, n, name: calls.append((i, n, name)))
    source, _ = _read(src)
    got, meta = _read(out)
    layers = _layers(source)
    assert len(layers) == 12 and summary["quantized_layers"] == 12  # 3 blocks x qkv, out_proj, fc1, fc2
    assert [c[0] for c in calls] == list(range(len(source))) and calls[0][1] == len(source)
    assert not (tmp_path / "tiny_nvfp4.safetensors.partial").exists()
    for layer in layers:
        w = source[layer + ".weight"]
        assert got[layer + ".weight"].dtype == torch.uint8
        assert got[layer + ".weight_scale"].dtype == torch.float8_e4m3fn
        assert got[layer + ".weight_scale_2"].dtype == torch.float32 and got[layer + ".weight_scale_2"].shape == ()
        assert json.loads(bytes(got[layer + ".comfy_quant"].tolist())) == {"format": "nvfp4"}
        ours = nv.quantize(w)
        # comfy-kitchen (eager, its default high-nibble-first order) dequantizes the file to our values
        with ck.use_backend("eager"):
            theirs = ck.dequantize_nvfp4(got[layer + ".weight"], got[layer + ".weight_scale_2"],
                                         got[layer + ".weight_scale"], output_type=torch.float32)
        assert torch.equal(theirs[: w.shape[0], : w.shape[1]], nv.dequantize(ours))
        # and the colleague loader's nvfp4 path reads the same values
        assert torch.equal(dequantize_layer(open_checkpoint(out), layer, {"format": "nvfp4"}, "cpu")[: w.shape[0]],
                           nv.dequantize(ours))
    for k, v in source.items():  # everything else: unchanged, at source precision
        if k[: -len(".weight")] not in layers:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert set(json.loads(meta["_quantization_metadata"])["layers"]) == set(layers)
    assert "config" in meta  # the source's config metadata is carried over
    ckpt = open_checkpoint(out)
    assert ckpt.scheme == "comfy" and ckpt.quant_format(layers[0]) == {"format": "nvfp4"}


def test_spooled_stream_equals_header_first_and_nvfp4_passes_through(tmp_path):
    src = save_tiny(tmp_path / "tiny.safetensors", seed=4)
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    quantize_checkpoint(src, a)
    ckpt = open_checkpoint(src)
    quantize_state_dict_streaming(ckpt.iter_tensors(), b, "cpu", metadata=ckpt.metadata)  # no shapes: spooled
    assert a.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob("*.spool"))
    quantize_checkpoint(a, c)  # an NVFP4 file goes through unchanged (no re-quantization)
    ta, _ = _read(a)
    tc, _ = _read(c)
    assert ta.keys() == tc.keys() and all(torch.equal(ta[k], tc[k]) for k in ta)


def test_diffusers_source_gives_the_same_nvfp4_file_content(tmp_path):
    sd = tiny_state_dict(seed=5, dtype=torch.bfloat16)
    save_file(sd, str(tmp_path / "comfy.safetensors"))
    save_file(comfy_to_diffusers_state_dict(sd), str(tmp_path / "diffusers.safetensors"))
    quantize_checkpoint(tmp_path / "comfy.safetensors", tmp_path / "q1.safetensors")
    quantize_checkpoint(tmp_path / "diffusers.safetensors", tmp_path / "q2.safetensors")
    t1, _ = _read(tmp_path / "q1.safetensors")
    t2, _ = _read(tmp_path / "q2.safetensors")
    assert t1.keys() == t2.keys()  # ComfyUI naming, qkv stacked, fc1 [gate; up]
    for k in t1:
        assert torch.equal(t1[k], t2[k]), k


def test_quantized_and_inconsistent_sources_are_refused(tmp_path):
    sd = {"blocks.0.mlp.fc1.weight": torch.randn(64, 32).to(torch.float8_e4m3fn),
          "blocks.0.mlp.fc1.weight_scale": torch.tensor(0.1)}
    out = tmp_path / "o.safetensors"
    with pytest.raises(H3Error, match="stored as F8_E4M3: an already-quantized source"):
        quantize_state_dict_streaming(iter(sd.items()), out, "cpu")
    assert not out.exists() and not list(tmp_path.iterdir())  # no partial or spool file left behind
    w = torch.randn(32, 32, dtype=torch.bfloat16)
    with pytest.raises(H3Error, match="header planned 'blocks.0.mlp.fc2.weight' next"):
        quantize_state_dict_streaming(iter([("blocks.0.mlp.fc1.weight", w)]), out, "cpu",
                                      shapes={"blocks.0.mlp.fc2.weight": ((32, 32), "BF16")})
    with pytest.raises(H3Error, match=r"header planned BF16 \[4\], found BF16 \[5\]"):
        quantize_state_dict_streaming(iter([("norm.weight", torch.ones(5, dtype=torch.bfloat16))]), out, "cpu",
                                      shapes={"norm.weight": ((4,), "BF16")})
    with pytest.raises(H3Error, match="same file"):
        quantize_checkpoint(out, out)


_RSS_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    from h3_blackwell.runtime.io.convert import quantize_state_dict_streaming

    H, INNER, FFN, BLOCKS = 5376, 7168, 14336, int(sys.argv[2])
    LINEARS = [("attn.qkv_proj.weight", (3 * INNER, H)), ("attn.out_proj.weight", (H, INNER)),
               ("mlp.fc1.weight", (2 * FFN, H)), ("mlp.fc2.weight", (H, FFN))]
    SMALL = [("norm1.weight", (H,)), ("norm2.weight", (H,)), ("attn.q_norm.weight", (128,))]
    spec = [(f"blocks.{b}.{n}", s) for b in range(BLOCKS) for n, s in LINEARS + SMALL]

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1 << 23, generator=g).bfloat16()  # random values, copied at random offsets (fast)

    def make(shape):
        t = torch.empty(shape, dtype=torch.bfloat16)
        flat, step = t.view(-1), 1 << 22
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            o = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=g))
            flat[i:i + n] = pool[o:o + n]
        return t

    def source():  # each tensor made when asked for and not kept by the generator: never the model in RAM
        for name, shape in spec:
            yield name, make(shape)

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    # warm up every code path once on a small tensor, then measure from the current footprint
    quantize_state_dict_streaming(iter([("blocks.0.mlp.fc2.weight", torch.randn(256, 512).bfloat16())]),
                                  sys.argv[1], "cpu")
    base = rss()
    t0 = time.time()
    quantize_state_dict_streaming(source(), sys.argv[1], "cpu",
                                  shapes={n: (s, "BF16") for n, s in spec})
    # VmHWM: this process image's own peak (ru_maxrss would carry the forking parent's peak across exec)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    largest = max(2 * s[0] * (s[1] if len(s) > 1 else 1) for _, s in spec)
    total = sum(2 * s[0] * (s[1] if len(s) > 1 else 1) for _, s in spec)
    print(json.dumps({"base": base, "peak": peak, "largest": largest, "total": total, "s": time.time() - t0}))
""")


def test_streaming_keeps_host_memory_near_one_tensor(tmp_path):
    """Two full-width blocks (1.5 GB of bf16 block linears; the largest, fc1, is 308 MB) convert with the
    process growing by less than 1.75x the largest tensor (the source tensor, its NVFP4 form and the
    fixed-size 256-row quantization temporaries), never the model. Peak RSS (VmHWM) of a fresh process."""
    out = tmp_path / "big.safetensors"
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(out), "2"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    assert grown < 1.75 * r["largest"], r  # measured ~1.45x: source + packed + 256-row temporaries
    assert grown < 0.35 * r["total"], r
    with safe_open(str(out), "pt") as f:
        assert f.get_slice("blocks.1.mlp.fc1.weight").get_shape() == [28672, 2688]
        assert f.get_slice("blocks.1.mlp.fc1.weight_scale").get_shape() == [28672, 336]


def test_write_planned_streams_any_plan_and_refuses_a_mismatch(tmp_path):
    """The header-first writer under the converter, for files of other formats (the bench's fp8 file for core):
    safetensors reads back every tensor; a tensor that is not the plan's next, or of another shape, is refused
    by name and leaves no file."""
    from h3_blackwell.runtime.io.convert import planned_bytes, write_planned

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn), "a.weight_scale": torch.tensor(0.5),
               "b": torch.randn(7, generator=g).to(torch.bfloat16), "c": torch.tensor(list(b"{}"), dtype=torch.uint8)}
    plan = [("a.weight", "F8_E4M3", (5, 3)), ("a.weight_scale", "F32", ()), ("b", "BF16", (7,)), ("c", "U8", (2,))]
    out = tmp_path / "f.safetensors"
    assert write_planned(out, plan, iter(tensors.items()), {"k": "v"}) == planned_bytes(plan) == 15 + 4 + 14 + 2
    got, meta = _read(out)
    assert meta == {"k": "v"} and list(got) == list(tensors)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
               for k, v in tensors.items())
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(H3Error, match="b: header planned BF16 \\[7\\], found BF16 \\[6\\]"):
        write_planned(bad, plan, iter({**tensors, "b": tensors["b"][:6]}.items()))
    with pytest.raises(H3Error, match="yielded 'c' but the header planned 'b' next"):
        write_planned(bad, plan, iter((k, tensors[k]) for k in ("a.weight", "a.weight_scale", "c")))
    with pytest.raises(H3Error, match="after 2 of 4 planned tensors; next missing: 'b'"):
        write_planned(bad, plan, iter((k, tensors[k]) for k in ("a.weight", "a.weight_scale")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors"]
