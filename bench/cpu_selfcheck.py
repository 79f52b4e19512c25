"""The benches' own stages on the CPU (tiny model, reference kernels): run before taking a bench to the H200, so a
plumbing error costs no device time. Measures nothing; checks that each stage runs and that each number is what
its name says. Exit status 0 when every check holds, 1 otherwise.

    python3 bench/cpu_selfcheck.py

1. bench/_sparse_bench.py ``canonical_sparse``: the dense run on the same model, the quality numbers, the
   First-Block Cache run (tiny model, comfy-kitchen's fp32 reference of sol_attn, which comfy-kitchen must be
   installed for: ``pip install -e .[test]``).
2. bench/canonical.py ``accuracy`` on the tiny W4A8 model (its first H200 run failed there: the W4A4 emulation must
   switch the activation format too) and the run report's FC2 consistency for W4A8.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (no GPU here)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from h3_blackwell.runtime import (Measure, RuntimeOptions, SampleInputs, SamplingSettings, load_model,  # noqa: E402
                                  run, sample, tensor_job)
from h3_blackwell.runtime.model.layout import latent_shapes  # noqa: E402


def check_sparse_sections() -> None:
    import _sparse_bench as B

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="sparse",
                                         sparse_min_tokens=0, sparse_extra_tokens=0), tiny_seed=0)
    vshape, ashape = latent_shapes(256, 192, 39)
    text = torch.randn(1, 9, 5120, generator=torch.Generator().manual_seed(0))
    steps = 4
    kw = dict(sampling=SamplingSettings(seed=3, steps=steps, sampler="res_multistep"))
    r = sample(rt, SampleInputs(text, None, torch.zeros(vshape), torch.zeros(ashape)), kw["sampling"])
    saved = []
    out = B.canonical_sparse(rt, r, text, vshape, ashape, steps, kw, fbcache=10.0, dense_runs=1, write=saved.append)
    assert len(saved) == 3 and out["quality_note"].startswith("The weights are random")
    assert out["dense_run"]["latent_checksums"]["video_sha256"] != r.report["latent_checksums"]["video_sha256"]
    fin = out["quality"]["final_latent_vs_dense"]
    assert 0 < fin["video_rel_l2"] < 0.5 and 0 < fin["audio_rel_l2"] < 0.5
    one = out["quality"]["one_forward_vs_dense"]
    assert [one[k]["step"] for k in ("early", "middle", "late")] == [1, 2, 3]  # the 4-step schedule's sparse steps
    assert all(0 < one[k]["video_rel_l2"] < 0.5 for k in one)
    fb = out["first_block_cache_run"]
    assert fb["reused_steps"] == [1, 2, 3] and fb["final_latent_vs_uncached"]["video_rel_l2"] > 0
    again = sample(rt, SampleInputs(text, None, torch.zeros(vshape), torch.zeros(ashape)), kw["sampling"])
    assert again.report["latent_checksums"]["video_sha256"] == r.report["latent_checksums"]["video_sha256"]


def check_accuracy_stage() -> None:
    import canonical

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", gemm="fp8", act_format="fp8"), tiny_seed=6)
    assert rt.ops.name == "w4a8" and rt.plan.act_format == "fp8"
    m = rt.model
    g = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 24, 2, 6, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g)
    text = torch.randn(1, 7, 5120, generator=g)
    plan = m.plan(text, tuple(video.shape), tuple(audio.shape), [0.95])
    r = canonical.accuracy(rt, plan, torch.randn(video.shape), torch.randn(audio.shape))
    assert rt.ops.name == "w4a8" and r["benchmarked"]["act_format"] == "fp8"
    assert {lin.backend for blk in m.blocks for lin in (blk.attn.qkv_proj, blk.mlp.fc2)} == {"fp8"}  # restored
    assert 0 < r["benchmarked"]["video_rel_l2"] < r["nvfp4_w4a4_emulation"]["video_rel_l2"], r
    assert r["benchmarked_no_less_accurate"] is True
    f = run(tensor_job(rt, SampleInputs(text, None, video, audio), SamplingSettings(seed=1, steps=2),
                       measure=Measure(2, 0))).report["fc2_dispatch"]
    n = len(m.blocks) * 2
    assert [x["direct_calls"] for x in f["runs"]] == [n, n] and {x["attempts"] for x in f["runs"]} == {0}
    assert f["consistent_with_configuration"] is True and "direct FC2 calls" in f["expected"]


def main() -> int:
    failed = 0
    for check in (check_sparse_sections, check_accuracy_stage):
        try:
            check()
            print(f"ok   {check.__name__}")
        except Exception as e:  # noqa: BLE001 - report every check, then the exit status
            failed += 1
            print(f"FAIL {check.__name__}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
