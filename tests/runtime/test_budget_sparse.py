"""The memory model of a sparse run (runtime.budget.sparse_phases / sparse_rows / sparse_held_bytes): at the full
H3 shapes on the plan numbers (no model allocated), VSA's tiles and its to_gate_compress buffer are counted and no
sparse call holds the whole qkv buffer; on the tiny model on the CPU, the modelled bytes bound what one sparse block
call really allocates (fixtures.live_bytes), for every method."""

import dataclasses

import pytest
import torch

from fixtures.live_bytes import LiveBytes
from h3_blackwell.runtime.budget import (ModelMemory, sol_workspace_bytes, sparse_workspace, Workload, activation_phases, estimate, sparse_held_bytes,
                                         sparse_phases, sparse_rows)
from h3_blackwell.runtime.model.block import DiTBlock
from h3_blackwell.runtime.model.config import FULL, TINY
from h3_blackwell.runtime.model.layout import build_layout
from h3_blackwell.runtime.ops import sparse_attention as SA
from h3_blackwell.runtime.ops import sparse_methods as SM
from h3_blackwell.runtime.ops.reference import ReferenceOps
from h3_blackwell.runtime.options import RuntimeOptions, SparseSettings
from h3_blackwell.runtime.plan import memory_choices

CANONICAL = Workload.from_shapes((1, 24, 37, 48, 84), (1, 32, 2, 207), 100, 12)
CANONICAL_LAYOUT = dict(text_len=100, latent_t=37, lat_h=48, lat_w=84, audio_t=207)


def _mm(cfg, method: str, dtype=torch.bfloat16, form="fp8"):
    mm = ModelMemory.build(cfg, dtype, form, "fp8" if form != "dense" else "dense",
                           "sage2" if dtype == torch.bfloat16 else "reference")
    return dataclasses.replace(mm, sparse=bool(method), sparse_method=method)


def test_vsa_tiles_and_gate_buffer_at_the_canonical_size():
    lay = build_layout(**CANONICAL_LAYOUT)
    assert lay.seq_len == CANONICAL.rows == 37810
    plan = SM.vsa_plan(lay.segments, (37, 24, 42), "cpu")          # core's tiling of the real layout (index tensors)
    gate_cfg = dataclasses.replace(FULL, gate_compress=True)
    vsa, vsa_no_gate = _mm(gate_cfg, "vsa"), _mm(FULL, "vsa")
    n = sparse_rows(vsa, CANONICAL)
    assert plan.n <= n < plan.n + 64 * CANONICAL.prefix_segments  # every real tile counted, padding at most 63/segment
    gate = sparse_phases(vsa, CANONICAL)["sparse_kernel"] - sparse_phases(vsa_no_gate, CANONICAL)["sparse_kernel"]
    real_gate = plan.n * FULL.inner_dim * 2                         # to_gate_compress of every padded row, bf16
    assert real_gate > 0.6e9 and real_gate <= gate < real_gate * 1.01
    # the chunked producer never holds the whole bf16 qkv buffer: beside the residual and the kernel's int8
    # workspace it holds one chunk's work, under a quarter of that buffer
    x, qkv = CANONICAL.rows * FULL.hidden_size * 2, CANONICAL.rows * 3 * FULL.inner_dim * 2
    for method in ("sol-attn", "sla"):
        mm = dataclasses.replace(_mm(FULL, method), sparse_token_aug=SparseSettings(method).token_aug)
        ws = sparse_workspace(mm, CANONICAL.rows)
        assert 0 < sparse_phases(mm, CANONICAL)["sparse_produce"] - x - ws < qkv / 4, method


def test_the_estimate_counts_the_sparse_run_beside_its_dense_steps():
    """The dense phases stay (the steps before start_percent, dense_blocks run them); the sparse phases join them
    and the run keeps the call-order rotary tables and the carried statistics."""
    gate_cfg = dataclasses.replace(FULL, gate_compress=True)
    dense, vsa = _mm(gate_cfg, ""), _mm(gate_cfg, "vsa")
    phases = activation_phases(vsa, CANONICAL)
    assert {"qkv", "attention", "sparse_produce", "sparse_kernel", "sparse_gather"} <= set(phases)
    e_dense, e_vsa = (estimate(m, CANONICAL, FULL.num_layers, 0, None) for m in (dense, vsa))
    assert e_vsa.total - e_dense.total >= sparse_held_bytes(vsa, CANONICAL) > 0
    n, r = SM.vsa_plan(build_layout(**CANONICAL_LAYOUT).segments, (37, 24, 42), "cpu").n, FULL.rope_dim
    with torch.device("meta"):                                      # the real tables' shapes, nothing allocated
        cos = torch.empty(n, r)
        freqs = SM.rope_freqs(cos, cos)
    tables = 2 * freqs.numel() * 4 + 2 * cos.numel() * 4             # freqs, the kernel's packed copy, padded cos/sin
    assert sparse_held_bytes(vsa, CANONICAL) >= tables + FULL.num_layers * 2 * FULL.inner_dim * 4


