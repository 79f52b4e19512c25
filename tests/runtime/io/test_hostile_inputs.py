"""Every hostile input is a refusal (issue 26): exit 2, one ``error:`` line naming the file or field with what was
expected and what was found, no traceback, nothing written, before the model loads.

Classes: safetensors headers that lie (extents, dtypes, names, metadata) in every file the CLI reads (the inputs,
the text states, the checkpoint, a LoRA); NVFP4 and dense tensors of the right shape but the wrong dtype;
quantization claims the stored tensors contradict; a LoRA of rank 0; output paths that are dangling symbolic
links or loops; out of memory from the CPU allocator; a full disk while writing.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fixtures.cli_contract import (check_refusal, edit_header, leftovers, listing, refused_inproc, run,
                                   split_safetensors, tiny_model_files, write_safetensors)

SMALL = ["--width", "64", "--height", "64", "--frames", "5", "--steps", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    files = tiny_model_files(tmp_path_factory.mktemp("hostile"))
    d = files["dir"]
    g = torch.Generator().manual_seed(0)
    inputs = d / "in.safetensors"
    save_file({"video": torch.randn(1, 24, 2, 4, 4, generator=g), "audio": torch.randn(1, 32, 2, 4, generator=g),
               "text_states": torch.randn(1, 4, 5120, generator=g), "sigma": torch.tensor([0.5]),
               "kf": torch.randn(1, 24, 1, 4, 4, generator=g)}, str(inputs))
    text = d / "ts.safetensors"
    save_file({"text_states": torch.randn(1, 5, 5120, generator=g)}, str(text))
    lora = d / "lora.safetensors"
    save_file({"diffusion_model.blocks.0.attn.out_proj.lora_A.weight": torch.randn(4, 96, generator=g),
               "diffusion_model.blocks.0.attn.out_proj.lora_B.weight": torch.randn(96, 4, generator=g)}, str(lora))
    return dict(files, inputs=inputs, text=text, lora=lora)




def refused(capsys, argv, *needles, watch: Path | None = None) -> str:
    """The refusal contract in process; ``watch``: a folder that must not change; the model must not load."""
    before = listing(watch) if watch is not None else None
    line = refused_inproc(capsys, argv, *needles)
    if watch is not None:
        assert listing(watch) == before, "something was written"
    return line


# ---------------------------------------------------------------------------------------------
# safetensors headers that lie, in every file the CLI reads
# ---------------------------------------------------------------------------------------------

def _first(header: dict, name: str | None = None) -> str:
    return name or next(k for k in header if k != "__metadata__")


def _lie(kind: str, src: Path, dst: Path, name: str | None = None) -> Path:
    if kind == "duplicate_name":
        header, data = split_safetensors(src)
        k = _first(header, name)
        text = json.dumps(header)
        entry = json.dumps({k: header[k]})[1:-1]
        return write_safetensors(dst, text[:-1] + ", " + entry + "}", data)
    if kind == "deep":
        _, data = split_safetensors(src)
        return write_safetensors(dst, '{"a": ' + "[" * 5000 + "]" * 5000 + "}", data)

    def edit(h):
        k = _first(h, name)
        e = h[k]
        if kind == "short":  # the extent ends 4 bytes before what the shape needs
            e["data_offsets"][1] -= 4
        elif kind == "shape_smaller":
            e["shape"][-1] -= 1
        elif kind == "shape_huge":
            e["shape"] = [2 ** 40, 2 ** 40]
        elif kind == "past_end":
            e["data_offsets"] = [e["data_offsets"][0], e["data_offsets"][0] + 10 ** 12]
        elif kind == "negative_shape":
            e["shape"][0] = -e["shape"][0] if e["shape"][0] else -1
        elif kind == "reversed":
            e["data_offsets"] = [e["data_offsets"][1], e["data_offsets"][0]]
        elif kind == "unknown_dtype":
            e["dtype"] = "F9_E9M9"
        elif kind == "float_shape":
            e["shape"] = [float(s) + 0.5 for s in e["shape"]]
        elif kind == "meta_not_string":
            h["__metadata__"] = {"config": {"nested": 1}}
        else:
            raise ValueError(kind)

    return edit_header(src, dst, edit)


LIES = ["short", "shape_smaller", "shape_huge", "past_end", "negative_shape", "reversed", "unknown_dtype",
        "float_shape", "meta_not_string", "duplicate_name", "deep"]


@pytest.mark.parametrize("kind", LIES)
@pytest.mark.parametrize("role", ["generate_inputs", "forward_inputs", "text_states", "model", "lora"])
def test_a_header_that_lies_is_refused_naming_the_file(role, kind, files, out, tmp_path, capsys):
    src = {"generate_inputs": files["inputs"], "forward_inputs": files["inputs"], "text_states": files["text"],
           "model": files["tiny"], "lora": files["lora"]}[role]
    name = {"generate_inputs": "text_states", "forward_inputs": "video", "text_states": "text_states",
            "model": "blocks.1.mlp.fc2.weight", "lora": None}[role]
    bad = _lie(kind, src, tmp_path / f"{role}.safetensors", name)
    argv = {"generate_inputs": ["generate", "--output", out / "o", "--inputs", bad, "--steps", "1"],
            "forward_inputs": ["forward", "--model", files["tiny"], "--inputs", bad, "--out", out / "v.safetensors"],
            "text_states": ["generate", "--output", out / "o", "--text-states", bad, *SMALL],
            "model": ["generate", "--output", out / "o", "--model", bad, *SMALL],
            "lora": ["generate", "--output", out / "o", "--lora", f"{bad}:1.0", *SMALL]}[role]
    line = refused(capsys, argv, bad.name, watch=out)
    assert "internal" not in line


def test_inputs_header_extent_lie_message_says_expected_and_found(files, out, tmp_path, capsys):
    bad = _lie("short", files["inputs"], tmp_path / "in.safetensors", "video")
    line = refused(capsys, ["generate", "--output", out / "o", "--inputs", bad, "--steps", "1"], "'video'",
                   "has 3068 bytes but shape [1, 24, 2, 4, 4] of F32 needs 3072", watch=out)
    assert "in.safetensors" in line


def test_a_checked_reader_reads_what_safetensors_wrote(files):
    """The checked reader (every CLI input) gives the same tensors as safetensors itself."""
    from safetensors import safe_open

    from h3_blackwell.runtime.io.header import read_tensors

    _, got = read_tensors(files["inputs"], "inputs file")
    with safe_open(str(files["inputs"]), "pt") as f:
        for k in f.keys():
            assert torch.equal(got[k], f.get_tensor(k)), k


# ---------------------------------------------------------------------------------------------
# the right shape, the wrong dtype; quantization claims the tensors contradict
# ---------------------------------------------------------------------------------------------

def _retype(src: Path, dst: Path, name: str, dtype: str) -> Path:
    """Change one tensor's header dtype to another of the same element size (the file stays self-consistent)."""
    return edit_header(src, dst, lambda h: h[name].update(dtype=dtype))


