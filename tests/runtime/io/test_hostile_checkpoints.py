"""Checkpoints that lie in their names, metadata or quantization claims: each is a refusal naming the file, what was
expected and what was found (exit 2, nothing written), never an internal error, a hang on a model built to the
lie's size, or a model silently built from part of the file. And two legitimate layouts that must load: NVFP4 layers
described only by the file's ``_quantization_metadata`` (ComfyUI's older form, no per-layer marker), and fp8 / int8
weights with one scale per row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fixtures.cli_contract import listing, refused_inproc, tiny_model_files, write_safetensors
from h3_blackwell.runtime import CheckpointError
from h3_blackwell.runtime.io.checkpoint import dequantize_layer, open_checkpoint
from h3_blackwell.runtime.io.header import read_header

SMALL = ["--width", "64", "--height", "64", "--frames", "5", "--steps", "1"]
FC1 = "blocks.0.mlp.fc1"  # [320, 96] in the tiny model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_model_files(tmp_path_factory.mktemp("hostile_ck"))


def _rewrite(src: Path, dst: Path, tensors=None, meta=None) -> Path:
    """A copy of ``src`` with ``tensors(dict)`` and ``meta(dict) -> dict`` applied."""
    with safe_open(str(src), "pt") as f:
        m = dict(f.metadata() or {})
        t = {k: f.get_tensor(k) for k in f.keys()}
    if tensors is not None:
        tensors(t)
    save_file(t, str(dst), metadata=meta(m) if meta is not None else m)
    return dst


def _config(**over):
    """A metadata edit that overrides our config entry's fields."""
    def edit(m):
        c = json.loads(m["config"])
        c["h3_blackwell"].update(over)
        return {**m, "config": json.dumps(c)}
    return edit


def _marker(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _refused(capsys, out: Path, model: Path, *needles) -> str:
    before = listing(out)
    line = refused_inproc(capsys, ["generate", "--output", out / "o", "--model", model, *SMALL], *needles)
    assert "internal" not in line and listing(out) == before
    return line


# ---------------------------------------------------------------------------------------------
# block counts: the model is built to the file's numbering, so the numbering must be the file's blocks
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,needles", [
    ("blocks.1000000000.norm1.weight", ["blocks.1000000000", "no blocks.3"]),
    ("token_refiner.blocks.100000000.norm1.weight", ["token_refiner.blocks.100000000", "no token_refiner.blocks.2"]),
])
def test_a_stray_block_index_is_refused_before_a_model_is_built(key, needles, files, tmp_path):
    """One 96-float tensor named ``blocks.1000000000.*`` (no config metadata) made the detected model a billion
    blocks long: building its key table hung. The numbering must be 0..n-1."""
    bad = _rewrite(files["tiny"], tmp_path / "stray.safetensors", lambda t: t.update({key: torch.randn(96)}),
                   lambda m: {})
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(bad)
    assert time.perf_counter() - t0 < 10
    assert all(n in str(ei.value) for n in [*needles, "stray.safetensors"]), str(ei.value)


def test_a_missing_block_is_named(files, out, tmp_path, capsys):
    bad = _rewrite(files["tiny"], tmp_path / "gap.safetensors",
                   lambda t: [t.pop(k) for k in list(t) if k.startswith("blocks.1.")], lambda m: {})
    _refused(capsys, out, bad, "gap.safetensors", "no blocks.1", "blocks.0 .. blocks.1")


@pytest.mark.parametrize("over,needle", [({"num_layers": 10 ** 9}, "num_layers=1000000000"),
                                         ({"num_refiner_layers": 10 ** 8}, "num_refiner_layers=100000000"),
                                         ({"num_layers": 1}, "num_layers=1")])
