"""Sequence parallelism on the CPU (gloo, 2 local processes): row sharding, the Ulysses all-to-all attention
against single-process attention, degree checks and the failure paths of the launcher (no hang, the
worker's own error)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from h3_blackwell.runtime.ops.attention import bind_attention, rel_l2
from h3_blackwell.runtime.parallel import (CommStats, ParallelEnv, ParallelError, RowShard, UlyssesAttention,
                                           WorkerFailed, check_degree, launch)


# ---------------------------------------------------------------------------------------------
# row sharding (no processes)
# ---------------------------------------------------------------------------------------------

def test_row_shard_covers_rows_once_and_clips_segments():
    segs = [(0, 5, "text"), (5, 12, "audio"), (12, 37, "video")]
    shards = [RowShard(37, 4, r) for r in range(4)]
    assert [s.chunk for s in shards] == [10] * 4 and shards[0].padded_len == 40
    assert [(s.start, s.stop) for s in shards] == [(0, 10), (10, 20), (20, 30), (30, 37)]
    # the straddling segment (5, 12) appears on ranks 0 and 1 with its payload, in local indices
    assert shards[0].local_segments(segs) == [(0, 5, "text"), (5, 10, "audio")]
    assert shards[1].local_segments(segs) == [(0, 2, "audio"), (2, 10, "video")]
    assert shards[3].local_segments(segs) == [(0, 7, "video")]
    x = torch.randn(37, 3)
    parts = [s.take(x) for s in shards]
    # the row-local ops see exactly the real rows (the segment tables tile them); padding lives in the collectives
    assert [p.shape[0] for p in parts] == [10, 10, 10, 7] and torch.equal(torch.cat(parts), x)
    cos = torch.randn(37, 4)
    assert torch.equal(shards[3].rope(cos, cos)[0], cos[30:])
    # a rank that holds only padding (S=3 over 4 ranks: chunk 1, rank 3 has no real row)
    assert RowShard(3, 4, 3).real_rows == 0 and RowShard(3, 4, 3).local_segments([(0, 3, 0)]) == []


def test_check_degree_errors_before_any_work(monkeypatch):
    assert check_degree(1, 4, "cpu") == "gloo" and check_degree(2, 4, "cpu") == "gloo"
    with pytest.raises(ParallelError, match=r"does not divide the model's 56 attention heads; use one of \[1, 2, 4, 7, 8"):
        check_degree(3, 56, "cpu")
    with pytest.raises(ParallelError, match="expected an integer >= 1"):
        check_degree(0, 4, "cpu")
    with pytest.raises(ParallelError, match="needs 4 CUDA devices .* 2 visible"):
        check_degree(4, 56, "cuda", device_count=2)
    with pytest.raises(ParallelError, match="cuda .* or cpu"):
        check_degree(2, 4, "mps")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ParallelError, match="no nccl backend, which cuda ranks need"):
        check_degree(2, 56, "cuda", device_count=2)


def test_parallel_env_reads_torchrun_variables():
    assert ParallelEnv.from_env({}) is None
    e = ParallelEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (1, 2, 1, "h", 9)
    with pytest.raises(ParallelError, match=r"\['RANK'.*torchrun"):
        ParallelEnv.from_env({"WORLD_SIZE": "2"})


# ---------------------------------------------------------------------------------------------
# the all-to-all attention wrapper vs single-process attention (2 gloo ranks)
# ---------------------------------------------------------------------------------------------

def _reference_inner(qkv, heads, head_dim, seq_len):
    """What sequence parallelism runs around the load's bound attention (evaluate.make_inner), here the
    reference backend bound for ``head_dim``: the rank's heads over the first ``seq_len`` rows."""
    from h3_blackwell.runtime.parallel.evaluate import make_inner

    return make_inner(bind_attention("reference", head_dim))(qkv, heads, head_dim, seq_len)


def _ulysses_vs_single(ctx, cases):
    out = []
    for seq, heads, head_dim in cases:
        qkv = torch.randn(seq, 3 * heads * head_dim, generator=torch.Generator().manual_seed(seq))
        shard = RowShard(seq, ctx.world_size, ctx.rank)
        stats = CommStats()
        local = UlyssesAttention(shard, _reference_inner, stats=stats)(shard.take(qkv), heads, head_dim)
        full = shard.gather(local)
        single = bind_attention("reference", head_dim)(qkv)
        out.append((rel_l2(full, single), stats.calls, stats.bytes_per_call, stats.offrank_bytes_per_call,
                    len(stats.per_step_seconds(1))))
    return out


def test_ulysses_attention_matches_single_process_uneven_rows():
    # S = 37 and S = 3 over 2 ranks: chunks of 19 and 2, rank 1 one row short (a zero row in its send buffer).
    # A padding key that leaked into the softmax would move every output row by ~1/S (rel-L2 ~1e-2).
    res = launch(_ulysses_vs_single, ([(37, 4, 8), (3, 2, 16)],), world_size=2, timeout_s=60, join_timeout_s=120)
    (err37, calls, nbytes, off, nsteps), (err3, *_rest) = res
    # same per-head fp32 math on the same rows: only the summation order inside the score matmuls can differ
    assert err37 < 1e-6 and err3 < 1e-6, (err37, err3)
    assert calls == 1 and nsteps == 1
    assert nbytes == (19 * 3 * 32 + 38 * 16) * 4 and off == nbytes // 2  # qkv out + output back, fp32


def test_ulysses_world_of_one_is_the_single_device_op_without_copies_or_collectives():
    qkv = torch.randn(37, 3 * 4 * 8, generator=torch.Generator().manual_seed(1))
    seen = []

    def inner(buf, heads, head_dim, seq_len):
        seen.append(buf.data_ptr())
        return _reference_inner(buf, heads, head_dim, seq_len)

    stats = CommStats()
    out = UlyssesAttention(RowShard(37, 1, 0), inner, stats=stats)(qkv, 4, 8)
    assert seen == [qkv.data_ptr()]  # the op read the caller's buffer itself: no permute copy, no exchange
    assert torch.equal(out, bind_attention("reference", 8)(qkv))
    assert (stats.calls, stats.bytes_per_call, stats.per_step_seconds(1)) == (0, 0, [0.0])


# ---------------------------------------------------------------------------------------------
# failure paths: a worker that raises, one that dies hard, one that is stuck (no hang, nothing returned)
# ---------------------------------------------------------------------------------------------

def _rank1_fails(ctx, how):
    if ctx.rank == 1:
        if how == "raise":
            raise RuntimeError("boom in rank 1")
        if how == "exit":
            os._exit(3)
        time.sleep(600)  # stuck: never joins the collective below
    dist.barrier()  # rank 0 waits here for a peer that never comes
    return "finished"


@pytest.mark.parametrize("how, expect", [
    ("raise", r"rank 1 failed: RuntimeError: boom in rank 1; the run was stopped and nothing was written"),
    ("exit", r"rank 1 exited with status 3 without an error message"),
    ("stuck", r"rank 0 failed: .*"),  # the collective timeout (3 s) ends rank 0, the launcher stops rank 1
])
def test_failing_worker_ends_the_run_with_its_error(how, expect):
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed, match=expect):
        launch(_rank1_fails, (how,), world_size=2, timeout_s=3 if how == "stuck" else 120, join_timeout_s=120)
    # well before the 120 s collective timeout / join bound: the launcher noticed the failure itself
    assert time.perf_counter() - t0 < 60