DTYPE_CASES = [
    ("blocks.0.mlp.fc2.weight", "BOOL", "U8"),
    ("blocks.0.mlp.fc2.weight_scale", "F8_E5M2", "F8_E4M3"),
    ("blocks.1.attn.qkv_proj.weight_scale", "I8", "F8_E4M3"),
    ("blocks.2.mlp.fc1.weight_scale_2", "I32", "F32"),
]


@pytest.mark.parametrize("name,dtype,want", DTYPE_CASES, ids=[f"{n}:{d}" for n, d, _ in DTYPE_CASES])
@pytest.mark.parametrize("command", ["generate", "quantize", "load_model"])
def test_nvfp4_tensor_of_the_wrong_dtype(command, name, dtype, want, files, out, tmp_path, capsys):
    bad = _retype(files["nvfp4"], tmp_path / "nv_bad.safetensors", name, dtype)
    needles = [name, f"found {dtype}", want, "dtype"]
    if command == "load_model":
        from h3_blackwell.runtime import load_model
        from h3_blackwell.runtime.errors import CheckpointError

        with pytest.raises(CheckpointError) as e:
            load_model(bad)
        assert all(n in str(e.value) for n in needles), str(e.value)
        return
    argv = (["generate", "--output", out / "o", "--model", bad, *SMALL] if command == "generate"
            else ["quantize", bad, out / "q.safetensors"])
    refused(capsys, argv, *needles, watch=out)


@pytest.mark.parametrize("name,dtype", [("blocks.0.norm1.weight", "I32"), ("final_layer.video_out.bias", "I32"),
                                        ("blocks.1.attn.out_proj.weight", "I16")])
def test_dense_tensor_of_an_integer_dtype(name, dtype, files, out, tmp_path, capsys):
    src = files["tiny"]
    header, _ = split_safetensors(src)
    if name not in header:
        pytest.skip(f"{name} is not in the tiny checkpoint")
    size = {"I32": 4, "I16": 2}[dtype]
    if {"F32": 4, "BF16": 2}[header[name]["dtype"]] != size:
        dtype = {4: "I32", 2: "I16"}[{"F32": 4, "BF16": 2}[header[name]["dtype"]]]
    bad = _retype(src, tmp_path / "int.safetensors", name, dtype)
    refused(capsys, ["generate", "--output", out / "o", "--model", bad, *SMALL], name, f"found {dtype}", watch=out)


