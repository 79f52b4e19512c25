"""Side files the CLI reads that are not what they claim: a comfy-run workflow or ``--set`` value nested too deeply,
a workflow or ``H3_PRODUCER_TILES`` table that is a pipe or a device. Each is a refusal (exit 2, one ``error:`` line
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
    assert str(wf) in line and ("nested too deeply" if kind == "deep" else "not a regular file") in line, line
    assert not (tmp_path / "out").exists()


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
