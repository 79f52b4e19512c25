"""Signals and process hygiene (issue 26): SIGTERM ends a run like Ctrl-C (one line, exit 143, nothing written, no
temporary left); sequence-parallel workers die with their parent whatever kills it (SIGTERM, SIGINT, SIGKILL, a
signal to the whole process group), checked by PID, and no job folder is left; a worker's death ends the run
with one error line that starts on a line of its own (never glued onto rank 0's progress line).

Real processes throughout; every wait is bounded, so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fixtures.cli_contract import (SLOW_QUANTIZE, check_refusal, finish, kill_tree, leftovers, read_until, start,
                                   wait_gone, workers)

TINY_SLOW = ["--dense", "--width", "64", "--height", "64", "--frames", "5", "--steps", "400", "--progress"]
SP = ["--sequence-parallel", "2"]


def _interrupted(err: str, rc: int, code: int, line: str) -> None:
    assert rc == code, (rc, err[-2000:])
    assert "Traceback" not in err and "error:" not in err, err[-2000:]
    lines = err.replace("\r", "\n").strip().splitlines()
    assert lines[-1] == line, err[-500:]
    assert ("\n" + line) in err or err.startswith(line), err[-500:]  # on a line of its own, never after the bar


@pytest.fixture
def work(tmp_path):
    (tmp_path / "tmp").mkdir()
    return tmp_path


def _gen(work, extra=(), **kw) -> subprocess.Popen:
    return start(["generate", "--output", work / "o", *TINY_SLOW, *extra], TMPDIR=work / "tmp", **kw)


# ---------------------------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------------------------

def test_sigterm_during_the_imports_is_one_line_and_143(work):
    """SIGTERM arriving while torch is imported (the process sends it to itself when the import starts)."""
    code = ("import os, signal, sys\n"
            "class Stop:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            os.kill(os.getpid(), signal.SIGTERM)\n"
            "sys.meta_path.insert(0, Stop())\n"
            "from h3_blackwell.cli.main import main\n"
            f"sys.exit(main(['generate', '--output', {str(work / 'o')!r}]))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(x for x in sys.path if x)})
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert err.decode().strip().splitlines() == ["terminated; nothing was written"], err
    assert not (work / "o").exists()


def test_sigterm_while_sampling(work):
    """(SIGINT while sampling: tests/cli/test_bad_inputs.py.)"""
    p = _gen(work)
    head = read_until(p.stderr, b"sampling [", 120)
    assert b"sampling [" in head, head.decode()[-2000:]
    p.send_signal(signal.SIGTERM)
    err = finish(p, head)
    _interrupted(err, p.returncode, 143, "terminated; nothing was written")
    assert not (work / "o").exists() and not leftovers(work)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_quantize_leaves_no_partial_file(sig, code, work):
    from h3_blackwell.runtime.model.tiny import save_tiny

    src = save_tiny(work / "tiny.safetensors", seed=0)
    (work / "q").mkdir()
    p = start(["quantize", src, work / "q" / "nv.safetensors"], prelude=SLOW_QUANTIZE, TMPDIR=work / "tmp")
    head = read_until(p.stderr, b"converting blocks.1.", 120)
    assert b"converting blocks.1." in head, head.decode()[-2000:]
    assert [f.name for f in (work / "q").iterdir()] != [], "the writer had started: its temporary file exists"
    p.send_signal(sig)
    err = finish(p, head)
    assert p.returncode == code, err[-2000:]
    assert "Traceback" not in err and "error:" not in err
    assert list((work / "q").iterdir()) == [] and not leftovers(work)


# ---------------------------------------------------------------------------------------------
# sequence-parallel: the workers die with their parent
# ---------------------------------------------------------------------------------------------

def _sp_started(work, **kw):
    p = _gen(work, SP, **kw)
    head = read_until(p.stderr, b"sampling [", 180)
    assert b"sampling [" in head, head.decode()[-3000:]
    return p, head, workers(p.pid, 2)


def _kill_all(p, ranks) -> None:
    """The run's parent tree and its workers, whatever state they are in (a test's cleanup)."""
    kill_tree(p.pid)
    for pid in ranks.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("sig,code,line", [(signal.SIGTERM, 143, "terminated; nothing was written"),
                                           (signal.SIGKILL, -9, None)])  # (SIGINT takes SIGTERM's path)
def test_sequence_parallel_workers_die_with_their_parent(sig, code, line, work):
    p, head, ranks = _sp_started(work)
    try:
        p.send_signal(sig)
        err = finish(p, head)
        assert wait_gone(ranks.values(), 20) == [], f"workers {ranks} outlived their parent"
    finally:
        _kill_all(p, ranks)
    if line is not None:
        _interrupted(err, p.returncode, code, line)
    else:
        assert p.returncode == code
    assert not (work / "o").exists() and not leftovers(work)
    assert [x.name for x in (work / "tmp").iterdir() if x.name.startswith("h3-")] == []  # no job folder


def test_a_signal_to_the_whole_process_group(work):
    """What a CI runner or a shell's job control does: SIGTERM to every process of the CLI's group."""
    p = start(["generate", "--output", work / "o", *TINY_SLOW, *SP], TMPDIR=work / "tmp", new_group=True)
    head = read_until(p.stderr, b"sampling [", 180)
    assert b"sampling [" in head, head.decode()[-3000:]
    ranks = workers(p.pid, 2)
    try:
        os.killpg(p.pid, signal.SIGTERM)
        err = finish(p, head)
        assert wait_gone(ranks.values(), 20) == []
    finally:
        kill_tree(p.pid)
    _interrupted(err, p.returncode, 143, "terminated; nothing was written")
    assert not (work / "o").exists() and not leftovers(work)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_killed_mid_run_is_one_error_line_on_its_own_line(rank, work):
    p, head, ranks = _sp_started(work)
    try:
        os.kill(ranks[rank], signal.SIGKILL)
        err = finish(p, head)
        assert wait_gone(ranks.values(), 20) == []
    finally:
        kill_tree(p.pid)
    line = check_refusal(p.returncode, err, 2, [f"rank {rank}", "SIGKILL", "nothing was written"])
    assert ("\n" + line) in err  # rank 0's unfinished progress line was ended first
    assert not (work / "o").exists() and not leftovers(work)


def test_a_second_signal_does_not_cut_the_cleanup_short(work):
    """SIGTERM then SIGINT at once: the first ends the run, the second is ignored while the writer cleans up."""
    from h3_blackwell.runtime.model.tiny import save_tiny

    src = save_tiny(work / "tiny.safetensors", seed=0)
    (work / "q").mkdir()
    p = start(["quantize", src, work / "q" / "nv.safetensors"], prelude=SLOW_QUANTIZE, TMPDIR=work / "tmp")
    head = read_until(p.stderr, b"converting blocks.1.", 120)
    assert b"converting blocks.1." in head, head.decode()[-2000:]
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGTERM)
    err = finish(p, head)
    assert p.returncode in (130, 143), err[-2000:]
    lines = [ln for ln in err.splitlines() if "nothing was written" in ln]
    assert len(lines) == 1 and "Traceback" not in err and "error:" not in err, err[-2000:]
    assert list((work / "q").iterdir()) == [] and not leftovers(work)


def test_a_stopped_worker_is_named_and_the_run_goes_on_after_sigcont(work):
    """SIGSTOP to one worker: the launcher says on its own line which rank and pid is stopped and what to do
    (instead of a silent wait for the collective timeout); after SIGCONT the run goes on."""
    p, head, ranks = _sp_started(work)
    try:
        os.kill(ranks[1], signal.SIGSTOP)
        more = read_until(p.stderr, b"to resume", 60)
        text = more.decode(errors="replace")
        assert f"rank 1 (pid {ranks[1]}) is stopped" in text and "SIGCONT" in text, text[-2000:]
        assert "\nnote: sequence-parallel worker rank 1" in (head + more).decode(errors="replace")  # its own line
        os.kill(ranks[1], signal.SIGCONT)
        after = read_until(p.stderr, b"sampling [", 60)  # rank 0's progress goes on
        assert b"sampling [" in after and p.poll() is None
        p.send_signal(signal.SIGTERM)
        finish(p, head + more + after)
        assert wait_gone(ranks.values(), 20) == []
    finally:
        _kill_all(p, ranks)