def _claim(src: Path, dst: Path, layers: dict) -> Path:
    def edit(h):
        h.setdefault("__metadata__", {})["_quantization_metadata"] = json.dumps({"format_version": "1.0",
                                                                                "layers": layers})
    return edit_header(src, dst, edit)


@pytest.mark.parametrize("dense", [False, True])
def test_metadata_claiming_a_dense_layer_is_nvfp4(dense, files, out, tmp_path, capsys):
    bad = _claim(files["tiny"], tmp_path / "claim.safetensors", {"blocks.0.mlp.fc2": {"format": "nvfp4"}})
    line = refused(capsys, ["generate", "--output", out / "o", "--model", bad, *SMALL, *(["--dense"] if dense else [])],
                   "blocks.0.mlp.fc2.weight", "_quantization_metadata says nvfp4", "dense BF16 [96, 160]", watch=out)
    assert "no _quantization_metadata entry" not in line  # the message matches the input


@pytest.mark.parametrize("layers,needles", [
    ({"blocks.0.norm1": {"format": "nvfp4"}}, ["blocks.0.norm1", "not a linear layer"]),
    ({"blocks.0.attn.out_proj": {"format": "mxfp9"}}, ["blocks.0.attn.out_proj", "'mxfp9' is not supported"]),
    ({"blocks.0.attn.out_proj": {"format": "float8_e4m3fn"}}, ["blocks.0.attn.out_proj.weight", "found BF16"]),
])
def test_metadata_claims_the_tensors_contradict(layers, needles, files, out, tmp_path, capsys):
    header, _ = split_safetensors(files["tiny"])
    if next(iter(layers)) + ".weight" not in header:
        pytest.skip("layer not in the tiny checkpoint")
    bad = _claim(files["tiny"], tmp_path / "claim.safetensors", layers)
    refused(capsys, ["generate", "--output", out / "o", "--model", bad, *SMALL], *needles, watch=out)


@pytest.mark.parametrize("value", ['{"layers": []}', "[1, 2]", '{"layers": ' + "[" * 3000 + "]" * 3000 + "}",
                                   "not json"])
def test_malformed_quantization_metadata(value, files, out, tmp_path, capsys):
    bad = edit_header(files["nvfp4"], tmp_path / "m.safetensors",
                      lambda h: h["__metadata__"].update(_quantization_metadata=value))
    refused(capsys, ["generate", "--output", out / "o", "--model", bad, *SMALL], "_quantization_metadata", watch=out)


@pytest.mark.parametrize("value", ["[1]", '{"a":' * 3000 + "1" + "}" * 3000, "not json", '"text"',
                                   '{"h3_blackwell": {"num_layers": "x"}}', '{"h3_blackwell": {"rope_theta": null}}'])
def test_malformed_config_metadata(value, files, out, tmp_path, capsys):
    bad = edit_header(files["tiny"], tmp_path / "c.safetensors", lambda h: h["__metadata__"].update(config=value))
    line = refused_inproc(capsys, ["generate", "--output", out / "o", "--model", bad, *SMALL])
    assert "internal" not in line


# ---------------------------------------------------------------------------------------------
# a LoRA of rank 0
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["merge", "side"])
@pytest.mark.parametrize("model", ["tiny", "nvfp4"])
def test_lora_of_rank_0(mode, model, files, out, tmp_path, capsys):
    p = tmp_path / "rank0.safetensors"
    save_file({"diffusion_model.blocks.0.attn.out_proj.lora_A.weight": torch.zeros(0, 96),
               "diffusion_model.blocks.0.attn.out_proj.lora_B.weight": torch.zeros(96, 0),
               "diffusion_model.blocks.0.attn.out_proj.alpha": torch.tensor(8.0)}, str(p))
    refused(capsys, ["generate", "--output", out / "o", "--model", files[model], "--lora", f"{p}:1.0:{mode}", *SMALL],
            "rank 0", "blocks.0.attn.out_proj", "rank >= 1", watch=out)


# ---------------------------------------------------------------------------------------------
# output paths: dangling symbolic links and loops, refused before any work
# ---------------------------------------------------------------------------------------------

