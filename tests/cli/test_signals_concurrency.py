"""Signals and concurrent writers against the CLI's contract, the cases tests/cli/test_signals.py and
tests/runtime/io/ do not cover:

- SIGHUP (a closed terminal, a dropped ssh session) ends a command like SIGTERM: one line, exit status 129, no
  partial file (before: killed outright, the quantize temporary left behind, no line);
- a second Ctrl-C after the interruption's line is ignored until the process has exited (before: a
  "KeyboardInterrupt" traceback from the interpreter's exit handlers);
- a reader that goes away (``| head -1``, ``| true``) costs the command nothing (before: "error: [Errno 32] Broken
  pipe" with exit status 2 after the output was written, or "Exception ignored ... BrokenPipeError" and status 120);
- a signal that arrives while a set of outputs is being moved in is held back until the set is whole, and the line
  says it was written (before: half of the new set beside the rest of the old one, "nothing was written");
- a generate set without a preview removes an earlier run's preview.webp (before: it stayed beside the new latents);
- a folder another run's cleanup removes at the wrong moment is made again (before: FileNotFoundError);
- processes sharing an FC2 compatibility cache keep each other's entries (before: about half were lost).

Real processes where the process is the subject; every wait is bounded; synchronisation by marker lines.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fixtures.cli_contract import SLOW_QUANTIZE, env, finish, leftovers, read_until, start
from h3_blackwell.cli import main as cli
from h3_blackwell.runtime.io import atomic

SMALL = ["--width", "64", "--height", "64", "--frames", "5", "--steps", "1"]



@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from h3_blackwell.runtime.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("sc") / "tiny.safetensors", seed=0)


def _slow_quantize(tiny: Path, out: Path) -> tuple[subprocess.Popen, bytes]:
    p = start(["quantize", tiny, out], prelude=SLOW_QUANTIZE)
    head = read_until(p.stderr, b"converting blocks.1.", 120)
    assert b"converting blocks.1." in head, head.decode(errors="replace")[-2000:]
    return p, head


# ---------------------------------------------------------------------------------------------
# SIGHUP, and a signal again after the line
# ---------------------------------------------------------------------------------------------

def test_sighup_ends_like_sigterm_with_129_and_no_partial_file(tiny, tmp_path):
    (tmp_path / "q").mkdir()
    p, head = _slow_quantize(tiny, tmp_path / "q" / "nv.safetensors")
    assert os.listdir(tmp_path / "q"), "the writer had started: its temporary file exists"
    p.send_signal(signal.SIGHUP)
    err = finish(p, head)
    assert p.returncode == 129, (p.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == "hung up; nothing was written", err[-2000:]
    assert "Traceback" not in err and "error:" not in err
    assert os.listdir(tmp_path / "q") == [] and not leftovers(tmp_path)


def test_ctrl_c_again_after_the_line_changes_nothing(tiny, tmp_path):
    """Ctrl-C, then Ctrl-C held down while the process exits: the first one's line stays the last thing said."""
    (tmp_path / "q").mkdir()
    p, head = _slow_quantize(tiny, tmp_path / "q" / "nv.safetensors")
    p.send_signal(signal.SIGINT)
    more = read_until(p.stderr, b"interrupted; nothing was written\n", 60)
    assert b"interrupted; nothing was written\n" in more, (head + more).decode(errors="replace")[-2000:]
    end = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < end:
        try:
            p.send_signal(signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.002)
    err = finish(p, head + more)
    # the interpreter's own last steps put SIGINT back to its default action: a signal that lands there ends the
    # process by SIGINT, which a shell reports as 130 too
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, err[-2000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert os.listdir(tmp_path / "q") == [] and not leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------
# a reader that goes away
# ---------------------------------------------------------------------------------------------

_MAKE_TINY = "import sys\nfrom h3_blackwell.cli.main import main\nsys.exit(main())\n"


def test_a_closed_stdout_or_stderr_costs_the_command_nothing(tmp_path):
    """``h3-blackwell make-tiny OUT | true``: the reader is gone before the command prints. Two at once: stdout
    closed with Python's stdout buffered (the error came from the flush at exit), and stdout and stderr closed
    with both unbuffered (the error came from print itself, and its error line had nowhere to go)."""
    procs = {}
    for name in ("stdout", "both"):
        e = env(PYTHONUNBUFFERED="1") if name == "both" else {k: v for k, v in env().items()
                                                                if k != "PYTHONUNBUFFERED"}
        procs[name] = subprocess.Popen([sys.executable, "-c", _MAKE_TINY, "make-tiny", tmp_path / f"{name}.st"],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
        procs[name].stdout.close()  # before the interpreter has even imported torch
        if name == "both":
            procs[name].stderr.close()
    err = finish(procs["stdout"], timeout=120)
    procs["both"].wait(timeout=120)
    assert procs["stdout"].returncode == 0, err[-2000:]
    assert err.strip().splitlines() == ["note: standard output was closed (its reader exited); what the command "
                                        "prints there is dropped and the command goes on"], err
    assert procs["both"].returncode == 0
    for name in procs:
        assert len(load_file(str(tmp_path / f"{name}.st"))) > 10  # the output, whole
    assert not leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------
# a signal while an output is moved in
# ---------------------------------------------------------------------------------------------

def _signal_after_first_replace(monkeypatch, sig: int) -> list:
    """os.replace that sends ``sig`` to this process right after its first rename (a signal landing between the
    renames of a set)."""
    real, done = os.replace, []

    def replace(a, b):
        real(a, b)
        done.append(Path(b).name)
        if len(done) == 1:
            os.kill(os.getpid(), sig)
    monkeypatch.setattr(atomic.os, "replace", replace)
    return done


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler in this process for the test (a run started as a background job has SIGINT
    ignored, where a held-back signal has nothing to deliver), then whatever was there before."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


def test_a_signal_between_the_renames_of_a_set_waits_until_the_set_is_whole(tmp_path, monkeypatch, python_sigint):
    out = tmp_path / "o"
    out.mkdir()
    for n in ("a.txt", "b.txt"):
        (out / n).write_text("old")
    done = _signal_after_first_replace(monkeypatch, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as ei:
        atomic.write_dir(out, {"a.txt": lambda p: p.write_text("new"), "b.txt": lambda p: p.write_text("new")})
    assert done == ["a.txt", "b.txt"]
    assert {n: (out / n).read_text() for n in ("a.txt", "b.txt")} == {"a.txt": "new", "b.txt": "new"}
    assert ei.value.written == str(out) and sorted(os.listdir(out)) == ["a.txt", "b.txt"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back


def test_a_side_files_rename_is_never_named_as_written(tmp_path, monkeypatch, python_sigint):
    """A cache record (write_file(..., output=False)) is installed whole too, but the interrupt line must not name
    it as what was written: nothing the user asked for was."""
    _signal_after_first_replace(monkeypatch, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as ei:
        atomic.write_file(tmp_path / "rec.json", lambda p: p.write_text("{}"), output=False)
    assert (tmp_path / "rec.json").read_text() == "{}" and getattr(ei.value, "written", None) is None


def test_a_signal_while_the_output_is_renamed_says_it_was_written(tmp_path, monkeypatch, capsys):
    out = tmp_path / "tiny.safetensors"
    _signal_after_first_replace(monkeypatch, signal.SIGTERM)
    prev = signal.getsignal(signal.SIGTERM)
    rc = cli.main(["make-tiny", str(out)])
    err = capsys.readouterr().err
    assert rc == 143, err
    assert err.strip().splitlines() == [f"terminated after {out} was written whole"], err
    assert len(load_file(str(out))) > 10 and os.listdir(tmp_path) == ["tiny.safetensors"]
    assert signal.getsignal(signal.SIGTERM) is prev  # an in-process caller gets its handlers back


# ---------------------------------------------------------------------------------------------
# a set is one run's: files of an earlier set, a folder removed under a run
# ---------------------------------------------------------------------------------------------

def test_an_earlier_runs_preview_does_not_stay_beside_a_new_set(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(["generate", "--output", str(out), *SMALL, "--preview", "--seed", "1"]) == 0
    assert sorted(os.listdir(out)) == ["latents.safetensors", "preview.webp", "report.json"]
    assert cli.main(["generate", "--output", str(out), *SMALL, "--seed", "2"]) == 0
    assert sorted(os.listdir(out)) == ["latents.safetensors", "report.json"]
    assert json.loads((out / "report.json").read_text())["workload"]["seed"] == 2
    capsys.readouterr()


def test_write_dir_leaves_a_folder_in_a_replaced_name_alone(tmp_path):
    out = tmp_path / "o"
    (out / "preview.webp").mkdir(parents=True)
    (out / "preview.webp" / "mine").write_text("keep")
    atomic.write_dir(out, {"a.txt": lambda p: p.write_text("a")}, replaces=("preview.webp",))
    assert (out / "preview.webp" / "mine").read_text() == "keep" and (out / "a.txt").read_text() == "a"


def test_an_output_folder_removed_by_another_runs_cleanup_is_made_again(tmp_path, monkeypatch):
    """Another run into the same new folder failed and removed the folder it had made (still empty) just after
    this run's mkdir: the temporary folder could not be made, FileNotFoundError."""
    out = tmp_path / "o"
    sweep = atomic.sweep_stale

    def sweep_then_other_cleanup(folder, prefix, rest):
        removed = sweep(folder, prefix, rest)
        folder.rmdir()
        monkeypatch.setattr(atomic, "sweep_stale", sweep)
        return removed
    monkeypatch.setattr(atomic, "sweep_stale", sweep_then_other_cleanup)
    atomic.write_dir(out, {"a.txt": lambda p: p.write_text("a")})
    assert os.listdir(out) == ["a.txt"]


# ---------------------------------------------------------------------------------------------
# the FC2 compatibility cache shared by processes (one H3_CACHE_DIR)
# ---------------------------------------------------------------------------------------------

def _store_many(root: str, who: str, n: int) -> None:
    from h3_blackwell.runtime.fc2.lt_plans import CompatCache

    c = CompatCache(root)
    for i in range(n):
        c.store_entry(_ENV(), "layer", f"{who}-{i}", {"status": "ready"})


def _ENV():
    from h3_blackwell.runtime.fc2.guard import Fc2Environment

    return Fc2Environment(cc=(9, 0), sm_count=132, cuda_header=13000, cublas_header=130100, cuda_runtime=13000,
                          cublaslt_runtime=130100, device_name="NVIDIA H200")


def test_processes_sharing_the_compat_cache_keep_each_others_entries(tmp_path):
    from h3_blackwell.runtime.fc2.lt_plans import CompatCache

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_store_many, args=(str(tmp_path), who, 60)) for who in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entries = CompatCache(tmp_path).load(_ENV(), "layer")["entries"]
    assert len(entries) == 180, f"{180 - len(entries)} of 180 entries lost"
    assert not leftovers(tmp_path)
