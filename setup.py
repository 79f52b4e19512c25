"""The package list, found rather than written by hand (everything else is in pyproject.toml).

The repository root is the package ``h3_blackwell`` (``package-dir`` maps it to "."), which setuptools' own
``packages.find`` cannot express: its names would lack the ``h3_blackwell.`` prefix. So this finds every folder
under the code folders (every top-level folder with an ``__init__.py``) and the data
folders below, with or without an ``__init__.py`` (a folder that forgot one still ships),
and names it under ``h3_blackwell``. tests/, bench/ and scripts/ are not part of the package.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

NOT_SHIPPED = {"tests", "bench", "scripts", "build", "dist", "third_party"}
# every top-level folder with an __init__.py is code (runtime, cli, nodes, comfy_client, ...): a new one ships
# without an edit here
CODE = tuple(sorted(d.name for d in Path(__file__).resolve().parent.iterdir()
                    if (d / "__init__.py").is_file() and d.name not in NOT_SHIPPED and not d.name.startswith(".")))
DATA = ("csrc", "workflows", "web")  # folders of package data (no Python), shipped beside the code

found = find_namespace_packages(include=[f"{top}{tail}" for top in CODE + DATA for tail in ("", ".*")],
                                exclude=["*.__pycache__", "*.__pycache__.*"])
setup(packages=["h3_blackwell"] + [f"h3_blackwell.{name}" for name in sorted(found)])
