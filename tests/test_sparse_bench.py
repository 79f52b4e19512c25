"""The sparse sections of bench/canonical.py run end to end on the CPU (tiny model, reference kernel): the dense run
on the same model, the quality numbers, the First-Block Cache run. Measures nothing; checks the plumbing and that
each number is what its name says."""

import sys
from pathlib import Path

import torch

from h3_blackwell.runtime import RuntimeOptions, load_model, sample
from h3_blackwell.runtime.model.layout import latent_shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _sparse_bench as B  # noqa: E402


def test_canonical_sparse_sections_on_tiny():
    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="sparse",
                                         sparse_min_tokens=0, sparse_extra_tokens=0), tiny_seed=0)
    vshape, ashape = latent_shapes(256, 192, 39)
    text = torch.randn(1, 9, 5120, generator=torch.Generator().manual_seed(0))
    kw = dict(seed=3, sampler="res_multistep")
    steps = 4
    r = sample(rt, text, None, torch.zeros(vshape), torch.zeros(ashape), steps=steps, **kw)
    saved = []
    out = B.canonical_sparse(rt, r, text, vshape, ashape, steps, kw, fbcache=10.0, dense_runs=1, write=saved.append)
    assert len(saved) == 3 and out["quality_note"].startswith("The weights are random")
    assert out["dense_run"]["latent_checksums"]["video_sha256"] != r.report["latent_checksums"]["video_sha256"]
    fin = out["quality"]["final_latent_vs_dense"]
    assert 0 < fin["video_rel_l2"] < 0.5 and 0 < fin["audio_rel_l2"] < 0.5
    one = out["quality"]["one_forward_vs_dense"]
    assert [one[k]["step"] for k in ("early", "middle", "late")] == [1, 2, 3]   # the 4-step schedule's sparse steps
    assert all(0 < one[k]["video_rel_l2"] < 0.5 for k in one)
    fb = out["first_block_cache_run"]
    assert fb["reused_steps"] == [1, 2, 3] and fb["final_latent_vs_uncached"]["video_rel_l2"] > 0
    assert rt.sparse.start_percent == 0.2                                          # restored after the dense run
    again = sample(rt, text, None, torch.zeros(vshape), torch.zeros(ashape), steps=steps, **kw)
    assert again.report["latent_checksums"]["video_sha256"] == r.report["latent_checksums"]["video_sha256"]