def test_metadata_block_counts_must_be_the_files(over, needle, files, tmp_path):
    """The metadata ``config`` overrides what the shapes say: a block count of 10**9 hung the key table, a count of
    1 ran a one-block model from a three-block file without a word."""
    bad = _rewrite(files["tiny"], tmp_path / "count.safetensors", meta=_config(**over))
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(bad)
    msg = str(ei.value)
    assert needle in msg and "holds" in msg and "count.safetensors" in msg and "re-export" in msg, msg


@pytest.mark.parametrize("field,value", [("eps", -1.0), ("rope_theta", 0.0), ("shift_video", -5.0),
                                         ("shift_audio", 0.0)])
def test_metadata_numbers_must_be_positive(field, value, files, out, tmp_path, capsys):
    """eps < 0 gave NaN latents blamed on a backend; a negative shift sampled a schedule outside [0, 1] (exit 0)."""
    bad = _rewrite(files["tiny"], tmp_path / "num.safetensors", meta=_config(**{field: value}))
    _refused(capsys, out, bad, "num.safetensors", f"{field}={value!r}", "expected a finite number > 0")


def test_a_head_of_zero_width_is_refused(files, out, tmp_path, capsys):
    """q_norm [0] gave head_dim 0 and a ZeroDivisionError (an internal error)."""
    bad = _rewrite(files["tiny"], tmp_path / "q0.safetensors",
                   lambda t: t.update({"blocks.0.attn.q_norm.weight": torch.zeros(0)}), lambda m: {})
    _refused(capsys, out, bad, "q0.safetensors", "blocks.0.attn.q_norm.weight has shape [0]", "head_dim > 0")


# ---------------------------------------------------------------------------------------------
# quantization claims
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where,value", [("marker", ["nvfp4"]), ("marker", {"a": 1}), ("metadata", ["nvfp4"])])
def test_a_format_of_the_wrong_json_type(where, value, files, out, tmp_path, capsys):
    """``"format": ["nvfp4"]`` was looked up in a dict: TypeError (unhashable), an internal error."""
    if where == "marker":
        bad = _rewrite(files["nvfp4"], tmp_path / "fmt.safetensors",
                       lambda t: t.update({FC1 + ".comfy_quant": _marker(json.dumps({"format": value}))}))
    else:
        def meta(m):
            q = json.loads(m["_quantization_metadata"])
            q["layers"][FC1] = {"format": value}
            return {**m, "_quantization_metadata": json.dumps(q)}
        bad = _rewrite(files["nvfp4"], tmp_path / "fmt.safetensors", lambda t: t.pop(FC1 + ".comfy_quant"), meta)
    _refused(capsys, out, bad, "fmt.safetensors", f"'format' is {json.dumps(value)}", "expected a string")


def _run_latents(out: Path, model: Path, *extra) -> dict:
    from h3_blackwell.cli import main as cli

    assert cli.main([str(x) for x in ["generate", "--output", out, "--model", model, *SMALL, *extra]]) == 0
    return load_file(str(out / "latents.safetensors"))


@pytest.mark.parametrize("extra", [[], ["--dense"]])
def test_nvfp4_layers_described_by_the_metadata_alone_load(extra, files, tmp_path):
    """ComfyUI's older NVFP4 layout: no ``<layer>.comfy_quant`` tensors, the formats in ``_quantization_metadata``
    (core converts them into markers when it loads). The plan adopted those layers as NVFP4, then the loader asked
    for a marker: an internal error. The run equals the run of the same file with its markers."""
    meta_only = _rewrite(files["nvfp4"], tmp_path / "meta_only.safetensors",
                         lambda t: [t.pop(k) for k in list(t) if k.endswith(".comfy_quant")])
    assert "comfy_quant" not in " ".join(read_header(meta_only).tensors)
    got = _run_latents(tmp_path / "a", meta_only, *extra)
    want = _run_latents(tmp_path / "b", files["nvfp4"], *extra)
    assert all(torch.equal(got[k], want[k]) for k in ("video", "audio"))


