"""Writers that never lie (issue 26): every output is written under a unique temporary name in its folder and
renamed into place, so two runs writing one output each finish with their own complete content (the last rename
wins) and neither reports success for the other's bytes; a generate folder's files move in as one set (the
latents and the report that describes them always come from the same run); nothing temporary is left, after an
error or an interruption either.

The concurrent runs are real processes made to collide: each waits at a barrier once its temporary file is
written, then renames slowly, so without a unique name or the folder lock their files would mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.cli_contract import finish, leftovers, start
from h3_blackwell.runtime.io import atomic
from h3_blackwell.runtime.io.convert import quantize_checkpoint
from h3_blackwell.runtime.model.tiny import save_tiny

SMALL = ["--dense", "--width", "64", "--height", "64", "--frames", "5", "--steps", "2"]

# In the child: after writing its temporary file(s), wait until every racer has (a file barrier in BARRIER_DIR),
# then make every rename slow, so the two runs' renames interleave.
_COLLIDE = """
import os, sys, time
from pathlib import Path
import h3_blackwell.runtime.io.atomic as A
import h3_blackwell.runtime.io.convert as C
bar = Path(os.environ["BARRIER_DIR"])
def arrive():
    (bar / str(os.getpid())).touch()
    end = time.monotonic() + 60
    while len(list(bar.iterdir())) < int(os.environ["RACERS"]) and time.monotonic() < end:
        time.sleep(0.01)
_replace = os.replace
def slow_replace(a, b):
    time.sleep(0.2)
    _replace(a, b)
    time.sleep(0.2)
_save = A.save_tensors
def save_then_wait(path, tensors, metadata=None):
    _save(path, tensors, metadata)
    arrive()
A.save_tensors = save_then_wait
import h3_blackwell.runtime as R
R.save_tensors = save_then_wait  # the name the CLI imports
A.os.replace = slow_replace
_tmp = C.temp_path
def temp_then_wait(path, suffix=".partial"):
    t = _tmp(path, suffix)
    if suffix == ".partial":
        arrive()
    return t
