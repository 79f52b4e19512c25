"""What an output does to the files around it: it never replaces a file the same command reads, a folder in the way
of a generate set refuses the set whole (the previous run's files stay as they were), and an output file gets a
plain write's permissions (the umask's), not a private temporary file's 0600.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.cli_contract import leftovers, listing, refused_inproc, tiny_model_files
from h3_blackwell.cli import main as cli
from h3_blackwell.runtime import write_file

SMALL = ["--width", "64", "--height", "64", "--frames", "5", "--steps", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    files = tiny_model_files(tmp_path_factory.mktemp("outputs"))
    g = torch.Generator().manual_seed(0)
    inputs = files["dir"] / "in.safetensors"
    save_file({"video": torch.randn(1, 24, 2, 4, 4, generator=g), "audio": torch.randn(1, 32, 2, 4, generator=g),
               "text_states": torch.randn(1, 4, 5120, generator=g), "sigma": torch.tensor([0.5])}, str(inputs))
    return dict(files, inputs=inputs)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# ---------------------------------------------------------------------------------------------
# an output never replaces an input
# ---------------------------------------------------------------------------------------------

def _sharded(d: Path, tiny: Path) -> Path:
    t = load_file(str(tiny))
    keys = sorted(t)
    parts = {"m-1.safetensors": keys[:30], "m-2.safetensors": keys[30:]}
    for name, ks in parts.items():
        save_file({k: t[k] for k in ks}, str(d / name))
    index = d / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: name for name, ks in parts.items() for k in ks}}))
    return index


CASES = ["forward --out = --inputs", "forward --out = --model", "forward --out = a link to --model",
         "generate --inputs in the --output folder", "generate --text-states in the --output folder",
         "quantize onto a shard of its input"]


@pytest.mark.parametrize("case", CASES)
def test_an_output_never_replaces_an_input(case, files, tmp_path, capsys):
    """forward --out onto its own --inputs or --model, generate into the folder that holds its inputs under an
    output's name, quantize onto a shard of a sharded input: each replaced the input with the output (exit 0)."""
    w = tmp_path / "w"
    w.mkdir()
    model, inputs = w / "model.safetensors", w / "in.safetensors"
    shutil.copy(files["tiny"], model)
    shutil.copy(files["inputs"], inputs)
    text = w / "latents.safetensors"
    save_file({"text_states": torch.randn(1, 3, 5120, generator=torch.Generator().manual_seed(1))}, str(text))
    forward = ["forward", "--model", model, "--inputs", inputs, "--out"]
    if case == "forward --out = --inputs":
        argv, victim, what = [*forward, inputs], inputs, "--inputs"
    elif case == "forward --out = --model":
        argv, victim, what = [*forward, model], model, "--model"
    elif case == "forward --out = a link to --model":
        (w / "link.safetensors").symlink_to(model)
        argv, victim, what = [*forward, w / "link.safetensors"], model, "--model"
    elif case == "generate --inputs in the --output folder":
        shutil.copy(inputs, w / "latents.safetensors")
        argv, victim, what = ["generate", "--inputs", w / "latents.safetensors", "--output", w, "--steps", "1"], \
            w / "latents.safetensors", "--inputs"
    elif case == "generate --text-states in the --output folder":
        argv, victim, what = ["generate", "--text-states", text, "--output", w, *SMALL], text, "--text-states"
    else:
        index = _sharded(w, files["tiny"])
        argv, victim, what = ["quantize", index, w / "m-1.safetensors"], w / "m-1.safetensors", "input shard"
    before = {p: p.read_bytes() for p in w.iterdir() if p.is_file()}
    line = refused_inproc(capsys, argv, what, str(victim), "choose another output path")
    assert "internal" not in line
    assert {p: p.read_bytes() for p in w.iterdir() if p.is_file()} == before
    assert not leftovers(w)


def test_an_output_beside_its_inputs_is_written(files, tmp_path):
    """The check compares the file that would be replaced, not names: a link in the output's place is replaced,
    not written through, so an input it points at is safe."""
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(files["inputs"], w / "in.safetensors")
    (w / "latents.safetensors").symlink_to(w / "in.safetensors")
    keep = (w / "in.safetensors").read_bytes()
    assert cli.main(["generate", "--inputs", str(w / "latents.safetensors"), "--output", str(w), "--steps", "1"]) == 0
    assert (w / "in.safetensors").read_bytes() == keep
    assert not (w / "latents.safetensors").is_symlink() and set(load_file(str(w / "latents.safetensors"))) == \
        {"video", "audio"}


# ---------------------------------------------------------------------------------------------
# a generate set is installed whole or not at all
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_the_way", ["report.json", "latents.safetensors"])
def test_a_folder_in_the_way_of_a_set_changes_nothing(in_the_way, tmp_path, capsys):
    """report.json as a folder: latents.safetensors was replaced first, then the rename of report.json failed with
    a raw OSError naming the temporary folder: half of the new set beside nothing of the old one."""
    o = tmp_path / "o"
    o.mkdir()
    (o / in_the_way).mkdir()
    other = next(n for n in ("latents.safetensors", "report.json") if n != in_the_way)
    (o / other).write_text("the previous run's")
    before = listing(o)
    line = refused_inproc(capsys, ["generate", "--output", o, *SMALL], f"{o / in_the_way} is a directory",
                          "nothing was written")
    assert ".h3-tmp" not in line
    assert listing(o) == before and (o / other).read_text() == "the previous run's"


# ---------------------------------------------------------------------------------------------
# permissions
# ---------------------------------------------------------------------------------------------

def test_outputs_get_a_plain_writes_permissions(files, tmp_path, umask_022):
    """make-tiny, quantize and forward outputs were 0600 (tempfile.mkstemp's, and safetensors' own temporary file's):
    unreadable to the other users a ComfyUI server or a shared model folder runs as."""
    w = tmp_path / "w"
    w.mkdir()
    assert cli.main(["make-tiny", str(w / "tiny.safetensors")]) == 0
    assert cli.main(["quantize", str(w / "tiny.safetensors"), str(w / "nv.safetensors")]) == 0
    assert cli.main(["forward", "--model", str(w / "tiny.safetensors"), "--inputs", str(files["inputs"]), "--out",
                     str(w / "v.safetensors")]) == 0
    assert cli.main(["generate", "--output", str(w / "g"), *SMALL]) == 0
    made = [w / "tiny.safetensors", w / "nv.safetensors", w / "v.safetensors", w / "g" / "latents.safetensors",
            w / "g" / "report.json"]
    assert {p.name: oct(_mode(p)) for p in made} == {p.name: oct(0o644) for p in made}


def test_write_file_keeps_the_umasks_permissions_whatever_the_writer_does(tmp_path, umask_022):
    def replaces_its_file(p: Path):  # as safetensors' save_file does: its own 0600 temporary renamed onto p
        tmp = p.with_name(p.name + ".mine")
        tmp.write_bytes(b"data")
        os.chmod(tmp, 0o600)
        os.replace(tmp, p)

    write_file(tmp_path / "a.bin", replaces_its_file)
    write_file(tmp_path / "b.txt", lambda p: p.write_text("x"))
    assert _mode(tmp_path / "a.bin") == _mode(tmp_path / "b.txt") == 0o644
    os.umask(0o077)
    write_file(tmp_path / "c.txt", lambda p: p.write_text("x"))
    assert _mode(tmp_path / "c.txt") == 0o600
