"""Sequence parallelism on real GPUs (NCCL): run before the issue-19 bench to catch device-binding or NCCL
problems in seconds (python3 -m pytest -m gpu tests/gpu/test_parallel_gpu.py). The 2-rank tests need two
visible GPUs and skip otherwise; the world-of-one test needs one.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime.ops.attention import TOLERANCE, bind_attention, rel_l2
from h3_blackwell.runtime.parallel import CommStats, RowShard, UlyssesAttention, launch

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 visible CUDA devices")


def _sdpa_inner(qkv, heads, head_dim, seq_len):
    """Sequence parallelism's inner op (evaluate.make_inner) around the bound sdpa function."""
    from h3_blackwell.runtime.parallel.evaluate import make_inner

    return make_inner(bind_attention("sdpa", head_dim))(qkv, heads, head_dim, seq_len)


def _ulysses_vs_single_cuda(ctx, seq, heads, head_dim):
    g = torch.Generator(device=ctx.device).manual_seed(seq)
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=g, device=ctx.device).to(torch.bfloat16)
    shard = RowShard(seq, ctx.world_size, ctx.rank)
    stats = CommStats()
    local = UlyssesAttention(shard, _sdpa_inner, stats=stats)(shard.take(qkv), heads, head_dim)
    full = shard.gather(local)
    single = bind_attention("sdpa", head_dim)(qkv)
    return rel_l2(full, single), stats.per_step_seconds(1)[0], str(local.device)


@two_gpus
def test_ulysses_on_two_gpus_matches_one_gpu_sdpa():
    # bf16 SDPA per head on the same rows; only the head count per call differs, so torch may pick another kernel
    # for it: bounded by SDPA's own tolerance against fp32 (bf16 P and output rounding)
    err, a2a_seconds, dev = launch(_ulysses_vs_single_cuda, (4099, 8, 128), world_size=2, device_type="cuda",
                                   timeout_s=120, join_timeout_s=300)
    assert err < TOLERANCE["sdpa"][0], err
    assert a2a_seconds > 0 and dev == "cuda:0"


def _generate(tmp_path, name, extra):
    assert cli.main(["generate", "--output", str(tmp_path / name), "--device", "cuda", "--steps", "3", *extra]) == 0
    return (load_file(str(tmp_path / name / "latents.safetensors")),
            json.loads((tmp_path / name / "report.json").read_text()))


@two_gpus
def test_generate_sequence_parallel_2_on_two_gpus(tmp_path):
    one, _ = _generate(tmp_path, "one", [])
    sp, rep = _generate(tmp_path, "sp", ["--sequence-parallel", "2"])
    s = rep["sequence_parallel"]
    assert s["world_size"] == 2 and s["backend"] == "nccl" and s["latents_identical_across_ranks"]
    assert [r["device"] for r in s["ranks"]] == ["cuda:0", "cuda:1"]
    assert all(run["peak_allocated_bytes"] > 0 for r in s["ranks"] for run in r["runs"])
    # bf16 W4A8 / NVFP4 stacks: the codes may move where a GEMM over fewer rows rounds differently (W4A8), or
    # the per-rank W4A4 amax differs; both stay far inside the quantization's own error against exact math
    for k in ("video", "audio"):
        assert rel_l2(sp[k], one[k]) < 5e-2, (k, rel_l2(sp[k], one[k]))


def test_world_of_one_on_cuda_equals_the_plain_path(tmp_path, monkeypatch):
    from h3_blackwell.runtime.parallel.launch import free_port

    one, _ = _generate(tmp_path, "one", [])
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    tr, rep = _generate(tmp_path, "tr", [])
    assert rep["sequence_parallel"]["backend"] == "nccl"
    for k in ("video", "audio"):  # nothing is split or exchanged: the same kernels on the same rows
        assert torch.equal(tr[k], one[k]), (k, rel_l2(tr[k], one[k]))
