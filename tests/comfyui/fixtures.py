"""Session fixtures around tests/comfyui/server.py, imported by tests/conftest.py so that every test folder
(tests/comfyui/, tests/browser/) shares one server per session:

- ``comfyui_install``: (src, python) of the vendored ComfyUI; skips (saying why) where the archive is absent.
- ``comfyui_models``: {name: path} of the small files every server's base directory gets, made by the tests
  (``h3-blackwell make-tiny`` seeds 0 and 1, a tiny LoRA, a tiny Fun ControlNet tower).
- ``comfyui_server``: a ComfyServer on the loader's default stack (the user's path), base directory outside the
  repository, stopped at the session's end.
- ``comfyui_dense_server``: a second one with ``H3_NVFP4=0`` (our runtime dense, fp32): core's own model and ours
  compared at 1e-3 (tests/oracles/check_core_model.py's setting); started on first use.
- ``h3b_cli(python=None)``: the command line of ``h3-blackwell`` (this venv's, or ``python``'s with the checkout on
  its path).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from comfyui.server import REPO, ComfyServer, comfyui_paths, make_base_dir

TINY_MODELS = {"tiny.safetensors": 0, "tiny_b.safetensors": 1}  # make-tiny seed per file


@functools.lru_cache(maxsize=1)
def _package_link() -> Path:
    """A folder holding an ``h3_blackwell`` link to this checkout (its root is the package), made once."""
    link_dir = Path(tempfile.mkdtemp(prefix="h3b-pkg-"))
    atexit.register(shutil.rmtree, link_dir, True)
    (link_dir / "h3_blackwell").symlink_to(REPO, target_is_directory=True)
    return link_dir


def h3b_command(python: str | Path | None = None) -> tuple[list[str], dict]:
    """(argv prefix, env) running this checkout's CLI: in this venv, or in ``python`` (e.g. ComfyUI's) with a
    folder holding an ``h3_blackwell`` link to the checkout on its path."""
    env = {**os.environ}
    if python is None:
        return [sys.executable, "-m", "h3_blackwell.cli"], env
    env["PYTHONPATH"] = str(_package_link())
    env.pop("TRITON_INTERPRET", None)
    return [str(python), "-m", "h3_blackwell.cli"], env


@pytest.fixture(scope="session")
def h3b_cli():
    return h3b_command


@pytest.fixture(scope="session")
def comfyui_install():
    return comfyui_paths()


@pytest.fixture(scope="session")
def comfyui_models(tmp_path_factory, comfyui_install):
    """The model files, made once per session in this venv, copied into each server's models/."""
    folder = tmp_path_factory.mktemp("comfyui_models")
    cmd, env = h3b_command()
    out = {}
    for name, seed in TINY_MODELS.items():
        path = folder / "diffusion_models" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([*cmd, "make-tiny", str(path), "--seed", str(seed)], env=env, check=True, timeout=300,
                       capture_output=True)
        out[name] = path
    import torch
    from fixtures.tiny_control import save_tiny_control  # tests/ is on the path (tests/conftest.py)
    from fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth

    from h3_blackwell.runtime.model.config import TINY

    (folder / "loras").mkdir()
    save_tiny_lora(folder / "loras" / "tiny_lora.safetensors", tiny_lora_truth(TINY, seed=3), "diffusion_model")
    out["tiny_lora.safetensors"] = folder / "loras" / "tiny_lora.safetensors"
    (folder / "model_patches").mkdir()
    out["tiny_fun.safetensors"] = save_tiny_control(folder / "model_patches" / "tiny_fun.safetensors", TINY, (0, 2),
                                                    seed=5, dtype=torch.bfloat16)
    return out


def _start(install, models, name: str, env: dict):
    base = make_base_dir(Path(tempfile.mkdtemp(prefix=f"h3b-{name}-")))
    for path in models.values():
        shutil.copy(path, base / "models" / path.parent.name / path.name)
    src, python = install
    return ComfyServer(base, src, python, env=env), base


@pytest.fixture(scope="session")
def comfyui_server(comfyui_install, comfyui_models):
    srv, base = _start(comfyui_install, comfyui_models, "comfyui", {})
    with srv:
        yield srv
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def comfyui_dense_server(comfyui_install, comfyui_models):
    srv, base = _start(comfyui_install, comfyui_models, "comfyui-dense", {"H3_NVFP4": "0"})
    with srv:
        yield srv
    shutil.rmtree(base, ignore_errors=True)
