"""The progress line is always ended before an error line (issue 26): whatever ends a run while its progress bar
is drawn in place (a refusal, an internal error, out of memory; in one process or in a sequence-parallel worker,
whose output the launcher relays), the one ``error:`` line starts on a line of its own.
"""

from __future__ import annotations

import io
import os
import sys

import pytest

from fixtures.cli_contract import check_refusal, finish, kill_tree, leftovers, marked, start, unique_mark, wait_gone
from h3_blackwell.runtime.errors import H3Error

RUN = ["--dense", "--width", "64", "--height", "64", "--frames", "5", "--steps", "6", "--progress"]


def _fail_at_step(exc: BaseException, step: int = 3):
    import h3_blackwell.runtime.sampling.sampler as sampler_mod

    class Failing(sampler_mod.Stepper):
        def step(self, i, x, den):
            if i == step:
                raise exc
            return super().step(i, x, den)

    return sampler_mod, Failing


@pytest.mark.parametrize("exc,code,needle", [
    (H3Error("a refusal found mid-run"), 2, "a refusal found mid-run"),
    (RuntimeError("kernel exploded"), 1, "internal"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"), 2, "out of memory"),
])
def test_an_error_mid_run_starts_on_its_own_line(exc, code, needle, tmp_path, capsys, monkeypatch):
    from h3_blackwell.cli import main as cli

    mod, failing = _fail_at_step(exc)
    monkeypatch.setattr(mod, "Stepper", failing)
    capsys.readouterr()
    rc = cli.main(["generate", "--output", str(tmp_path / "o"), *RUN])
    err = capsys.readouterr().err
    line = check_refusal(rc, err, code, [needle])
    assert "3/6" in err and ("\n" + line) in err, err[-600:]  # the bar was drawn in place, then ended
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)


# a worker that fails mid-run: a sitecustomize on the workers' path replaces the sampler's stepper in the rank
# named by FAIL_RANK (only the sequence-parallel workers have RANK set)
_SITE = """
import os
if os.environ.get("RANK") == os.environ.get("FAIL_RANK"):
    import h3_blackwell.runtime.sampling.sampler as sampler_mod
    from h3_blackwell.runtime.errors import H3Error

    class Failing(sampler_mod.Stepper):
        def step(self, i, x, den):
            if i == 3:
                if os.environ["FAIL_HOW"] == "exit":
                    os._exit(7)
                raise (H3Error if os.environ["FAIL_HOW"] == "refusal" else RuntimeError)("rank fails at step 4")
            return super().step(i, x, den)

    sampler_mod.Stepper = Failing
"""


@pytest.mark.parametrize("how,rank", [("refusal", 0), ("bug", 0), ("exit", 1)])
def test_a_worker_failing_mid_run(how, rank, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    path = os.pathsep.join([str(site), *(p for p in sys.path if p)])
    mark = unique_mark("progress")
    p = start(["generate", "--output", tmp_path / "o", *RUN, "--steps", "40", "--sequence-parallel", "2"],
              PYTHONPATH=path, FAIL_RANK=rank, FAIL_HOW=how, HARDEN_TEST_MARK=mark)
    try:
        err = finish(p, timeout=240)
        assert wait_gone(marked(mark), 20) == []
    finally:
        kill_tree(p.pid)
    line = check_refusal(p.returncode, err, 1 if how == "bug" else 2, [f"rank {rank}"])  # a bug is internal
    assert {"refusal": "rank fails at step 4", "bug": "RuntimeError", "exit": "status 7"}[how] in line, line
    if rank == 0:  # rank 0 draws the bar: it was drawn in place, then ended before the error
        assert "3/40" in err and ("\n" + line) in err, err[-600:]
    assert "Traceback" not in err and not (tmp_path / "o").exists() and not leftovers(tmp_path)


def test_the_launchers_console_ends_an_open_line_once():
    """The relay: another rank's text starts on a new line after an open one; end_line ends only an open line."""
    from h3_blackwell.runtime.parallel.launch import _Console

    buf = io.StringIO()
    c = _Console(buf)
    c.write(0, "\rsampling [##....] 1/3")
    c.write(1, "a warning from rank 1\n")
    c.write(0, "\rsampling [####..] 2/3")
    c.end_line()
    c.end_line()
    c.mute()
    c.write(1, "lost connection\n")
    assert buf.getvalue() == ("\rsampling [##....] 1/3\na warning from rank 1\n\rsampling [####..] 2/3\n")
