"""The package as pip builds and installs it: the wheel and the sdist hold every module of the source tree and the
data files, and the wheel installed the ordinary way (not editable, into a virtual environment that cannot see
this checkout) runs ``h3-blackwell generate`` on the embedded tiny model and gives ComfyUI its node mappings.

The hand-written package list once left ``runtime.ops.triton`` out of the wheel, and nothing noticed: only editable
installs and the checkout itself were ever run. These tests build from a copy of the checkout, so the checkout gets
no build/ or egg-info of theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from fixtures.checkout import copy_checkout

ROOT = Path(__file__).resolve().parents[1]
# the Python of the package: every top-level folder holding a .py file anywhere below it, except what is not part of
# the package (tests/, bench/, scripts/, ignored build folders)
NOT_PACKAGE = {"tests", "bench", "scripts", "build", "dist", "third_party", "out"}
CODE = tuple(sorted(d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
                    and d.name not in NOT_PACKAGE and any(d.rglob("*.py"))))
assert {"runtime", "cli", "nodes", "comfy_client"} <= set(CODE), CODE
# data folders and root files the package ships: (folder, patterns)
DATA = (("csrc", ("*.cpp", "*.h", "*.cu", "*.cuh")), ("workflows", ("*.json",)), ("web", ("**/*.js", "**/*.css")))
ROOT_DATA = ("README.md", "requirements.txt", "icon.svg")
# the torch the clean environment gets: a user's CPU install. On the project's CI machines torch==2.13.0 is the CPU
# build on local disk (~0.7 GB installed); the tests' own torch (2.14.1, scripts/test.sh) is a CUDA build of 5.5 GB,
# and a second copy of it beside .venv and ComfyUI's venv filled CI's disk. H3_WHEEL_TORCH picks another.
TORCH_REQ = os.environ.get("H3_WHEEL_TORCH", "torch==2.13.0")

pytestmark = pytest.mark.slow


def source_modules(root: Path) -> set[str]:
    """Every module of the package in the tree, as dotted names under h3_blackwell."""
    mods = {"h3_blackwell"}
    for top in CODE:
        for f in (root / top).rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            parts = f.relative_to(root).with_suffix("").parts
            mods.add(".".join(("h3_blackwell",) + (parts[:-1] if parts[-1] == "__init__" else parts)))
    return mods


def source_data(root: Path) -> set[str]:
    """The data files the package must ship, as paths relative to the package folder."""
    out = {name for name in ROOT_DATA if (root / name).is_file()}
    for folder, patterns in DATA:
        for pattern in patterns:
            out |= {f.relative_to(root).as_posix() for f in (root / folder).glob(pattern)}
    return out


def modules_of(paths: list[str], prefix: str) -> set[str]:
    """Dotted module names of the .py paths under ``prefix`` (the package folder inside an archive)."""
    mods = set()
    for p in paths:
        if p.startswith(prefix) and p.endswith(".py"):
            parts = tuple(Path(p[len(prefix):]).with_suffix("").parts)
            if parts and parts[0] not in CODE and parts != ("__init__",):
                continue  # setup.py and the like, beside the package in an sdist
            mods.add(".".join(("h3_blackwell",) + (parts[:-1] if parts[-1] == "__init__" else parts)))
    return mods


def _run(cmd: list, cwd: Path, timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The wheel (pip wheel, as a user builds it) and the sdist (setuptools' PEP 517 backend) of a copy of this
    checkout, and the seconds each took."""
    tmp = tmp_path_factory.mktemp("pack")
    src = tmp / "h3-blackwell"
    copy_checkout(src)
    dist = tmp / "dist"
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src], tmp, 300)
    t1 = time.perf_counter()
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"], src,
         300)
    wheel, = dist.glob("*.whl")
    sdist, = dist.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "source": src, "seconds": (t1 - t0, time.perf_counter() - t1)}