def test_packed_bytes_without_a_format_claim_are_refused(files, out, tmp_path, capsys):
    """A U8 weight with neither a marker nor a metadata entry passed the check as nvfp4, then loaded as
    int8_tensorwise (a broadcast error, internal); ``quantize`` copied it into a broken output."""
    def meta(m):
        q = json.loads(m["_quantization_metadata"])
        q["layers"].pop(FC1)
        return {**m, "_quantization_metadata": json.dumps(q)}
    bad = _rewrite(files["nvfp4"], tmp_path / "bare.safetensors", lambda t: t.pop(FC1 + ".comfy_quant"), meta)
    _refused(capsys, out, bad, "bare.safetensors", f"{FC1}.weight: stored as U8", "says its format")
    before = listing(out)
    refused_inproc(capsys, ["quantize", bad, out / "q.safetensors"], "stored as U8")
    assert listing(out) == before


def test_an_fp8_weight_without_its_scale_is_named_as_such(files, out, tmp_path, capsys):
    """An unscaled fp8 file (or an older scaled_fp8 one, whose scale is 'scale_weight') was refused as a damaged
    int8_tensorwise layer, a format the file never claims."""
    def edit(t):
        t[FC1 + ".weight"] = t[FC1 + ".weight"].to(torch.float8_e4m3fn)
    bad = _rewrite(files["tiny"], tmp_path / "fp8_unscaled.safetensors", edit)
    line = _refused(capsys, out, bad, "fp8_unscaled.safetensors", f"{FC1}.weight: an F8_E4M3 weight without "
                    f"{FC1}.weight_scale", "not supported")
    assert "int8" not in line.split("not supported")[0], line


def _fp8(scale: torch.Tensor):
    def edit(t):
        t[FC1 + ".weight"] = t[FC1 + ".weight"].to(torch.float8_e4m3fn)
        t[FC1 + ".weight_scale"] = scale
    return edit


def _int8(scale: torch.Tensor, **conf):
    def edit(t):
        g = torch.Generator().manual_seed(1)
        t[FC1 + ".weight"] = torch.randint(-127, 128, (320, 96), generator=g, dtype=torch.int8)
        t[FC1 + ".weight_scale"] = scale
        t[FC1 + ".comfy_quant"] = _marker(json.dumps({"format": "int8_tensorwise", **conf}))
    return edit


def _nv(name: str, value: torch.Tensor):
    return lambda t: t.update({FC1 + name: value})


SIDE_CASES = {
    "nvfp4 input_scale [5]": ("nvfp4", _nv(".input_scale", torch.rand(5) + 0.5),
                              [f"{FC1}.input_scale", "expected one value, found [5]"]),
    "nvfp4 pre_quant_scale [7]": ("nvfp4", _nv(".pre_quant_scale", torch.rand(7) + 0.5),
                                  [f"{FC1}.pre_quant_scale", "expected [96], found [7]"]),
    "fp8 scale [K]": ("tiny", _fp8(torch.rand(96) + 0.5), [f"{FC1}.weight_scale", "one per row", "found [96]"]),
    "fp8 scale [7]": ("tiny", _fp8(torch.rand(7) + 0.5), [f"{FC1}.weight_scale", "found [7]"]),
    "int8 scale [7]": ("tiny", _int8(torch.rand(7) + 0.5), [f"{FC1}.weight_scale", "found [7]"]),
    "int8 scale [1, K]": ("tiny", _int8(torch.rand(1, 96) + 0.5), [f"{FC1}.weight_scale", "found [1, 96]"]),
    "convrot 'abc'": ("tiny", _int8(torch.tensor(0.01), convrot=True, convrot_groupsize="abc"), ["'abc'"]),
    "convrot 5": ("tiny", _int8(torch.tensor(0.01), convrot=True, convrot_groupsize=5), ["convrot_groupsize 5"]),
    "convrot 16.7": ("tiny", _int8(torch.tensor(0.01), convrot=True, convrot_groupsize=16.7), ["16.7"]),
    "convrot 64 (does not divide 96)": ("tiny", _int8(torch.tensor(0.01), convrot=True, convrot_groupsize=64),
                                        ["convrot_groupsize 64", "divides the weight's 96 columns"]),
    # a Hadamard matrix of 4**9 rows is 550 GB: it was allocated before anything looked at the number
    "convrot 4**9": ("tiny", _int8(torch.tensor(0.01), convrot=True, convrot_groupsize=4 ** 9),
                     ["convrot_groupsize 262144"]),
}


