"""Run SageAttention3's ``sageattention3_blackwell/setup.py build_ext`` for one target without that GPU.

    python bench/_sage3_setup.py CC SRC BUILD_LIB BUILD_TEMP      # CC: 10.0, 12.0 or 12.1

Its setup.py chooses the ``-gencode`` target from ``torch.cuda.get_device_capability()`` (and raises "Unsupported
GPU" elsewhere); here that call answers CC, nothing else changes. Its ``from wheel.bdist_wheel import bdist_wheel``
gets setuptools' own class where the ``wheel`` package is missing (build_ext never uses it). Used by
bench/blackwell_device_builds.sh on the GPU machine.
"""

import os
import runpy
import sys
import types

import torch


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        raise SystemExit(f"usage: {sys.argv[0]} CC SRC BUILD_LIB BUILD_TEMP (found {len(argv)} arguments)")
    cc, src, lib, tmp = argv
    major, minor = (int(x) for x in cc.split("."))
    torch.cuda.get_device_capability = lambda *a, **k: (major, minor)
    try:
        import wheel.bdist_wheel  # noqa: F401
    except ImportError:
        from setuptools.command.bdist_wheel import bdist_wheel
        pkg, mod = types.ModuleType("wheel"), types.ModuleType("wheel.bdist_wheel")
        mod.bdist_wheel = bdist_wheel
        pkg.bdist_wheel = mod
        sys.modules.update({"wheel": pkg, "wheel.bdist_wheel": mod})
    os.chdir(src)
    sys.argv = ["setup.py", "build_ext", "--build-lib", os.path.abspath(lib), "--build-temp", os.path.abspath(tmp)]
    print(f"sageattn3 setup.py build_ext for capability {major}.{minor} -> {lib}", flush=True)
    runpy.run_path("setup.py", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