def test_the_request_check_sees_the_loads_method():
    opts = RuntimeOptions(attention="sparse", sparse_method="vsa")
    choices = memory_choices(opts, FULL, torch.device("cuda"))
    mm = ModelMemory.for_options(dataclasses.replace(FULL, gate_compress=True), choices, torch.bfloat16)
    assert mm.sparse and mm.sparse_method == "vsa"
    assert memory_choices(RuntimeOptions(), FULL, torch.device("cuda"))["sparse_method"] == ""


def test_live_bytes_counts_storages_once_while_alive():
    with LiveBytes() as m:
        a = torch.empty(1000)
        v = a[10:]                                                   # a view: the same storage
        del a
        b = torch.empty(500)
        del v, b
    assert m.peak == 6000 and m.live == 0


LAY = dict(text_len=70, latent_t=5, lat_h=12, lat_w=6, audio_t=20)   # 70 text + 40 audio + 90 video rows
# measured/modelled on this layout: 0.79 (sol-attn, sla), 0.71 (vsa); below 0.5 the model would be too loose to
# mean anything (it counts a chunk of scores and every fp32 copy the reference makes)
LOOSEST = 0.5


@pytest.mark.parametrize("method,gate", [("sol-attn", False), ("sla", False), ("vsa", True), ("vsa", False)])
def test_modelled_bytes_bound_one_cpu_sparse_call(method, gate):
    """One tiny block's sparse call on the CPU (the eager reference path): the new storages alive at its peak
    (weights and inputs excluded) are at most the modelled phase (less the residual x, which exists before) plus
    the tables the run keeps (built by this first call)."""
    cfg = dataclasses.replace(TINY, gate_compress=gate)
    torch.manual_seed(0)
    blk = DiTBlock(cfg, torch.float32, torch.float32)
    for p in blk.parameters():
        p.data.normal_(0, 0.3)
    lay = build_layout(**LAY)
    s = lay.seq_len
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, cfg.hidden_size, generator=g)
    shift, scale = (torch.randn(3, cfg.hidden_size, generator=g) * 0.1 for _ in range(2))
    ang = torch.randn(s, cfg.rope_dim // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    att = SA.SparseStepAttention(None, None, cfg.num_heads, cfg.head_dim,
                                 SparseSettings(method, keep_percent=30, min_tokens=0))
    att.begin_run(lay.segments, lay.token_grid, 12.0)
    att.begin_step(1, 0.5)
    call = SA.SparseBlockCall(ReferenceOps(cfg), 0, x, shift, scale, [(0, s // 2, 0), (s // 2, s, 1)], cos, sin)
    with torch.no_grad(), LiveBytes(exclude=[x, shift, scale, cos, sin, *blk.parameters()]) as m:
        att.block_attention(blk, call)  # the output dropped at once, as the block drops it after out_proj
    mm = _mm(cfg, method, torch.float32, "dense")
    wl = Workload(s, 90, 1, 0, video_grid=(5, 6, 3), prefix_segments=2)
    modelled = sparse_phases(mm, wl, "cpu")["sparse_reference"] - x.numel() * 4 + sparse_held_bytes(mm, wl)
    assert LOOSEST * modelled <= m.peak <= modelled, (m.peak, modelled)


def test_a_runs_own_method_is_what_fit_memory_counts():
    """A sampler (or core's node) may run another method than the load's: fit_memory counts the run's (the tiny
    model on the CPU under an explicit budget, sol-attn loaded, a VSA run: its padded tiles make the estimate grow)."""
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from h3_blackwell.runtime.model.layout import latent_shapes

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="sparse",
                                         vram_budget="2"), tiny_seed=0)
    v, a = latent_shapes(256, 192, 39)
    totals = []
    for s in (None, SparseSettings("vsa")):
        rt.fit_memory(v, a, 9, 4, sparse=s)
        totals.append(rt.plan.memory.estimate)
    assert totals[0].peak_phase == totals[1].peak_phase == "sparse_reference"
    assert totals[1].activations > totals[0].activations


def test_the_sol_workspace_is_comfy_kitchens_carve_up():
    """budget.sol_workspace_bytes against comfy-kitchen 0.2.40's own ``_C.sol_attn_plan(...)["total"]`` (an
    integer layout, the same on every machine), recorded on an H100 on 2026-12-06: 4 heads, 5,862 rows (the GPU
    memory test's VSA block), no extra tokens. The shape terms: the int8 operands grow with the rows, the
    routed-block table with their square, and extra tokens add v by row and the token routing's slots."""
    assert sol_workspace_bytes(4, 5862, 0) == 10_260_384
    n, h = 45_000, 48
    base, aug = sol_workspace_bytes(h, n, 0), sol_workspace_bytes(h, n, 256)
    assert base > 3 * n * h * 128 and aug - base > n * h * 128            # v by row (int8) at least
    blocks = -(-n // 64)
    assert sol_workspace_bytes(h, 2 * n, 0) - 2 * base > 1.9 * h * blocks * blocks * 2  # the T x T uint16 table
    assert sol_workspace_bytes(h, n, 64) < aug
