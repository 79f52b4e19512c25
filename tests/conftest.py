"""Shared test setup: gpu-marked tests skip cleanly without CUDA; without CUDA, Triton kernels run in
its interpreter (the variable must be set before anything imports triton, comfy_kitchen included)."""

import os
import signal
import sys
import types
from pathlib import Path

import pytest

# The suite's work is small (tiny models): one intra-op thread, as `generate`'s auto picks for such work
# (runtime.cpu_thread_count). A pool of two on a 2-core machine that other jobs share waits on its slowest thread at
# every op (the suite: 11 min against 9). Set before torch is imported, so this process and every command the tests
# start inherit it; an OMP_NUM_THREADS already set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 - after the thread count above

# Before anything imports h3_blackwell: Triton decides at decoration (the kernel modules' import) whether a kernel
# is compiled or interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests live in folders mirroring the packages (tests/runtime/ops/, tests/cli/, ...); the shared helpers sit at the top:
# tests/fixtures (small models and contracts), tests/refblock.py and tests/oracles (the float64 oracles).
TESTS = Path(__file__).resolve().parent
for _p in (TESTS / "oracles", TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

def _here_only(signum, frame) -> None:
    """Stands in for SIG_IGN in this process (see below)."""


# A test run started as a background job (``cmd &`` in a script) or under nohup inherits SIGINT / SIGHUP ignored, and
# an ignored signal stays ignored across exec: every CLI the tests start would then keep them ignored, as the CLI
# must for its own caller, and the tests that interrupt it would see it finish instead. A Python handler is reset to
# the default on exec, so this process keeps ignoring them in effect while the commands it starts get the defaults
# a foreground terminal gives.
for _sig in ("SIGINT", "SIGHUP"):
    if hasattr(signal, _sig) and signal.getsignal(getattr(signal, _sig)) is signal.SIG_IGN:
        signal.signal(getattr(signal, _sig), _here_only)

try:  # a plain checkout (e.g. the device copy) that is not pip-installed: the repo root is the package
    import h3_blackwell  # noqa: F401
except ImportError:
    _pkg = types.ModuleType("h3_blackwell")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[1])]
    sys.modules["h3_blackwell"] = _pkg


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu-marked); run on the H200 with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# the real-ComfyUI fixtures (comfyui_server, comfyui_dense_server, comfyui_models, h3b_cli), shared by the tests
# marked comfyui and browser; they start nothing until a test asks for them
from comfyui.fixtures import comfyui_dense_server, comfyui_install, comfyui_models, comfyui_server, h3b_cli  # noqa: E402,F401
