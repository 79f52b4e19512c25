"""The device-memory budget (runtime.budget): the plan's decisions for the canonical job (1344x768, 124 frames,
37,810 rows, the full H3 config) on a simulated H200-class device at 8, 12, 16 and 24 GB, auto, integrated
devices, and the refusals (a budget too small, not enough host memory, a bad value) before any tensor is read."""

import pytest
import torch

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime import RuntimeOptions, load_model
from h3_blackwell.runtime.budget import (GB, SLOTS, BudgetError, Chunking, DeviceMemory, Held, ModelMemory, Workload, budget_arg,
                                         chunk_options, decide, estimate, parse_vram_budget, smallest_budget)
from h3_blackwell.runtime.model.config import FULL
from h3_blackwell.runtime.model.h3 import H3Model

CANONICAL = Workload.from_shapes((1, 24, 37, 48, 84), (1, 32, 2, 207), 100, 12)
H200 = DeviceMemory("cuda", "simulated H200", 150 * 10 ** 9, 149 * 10 ** 9)
HOST = 100 * 10 ** 9


@pytest.fixture(scope="module")
def w4a8():
    """The H200's canonical configuration: W4A8 (fp8 GEMMs), Sage2 with fused fp8 V, bf16, AdaLN on the host."""
    return ModelMemory.build(FULL, torch.bfloat16, "fp8", "fp8", "sage2", "fused", adaln_on_host=True)


def test_canonical_workload_is_37810_rows():
    assert (CANONICAL.rows, CANONICAL.video_rows, CANONICAL.steps) == (37810, 37296, 12)
    assert Workload.for_request(FULL, steps=12).rows == 37810


