"""The FC2 cuBLASLt path on a real GPU (run on the H200: ``pytest -m gpu tests/gpu/test_fc2_gpu.py``).

Shapes are moderate so the file runs in about a minute; the canonical-shape evidence comes from
``bench/fc2_h200.py``. Every exactness claim is bitwise against torch's own GEMM for the dtype (the
path the fallback takes), on random data.
"""

from __future__ import annotations

import json

import pytest
import torch

from h3_blackwell.runtime.fc2 import ext
from h3_blackwell.runtime.fc2.dispatcher import Fc2Dispatcher
from h3_blackwell.runtime.fc2.guard import Fc2Operands
from h3_blackwell.runtime.fc2.lt_plans import LtPlanLayer
from h3_blackwell.runtime.fc2.table import AlgoSpec, Fc2Entry, Fc2LtError, Fc2Table, GB10_CANONICAL, PRODUCER_SWIGLU_NVFP4
from h3_blackwell.runtime.options import RuntimeOptions
from h3_blackwell.runtime.fc2.tune import (
    TuneCrash,
    TuneProblem,
    TuneSweep,
    compare_bytes,
    reference_gemm,
    synthetic_operands,
    tune_subprocess,
)

pytestmark = pytest.mark.gpu

SMALL = dict(m_logical=4000, m_padded=4016, n=2048, k=4096)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fc2cache")


@pytest.fixture(scope="module")
def options(cache):
    return RuntimeOptions(cache_dir=str(cache))


@pytest.fixture(scope="module")
def extst(options):
    st = ext.load(options.cache_dir)
    assert st.ok, st.reason
    return st


def _cc():
    return torch.cuda.get_device_capability()


def test_build_info_matches_the_device(extst):
    info = extst.build_info
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert tuple(info["device"]["cc"]) == (props.major, props.minor)
    assert info["device"]["sm_count"] == props.multi_processor_count
    assert info["cuda_runtime"] // 1000 == 13 and info["cublaslt_runtime"] // 10000 == 13
    assert len(info["cublaslt_mapped"]) == 1, f"two libcublasLt copies: {info['cublaslt_mapped']}"
    print(json.dumps(info, indent=1, default=str))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10,
                    reason="Hopper-and-older behaviour of the FP4 queries")
def test_fp4_algo_ids_do_not_filter_by_device(extst):
    prob = extst.module.Problem("nvfp4", 256, 256, 256, "device", "vec16_ue4m3")
    ids = list(prob.algo_ids(64))
    assert ids, "AlgoGetIds returned no FP4 ids (facts say it lists them even on sm_90)"
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        prob.heuristic(4, 0, False)
    plan = prob.pinned_plan(GB10_CANONICAL.algo.as_dict(), 0)
    assert not plan.ok and plan.info()["stage"] in ("init", "config", "check")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() == (12, 1),
                    reason="on GB10 the canonical entry may legitimately be accepted")
def test_canonical_nvfp4_entry_is_refused_with_its_reason(options, extst):
    dev = torch.device("cuda")
    d = Fc2Dispatcher(options.cache_dir, table=Fc2Table([GB10_CANONICAL]),
                      plan_layer=LtPlanLayer(options.cache_dir, extst))
    prep = d.prepare(dev, self_test=False)
    assert prep["entries"][GB10_CANONICAL.name]["status"] == "not this device"
    x = torch.empty((37824, 7168), dtype=torch.uint8, device=dev)
    w = torch.empty((5376, 7168), dtype=torch.uint8, device=dev)
    called = []
    d.begin_run()
    d(Fc2Operands(x, w, m_logical=37810),
      lambda ops: called.append(ops) or torch.zeros((37810, 5376), dtype=torch.bfloat16, device=dev),
      producer=PRODUCER_SWIGLU_NVFP4)
    run = d.end_run()
    assert len(called) == 1 and called[0].x is x
    [reason] = run["reasons"]
    cc = _cc()
    expected = "cc" if cc != (12, 1) else "sm_count"
    assert reason.startswith(f"{expected}: device is sm_{cc[0]}{cc[1]}"), reason
    strict = Fc2Dispatcher(options.cache_dir, strict=True, table=Fc2Table([GB10_CANONICAL]),
                           plan_layer=LtPlanLayer(options.cache_dir, extst))
    with pytest.raises(Fc2LtError):
        strict(Fc2Operands(x, w, m_logical=37810), lambda ops: None, producer=PRODUCER_SWIGLU_NVFP4)


_TUNED: dict = {}


