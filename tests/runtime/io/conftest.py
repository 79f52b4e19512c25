"""The io tests' shared fixture: ``out``, an empty working folder for a command's outputs."""

import pytest


@pytest.fixture
def out(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    return w