C.temp_path = temp_then_wait
"""


def _race(argvs, tmp_path, timeout=240):
    bar = tmp_path / "barrier"
    bar.mkdir()
    procs = [start(a, prelude=_COLLIDE, BARRIER_DIR=bar, RACERS=len(argvs)) for a in argvs]
    errs = [finish(p, timeout=timeout) for p in procs]
    return [(p.returncode, err, p) for p, err in zip(procs, errs)]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_two_generates_into_one_folder_leave_one_runs_files(tmp_path):
    out = tmp_path / "o"
    runs = _race([["generate", "--output", out, *SMALL, "--seed", str(s)] for s in (1, 2)], tmp_path)
    for rc, err, _ in runs:
        assert rc == 0, err[-2000:]
    assert len(os.listdir(tmp_path / "barrier")) == 2  # both runs had written their files before either moved in
    lat = load_file(str(out / "latents.safetensors"))
    rep = json.loads((out / "report.json").read_text())
    # the report describes exactly the latents beside it (a mix of the two runs' files would not)
    assert rep["latent_checksums"]["video_sha256"] == _sha(lat["video"])
    assert rep["latent_checksums"]["audio_sha256"] == _sha(lat["audio"])
    assert rep["workload"]["seed"] in (1, 2)
    assert sorted(os.listdir(out)) == ["latents.safetensors", "report.json"] and not leftovers(tmp_path)


def test_two_quantizes_to_one_output_each_write_their_own_file(tmp_path):
    srcs = [save_tiny(tmp_path / f"tiny{s}.safetensors", seed=s) for s in (0, 1)]
    refs = []
    for i, s in enumerate(srcs):
        quantize_checkpoint(s, tmp_path / f"ref{i}.safetensors")
        refs.append((tmp_path / f"ref{i}.safetensors").read_bytes())
    assert refs[0] != refs[1]
    (tmp_path / "q").mkdir()
    out = tmp_path / "q" / "nv.safetensors"
    runs = _race([["quantize", s, out] for s in srcs], tmp_path)
    ok = [i for i, (rc, _, _) in enumerate(runs) if rc == 0]
    for rc, err, _ in runs:
        assert rc in (0, 2), err[-2000:]
        assert "Traceback" not in err
    assert ok, "one of the two must have written the output"
    assert out.read_bytes() in [refs[i] for i in ok]  # complete, and the content of a run that reported success
    assert os.listdir(tmp_path / "q") == ["nv.safetensors"] and not leftovers(tmp_path)


def test_two_make_tinys_to_one_path(tmp_path):
    refs = [save_tiny(tmp_path / f"ref{s}.safetensors", seed=s).read_bytes() for s in (3, 4)]
    (tmp_path / "t").mkdir()
    out = tmp_path / "t" / "tiny.safetensors"
    procs = [start(["make-tiny", out, "--seed", str(s)]) for s in (3, 4)]
    for p in procs:
        err = finish(p)
        assert p.returncode == 0, err
    assert out.read_bytes() in refs and os.listdir(tmp_path / "t") == ["tiny.safetensors"]


# ---------------------------------------------------------------------------------------------
# the writer itself
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [RuntimeError("writer failed"), KeyboardInterrupt()])
def test_write_file_leaves_nothing_on_failure(exc, tmp_path):
    (tmp_path / "old.bin").write_bytes(b"old")

    def writer(p: Path):
        p.write_bytes(b"half")
        raise exc

    with pytest.raises(type(exc)):
        atomic.write_file(tmp_path / "old.bin", writer)
    assert (tmp_path / "old.bin").read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["old.bin"]


@pytest.mark.parametrize("exc", [RuntimeError("writer failed"), KeyboardInterrupt()])
def test_write_dir_leaves_nothing_on_failure(exc, tmp_path):
    out = tmp_path / "new"

    def bad(p: Path):
        raise exc

    with pytest.raises(type(exc)):
        atomic.write_dir(out, {"a.txt": lambda p: p.write_text("a"), "b.txt": bad})
    assert not out.exists()


def test_temporary_names_are_unique_and_beside_the_target(tmp_path):
    target = tmp_path / "out.safetensors"
    names = {atomic.temp_path(target) for _ in range(50)}
    assert len(names) == 50 and all(n.parent == tmp_path and n.name.startswith(".out.safetensors.") for n in names)


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    import errno

    def full(p: Path):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(atomic.OutputError, match=r"out\.bin: the disk is full .*No space left on device.*nothing was "
                                                 r"written"):
        atomic.write_file(tmp_path / "out.bin", full)
    assert os.listdir(tmp_path) == []


def test_concurrent_writers_in_threads_each_install_a_complete_file(tmp_path):
    """Many writers to one path in one process: the final file is one writer's complete content."""
    import threading

    target = tmp_path / "f.bin"
    payloads = [bytes([i]) * 200_000 for i in range(8)]

    def writer(data):
        def w(p: Path):
            with open(p, "wb") as f:
                for k in range(0, len(data), 10_000):
                    f.write(data[k:k + 10_000])
                    time.sleep(0.0005)
        atomic.write_file(target, w)

    threads = [threading.Thread(target=writer, args=(d,)) for d in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert target.read_bytes() in payloads and os.listdir(tmp_path) == ["f.bin"]


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temporaries_of_killed_writers_are_removed_by_the_next_write(tmp_path):
    """A writer killed outright (SIGKILL) leaves its hidden temporary; the next write to the same target removes
    it, and leaves alone the temporaries of live writers, other targets, and names it did not make."""
    target = tmp_path / "out.safetensors"
    dead, live = _dead_pid(), os.getppid()
    stale = [tmp_path / f".out.safetensors.{dead}.ab12cd_3.partial", tmp_path / f".out.safetensors.{dead}.x9.spool"]
    kept = [tmp_path / f".out.safetensors.{live}.ab12cd_3.partial",     # a writer that still runs
            tmp_path / f".out.safetensors.7.{dead}.zz.partial",          # target "out.safetensors.7"'s own
            tmp_path / ".out.safetensors.ab12cd_3.partial",              # an old name without a pid
            tmp_path / f".other.bin.{dead}.ab12cd_3.partial"]            # another target's
    for p in stale + kept:
        p.write_bytes(b"x" * 10)
    atomic.write_file(target, lambda t: t.write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)

    out = tmp_path / "run"
    out.mkdir()
    (out / f".h3-tmp-{dead}-q1w2e3").mkdir()
    (out / f".h3-tmp-{dead}-q1w2e3" / "report.json").write_text("{}")
    (out / f".h3-tmp-{live}-r4t5").mkdir()
    atomic.write_dir(out, {"a.txt": lambda p: p.write_text("a")})
    assert not (out / f".h3-tmp-{dead}-q1w2e3").exists() and (out / f".h3-tmp-{live}-r4t5").exists()
    assert (out / "a.txt").read_text() == "a"
