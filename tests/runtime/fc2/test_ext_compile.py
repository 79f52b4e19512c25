"""The cuBLASLt extension compiles against the CUDA 13 headers and cuBLASLt from PyPI, without a GPU.

CI installs the headers and libraries with ``pip install -e '.[cuda-headers]'`` (nvidia-cublas,
nvidia-cuda-runtime, nvidia-cuda-crt, nvidia-cuda-cccl). The compile test is skipped only when they are
not installed, and the skip message says how to install them. The compiled module is also imported
and asked for build_info(): libcublasLt and libcudart load without a driver, so the header and
runtime versions are real even here; the device part reports the driver error instead of crashing.
"""

from __future__ import annotations

import time

import pytest
import torch

from h3_blackwell.runtime.fc2 import ext
from h3_blackwell.runtime.fc2.dispatcher import Fc2Dispatcher
from h3_blackwell.runtime.fc2.guard import Fc2Operands
from h3_blackwell.runtime.fc2.lt_plans import LtPlanLayer
from h3_blackwell.runtime.fc2.table import Fc2Table, GB10_CANONICAL


def _paths_or_skip():
    try:
        return ext.find_cuda()
    except ext.ExtensionUnavailable as e:
        pytest.skip(f"CUDA 13 headers/libraries not installed, cannot compile: {e}")


@pytest.mark.slow
def test_extension_compiles_links_imports_and_reports_versions(tmp_path):
    paths = _paths_or_skip()
    assert paths.cuda_header // 1000 == 13 and paths.cublas_header // 10000 == 13
    t0 = time.perf_counter()
    st = ext.load(str(tmp_path))
    assert st.ok, st.reason
    assert st.built_now and st.build_dir.startswith(str(tmp_path)) and st.tag in st.build_dir
    info = st.build_info
    # compile-time versions are the headers' own macros, runtime versions come from the loaded libraries
    assert info["cuda_header"] == paths.cuda_header and info["cublas_header"] == paths.cublas_header
    assert info["cublaslt_runtime"] // 10000 == 13 and info["cuda_runtime"] // 1000 == 13
    assert info["cublaslt_path"].endswith("libcublasLt.so.13")
    assert len(info["cublaslt_mapped"]) == 1, f"two libcublasLt copies mapped: {info['cublaslt_mapped']}"
    mod = st.module
    for name in ("build_info", "status_name", "Problem", "Plan"):
        assert hasattr(mod, name)
    for name in ("algo_ids", "algo_caps", "heuristic", "pinned_plan", "heuristic_plan"):
        assert hasattr(mod.Problem, name)
    assert mod.status_name(15) == "CUBLAS_STATUS_NOT_SUPPORTED"
    with pytest.raises(ValueError, match="expected nvfp4, fp8_e4m3 or bf16"):
        mod.Problem("int8", 16, 16, 16)
    if not torch.cuda.is_available():
        assert info["device"] is None and info["device_error"]
        # descriptors need a device: a clear error, not a crash
        with pytest.raises(RuntimeError, match="cudaGetDevice"):
            mod.Problem("bf16", 64, 64, 64)
        # the dispatcher over the real layer falls back for CPU operands, with the reason
        d = Fc2Dispatcher(str(tmp_path), table=Fc2Table([GB10_CANONICAL]),
                          plan_layer=LtPlanLayer(str(tmp_path), st))
        x = torch.empty((37824, 7168), dtype=torch.uint8)
        w = torch.empty((5376, 7168), dtype=torch.uint8)
        d(Fc2Operands(x, w, m_logical=37810), lambda ops: torch.zeros(ops.m_logical, 5376, dtype=torch.bfloat16),
          producer="swiglu_nvfp4")
        [reason] = d.total["reasons"]
        assert reason.startswith("no_device:")
    again = ext.load(str(tmp_path))
    assert again is st  # one build per process and tag
    print(f"extension build + import: {time.perf_counter() - t0:.1f} s")


def test_missing_headers_give_an_actionable_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(ext, "_candidate_include_roots", lambda extra: [tmp_path])
    st = ext.load(str(tmp_path))
    assert not st.ok and "cublasLt.h" in st.reason and "pip install -e '.[cuda-headers]'" in st.reason
    d = Fc2Dispatcher(str(tmp_path), table=Fc2Table([GB10_CANONICAL]),
                      plan_layer=LtPlanLayer(str(tmp_path), st))
    assert d.prepare(torch.device("cpu"))["reason"].startswith("extension: CUDA headers missing")


def test_failed_build_falls_back_with_a_clear_message_and_is_remembered(tmp_path, monkeypatch):
    _paths_or_skip()
    broken = tmp_path / "fc2_nvfp4_lt.cpp"
    broken.write_text('#error "deliberately broken for the test"\n')
    monkeypatch.setattr(ext, "SOURCE", broken)
    o = str(tmp_path / "cache")
    st = ext.load(o)
    assert not st.ok and st.reason.startswith("extension build failed") and "deliberately broken" in st.reason
    assert (tmp_path / "cache" / "ext" / st.tag / "FAILED.json").is_file()
    t0 = time.perf_counter()
    again = ext.load(o)
    assert not again.ok and "earlier build of this exact configuration failed" in again.reason
    assert time.perf_counter() - t0 < 5  # no second compile
    d = Fc2Dispatcher(o, table=Fc2Table([GB10_CANONICAL]), plan_layer=LtPlanLayer(o, again))
    x = torch.empty((37824, 7168), dtype=torch.uint8)
    w = torch.empty((5376, 7168), dtype=torch.uint8)
    y = d(Fc2Operands(x, w, m_logical=37810), lambda ops: torch.zeros(ops.m_logical, 5376, dtype=torch.bfloat16),
          producer="swiglu_nvfp4")
    assert y.shape == (37810, 5376)
    [reason] = d.total["reasons"]
    assert reason.startswith("extension: an earlier build")


def test_no_ninja_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    _paths_or_skip()
    import torch.utils.cpp_extension as cpp_ext

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_ext, "verify_ninja_availability", no_ninja)
    monkeypatch.setattr(ext, "_LOADED", {})
    st = ext.load(str(tmp_path))
    assert not st.ok and "ninja" in st.reason
