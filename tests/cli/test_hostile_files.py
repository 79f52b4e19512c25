"""Side files the CLI reads that are not what they claim: a comfy-run workflow or ``--set`` value nested too deeply,
a workflow that is a device or a pipe nobody writes to, an ``H3_PRODUCER_TILES`` table that is a pipe (a workflow
piped in by its writer, ``<(jq ...)``, is read). Each is a refusal (exit 2, one ``error:`` line
naming the file), read before anything is sent or loaded. Before: a deep JSON was ``error: internal:
RecursionError`` (exit 1); a pipe blocked the command forever (``--timeout`` does not cover reading the workflow),
``/dev/zero`` was read until the memory ran out.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from fixtures.cli_contract import check_refusal, refused_inproc

DEEP = "[" * 100000 + "]" * 100000
UNREACHABLE = ["--server", "http://127.0.0.1:9", "--timeout", "5", "--http-timeout", "1", "--no-websocket"]


@pytest.fixture
def alarm():
    """A read that blocked on a pipe fails the test (SIGALRM) instead of hanging the run."""
    def hung(signum, frame):
        raise AssertionError("the CLI blocked on a pipe")

    prev = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, prev)


def _comfy_run(capsys, argv):
    from h3_blackwell.cli import main as cli

    capsys.readouterr()
    rc = cli.main(["comfy-run", *map(str, argv)])
    return check_refusal(rc, capsys.readouterr().err, 2)


@pytest.mark.parametrize("kind", ["deep", "pipe", "device"])
def test_a_workflow_that_is_not_a_json_file(kind, tmp_path, capsys, alarm):
    # (/dev/null, not /dev/zero: before the check, /dev/zero was read until the memory ran out)
    wf = {"deep": tmp_path / "deep.json", "pipe": tmp_path / "pipe.json", "device": "/dev/null"}[kind]
    if kind == "deep":
        wf.write_text(DEEP)
    elif kind == "pipe":
        os.mkfifo(wf)
    line = _comfy_run(capsys, [wf, *UNREACHABLE, "--output", tmp_path / "out"])
    # a named pipe nobody writes to reads as empty (it must not block): not a JSON workflow
    want = {"deep": "nested too deeply", "pipe": "is not a JSON workflow", "device": "a socket or a device"}[kind]
    assert str(wf) in line and want in line, line
    assert not (tmp_path / "out").exists()


def test_a_workflow_from_a_pipe_with_a_writer_is_read(tmp_path, alarm):
    """``comfy-run <(jq ... wf.json)``: the shell hands over a pipe its writer already holds; it is read to its
    end like a file."""
    import threading

    from h3_blackwell.comfy_client.workflow import load_workflow

    prompt = {"1": {"class_type": "H3B_EmptyLatent", "inputs": {"width": 64}}}
    r, w = os.pipe()

    def write():
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(prompt))

    t = threading.Thread(target=write)
    t.start()
    try:
        assert load_workflow(f"/proc/self/fd/{r}" if os.path.exists(f"/proc/self/fd/{r}") else f"/dev/fd/{r}") == (
            "api", prompt)
    finally:
        t.join()
        os.close(r)


def test_a_set_value_nested_too_deeply(tmp_path, capsys):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps({"1": {"class_type": "H3B_EmptyLatent", "inputs": {}}}))
    line = _comfy_run(capsys, [wf, *UNREACHABLE, "--output", tmp_path / "out", "--set", "1.width=" + "[" * 100000])
    assert "--set 1.width" in line and "nested too deeply" in line, line


@pytest.mark.parametrize("kind", ["deep", "pipe"])
def test_a_producer_tile_table_that_is_not_a_json_file(kind, tmp_path, capsys, monkeypatch, alarm):
    table = tmp_path / "tiles.json"
    if kind == "deep":
        table.write_text(DEEP)
    else:
        os.mkfifo(table)
    monkeypatch.setenv("H3_PRODUCER_TILES", str(table))
    out = tmp_path / "o"
    refused_inproc(capsys, ["generate", "--output", out, "--width", "64", "--height", "64", "--frames", "5",
                            "--steps", "1"], "producer tile table", str(table),
                   "nested too deeply" if kind == "deep" else "not a regular file")
    assert not out.exists()
