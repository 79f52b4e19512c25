"""What ComfyUI's tools read from this repository, and the two ways they install it.

* The Comfy registry (``comfy node install``, ``comfy node publish``) reads ``pyproject.toml``'s ``[project]`` and
  ``[tool.comfy]``; its own check is ``comfy node validate`` (comfy-cli). The fields are checked here against the
  registry's specification (docs.comfy.org/registry/specifications) without comfy-cli, and, where comfy-cli can
  be installed from the package index, by comfy-cli itself.
* ComfyUI-Manager (and the registry) install ``requirements.txt`` into ComfyUI's environment: it must install
  cleanly offline and hold what the nodes need that ComfyUI does not bring, and nothing ComfyUI does.
* A ``custom_nodes/`` copy (git clone) is imported by ComfyUI's ``nodes.load_custom_node``: module name = the
  folder's path, ``importlib.util.spec_from_file_location(name, folder/__init__.py)``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

from fixtures.checkout import copy_checkout

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VENDOR = Path(os.environ.get("H3_SHARED") or ROOT.parent / "shared") / "vendor"  # as scripts/test.sh finds it
COMFY_CLI = os.environ.get("H3_COMFY_CLI", "comfy-cli==1.23.0")  # the version these checks were written against
# comfy-cli's accepted classifier values (comfy_cli/registry/config_parser.py)
_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                 "GPU :: Apple Metal"}


def _requirement_names(lines) -> set[str]:
    """Normalised distribution names of requirement lines (comments, options and blank lines skipped)."""
    out = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out.add(re.split(r"[\s<>=!~;\[@]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return out


def _comfyui_requirements() -> set[str]:
    """ComfyUI's own requirements: from the unpacked source scripts/test.sh exports, else its archive."""
    src = os.environ.get("H3_COMFYUI_SRC")
    if src and (Path(src) / "requirements.txt").is_file():
        return _requirement_names((Path(src) / "requirements.txt").read_text().splitlines())
    archives = sorted(VENDOR.glob("comfyui-*.tar.gz"))
    if not archives:
        pytest.skip(f"no ComfyUI source archive in {VENDOR} (../shared/vendor/comfyui-*.tar.gz): cannot read "
                    "ComfyUI's requirements.txt")
    with tarfile.open(archives[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/requirements.txt"))
        return _requirement_names(tar.extractfile(member).read().decode().splitlines())


# ---------------------------------------------------------------------------------------------
# the registry's fields
# ---------------------------------------------------------------------------------------------

def test_project_table_follows_the_registry_spec():
    p = PYPROJECT["project"]
    name = p["name"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9._-]*", name), name
    assert not re.search(r"[._-]{2}", name) and "comfyui" not in name.lower(), name
    assert re.fullmatch(r"\d+\.\d+\.\d+", p["version"]), f"version {p['version']!r}: the registry wants X.Y.Z"
    lic = p.get("license")
    assert isinstance(lic, str) or (isinstance(lic, dict) and ({"file", "text"} & set(lic))), lic
    assert p.get("description") and p.get("requires-python")
    urls = p["urls"]
    assert urls["Repository"].startswith("https://"), "the registry requires [project.urls] Repository"
    assert {"Homepage", "Documentation", "Issues"} <= set(urls), sorted(urls)
    for c in p.get("classifiers", []):
        if c.startswith("Operating System :: "):
            assert c[len("Operating System :: "):].startswith(_OS_PREFIXES), c
        if c.startswith("Environment ::"):
            assert c[len("Environment :: "):] in _ACCELERATORS, c
    assert any(c.startswith("Environment :: GPU") for c in p.get("classifiers", []))


def test_tool_comfy_table_is_complete_and_its_icon_ships():
    comfy = PYPROJECT["tool"]["comfy"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", comfy["PublisherId"]), comfy["PublisherId"]
    assert comfy["DisplayName"].strip()
    assert isinstance(comfy["includes"], list)
    icon = comfy["Icon"]
    repo = PYPROJECT["project"]["urls"]["Repository"].removeprefix("https://github.com/")
    m = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(repo)}/[^/]+/(.+)", icon)
    assert m, f"Icon {icon!r}: expected a raw URL into this repository ({repo})"
    path = ROOT / m.group(1)
    assert path.is_file() and path.suffix in (".svg", ".png", ".jpg", ".gif"), path
    assert path.name in PYPROJECT["tool"]["setuptools"]["package-data"]["h3_blackwell"], "the icon must ship"
    if path.suffix == ".svg":  # the registry's limit: 800 x 400 px
        svg = path.read_text()
        w, h = (int(re.search(rf'\b{k}="(\d+)"', svg).group(1)) for k in ("width", "height"))
        assert w <= 800 and h <= 400, (w, h)
    web = comfy.get("web")
    if web is not None:  # ComfyUI serves [tool.comfy] web as the pack's web extension folder
        assert (ROOT / web).is_dir(), web


# ---------------------------------------------------------------------------------------------
# requirements.txt: ComfyUI-Manager's and the registry's install
# ---------------------------------------------------------------------------------------------

def test_requirements_hold_what_comfyui_lacks_and_nothing_it_has():
    comfy = _comfyui_requirements()
    ours = _requirement_names((ROOT / "requirements.txt").read_text().splitlines())
    assert not ours & comfy, f"requirements.txt repeats what ComfyUI installs: {sorted(ours & comfy)}"
    needed = _requirement_names(PYPROJECT["project"]["dependencies"])
    assert needed <= comfy | ours, f"the nodes need {sorted(needed - comfy - ours)}, which neither ComfyUI nor " \
                                   "requirements.txt brings"
    # and the check sees a missing requirement
    assert not {"torch", "some-new-dependency"} <= comfy | ours


def test_requirements_install_offline():
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-r",
                        ROOT / "requirements.txt"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_comfy_cli_validates_the_pyproject(tmp_path):
    """``comfy node validate``: comfy-cli from the package index in a virtual environment of its own
    (.venv/comfy-cli, kept between runs), run in a copy of the checkout."""
    venv = ROOT / ".venv" / "comfy-cli"
    comfy = venv / "bin" / "comfy"
    if not comfy.exists():
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", venv], check=True,
                       timeout=300)
        r = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", COMFY_CLI], capture_output=True,
                           text=True, timeout=900)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"comfy-cli could not be installed from the package index ({COMFY_CLI}): "
                        f"{r.stderr.strip().splitlines()[-1:]}; the field checks above still ran")
    src = tmp_path / "h3-blackwell"
    copy_checkout(src)
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "RUFF_NO_CACHE": "true"}
    r = subprocess.run([comfy, "--skip-prompt", "--no-enable-telemetry", "node", "validate"], cwd=src, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "All validation checks passed" in out and "Warning" not in out, out[-3000:]


# ---------------------------------------------------------------------------------------------
# a custom_nodes/ copy, imported as ComfyUI imports it
# ---------------------------------------------------------------------------------------------

_LOAD_AS_COMFYUI = r"""
import importlib.util, os, sys
path = sys.argv[1]
name = path.replace(".", "_x_")  # nodes.load_custom_node: the folder's path is the module name
spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"))
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
mappings = getattr(module, "NODE_CLASS_MAPPINGS")
names = getattr(module, "NODE_DISPLAY_NAME_MAPPINGS")
assert mappings and all(k.startswith("H3B_") for k in mappings), mappings
assert set(names) <= set(mappings)
for cls in mappings.values():
    assert callable(getattr(cls, "INPUT_TYPES", None)) and cls.FUNCTION, cls
checkout, env = sys.argv[2] + os.sep, os.path.join(sys.argv[2], ".venv") + os.sep  # torch & co. live in .venv
leaked = sorted(m for m, mod in list(sys.modules.items())
                if (getattr(mod, "__file__", None) or "").startswith(checkout)
                and not mod.__file__.startswith(env))
assert not leaked, f"imported from the checkout, not the copy: {leaked[:5]}"
print(len(mappings))
"""


def test_custom_nodes_copy_loads_as_comfyui_loads_it(tmp_path):
    folder = tmp_path / "ComfyUI" / "custom_nodes" / "h3-blackwell"
    copy_checkout(folder)
    r = subprocess.run([sys.executable, "-c", _LOAD_AS_COMFYUI, folder, ROOT], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) >= 5