def test_block_and_resident_bytes_come_from_the_shapes(w4a8):
    """One block: four NVFP4 linears (packed bytes + swizzled e4m3 scales); the rest is every other tensor of
    the model at its dtype, AdaLN excluded (host)."""
    h, i, f = FULL.hidden_size, FULL.inner_dim, FULL.ffn_hidden_size
    params = h * (3 * i) + i * h + h * (2 * f) + f * h
    assert params // 2 < w4a8.block_bytes < params // 2 * 1.13  # 4-bit values + one e4m3 scale per 16
    with torch.device("meta"):
        m = H3Model(FULL, torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    linears = sum(m.blocks[0].get_submodule(n).weight.numel() * 2 for n in
                  ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")) * FULL.num_layers
    assert w4a8.adaln_host_bytes == sum(p.numel() * 2 for b in m.blocks for p in b.adaln_proj.parameters())
    assert abs(w4a8.other_bytes - (total - linears - w4a8.adaln_host_bytes)) < 1e6


@pytest.mark.parametrize("gb", [8, 12, 16, 24])
def test_canonical_decisions_on_a_simulated_device(w4a8, gb):
    p = decide(w4a8, CANONICAL, H200, gb * 10 ** 9, host_free=HOST)
    n = FULL.num_layers
    assert sorted(p.resident + p.streamed) == list(range(n)) and not set(p.resident) & set(p.streamed)
    assert p.estimate.total <= gb * 10 ** 9
    assert p.ffn_chunk_rows is None  # streaming alone fits every one of these budgets: no chunking
    if gb == 24:
        assert p.streamed == () and p.choice().choice == "all resident"
        return
    # maximal: one more resident block would not fit
    assert estimate(w4a8, CANONICAL, len(p.resident) + 1, SLOTS, None).total > gb * 10 ** 9
    assert p.copy_bytes_per_step == len(p.streamed) * w4a8.block_bytes == p.host_bytes
    gaps = [b - a for a, b in zip(p.resident, p.resident[1:])]
    assert not gaps or max(gaps) - min(gaps) <= 1  # resident blocks spread evenly
    c = p.choice()
    assert c.choice == f"{len(p.resident)} resident, {len(p.streamed)} streamed"
    assert f"budget {gb}.00 GB" in c.reason and "estimate" in c.reason and "37,810 rows" in c.reason
    rep = p.report()
    assert rep["vram_budget_bytes"] == gb * 10 ** 9 and rep["streamed_blocks"] == list(p.streamed)
    assert rep["pinned_host_bytes"] == p.host_bytes and rep["estimate"]["total_bytes"] == p.estimate.total


def test_canonical_decisions_are_ordered(w4a8):
    streamed = [len(decide(w4a8, CANONICAL, H200, gb * 10 ** 9, host_free=HOST).streamed) for gb in (8, 12, 16, 24)]
    assert streamed[0] > streamed[1] > streamed[2] > streamed[3] == 0
    assert streamed[0] >= 35  # an 8 GB budget keeps only a handful of the 50 blocks (0.22 GB each) resident
    assert 1 <= streamed[2] <= 12  # the resident job needs about 16.6 GB: 16 GB streams a few blocks


def test_resident_estimate_is_the_resident_job(w4a8):
    """All resident at the canonical size: 12.6 GB of weights (the NVFP4 blocks and the dense refiner, text
    projection, time embedder and final layer) plus about 4 GB of activations and run tensors."""
    e = estimate(w4a8, CANONICAL, FULL.num_layers, SLOTS, None)
    assert 12.4e9 < e.weights_resident < 12.8e9 and 3.5e9 < e.total - e.weights_resident < 4.6e9
    assert e.peak_phase == "fc2"  # fc1's [S, 2F] output, the SwiGLU bytes and fc2's output


def test_auto_is_free_memory_less_a_margin(w4a8):
    card = DeviceMemory("cuda", "simulated 8 GB card", 8 * 10 ** 9, int(7.6e9))
    p = decide(w4a8, CANONICAL, card, None, host_free=HOST)
    assert p.budget_text.startswith("auto: 7.60 GB free of 8.00 GB") and p.budget_bytes < 7.6e9
    assert p.estimate.total <= p.budget_bytes and p.streamed
    big = decide(w4a8, CANONICAL, H200, None, host_free=HOST)
    assert big.streamed == () and big.budget_bytes > 130e9
    # re-planning a loaded model: the bytes it already holds count as available
    held = decide(w4a8, CANONICAL, DeviceMemory("cuda", "x", 8 * 10 ** 9, int(3e9)), None, host_free=HOST,
                  held=Held(int(4.6e9)))
    assert held.streamed == p.streamed


def test_integrated_device_keeps_every_block_resident(w4a8):
    gb10 = DeviceMemory("cuda", "simulated GB10", 128 * 10 ** 9, 100 * 10 ** 9, integrated=True)
    for budget in (None, 8 * 10 ** 9):
        p = decide(w4a8, CANONICAL, gb10, budget, host_free=1)
        assert p.streamed == () and "streaming does not apply" in p.choice().reason


def test_budget_too_small_names_the_smallest_that_works(w4a8):
    least = smallest_budget(w4a8, CANONICAL)
    assert 3e9 < least < 8e9  # 3.45 GB: every block streamed, the refiner in host memory, rows in chunks of 2,048
    with pytest.raises(BudgetError) as e:
        decide(w4a8, CANONICAL, H200, int(3e9), host_free=HOST)
    msg = str(e.value)
    assert "too small" in msg and f"at least {least / 1e9:.2f} GB" in msg and budget_arg(least) in msg
    p = decide(w4a8, CANONICAL, H200, least, host_free=HOST)  # the smallest is accepted ...
    assert p.resident == () and p.estimate.total == least
    with pytest.raises(BudgetError):  # ... one byte less is not
        decide(w4a8, CANONICAL, H200, least - 1, host_free=HOST)
    assert float(budget_arg(least)) * GB >= least


def test_chunking_only_when_streaming_alone_does_not_fit(w4a8):
    unchunked = estimate(w4a8, CANONICAL, 0, SLOTS, None).total
    least = smallest_budget(w4a8, CANONICAL)
    assert least < unchunked  # W4A8 is row-local: chunking the FFN lowers the floor
    p = decide(w4a8, CANONICAL, H200, (least + unchunked) // 2, host_free=HOST)
    assert p.resident == () and p.ffn_chunk_rows in chunk_options(CANONICAL.rows)
    assert p.ffn_chunk_rows % 128 == 0 and p.estimate.total <= (least + unchunked) // 2
    assert all(c >= 2048 for c in chunk_options(CANONICAL.rows))
    w4a4 = ModelMemory.build(FULL, torch.bfloat16, "nvfp4", "native", "sage2", "fused")
    assert not w4a4.ffn_row_local and smallest_budget(w4a4, CANONICAL) == estimate(w4a4, CANONICAL, 0, SLOTS,
                                                                                   None).total


def test_host_memory_is_checked_before_pinning(w4a8):
    p = decide(w4a8, CANONICAL, H200, 8 * 10 ** 9, host_free=HOST)
    with pytest.raises(BudgetError) as e:
        decide(w4a8, CANONICAL, H200, 8 * 10 ** 9, host_free=int(30e9))
    need = p.host_bytes / 1e9
    free = (30e9 - w4a8.adaln_host_bytes) / 1e9  # the AdaLN weights are loaded into host memory too
    assert f"needs {need:.1f} GB of host memory for the streamed weights ({len(p.streamed)} blocks), {free:.1f} GB " \
           f"free after the {w4a8.adaln_host_bytes / 1e9:.2f} GB of AdaLN weights" in str(e.value)
    decide(w4a8, CANONICAL, H200, 16 * 10 ** 9, host_free=int(30e9))  # fewer blocks stream: they fit


@pytest.mark.parametrize("value, want", [("auto", None), ("AUTO", None), (None, None), ("8", 8 * 10 ** 9),
                                         ("7.5", int(7.5e9)), ("12GB", 12 * 10 ** 9), (" 6 gb ", 6 * 10 ** 9),
                                         (16, 16 * 10 ** 9)])
def test_parse_budget(value, want):
    """One parser (options.vram_budget_bytes): the option's check and the budget read the same values the same."""
    from h3_blackwell.runtime.options import vram_budget_bytes

    assert parse_vram_budget(value) == want == vram_budget_bytes(value)
    assert RuntimeOptions(vram_budget="auto" if value is None else value).vram_budget is not None
    assert parse_vram_budget(repr(7_817_936 / 1e9)) == 7_817_936  # a byte count printed in GB reads back whole


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan", "inf", "", "8 TB", "1e999"])
def test_bad_budget_values_are_refused(bad):
    with pytest.raises(BudgetError, match="expected auto or a positive number of GB"):
        parse_vram_budget(bad)
    with pytest.raises(ValueError, match="vram_budget"):
        RuntimeOptions(vram_budget=bad)


class _NoTensors:
    """The tiny model's header without its tensors: any read fails the test."""

    def __init__(self):
        from h3_blackwell.runtime.model.config import TINY

        with torch.device("meta"):
            self._meta = H3Model(TINY, torch.float32).state_dict()
        self.config, self.name = TINY, "tiny header only"

    def keys(self):
        return list(self._meta)

    def shape(self, k):
        return tuple(self._meta[k].shape)

    def quant_format(self, layer):
        return None

    def tensor(self, k, device="cpu"):
        raise AssertionError(f"tensor {k} was read before the budget was checked")


def test_load_refuses_a_small_budget_before_reading_any_tensor(monkeypatch):
    with pytest.raises(BudgetError, match="too small"):
        load_model(_NoTensors(), RuntimeOptions(device="cpu", vram_budget="0.000001"))
    from h3_blackwell.runtime import budget as B

    monkeypatch.setattr(B, "host_available_bytes", lambda: 1000)
    wl = Workload.from_shapes((1, 24, 7, 16, 16), (1, 32, 2, 37), 32, 2)
    rt_plan = load_model(None, RuntimeOptions(device="cpu"), workload=wl).plan
    least = smallest_budget(ModelMemory.from_plan(rt_plan), wl, "cpu")
    with pytest.raises(BudgetError, match="of host memory for the streamed weights"):
        load_model(_NoTensors(), RuntimeOptions(device="cpu", vram_budget=repr(least / 1e9)), workload=wl)


def test_cli_refusals_are_one_error_line(tmp_path, capsys):
    assert cli.main(["generate", "--output", str(tmp_path / "a"), "--vram-budget", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "vram_budget" in err[0]
    assert cli.main(["generate", "--output", str(tmp_path / "b"), "--vram-budget", "0.000001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "too small" in err[0] and "set --vram-budget" in err[0]
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------------
# a Fun ControlNet tower in the estimate
# ---------------------------------------------------------------------------------------------

def _v2_tower():
    from h3_blackwell.runtime.budget import TowerSize
    from h3_blackwell.runtime.model.control import block_config

    c = FULL
    return TowerSize(block_config(c.hidden_size, c.num_heads, c.head_dim, c.ffn_hidden_size, c.time_embed_dim,
                                  c.curve_form), 10)


def test_control_tower_is_in_the_estimate(w4a8):
    """A v2 tower (10 full-size control blocks, W4A8 like the base, full-form AdaLN on the host) adds its weights
    (four NVFP4 linears a block, the dense projections and norms at their dtypes) and what it holds through an
    evaluation (c, the skip, the control rows' embedding, its modulation rows) to every estimate."""
    from dataclasses import replace

    from h3_blackwell.runtime.budget import tower_bytes
    from h3_blackwell.runtime.model.control import FunControl

    wl = replace(CANONICAL, tower=_v2_tower())
    weights, held = tower_bytes(w4a8, wl)
    with torch.device("meta"):
        t = FunControl(wl.tower.cfg, tuple(range(10)), torch.bfloat16)
    linear_params = sum(b.get_submodule(n).weight.numel() for b in t.control_blocks
                        for n in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"))
    dense = sum(p.numel() * p.element_size() for n, p in t.named_parameters()
                if ".adaln_proj." not in n and not any(x in n for x in ("qkv_proj.w", "out_proj.w", "fc1.w", "fc2.w")))
    assert linear_params // 2 + dense < weights < linear_params // 2 * 1.13 + dense
    h = FULL.hidden_size
    assert held >= 2 * CANONICAL.rows * h * 2 + CANONICAL.video_rows * h * 2
    for resident, chunk in ((50, None), (20, None), (0, 4096)):
        plain, with_tower = (estimate(w4a8, w, resident, SLOTS, chunk) for w in (CANONICAL, wl))
        assert with_tower.total == plain.total + weights + held
        assert "control tower" in with_tower.describe() and "control tower" not in plain.describe()
    assert tower_bytes(w4a8, CANONICAL) == (0, 0)


def test_blocks_stream_to_make_room_for_the_tower(w4a8):
    """Past "everything resident", the tower's blocks stream first (two device buffers of their own), then the
    base's as without a tower; the smallest budget streams both and names the tower."""
    from dataclasses import replace

    from h3_blackwell.runtime.budget import tower_bytes

    wl = replace(CANONICAL, tower=_v2_tower())
    resident = estimate(w4a8, wl, FULL.num_layers, SLOTS, None)
    assert decide(w4a8, wl, H200, resident.total, host_free=HOST).tower_streams is False
    fits = decide(w4a8, wl, H200, resident.total - 1, host_free=HOST)
    assert fits.tower_streams and fits.streamed == () and "control tower streamed" in fits.choice().choice
    saved = tower_bytes(w4a8, wl)[0] - tower_bytes(w4a8, wl, True)[0]
    assert saved == 8 * w4a8.block_bytes  # 10 blocks' linears (the base's block dims) -> 2 buffers of one each
    plain, with_tower = (decide(w4a8, w, H200, 14 * 10 ** 9, host_free=HOST) for w in (CANONICAL, wl))
    assert with_tower.estimate.total <= 14 * 10 ** 9 and len(with_tower.streamed) > len(plain.streamed)
    assert with_tower.tower_streams and "control tower of 10 blocks" in with_tower.choice().reason
    assert "the control tower's 10 blocks stream" in with_tower.choice().reason
    assert with_tower.report()["control_tower_streams"] is True
    with pytest.raises(BudgetError, match=r"control tower of 10 blocks.*control tower weights") as e:
        decide(w4a8, wl, H200, 5 * 10 ** 9, host_free=HOST)
    least = smallest_budget(w4a8, wl)
    assert budget_arg(least) in str(e.value) and least > smallest_budget(w4a8, CANONICAL)
    smallest_chunk = chunk_options(wl.rows)[-1]  # the FFN and the attention half in chunks of these rows,
    # K and V held as Sage2's operands (Sage2 on its sm_90 stages)
    assert least == estimate(w4a8, wl, 0, SLOTS, Chunking(smallest_chunk, smallest_chunk, "sage"), "cuda", True).total
    # the streamed tower's pinned host bytes are checked with the blocks' before anything loads
    assert fits.tower_host_bytes == 10 * w4a8.block_bytes and fits.report()["control_tower_host_bytes"] > 0
    with pytest.raises(BudgetError, match="the control tower's 10 blocks"):
        decide(w4a8, wl, H200, resident.total - 1, host_free=fits.tower_host_bytes - 1)


def test_tower_estimate_matches_a_loaded_tower(tmp_path):
    """The weight bytes the estimate gives a tower equal those of the tower ``load_control`` builds on the tiny
    model, dense and quantized (up to each NVFP4 tensor's alignment in the estimate)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures.tiny_control import save_tiny_control

    from h3_blackwell.runtime import load_control
    from h3_blackwell.runtime.budget import TowerSize, tower_bytes
    from h3_blackwell.runtime.ops.host_buffers import ALIGN
    from h3_blackwell.runtime.model.config import TINY

    f = save_tiny_control(tmp_path / "tower.safetensors", TINY, (0, 1, 2), seed=3)
    for quantize in (False, True):
        rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32", quantize=quantize))
        tower = load_control(f, rt.plan, rt.config)
        mm = ModelMemory.from_plan(rt.plan)
        wl = Workload.from_shapes((1, 24, 7, 16, 16), (1, 32, 2, 37), 32, 2, tower=TowerSize.of(tower))
        est = tower_bytes(mm, wl)[0]
        host = rt.plan.adaln_on_host and not tower.curve_form
        real = sum(t.numel() * t.element_size() for n, t in list(tower.named_parameters()) +
                   list(tower.named_buffers()) if not (host and ".adaln_proj." in n))
        slack = 3 * 4 * (2 * ALIGN + 64) if quantize else 0
        assert real <= est <= real + slack, (quantize, real, est)
