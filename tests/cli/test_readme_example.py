"""The README's conditioning example runs as written: its Python block writes the inputs, its JSON block is the
payload, and its shell block's h3-blackwell commands (make-tiny, forward --payload, generate --payload) succeed
on them. The README is the contract a new user copies from; a renamed field or a wrong shape fails here."""

import json
import re
import runpy
import shlex
from pathlib import Path

import pytest

from h3_blackwell.cli.main import main

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _one(lang: str, marker: str) -> str:
    found = [b for b in _blocks(lang) if marker in b]
    assert len(found) == 1, f"expected one ```{lang} block containing {marker!r} in the README; found {len(found)}"
    return found[0]


def test_readme_conditioning_example_runs_as_written(tmp_path, monkeypatch, capsys):
    script = _one("python", "example_inputs.safetensors")
    payload = _one("json", "resolved_frame_index")
    shell = _one("bash", "example_payload.json")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "make_example_inputs.py").write_text(script)
    (tmp_path / "example_payload.json").write_text(payload)
    json.loads(payload)  # the JSON block is JSON as printed
    for cmd in shell.replace("\\\n", " ").splitlines():
        argv = shlex.split(cmd)
        if not argv:
            continue
        if argv == ["python", "make_example_inputs.py"]:
            runpy.run_path(str(tmp_path / "make_example_inputs.py"), run_name="__main__")
            continue
        assert argv[0] == "h3-blackwell", cmd
        code = main(argv[1:])
        assert code == 0, f"{cmd}\n{capsys.readouterr().err[-2000:]}"
    out = capsys.readouterr().out
    assert "segments: text[0:12] cond[" in out and "ref_img[" in out and "ref_audio[" in out
    assert (tmp_path / "velocity.safetensors").is_file() and (tmp_path / "out/fl2va/latents.safetensors").is_file()


@pytest.mark.parametrize("lang", ["json"])
def test_every_payload_json_in_the_readme_parses(lang):
    for block in _blocks(lang):
        json.loads(block)
