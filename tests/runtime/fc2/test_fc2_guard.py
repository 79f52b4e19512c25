"""The FC2 guard, dispatch, counters, strict mode and compatibility cache, with a fake plan layer.

Canonical-shape operands are created with ``torch.empty`` (no pages touched), and the fake layer never
reads or writes them: these tests are about which path runs and why, not about GEMM numerics (those
are the GPU tests' job).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from h3_blackwell.runtime.fc2.dispatcher import Fc2Dispatcher

from h3_blackwell.runtime.fc2.guard import Fc2Call, Fc2Environment, Fc2Operands, match

from h3_blackwell.runtime.fc2.lt_plans import CompatCache, PlanError

from h3_blackwell.runtime.fc2.table import AlgoSpec, Fc2Entry, Fc2LtError, Fc2Table, GB10_CANONICAL, PRODUCER_SWIGLU_NVFP4, Refusal, table_dir
from h3_blackwell.runtime.options import RuntimeOptions
from h3_blackwell.runtime.plan import _fc2 as plan_fc2

M, MP, N, K = 37810, 37824, 5376, 14336

GB10_ENV = Fc2Environment(cc=(12, 1), sm_count=48, cuda_header=13000, cublas_header=130100, cuda_runtime=13000,
                          cublaslt_runtime=130000, device_name="NVIDIA GB10", device_index=0)
H200_ENV = Fc2Environment(cc=(9, 0), sm_count=132, cuda_header=13000, cublas_header=130100, cuda_runtime=13000,
                          cublaslt_runtime=130100, device_name="NVIDIA H200", device_index=0)


class FakeLayer:
    """Stands in for the cuBLASLt extension: scripted environment, build and run outcomes."""

    name = "fake"

    def __init__(self, env=GB10_ENV, *, unavailable=None, fail_build=None, fail_run=None, tag="fake-1",
                 compute=False, perturb=False):
        self.env, self.unavailable, self.tag = env, unavailable, tag
        self.fail_build, self.fail_run = fail_build, fail_run
        self.compute, self.perturb = compute, perturb  # compute: write torch's GEMM (small shapes only)
        self.builds = 0
        self.runs: list = []

    def unavailable_reason(self):
        return self.unavailable

    def environment(self, device):
        return self.env

    def build(self, entry, device):
        self.builds += 1
        if self.fail_build:
            raise PlanError(*self.fail_build)
        return {"entry": entry.name, "algo": entry.algo.as_dict()}

    def plan_info(self, plan):
        return {"config": plan["algo"], "workspace_required": 0}

    def run(self, plan, ops, out):
        self.runs.append(ops)
        if self.fail_run:
            raise PlanError("execute", self.fail_run)
        if self.compute:
            out.copy_(torch.nn.functional.linear(ops.x, ops.w))
            if self.perturb:
                out.view(torch.int16)[3, 5] ^= 1  # one bf16 ulp somewhere

    def build_info(self):
        return {"cublaslt_runtime": self.env.cublaslt_runtime}

    def compat_tag(self):
        return self.tag


def cache(tmp_path) -> str:
    """The cache directory a dispatcher takes (the plan's cache_dir)."""
    return str(tmp_path / "cache")


def nvfp4_operands(m_padded=MP, n=N, k=K):
    """Canonical NVFP4 FC2 operands as the SwiGLU producer leaves them (contents irrelevant here)."""
    return dict(
        x=torch.empty((m_padded, k // 2), dtype=torch.uint8),
        w=torch.empty((n, k // 2), dtype=torch.uint8),
        x_scale=torch.empty(((m_padded + 127) // 128 * 128) * (k // 16), dtype=torch.float8_e4m3fn),
        w_scale=torch.empty(((n + 127) // 128 * 128) * (k // 16), dtype=torch.float8_e4m3fn),
        alpha=torch.ones(1),
    )


class Fallback:
    """Records the operands it was handed; returns a [m_logical, N] result."""

    def __init__(self):
        self.calls: list = []

    def __call__(self, ops):
        self.calls.append(ops)
        return torch.zeros((ops.m_logical, ops.w.shape[0]), dtype=torch.bfloat16)


def dispatch(d: Fc2Dispatcher, fb=None, *, m_logical=M, producer=PRODUCER_SWIGLU_NVFP4, operands=None, **kw):
    fb = fb or Fallback()
    ops = operands or nvfp4_operands()
    operand_kw = {f: kw.pop(f) for f in ("bias",) if f in kw}
    y = d(Fc2Operands(**ops, **operand_kw, m_logical=m_logical), fb, producer=producer, **kw)
    return y, fb


def reasons(d: Fc2Dispatcher) -> list[str]:
    return list(d.total["reasons"])


# ----------------------------------------------------------------------------------------------
# the seed entry


def test_gb10_entry_is_exactly_the_seed():
    e = GB10_CANONICAL
    assert (e.role, e.k, e.n, e.m_logical, e.m_padded) == ("fc2", 14336, 5376, 37810, 37824)
    assert (e.dtype, e.out_dtype, e.producer) == ("nvfp4", "bf16", PRODUCER_SWIGLU_NVFP4)
    assert e.cc == (12, 1) and e.cuda_runtime == 13000 and e.cublaslt_runtime == 130000
    assert e.cuda_header == (13, 0) and e.cublas_header == (13, 1)
    assert e.algo == AlgoSpec(id=70, tile=20, stages=37, splitk=1, reduction=0, swizzle=0, custom=0)
    assert e.workspace_bytes == 0 and e.scale_mode == "vec16_ue4m3"
    assert e.key == ("fc2", (12, 1), 48, 130000, "nvfp4", "bf16", 37810, 37824, 5376, 14336)


def test_canonical_call_takes_the_pinned_plan(tmp_path):
    layer = FakeLayer()
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    d.begin_run()
    y, fb = dispatch(d)
    assert tuple(y.shape) == (M, N) and y.dtype == torch.bfloat16
    assert not fb.calls and len(layer.runs) == 1
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"], run["errors"]) == (1, 1, 0, 0)


# ----------------------------------------------------------------------------------------------
# every guard condition, flipped on its own


CALL_FLIPS = {
    "role": dict(role="fc1"),
    "lora": dict(lora_active=True),
    "bias": dict(bias=torch.empty(N, dtype=torch.bfloat16)),
    "out_dtype": dict(out_dtype=torch.float16),
    "dtype": dict(operands=dict(x=torch.empty((MP, K), dtype=torch.bfloat16),
                                w=torch.empty((N, K), dtype=torch.bfloat16))),
    "producer": dict(producer="unfused_quantize"),
    "k": dict(operands=nvfp4_operands(k=K + 32)),
    "n": dict(operands=nvfp4_operands(n=N // 2)),
    "m_logical": dict(m_logical=M + 1),
    "m_padded": dict(operands=nvfp4_operands(m_padded=MP + 64)),
}


@pytest.mark.parametrize("code", list(CALL_FLIPS))
def test_each_call_condition_flipped_falls_back_with_its_reason(tmp_path, code):
    layer = FakeLayer()
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    d.begin_run()
    kw = dict(CALL_FLIPS[code])
    if "operands" in kw:
        kw["operands"] = dict(kw["operands"])
        kw["operands"].setdefault("x_scale", None)
    y, fb = dispatch(d, **kw)
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"]) == (1, 0, 1)
    [reason] = run["reasons"]
    assert reason.startswith(code + ":"), reason
    assert len(fb.calls) == 1 and not layer.runs and layer.builds == 0


def test_lora_reason_names_the_side_path(tmp_path):
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=FakeLayer())
    dispatch(d, lora_active=True)
    assert "LoRA side-path active on fc2" in reasons(d)[0]


ENV_FLIPS = {
    "no_device": dict(cc=None, sm_count=None, device_error="operands are on cpu, not a CUDA device"),
    "cc": dict(cc=(9, 0)),
    "sm_count": dict(sm_count=132),
    "cuda_header": dict(cuda_header=13010),
    "cublas_header": dict(cublas_header=130000),
    "cuda_runtime": dict(cuda_runtime=13010),
    "cublaslt_runtime": dict(cublaslt_runtime=130100),
}


@pytest.mark.parametrize("code", list(ENV_FLIPS))
def test_each_device_condition_flipped_falls_back_with_its_reason(tmp_path, code):
    layer = FakeLayer(dataclasses.replace(GB10_ENV, **ENV_FLIPS[code]))
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    d.begin_run()
    _, fb = dispatch(d)
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"]) == (1, 0, 1)
    [reason] = run["reasons"]
    assert reason.startswith(code + ":"), reason
    assert len(fb.calls) == 1 and layer.builds == 0


def test_sm90_reason_reads_well(tmp_path):
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=FakeLayer(H200_ENV))
    dispatch(d)
    assert reasons(d)[0].startswith("cc: device is sm_90, the entry needs sm_121")


def test_the_plan_decides_whether_and_how_the_guarded_path_runs():
    """fc2_lt off, the CPU or e4m3 activations: the plan applies no dispatcher (the load builds none); strict is
    the plan's choice, handed to the dispatcher, which never reads the options."""
    cuda = torch.device("cuda")  # only its type is read
    assert plan_fc2(RuntimeOptions(fc2_lt=False), cuda, "nvfp4").choice == "off"
    assert plan_fc2(RuntimeOptions(), torch.device("cpu"), "nvfp4").choice == "off"
    assert plan_fc2(RuntimeOptions(), cuda, "fp8").choice.startswith("not applicable")
    assert plan_fc2(RuntimeOptions(), cuda, "nvfp4").choice == "dispatcher"
    o = RuntimeOptions.from_env({"H3_NVFP4_FC2_LT_STRICT": "1", "H3_NVFP4_FC2_LT_SPLITK1": "1"})
    assert plan_fc2(o, cuda, "nvfp4").choice == "strict"


def test_extension_unavailable_falls_back(tmp_path):
    layer = FakeLayer(unavailable="CUDA headers missing: cublasLt.h (cuBLASLt (pip: nvidia-cublas))")
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    _, fb = dispatch(d)
    assert len(fb.calls) == 1 and reasons(d)[0].startswith("extension: CUDA headers missing")


def test_malformed_operands_are_a_contract_refusal(tmp_path):
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=FakeLayer())
    dispatch(d, m_logical=0)
    ops = nvfp4_operands()
    ops["x"] = ops["x"].view(2, MP // 2, K // 2)
    dispatch(d, operands=ops)
    assert all(r.startswith("contract:") for r in reasons(d)) and d.total["fallbacks"] == 2


# ----------------------------------------------------------------------------------------------
# plan failures, strict mode, same bytes


def test_check_failure_falls_back_is_counted_and_not_rebuilt(tmp_path):
    layer = FakeLayer(fail_build=("check", "cublasLtMatmulAlgoCheck returned CUBLAS_STATUS_NOT_SUPPORTED (15)"))
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    d.begin_run()
    for _ in range(3):
        _, fb = dispatch(d)
        assert len(fb.calls) == 1
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"]) == (3, 0, 3)
    [reason] = run["reasons"]
    assert reason.startswith("check: cublasLtMatmulAlgoCheck returned CUBLAS_STATUS_NOT_SUPPORTED")
    assert layer.builds == 1 and not layer.runs


def test_execution_failure_falls_back_is_counted_and_disables_the_plan(tmp_path):
    layer = FakeLayer(fail_run="cublasLtMatmul returned CUBLAS_STATUS_EXECUTION_FAILED (13)")
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    d.begin_run()
    _, fb1 = dispatch(d)
    _, fb2 = dispatch(d)
    run = d.end_run()
    assert len(fb1.calls) == 1 and len(fb2.calls) == 1
    assert (run["attempts"], run["successes"], run["fallbacks"]) == (2, 0, 2)
    assert len(layer.runs) == 1  # not retried after the first failure
    assert all(r.startswith("execute:") for r in run["reasons"])
    assert any("plan disabled" in r for r in run["reasons"])


@pytest.mark.parametrize("layer_kw, code", [
    (dict(env=H200_ENV), "cc"),
    (dict(fail_build=("check", "AlgoCheck refused")), "check"),
    (dict(fail_run="launch failed"), "execute"),
])
def test_strict_mode_raises_instead_of_falling_back(tmp_path, layer_kw, code):
    d = Fc2Dispatcher(cache(tmp_path), strict=True, table=Fc2Table([GB10_CANONICAL]),
                      plan_layer=FakeLayer(**layer_kw))
    d.begin_run()
    fb = Fallback()
    with pytest.raises(Fc2LtError) as ei:
        dispatch(d, fb)
    assert ei.value.reason.code == code and "strict" in str(ei.value)
    assert not fb.calls
    run = d.end_run()
    assert (run["attempts"], run["successes"], run["fallbacks"], run["errors"]) == (1, 0, 0, 1)


def test_strict_raises_on_a_device_refusal(tmp_path):
    d = Fc2Dispatcher(cache(tmp_path), strict=True, table=Fc2Table([GB10_CANONICAL]), plan_layer=FakeLayer(H200_ENV))
    with pytest.raises(Fc2LtError):
        dispatch(d)
    assert d.status()["strict"] is True


def test_fallback_gets_the_same_bytes_no_second_quantization(tmp_path):
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=FakeLayer(H200_ENV))
    ops = nvfp4_operands()
    keep = dict(ops)
    _, fb = dispatch(d, operands=ops)
    [got] = fb.calls
    assert got.x is keep["x"] and got.w is keep["w"]
    assert got.x_scale is keep["x_scale"] and got.w_scale is keep["w_scale"] and got.alpha is keep["alpha"]
    assert got.m_logical == M


def test_pinned_path_receives_the_same_bytes_and_result_is_a_view_of_out(tmp_path):
    layer = FakeLayer()
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    out = torch.empty((MP, N), dtype=torch.bfloat16)
    ops = nvfp4_operands()
    x = ops["x"]
    y, _ = dispatch(d, operands=ops, out=out)
    assert layer.runs[0].x is x and y.data_ptr() == out.data_ptr() and y.shape[0] == M
    bad = torch.empty((M, N), dtype=torch.bfloat16)
    dispatch(d, out=bad)
    assert reasons(d)[-1].startswith("contract: out is")


# ----------------------------------------------------------------------------------------------
# runs and the report block


def test_runs_counts_and_report(tmp_path):
    layer = FakeLayer()
    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=layer)
    assert d.report(3)["all_passed"] is False  # no run yet
    d.begin_run()
    for _ in range(3):
        dispatch(d)
    assert d.end_run()["successes"] == 3
    assert d.report(3) == {"required_per_run": 3, "runs": [{"attempts": 3, "successes": 3, "fallbacks": 0}],
                           "all_passed": True}
    assert d.report(4)["all_passed"] is False  # fewer calls than blocks x steps
    d.begin_run()
    dispatch(d)
    dispatch(d)
    dispatch(d, m_logical=M - 1)
    d.end_run()
    rep = d.report(3)
    assert rep["runs"][1] == {"attempts": 3, "successes": 2, "fallbacks": 1} and rep["all_passed"] is False
    assert d.total["attempts"] == 6
    json.dumps(d.status())  # JSON-safe for the run report


# ----------------------------------------------------------------------------------------------
# several entries, tuned JSON entries


def h200_bf16_entry(**kw) -> Fc2Entry:
    base = dict(name="nvidia-h200-fc2-bf16-m37810", role="fc2", cc=(9, 0), sm_count=132, cuda_header=(13, 0),
                cublas_header=(13, 1), cuda_runtime=13000, cublaslt_runtime=130100, dtype="bf16", out_dtype="bf16",
                m_logical=M, m_padded=MP, n=N, k=K, algo=AlgoSpec(id=66, tile=31, stages=36), device_name="NVIDIA H200",
                evidence={"timing": {"rounds": 20}})
    base.update(kw)
    return Fc2Entry(**base)


def bf16_operands():
    return dict(x=torch.empty((MP, K), dtype=torch.bfloat16), w=torch.empty((N, K), dtype=torch.bfloat16))


def test_reason_comes_from_the_entry_that_got_furthest():
    table = Fc2Table([GB10_CANONICAL, h200_bf16_entry()])
    nv = Fc2Call("fc2", "nvfp4", "bf16", M, MP, N, K, producer=PRODUCER_SWIGLU_NVFP4)
    entry, r = match(table, nv, H200_ENV)
    assert entry is None and r.code == "cc" and "gb10" in r.detail
    bf = Fc2Call("fc2", "bf16", "bf16", M + 2, MP, N, K)
    entry, r = match(table, bf, H200_ENV)
    assert r.code == "m_logical" and "h200" in r.detail
    entry, r = match(table, dataclasses.replace(bf, m_logical=M), H200_ENV)
    assert r is None and entry.name == "nvidia-h200-fc2-bf16-m37810"


def test_tuned_json_entry_is_picked_up_from_the_cache_dir(tmp_path):
    o = cache(tmp_path)
    entry = h200_bf16_entry()
    d = table_dir(o)
    d.mkdir(parents=True)
    (d / f"{entry.name}.json").write_text(json.dumps(entry.to_json()))
    (d / "broken.json").write_text("{not json")
    table = Fc2Table.default(o)
    assert [e.name for e in table.entries] == [GB10_CANONICAL.name, entry.name]
    assert len(table.problems) == 1 and "broken.json" in table.problems[0]
    loaded = table.entries[1]
    assert loaded == entry and loaded.evidence == entry.evidence
    layer = FakeLayer(H200_ENV)
    disp = Fc2Dispatcher(o, plan_layer=layer)
    disp.begin_run()
    y, fb = dispatch(disp, operands=bf16_operands(), producer=None)
    assert not fb.calls and tuple(y.shape) == (M, N) and disp.end_run()["successes"] == 1


def test_entry_json_validation():
    good = h200_bf16_entry().to_json()
    assert Fc2Entry.from_json(good) == h200_bf16_entry()
    with pytest.raises(ValueError, match="schema"):
        Fc2Entry.from_json(dict(good, schema="other/1"))
    with pytest.raises(ValueError, match="split-K"):
        Fc2Entry.from_json(dict(good, algo=dict(good["algo"], splitk=2)))
    with pytest.raises(ValueError, match="bias"):
        Fc2Entry.from_json(dict(good, gemm=dict(good["gemm"], bias=True)))
    with pytest.raises(ValueError, match="unknown keys"):
        Fc2Entry.from_json(dict(good, algo=dict(good["algo"], tiles=3)))
    with pytest.raises(ValueError, match="missing field"):
        Fc2Entry.from_json({k: v for k, v in good.items() if k != "algo"})


def test_same_key_later_entry_replaces_earlier():
    a, b = h200_bf16_entry(), h200_bf16_entry(name="retuned", algo=AlgoSpec(id=71, tile=20, stages=30))
    t = Fc2Table([a, b])
    assert [e.name for e in t.entries] == ["retuned"]


# ----------------------------------------------------------------------------------------------
# the on-disk compatibility cache, prepare


def test_compat_cache_replays_a_refusal_keyed_by_versions(tmp_path):
    o = cache(tmp_path)
    failing = FakeLayer(fail_build=("check", "AlgoCheck returned CUBLAS_STATUS_NOT_SUPPORTED (15)"))
    d1 = Fc2Dispatcher(o, table=Fc2Table([GB10_CANONICAL]), plan_layer=failing)
    dispatch(d1)
    files = list((tmp_path / "cache" / "fc2_lt" / "compat").glob("*.json"))
    assert len(files) == 1
    rec = json.loads(files[0].read_text())
    assert rec["key"]["cublaslt_runtime"] == 130000 and rec["key"]["sm_count"] == 48
    [e] = rec["entries"].values()
    assert e["status"] == "refused" and e["code"] == "check"

    healthy = FakeLayer()  # same device, versions and build tag: the measured refusal is replayed
    d2 = Fc2Dispatcher(o, table=Fc2Table([GB10_CANONICAL]), plan_layer=healthy)
    _, fb = dispatch(d2)
    assert len(fb.calls) == 1 and healthy.builds == 0 and "cached compatibility result" in reasons(d2)[0]

    rebuilt = FakeLayer(tag="fake-2")  # a different extension build: measured again
    d3 = Fc2Dispatcher(o, table=Fc2Table([GB10_CANONICAL]), plan_layer=rebuilt)
    _, fb = dispatch(d3)
    assert not fb.calls and rebuilt.builds == 1


def test_compat_key_covers_device_and_versions(tmp_path):
    c = CompatCache(tmp_path)
    base = c.path(GB10_ENV, "t")
    for change in [dict(cc=(12, 0)), dict(sm_count=84), dict(cuda_runtime=13010), dict(cublaslt_runtime=130100),
                   dict(cuda_header=13010), dict(cublas_header=130200), dict(device_name="other"),
                   dict(cuda_driver=13020)]:
        assert c.path(dataclasses.replace(GB10_ENV, **change), "t") != base, change
    assert c.path(GB10_ENV, "t2") != base


def test_prepare_builds_matching_entries_and_explains_the_others(tmp_path):
    o = cache(tmp_path)
    d = Fc2Dispatcher(o, table=Fc2Table([GB10_CANONICAL, h200_bf16_entry()]), plan_layer=FakeLayer())
    p = d.prepare(torch.device("cpu"), self_test=False)
    assert p["entries"][GB10_CANONICAL.name]["status"] == "ready"
    h = p["entries"]["nvidia-h200-fc2-bf16-m37810"]
    assert h["status"] == "not this device" and h["reason"].startswith("cc:")
    d2 = Fc2Dispatcher(o, table=Fc2Table([GB10_CANONICAL]),
                       plan_layer=FakeLayer(unavailable="extension build failed: x"))
    assert d2.prepare(torch.device("cpu"))["reason"].startswith("extension:")
    json.dumps(d.status())


def test_refusal_str():
    assert str(Refusal("cc", "device is sm_90")) == "cc: device is sm_90"


# ----------------------------------------------------------------------------------------------
# the tuner's pure parts (the sweep itself needs a GPU: tests/gpu/test_fc2_gpu.py)


def test_candidate_configs_cover_the_capabilities():
    from h3_blackwell.runtime.fc2.tune import candidate_configs

    caps = {"id": 66, "init_status": 0, "tiles": [18, 20, 31], "stages": [8, 37], "swizzle_support": 1,
            "custom_option_max": 2}
    got = list(candidate_configs(caps))
    assert len(got) == 3 * 2 * 2 * 3
    assert all(c["splitk"] == 1 and c["reduction"] == 0 and c["id"] == 66 for c in got)
    assert {(c["tile"], c["stages"], c["swizzle"], c["custom"]) for c in got} == {
        (t, s, w, u) for t in (18, 20, 31) for s in (8, 37) for w in (0, 1) for u in (0, 1, 2)}
    assert list(candidate_configs({"id": 3, "init_status": 15})) == []  # AlgoInit refused the id
    assert len(list(candidate_configs({"id": 5, "init_status": 0}))) == 1  # no tiles/stages listed: undefined


def test_heuristic_results_become_split_k_1_candidates_without_duplicates():
    from h3_blackwell.runtime.fc2.tune import pinnable, unique

    stream_k = {"id": 70, "tile": 20, "stages": 37, "splitk": -1, "reduction": 2, "swizzle": 0, "custom": 0,
                "cluster": 0, "inner_shape": 0}
    p = pinnable(stream_k)
    assert p["splitk"] == 1 and p["reduction"] == 0 and (p["id"], p["tile"], p["stages"]) == (70, 20, 37)
    assert AlgoSpec.from_dict(p) == GB10_CANONICAL.algo
    assert len(list(unique([p, dict(p), dict(p, swizzle=1)]))) == 2


def test_alternating_order_and_summary():
    from h3_blackwell.runtime.fc2.tune import alternating_order, summarize_ms

    assert alternating_order(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    s = summarize_ms([3.0, 1.0, 2.0, 10.0])
    assert s["p50"] == 2.5 and s["min"] == 1.0 and s["n"] == 4


def test_compare_bytes_is_bitwise():
    from h3_blackwell.runtime.fc2.operands import compare_bytes

    a = torch.tensor([0.0, 1.0, 2.0], dtype=torch.bfloat16)
    assert compare_bytes(a, a.clone())["equal"]
    assert compare_bytes(a, torch.tensor([-0.0, 1.0, 2.0], dtype=torch.bfloat16))["mismatched"] == 1
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert not compare_bytes(nan, torch.zeros(1, dtype=torch.bfloat16))["equal"]
    assert compare_bytes(a, a[:2])["mismatched"] == -1


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_synthetic_operands_shapes_and_zero_padding(dtype):
    from h3_blackwell.runtime.fc2.guard import describe_call
    from h3_blackwell.runtime.fc2.operands import synthetic_operands

    ops = synthetic_operands(dtype, 100, 128, 64, 256, "cpu", seed=3)
    call = describe_call(ops, role="fc2", out_dtype=torch.bfloat16, lora_active=False, producer=None)
    assert (call.dtype, call.m_logical, call.m_padded, call.n, call.k) == (dtype, 100, 128, 64, 256)
    assert ops.x[100:].view(torch.uint8).eq(0).all() and ops.x[:100].view(torch.uint8).ne(0).any()
    if dtype == "nvfp4":
        assert ops.x_scale.numel() == 128 * 16 and ops.w_scale.numel() == 128 * 16
    again = synthetic_operands(dtype, 100, 128, 64, 256, "cpu", seed=3)
    assert torch.equal(ops.x.view(torch.uint8), again.x.view(torch.uint8))  # seeded


def test_reference_gemm_bf16_is_torch_linear():
    from h3_blackwell.runtime.fc2.operands import reference_gemm, synthetic_operands

    ops = synthetic_operands("bf16", 30, 32, 16, 64, "cpu", seed=1)
    y = reference_gemm(ops, "bf16")
    assert torch.equal(y, torch.nn.functional.linear(ops.x, ops.w)) and y[30:].eq(0).all()


def test_tune_cli_without_gpu_is_a_clean_error(capsys):
    from h3_blackwell.cli.tune_fc2 import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["--dtype", "bf16"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_tune_subprocess_reports_the_childs_refusal(tmp_path):
    """The sweep's child process (runtime side, not the CLI) gets its arguments and answers through its files:
    without a GPU it refuses with one line, which the parent's TuneCrash carries."""
    from h3_blackwell.runtime.fc2.tune import TuneCrash, TuneProblem, tune_subprocess

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TuneCrash) as ei:
        tune_subprocess(TuneProblem("bf16", 30, 32, 16, 64), cache_dir=str(tmp_path), trace=False, timeout=120,
                        say=lambda s: None)
    assert ei.value.returncode == 2 and "needs a CUDA device" in str(ei.value)


class _FakeLtPlan:
    """CPU stand-in for the extension's Plan: runs torch's GEMM, optionally off by one ulp."""

    def __init__(self, cfg, ok=True, stage="ready", exact=True, workspace_required=0):
        self.cfg, self.ok, self.stage, self.exact = dict(cfg), ok, stage, exact
        self.workspace_required = workspace_required

    def info(self):
        return {"ok": self.ok, "stage": self.stage, "message": "" if self.ok else "AlgoCheck refused",
                "config": self.cfg if self.ok else None, "requested": self.cfg,
                "workspace_required": self.workspace_required, "waves": 1.0}

    def run(self, x, w, out, xs, ws, alpha, alpha_h, workspace, stream):
        y = torch.nn.functional.linear(x, w)
        if not self.exact:
            y = y.clone()
            y.view(torch.int16)[0, 0] += 1
        out.copy_(y)
        return 0


class _FakeLtModule:
    """Problem/Plan interface of csrc/fc2_nvfp4_lt.cpp on the CPU: ids 1..3 (3 fails AlgoInit); a
    config is legal when tile == 10 or id == 2; only (id 1, tile 10, stages 20) is exact. ``needs_workspace``:
    every otherwise legal config needs that many bytes of workspace (as fp8 does on the H200)."""

    HEUR = {"id": 2, "tile": 11, "stages": 21, "splitk": -1, "reduction": 2, "swizzle": 0, "custom": 0,
            "cluster": 0, "inner_shape": 0}

    def __init__(self, exact_exists=True, needs_workspace=0):
        self.exact_exists, self.needs_workspace = exact_exists, needs_workspace
        mod = self

        class Problem:
            def __init__(self, kind, m, n, k, pointer_mode, scale_mode):
                self.kind = kind

            def algo_ids(self, max_ids):
                return [1, 2, 3]

            def algo_caps(self, i):
                return {"id": i, "init_status": 15 if i == 3 else 0, "tiles": [10, 11], "stages": [20, 21],
                        "swizzle_support": 0, "custom_option_max": 0}

            def heuristic(self, count, ws, reduction_none):
                return [{"state": 0, "workspace": 0, "waves": 1.0, "config": dict(mod.HEUR)}]

            def pinned_plan(self, cfg, ws):
                legal = cfg["tile"] == 10 or cfg["id"] == 2
                exact = mod.exact_exists and (cfg["id"], cfg["tile"], cfg["stages"]) == (1, 10, 20)
                need = mod.needs_workspace if legal else 0
                if need > ws:
                    return _FakeLtPlan(cfg, ok=False, stage="workspace", workspace_required=need)
                return _FakeLtPlan(cfg, ok=legal, stage="ready" if legal else "check", exact=exact,
                                   workspace_required=need)

            def heuristic_plan(self, index, ws, reduction_none):
                return _FakeLtPlan(mod.HEUR, exact=False)

        self.Problem = Problem

    def build_info(self):
        return {"cuda_header": 13000, "cublas_header": 130100, "cuda_runtime": 13000, "cublaslt_runtime": 130100,
                "device": {"index": 0, "name": "Fake H200", "cc": (9, 0), "sm_count": 132}, "device_error": None}


def test_tuner_keeps_only_byte_identical_configs_and_writes_an_entry(tmp_path):
    from h3_blackwell.runtime.fc2.tune import TuneProblem, TuneSweep, tune

    res = tune(TuneProblem("bf16", 30, 32, 16, 64), TuneSweep(rounds=4, seeds=2), device="cpu",
               cache_dir=cache(tmp_path), module=_FakeLtModule(), say=lambda s: None, command="test")
    ev = res["evidence"]
    assert ev["sweep"]["configurations_checked"] == 8  # 1 from the heuristic + 2 ids x 2 tiles x 2 stages, deduped
    assert ev["sweep"]["legal"] == 6 and ev["sweep"]["refused_by_stage"] == {"check": 2}
    assert ev["sweep"]["exact_seed0"] == 1 and ev["seeds"] == [0, 1]
    assert set(ev["timing"]["ms"]) == {"pinned0", "heuristic", "reference"}
    assert all(t["n"] == 4 for t in ev["timing"]["ms"].values())
    assert ev["heuristic"]["vs_reference_equal"] is False and "speedup_vs_heuristic" in ev
    entry = Fc2Entry.from_json(res["entry"])
    assert (entry.algo.id, entry.algo.tile, entry.algo.stages, entry.algo.splitk) == (1, 10, 20, 1)
    assert (entry.cc, entry.sm_count, entry.cublaslt_runtime) == ((9, 0), 132, 130100)
    assert (entry.m_logical, entry.m_padded, entry.n, entry.k, entry.dtype) == (30, 32, 16, 64, "bf16")
    assert entry.name == "fake-h200-fc2-bf16-m30" and entry.evidence["command"] == "test"
    json.dumps(res, default=str)


def test_tuner_writes_nothing_when_no_config_is_exact(tmp_path):
    from h3_blackwell.runtime.fc2.tune import TuneProblem, TuneSweep, tune

    res = tune(TuneProblem("bf16", 30, 32, 16, 64), TuneSweep(rounds=2, seeds=2), device="cpu",
               cache_dir=cache(tmp_path), module=_FakeLtModule(exact_exists=False), say=lambda s: None)
    assert res["entry"] is None and res["evidence"]["sweep"]["exact_seed0"] == 0
    assert res["evidence"]["inexact_examples"]


def test_tuner_says_when_only_workspace_stands_in_the_way(tmp_path):
    """fp8 on the H200: every configuration AlgoCheck accepts needs a few bytes of workspace. With a zero limit
    the tuner finds nothing and says how much workspace would do; with that much, the entry records it."""
    from h3_blackwell.runtime.fc2.tune import TuneProblem, TuneSweep, tune

    said: list[str] = []
    kw = dict(sweep=TuneSweep(rounds=2, seeds=2), device="cpu", cache_dir=cache(tmp_path))
    res = tune(TuneProblem("bf16", 30, 32, 16, 64), **kw, module=_FakeLtModule(needs_workspace=4), say=said.append)
    assert res["entry"] is None and res["evidence"]["sweep"]["legal"] == 0
    assert res["evidence"]["sweep"]["least_workspace_refused"] == 4
    assert res["evidence"]["sweep"]["refused_by_stage"] == {"check": 2, "workspace": 6}
    assert any("at least 4 bytes" in s and "--workspace-mb" in s for s in said), said
    res = tune(TuneProblem("bf16", 30, 32, 16, 64, workspace_limit=1 << 20), **kw,
               module=_FakeLtModule(needs_workspace=4), say=lambda s: None)
    entry = Fc2Entry.from_json(res["entry"])
    assert entry.workspace_bytes == 4 and (entry.algo.id, entry.algo.tile, entry.algo.stages) == (1, 10, 20)


def test_prepare_self_test_compares_bytes_and_caches_the_result(tmp_path):
    small = h200_bf16_entry(name="small-bf16", m_logical=30, m_padded=32, n=16, k=64)
    o = cache(tmp_path)
    ok_layer = FakeLayer(H200_ENV, compute=True)
    p = Fc2Dispatcher(o, table=Fc2Table([small]), plan_layer=ok_layer).prepare(torch.device("cpu"))
    st = p["entries"]["small-bf16"]["self_test"]
    assert p["entries"]["small-bf16"]["status"] == "ready" and st["passed"] and st["mismatched_elements"] == 0
    p2 = Fc2Dispatcher(o, table=Fc2Table([small]), plan_layer=ok_layer).prepare(torch.device("cpu"))
    assert p2["entries"]["small-bf16"]["self_test"].get("cached") is True  # measured once per device/versions

    o2 = cache(tmp_path / "other")
    bad = FakeLayer(H200_ENV, compute=True, perturb=True)
    d = Fc2Dispatcher(o2, table=Fc2Table([small]), plan_layer=bad)
    p3 = d.prepare(torch.device("cpu"))
    e = p3["entries"]["small-bf16"]
    assert e["status"] == "refused" and e["reason"].startswith("self_test: 1 of 512 bf16 elements differ")
    from h3_blackwell.runtime.fc2.operands import synthetic_operands

    ops = synthetic_operands("bf16", 30, 32, 16, 64, "cpu", seed=9)
    _, fb = dispatch(d, operands=dict(x=ops.x, w=ops.w), m_logical=30, producer=None)
    assert len(fb.calls) == 1 and reasons(d)[0].startswith("self_test:")
    healthy = FakeLayer(H200_ENV, compute=True)
    d2 = Fc2Dispatcher(o2, table=Fc2Table([small]), plan_layer=healthy)
    _, fb = dispatch(d2, operands=dict(x=ops.x, w=ops.w), m_logical=30, producer=None)
    assert len(fb.calls) == 1 and healthy.builds == 0 and "cached compatibility result" in reasons(d2)[0]


def test_unexpected_exceptions_fall_back_as_internal(tmp_path):
    class Broken(FakeLayer):
        def run(self, plan, ops, out):
            raise TypeError("a bug")

    d = Fc2Dispatcher(cache(tmp_path), table=Fc2Table([GB10_CANONICAL]), plan_layer=Broken())
    _, fb = dispatch(d)
    assert len(fb.calls) == 1 and reasons(d)[0] == "internal: TypeError: a bug"
    strict = Fc2Dispatcher(cache(tmp_path), strict=True, table=Fc2Table([GB10_CANONICAL]), plan_layer=Broken())
    with pytest.raises(Fc2LtError):
        dispatch(strict)