def _links(out: Path, kind: str, file_name: str) -> Path:
    if kind == "dangling":
        (out / file_name).symlink_to(out / "nowhere" / "deeper")
        return out / file_name
    if kind == "loop":
        (out / "a").symlink_to(out / "b")
        (out / "b").symlink_to(out / "a")
        return out / "a"
    if kind == "dangling_parent":
        (out / "gone").symlink_to(out / "missing-dir")
        return out / "gone" / file_name
    if kind == "loop_parent":
        (out / "l1").symlink_to(out / "l2")
        (out / "l2").symlink_to(out / "l1")
        return out / "l1" / file_name
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["dangling", "loop", "dangling_parent", "loop_parent"])
@pytest.mark.parametrize("command", ["generate", "forward", "make-tiny", "quantize"])
def test_output_symlinks_refused_before_any_work(command, kind, files, out, capsys, monkeypatch):
    import h3_blackwell.runtime.load as load_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(load_mod, "load_model", no_load)
    target = _links(out, kind, "o" if command == "generate" else "o.safetensors")
    argv = {"generate": ["generate", "--output", target, *SMALL],
            "forward": ["forward", "--model", files["tiny"], "--inputs", files["inputs"], "--out", target],
            "make-tiny": ["make-tiny", target],
            "quantize": ["quantize", files["tiny"], target]}[command]
    refused(capsys, argv, "symbolic link", "loop" if "loop" in kind else "does not exist", watch=out)


def test_a_symlink_to_a_file_is_written_through(files, out, capsys):
    real = out / "real.safetensors"
    real.write_bytes(b"old")
    (out / "link.safetensors").symlink_to(real)
    from h3_blackwell.cli import main as cli

    assert cli.main(["make-tiny", str(out / "link.safetensors")]) == 0
    assert (out / "link.safetensors").is_symlink() and real.stat().st_size > 1000
    assert not leftovers(out)


# ---------------------------------------------------------------------------------------------
# out of memory on every device
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 81604378624 bytes. Error code 12 "
                 "(Cannot allocate memory)"),
    MemoryError(),
    OSError(errno.ENOMEM, "Cannot allocate memory"),
    RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
])
def test_out_of_memory_is_a_refusal(exc, out, capsys, monkeypatch):
    import h3_blackwell.runtime.sampling.sampler as sampler_mod

    def oom(*a, **k):
        raise exc

    monkeypatch.setattr(sampler_mod, "sample", oom)
    refused(capsys, ["generate", "--output", out / "o", *SMALL], "out of memory", watch=out)


def test_is_out_of_memory_recognises_each_device_and_nothing_else():
    from h3_blackwell.runtime.errors import is_out_of_memory

    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                                         "allocate memory: you tried to allocate 123 bytes."))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(OSError(errno.ENOSPC, "No space left on device"))


# ---------------------------------------------------------------------------------------------
# a full disk while writing (a file size limit in a child; a small tmpfs where this user may mount one)
# ---------------------------------------------------------------------------------------------

def _limit(nbytes: int) -> str:
    return f"import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({nbytes}, {nbytes}))\n"


@pytest.mark.parametrize("command", ["generate", "quantize", "make-tiny"])  # (forward writes as generate does)
def test_a_size_limit_while_writing_is_a_refusal(command, files, out):
    argv = {"generate": ["generate", "--output", out / "o", "--dense", *SMALL],
            "quantize": ["quantize", files["tiny"], out / "q.safetensors"],
            "forward": ["forward", "--model", files["tiny"], "--inputs", files["inputs"], "--out",
                        out / "v.safetensors"],
            "make-tiny": ["make-tiny", out / "t.safetensors"]}[command]
    rc, _, err = run(argv, prelude=_limit(4000), timeout=240)
    check_refusal(rc, err, 2, ["nothing was written"])
    assert sorted(os.listdir(out)) == [], os.listdir(out)


def _tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_a_full_disk_while_writing_latents(tmp_path):
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        (disk / "o").mkdir()
        rc, _, err = run(["generate", "--output", disk / "o", "--dense", "--width", "256", "--height", "256",
                          "--frames", "22", "--steps", "1"], timeout=240)
        line = check_refusal(rc, err, 2, ["latents.safetensors"])
        assert "disk is full" in line or "No space" in line, line
        assert os.listdir(disk / "o") == [] and not leftovers(disk)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)



@pytest.mark.parametrize("role", ["inputs", "text_states", "model", "payload", "lora"])
def test_a_pipe_in_place_of_a_file_is_refused_not_waited_on(role, files, out, tmp_path, capsys):
    """In process, under an alarm: a read that blocked on the pipe would fail the test instead of hanging it."""
    import signal

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    argv = {"inputs": ["generate", "--output", out / "o", "--inputs", fifo, "--steps", "1"],
            "text_states": ["generate", "--output", out / "o", "--text-states", fifo, *SMALL],
            "model": ["generate", "--output", out / "o", "--model", fifo, *SMALL],
            "payload": ["generate", "--output", out / "o", "--inputs", files["inputs"], "--payload", fifo],
            "lora": ["generate", "--output", out / "o", "--lora", f"{fifo}:1.0", *SMALL]}[role]

    def hung(signum, frame):
        raise AssertionError("the CLI blocked on a pipe")

    prev = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        refused(capsys, argv, "pipe.safetensors", watch=out)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, prev)