def _tuned(options, dtype):
    """One small tune per dtype per session (the heuristic's picks are tried first, so 40 suffice).

    The tuner runs in a subprocess: a crash inside cuBLASLt (SIGSEGV) fails these tests with the signal
    and the last traced cublasLtMatmul arguments instead of killing pytest. A failure is remembered, so
    the next test that needs the entry fails at once instead of tuning (and crashing) again.
    """
    if dtype not in _TUNED:
        # fp8 with tensor scales: on the H200 (cuBLASLt 13.1) every configuration that passes AlgoCheck needs a
        # few bytes of workspace (the heuristic's pick: 4 bytes), so a zero-workspace sweep finds none; the
        # entry then records its workspace and the dispatcher allocates it at prepare
        ws = (1 << 20) if dtype == "fp8_e4m3" else 0
        try:
            res = tune_subprocess(TuneProblem(dtype, **SMALL, workspace_limit=ws),
                                  TuneSweep(max_candidates=40, top=3, rounds=3, seeds=2, check_seconds=10,
                                            run_seconds=20), cache_dir=str(options.cache_dir), timeout=300, say=print)
        except TuneCrash as e:
            _TUNED[dtype] = f"{e}\n--- tuner stderr tail ---\n{e.log_tail[-3000:]}"
        else:
            if res["entry"] is None:
                _TUNED[dtype] = "no entry: " + json.dumps(res["evidence"], indent=1, default=str)[:4000]
            else:
                _TUNED[dtype] = (Fc2Entry.from_json(res["entry"]), res["evidence"])
    got = _TUNED[dtype]
    if isinstance(got, str):
        pytest.fail(f"tune-fc2 ({dtype}) failed: {got}", pytrace=False)
    return got


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_tuned_entry_dispatches_byte_identical_to_the_reference(options, extst, dtype):
    if dtype == "fp8_e4m3" and _cc() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    entry, ev = _tuned(options, dtype)
    assert entry.algo.splitk == 1 and entry.algo.reduction == 0
    assert ev["sweep"]["legal"] > 0 and ev["timing"]["rounds"] == 3
    dev = torch.device("cuda")
    d = Fc2Dispatcher(options.cache_dir, table=Fc2Table([GB10_CANONICAL, entry]),
                      plan_layer=LtPlanLayer(options.cache_dir, extst))
    prep = d.prepare(dev)  # builds the plan and self-tests it against torch's GEMM
    assert prep["entries"][entry.name]["status"] == "ready", prep["entries"][entry.name]
    assert prep["entries"][entry.name]["self_test"]["passed"]
    d.begin_run()
    for seed in range(6):
        ops = synthetic_operands(dtype, device=dev, seed=100 + seed, **SMALL)
        ref = reference_gemm(ops, dtype)[: SMALL["m_logical"]]
        y = d(Fc2Operands(ops.x, ops.w, x_scale=ops.x_scale, w_scale=ops.w_scale, m_logical=SMALL["m_logical"]),
              lambda o: reference_gemm(o, dtype)[: o.m_logical])
        assert compare_bytes(y, ref)["equal"], f"seed {seed}"
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"]) == (6, 6, 0), run
    assert d.report(6)["all_passed"]


def test_check_failure_on_gpu_falls_back_and_is_counted(options, extst):
    dev = torch.device("cuda")
    cc = _cc()
    info = extst.build_info
    bad = Fc2Entry(name="bogus", role="fc2", cc=cc, sm_count=info["device"]["sm_count"],
                   cuda_header=(info["cuda_header"] // 1000, info["cuda_header"] % 1000 // 10),
                   cublas_header=(info["cublas_header"] // 10000, info["cublas_header"] % 10000 // 100),
                   cuda_runtime=info["cuda_runtime"], cublaslt_runtime=info["cublaslt_runtime"], dtype="bf16",
                   out_dtype="bf16", algo=AlgoSpec(id=0, tile=9999, stages=9999), **SMALL)
    d = Fc2Dispatcher(options.cache_dir, table=Fc2Table([bad]), plan_layer=LtPlanLayer(options.cache_dir, extst),
                      compat=False)
    ops = synthetic_operands("bf16", device=dev, seed=5, **SMALL)
    d.begin_run()
    for _ in range(2):
        y = d(Fc2Operands(ops.x, ops.w, m_logical=SMALL["m_logical"]),
              lambda o: reference_gemm(o, "bf16")[: o.m_logical])
        assert y.shape == (SMALL["m_logical"], SMALL["n"])
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"]) == (2, 0, 2)
    [reason] = run["reasons"]
    assert reason.split(":")[0] in ("init", "config", "check", "readback"), reason


def test_dispatch_inside_a_cuda_graph_after_prepare(options, extst):
    entry, _ = _tuned(options, "bf16")
    dev = torch.device("cuda")
    d = Fc2Dispatcher(options.cache_dir, table=Fc2Table([entry]),
                      plan_layer=LtPlanLayer(options.cache_dir, extst))
    d.prepare(dev, self_test=False)
    ops = synthetic_operands("bf16", device=dev, seed=7, **SMALL)
    out = torch.empty((SMALL["m_padded"], SMALL["n"]), dtype=torch.bfloat16, device=dev)
    fb = lambda o: reference_gemm(o, "bf16")[: o.m_logical]  # noqa: E731
    d(Fc2Operands(ops.x, ops.w, m_logical=SMALL["m_logical"]), fb, out=out)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = d(Fc2Operands(ops.x, ops.w, m_logical=SMALL["m_logical"]), fb, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert compare_bytes(y, reference_gemm(ops, "bf16")[: SMALL["m_logical"]])["equal"]
    assert d.total["fallbacks"] == 0 and d.total["successes"] == 2

    # without prepare, a plan is never built inside capture: the call falls back with the reason
    fresh = Fc2Dispatcher(options.cache_dir, table=Fc2Table([entry]),
                          plan_layer=LtPlanLayer(options.cache_dir, extst))
    fresh.layer.environment(dev)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        fresh(Fc2Operands(ops.x, ops.w, m_logical=SMALL["m_logical"]), fb)
    [reason] = fresh.total["reasons"]
    assert reason.startswith("capture:")
