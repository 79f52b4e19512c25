"""Node tests' fixtures: the ComfyUI stand-ins installed (with and without core H3's NestedTensor) and the
embedded tiny model loaded once through the loader node."""

import pytest

from h3_blackwell.nodes import loader as loader_mod
from h3_blackwell.nodes.loader import TINY_CHOICE, H3ModelLoader

from fixtures.comfy_standins import _install


@pytest.fixture
def comfy(monkeypatch, tmp_path):
    """A ComfyUI with core H3 support (NestedTensor present)."""
    return _install(monkeypatch, tmp_path, nested=True)


@pytest.fixture
def old_comfy(monkeypatch, tmp_path):
    """A ComfyUI that predates core H3 (no comfy.nested_tensor)."""
    return _install(monkeypatch, tmp_path, nested=False)


@pytest.fixture(scope="module")
def tiny():
    loader_mod.release_resident()
    rt = H3ModelLoader().load(TINY_CHOICE, "auto", "auto", "on", True)[0]
    return rt
