"""The memory model of a sparse call (runtime.budget.sparse_phases) against what one sparse block call really
allocates on the GPU (``torch.cuda.max_memory_allocated``), per method, on the parity block of
tests/fixtures/sparse_parity.py (head_dim 128, bf16, 4458 packed rows: more than one producer chunk), cold (no
carried statistics: the producer runs twice) and warm; and the modelled kernel workspace
(``budget.sparse_workspace``) equal to comfy-kitchen's own plan of it."""

import dataclasses

import pytest
import torch

from fixtures.sparse_parity import METHODS, _setup, require_kitchen_gpu
from h3_blackwell.runtime.budget import ModelMemory, Workload, sparse_held_bytes, sparse_phases, sparse_rows, \
    sparse_workspace
from h3_blackwell.runtime.ops import sparse_attention as SA
from h3_blackwell.runtime.ops.reference import ReferenceOps

pytestmark = pytest.mark.gpu


def _model(cfg, lay, settings):
    mm = ModelMemory.build(cfg, torch.bfloat16, "dense", "dense", "sage2")
    mm = dataclasses.replace(mm, sparse=True, sparse_method=settings.method, sparse_token_aug=settings.token_aug)
    grid = lay.token_grid
    wl = Workload(lay.seq_len, grid[0] * grid[1] * grid[2], 1, 0, video_grid=grid,
                  prefix_segments=sum(kind != "video" for _, _, kind in lay.segments))
    return mm, wl


def _case(method):
    """The parity block of ``method`` on the GPU -> (settings, (cfg, block, layout, cos, sin), (model memory,
    workload)); skips without CUDA and comfy-kitchen's kernel."""
    require_kitchen_gpu()
    settings, gate = METHODS[method]
    setup = _setup(gate)
    return settings, setup, _model(setup[0], setup[2], settings)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_one_sparse_call_allocates_at_most_the_modelled_bytes(method):
    settings, (cfg, blk, lay, cos, sin), (mm, wl) = _case(method)
    att = SA.SparseStepAttention(SA.SolAttention.resolve("cuda"), lambda qkv: None, cfg.num_heads, cfg.head_dim,
                                 settings)
    att.begin_run(lay.segments, lay.token_grid, 12.0)
    att.begin_step(1, 0.5)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(lay.seq_len, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
    shift, scale = (torch.randn(2, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16) * 0.1
                    for _ in range(2))
    segs = [(0, lay.seq_len // 2, 0), (lay.seq_len // 2, lay.seq_len, 1)]
    call = SA.SparseBlockCall(ReferenceOps(cfg), 0, x, shift, scale, segs, cos, sin)
    modelled = max(sparse_phases(mm, wl).values()) - x.numel() * 2 + sparse_held_bytes(mm, wl)
    peaks = []
    for _ in range(2):                                              # cold, then warm (carried statistics)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            att.block_attention(blk, call)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    print({"method": method, "measured": peaks, "modelled": modelled, "rows": sparse_rows(mm, wl)})
    assert max(peaks) <= modelled, (peaks, modelled)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_modelled_workspace_covers_comfy_kitchens_plan(method):
    from comfy_kitchen.backends.cuda import _C

    settings, (cfg, _, _, _, _), (mm, wl) = _case(method)
    n = sparse_rows(mm, wl)
    total = _C.sol_attn_plan(1, n, cfg.num_heads, token_aug=settings.token_aug)["total"]
    print({"method": method, "plan_total": total, "modelled": sparse_workspace(mm, n)})
    assert total == sparse_workspace(mm, n)  # the same carve-up (budget.sol_workspace_bytes), at its extra tokens