@pytest.mark.parametrize("case", sorted(SIDE_CASES))
def test_the_side_tensors_of_a_quantized_layer_are_checked(case, files, out, tmp_path, capsys):
    """Each of these was an internal error (a broadcast or reshape failure, int('abc')), a silent per-column scale
    (fp8 [K]), or an allocation of hundreds of GB (convrot 4**9)."""
    src, edit, needles = SIDE_CASES[case]
    bad = _rewrite(files[src], tmp_path / "side.safetensors", edit)
    _refused(capsys, out, bad, "side.safetensors", *needles)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("shape", [(320,), (320, 1)])
def test_one_scale_per_row_dequantizes_per_row(fmt, shape, files, tmp_path):
    """[N] and [N, 1] scales multiply the rows of the [N, K] weight (an fp8 [N] scale was broadcast over the
    columns: a shape error, or a silently wrong weight where N == K)."""
    scale = torch.rand(shape, generator=torch.Generator().manual_seed(2)) + 0.5
    edit = _fp8(scale) if fmt == "fp8" else _int8(scale)
    path = _rewrite(files["tiny"], tmp_path / "rows.safetensors", edit)
    ck = open_checkpoint(path)
    stored = load_file(str(path))
    w = stored[FC1 + ".weight"]
    want = (w.float() if fmt == "fp8" else w.view(torch.int8).float()) * scale.reshape(-1, 1)
    got = dequantize_layer(ck, FC1, ck.quant_format(FC1), "cpu")
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# safetensors extents
# ---------------------------------------------------------------------------------------------

def test_tensors_that_share_bytes_are_refused(tmp_path):
    """A 4 MB file declaring 2,000 tensors over the same 4 MB (an 8 GB read, and held, for a LoRA) was read
    tensor after tensor; safetensors stores each tensor in bytes of its own."""
    n, size = 2000, 4 << 20
    header = {f"diffusion_model.blocks.0.attn.x{i}.lora_A.weight": {"dtype": "F32", "shape": [1024, 1024],
                                                                     "data_offsets": [0, size]} for i in range(n)}
    bomb = write_safetensors(tmp_path / "bomb.safetensors", header, b"\0" * size)
    with pytest.raises(CheckpointError, match="share bytes of the data section"):
        read_header(bomb)
    # a partial overlap, and tensors of zero bytes at any offset (they hold nothing)
    partial = write_safetensors(tmp_path / "partial.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}}, b"\0" * 28)
    with pytest.raises(CheckpointError, match="'a' and 'b' share bytes"):
        read_header(partial)
    empty = write_safetensors(tmp_path / "empty.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}, b"\0" * 16)
    assert set(read_header(empty).tensors) == {"a", "z"}


def test_a_lora_whose_tensors_share_bytes_is_refused_in_the_cli(out, tmp_path, capsys):
    size = 1 << 20
    header = {f"diffusion_model.blocks.0.attn.out_proj.x{i}.lora_A.weight": {
        "dtype": "F32", "shape": [256, 1024], "data_offsets": [0, size]} for i in range(64)}
    bomb = write_safetensors(tmp_path / "bomb.safetensors", header, b"\0" * size)
    before = listing(out)
    refused_inproc(capsys, ["generate", "--output", out / "o", "--lora", f"{bomb}:1.0", *SMALL], "bomb.safetensors",
                   "share bytes")
    assert listing(out) == before