def test_wheel_holds_every_module_and_data_file(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    assert modules_of(names, "h3_blackwell/") == source_modules(ROOT), \
        "the wheel's modules differ from the source tree's (pyproject.toml / setup.py package discovery)"
    shipped = {n[len("h3_blackwell/"):] for n in names if n.startswith("h3_blackwell/")}
    missing = source_data(ROOT) - shipped
    assert not missing, f"data files missing from the wheel: {sorted(missing)} (pyproject.toml package-data)"
    assert not [n for n in names if n.startswith(("h3_blackwell/tests/", "h3_blackwell/bench/", "tests/"))]
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "h3-blackwell = h3_blackwell.cli.main:main" in zipfile.ZipFile(built["wheel"]).read(entry).decode()


def test_sdist_holds_every_module_and_data_file(built):
    with tarfile.open(built["sdist"]) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0] + "/"
    assert modules_of(names, top) == source_modules(ROOT), "the sdist's modules differ from the source tree's"
    missing = {top + p for p in source_data(ROOT) | {"pyproject.toml", "setup.py"}} - set(names)
    assert not missing, f"files missing from the sdist: {sorted(missing)}"


def test_source_modules_sees_a_new_module(tmp_path):
    """The comparison can fail: a module added in a new folder is counted (and would be missed by a hand list)."""
    copy_checkout(tmp_path / "src")
    extra = tmp_path / "src" / "runtime" / "ops" / "newfolder"
    extra.mkdir()
    (extra / "kernel.py").write_text("X = 1\n")
    assert source_modules(tmp_path / "src") - source_modules(ROOT) == {"h3_blackwell.runtime.ops.newfolder.kernel"}


# ---------------------------------------------------------------------------------------------
# the wheel installed as users install it
# ---------------------------------------------------------------------------------------------

def _clean_env(venv: Path) -> dict:
    """The environment of a user's shell with only ``venv`` active: no PYTHONPATH, no other venv on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(venv / "bin")] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                         if not p.startswith(str(ROOT))])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _wheel_venv(wheel: Path, tmp: Path) -> tuple[Path, float]:
    """A plain virtual environment (not --system-site-packages: it sees nothing of this checkout or its .venv)
    with ``wheel`` installed and its requirements from the package index. The environment is kept in
    .venv/wheel-test (beside the checkout's own, ignored by git) so later runs reuse torch; h3-blackwell itself is
    removed and installed afresh from the wheel every time. -> (venv, seconds the install took)."""
    venv = Path(os.environ.get("H3_WHEEL_TEST_VENV", ROOT / ".venv" / "wheel-test"))
    t0 = time.perf_counter()
    py = venv / "bin" / "python"
    if not py.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", "--clear", venv], tmp, 300)
    env = _clean_env(venv)
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "h3-blackwell"], cwd=tmp, env=env, capture_output=True,
                   timeout=120)
    _run([py, "-m", "pip", "install", "-q", wheel, TORCH_REQ], tmp, 900, env)
    return venv, time.perf_counter() - t0


def test_wheel_installed_outside_the_checkout_generates_and_registers_nodes(built, tmp_path):
    venv, install_s = _wheel_venv(built["wheel"], tmp_path)
    env = _clean_env(venv)
    work = tmp_path / "user"  # a folder of the user's, outside the checkout
    work.mkdir()
    where = _run([venv / "bin" / "python", "-c", "import h3_blackwell; print(h3_blackwell.__file__)"], work, 60, env)
    installed = Path(where.stdout.strip())
    assert installed.parent.parent.name == "site-packages" and venv in installed.parents, \
        f"h3_blackwell imported from {installed}, not from the wheel installed in {venv}"
    t0 = time.perf_counter()
    gen = _run([venv / "bin" / "h3-blackwell", "generate", "--output", "OUT", "--steps", "2"], work, 600, env)
    gen_s = time.perf_counter() - t0
    assert (work / "OUT" / "latents.safetensors").is_file() and (work / "OUT" / "report.json").is_file(), gen.stdout
    # ComfyUI's view of the installed copy: the node mappings, without ComfyUI present
    nodes = _run([venv / "bin" / "python", "-c",
                  "import h3_blackwell as p; m = p.NODE_CLASS_MAPPINGS; "
                  "assert m and all(k.startswith('H3B_') for k in m), m; "
                  "assert set(p.NODE_DISPLAY_NAME_MAPPINGS) <= set(m); print(len(m))"], work, 120, env)
    assert int(nodes.stdout.strip()) >= 5
    print(f"\nwheel {built['seconds'][0]:.1f} s, sdist {built['seconds'][1]:.1f} s, clean install {install_s:.1f} s, "
          f"generate {gen_s:.1f} s")
