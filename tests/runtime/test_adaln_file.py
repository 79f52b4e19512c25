"""Full-form AdaLN weights left in the checkpoint file when the host memory cannot keep them (issue 37): the plan's
host figure, the load that leaves them there, the runs that read them block by block (the same latents as AdaLN kept
in host memory, LoRA merges included), and the plan numbers of a 32 GB machine with an 8 GB card at H3's shapes."""

import pytest
import torch

from h3_blackwell.runtime import RuntimeOptions, load_model, save_tiny
from h3_blackwell.runtime.budget import (BudgetError, DeviceMemory, MemoryAsk, ModelMemory, Workload, adaln_on_device,
                                         decide, smallest_budget)
from h3_blackwell.runtime.lora.apply import apply_loras
from h3_blackwell.runtime.model.config import FULL
from h3_blackwell.runtime.model.layout import latent_shapes
from fixtures.reports import report_hashes
from fixtures.sampling import sample
from tests.fixtures.tiny_lora import tiny_checkpoint_and_lora

VS, AS = latent_shapes(128, 96, 22)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_checkpoint_and_lora(tmp_path_factory.mktemp("adaln_file"), seed=3)


def _load(ck, host_budget):
    return load_model(ck, RuntimeOptions(device="cpu", host_budget=host_budget),
                      workload=Workload.from_shapes(VS, AS, 32, 2))


def _run(rt):
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(1))
    return report_hashes(sample(rt, text, None, torch.zeros(VS), torch.zeros(AS), seed=2, steps=2))


def test_adaln_read_from_the_file_gives_the_host_memory_latents(files):
    ck, lora = files
    kept, left = _load(ck, "1000"), _load(ck, "0.001")  # 1 TB of host memory, then 1 MB
    assert kept.plan.choices["adaln"].choice == "rows per run" and not kept.plan.memory.adaln_from_file
    assert left.plan.adaln_from_file and left.plan.memory.report()["adaln_from_file"]
    assert "read from the checkpoint file" in left.plan.choices["memory"].reason
    assert all(b.adaln_proj.linear.weight.is_meta for b in left.model.blocks)  # nothing of it in host memory
    for rt in (kept, left):
        rt.hashes = [_run(rt)]
        apply_loras(rt, [(str(lora), 0.8, "merge")])
        rt.hashes.append(_run(rt))
        apply_loras(rt, [])
        rt.hashes.append(_run(rt))
    assert kept.hashes == left.hashes
    assert kept.hashes[0] != kept.hashes[1] and kept.hashes[0] == kept.hashes[2]  # the merge changed the AdaLN rows
    assert left.model.adaln_source.reads >= 3 * 2 * left.config.num_layers  # read again on every run
    assert not left.model.adaln_merges  # removal forgot the merges; the file was never written


H100 = DeviceMemory("cuda", "NVIDIA H100 80GB HBM3", 80 * 10 ** 9, 79 * 10 ** 9)


def _clip10s():
    vs, as_ = latent_shapes(1344, 768, 243, FULL.video_channels, FULL.audio_channels)
    return Workload.from_shapes(vs, as_, 100, 8)


def test_a_32gb_machine_with_an_8gb_card_at_full_shapes():
    """At the 8 GB cap every block streams (10.8 GB pinned) and the 26 GB of AdaLN do not fit beside them in 32 GB:
    they stay in the file, and the plan's host figure is the streamed blocks alone. A 128 GB machine keeps them."""
    mm = ModelMemory.build(FULL, torch.bfloat16, "fp8", "fp8", "sage2", "fused", True)
    from dataclasses import replace

    mm = replace(mm, adaln_file=True, adaln_block_bytes=mm.adaln_host_bytes // FULL.num_layers)
    assert mm.adaln_host_bytes > 25e9
    small = decide(mm, _clip10s(), H100, int(7.5e9), host_free=32 * 10 ** 9)
    assert small.adaln_from_file and small.host_bytes_planned == small.host_bytes < 12e9
    assert "AdaLN read from the checkpoint file" in small.choice().reason
    big = decide(mm, _clip10s(), H100, int(7.5e9), host_free=128 * 10 ** 9)
    assert not big.adaln_from_file and big.host_bytes_planned > 35e9
    with pytest.raises(BudgetError, match="2 blocks' AdaLN weights read from the checkpoint file"):
        decide(mm, _clip10s(), H100, int(7.5e9), host_free=8 * 10 ** 9)  # the streamed blocks alone need 10.8 GB
    no_file = replace(mm, adaln_file=False)  # an in-memory source cannot leave AdaLN anywhere
    with pytest.raises(BudgetError, match="AdaLN weights kept there"):
        decide(no_file, _clip10s(), H100, int(7.5e9), host_free=32 * 10 ** 9)


def test_a_32gb_machine_with_a_16gb_card_reads_adaln_from_the_file():
    """At the 16 GB cap (budget 15.5) two blocks stream: the 26 GB of AdaLN and 0.43 GB of streamed blocks are under
    the 28 GB a 32 GB machine leaves, but not with the process's own memory beside them (the H100 run pinned them
    and peaked at 32.7 GB of host RSS). They stay in the file, and the reason says why; 64 GB keeps them, and without
    a file to read them from they stay in host memory as before."""
    from dataclasses import replace

    from h3_blackwell.runtime.budget import HOST_PROCESS_BYTES

    mm = ModelMemory.build(FULL, torch.bfloat16, "fp8", "fp8", "sage2", "fused", True)
    mm = replace(mm, adaln_file=True, adaln_block_bytes=mm.adaln_host_bytes // FULL.num_layers)
    vs, as_ = latent_shapes(1344, 768, 124, FULL.video_channels, FULL.audio_channels)
    turbo8 = Workload.from_shapes(vs, as_, 100, 8)
    p = decide(mm, turbo8, H100, int(15.5e9), host_free=28 * 10 ** 9)
    assert p.streamed and p.host_bytes + mm.adaln_host_bytes < 28e9  # the old check alone would have kept them
    assert p.adaln_from_file and p.host_bytes_planned + HOST_PROCESS_BYTES <= 28e9
    assert not decide(mm, turbo8, H100, int(15.5e9), host_free=64 * 10 ** 9).adaln_from_file
    kept = decide(replace(mm, adaln_file=False), turbo8, H100, int(15.5e9), host_free=28 * 10 ** 9)
    assert not kept.adaln_from_file and kept.adaln_host_bytes == mm.adaln_host_bytes


def test_the_token_refiner_waits_in_host_memory_while_blocks_stream(files):
    """Blocks stream: the refiner's weights move to host memory (a copy on the CPU) and come to the device for each
    run's refine (functional_call over the same modules): the same latents, LoRA side paths on it included; a budget
    where everything fits brings it back."""
    from h3_blackwell.runtime.budget import smallest_budget

    ck, lora = files
    resident = _load(ck, "auto")
    apply_loras(resident, [(str(lora), 0.8, "side")])
    want = _run(resident)
    streamed = _load(ck, "auto")
    from h3_blackwell.runtime.lora.merge import side_device_bytes

    least = smallest_budget(ModelMemory.from_plan(streamed.plan), Workload.from_shapes(VS, AS, 32, 2), "cpu")
    before = streamed.model.token_refiner.blocks[0].attn.qkv_proj.weight
    apply_loras(streamed, [(str(lora), 0.8, "side")])
    streamed.plan.options.vram_budget = repr((least + side_device_bytes(streamed.model, "cpu")) / 1e9)
    got = _run(streamed)
    assert streamed.plan.memory.streamed and streamed.model.refiner_on_host
    assert streamed.model.token_refiner.blocks[0].attn.qkv_proj.weight is not before  # moved: a copy
    assert got[1] == want[1] and got[0] == want[0]
    streamed.plan.options.vram_budget = "auto"
    assert _run(streamed) == want and not streamed.model.refiner_on_host


def test_every_memory_path_at_once_gives_the_resident_latents(tmp_path):
    """W4A8 at its smallest budget with a host budget that leaves AdaLN in the file: every block streamed, the
    refiner in host memory, the FFN and the attention half in row chunks, AdaLN read per run: the resident bytes
    (the CPU's reference attention and per-row activations are row-exact)."""
    from h3_blackwell.runtime.budget import smallest_budget
    from h3_blackwell.runtime.model.config import H3Config

    cfg = H3Config(hidden_size=256, num_layers=4, num_refiner_layers=1, num_heads=2, head_dim=128,
                   ffn_hidden_size=512, time_embed_hidden_size=256, time_embed_dim=128)
    vs, as_ = latent_shapes(256, 192, 22)
    wl = Workload.from_shapes(vs, as_, 16, 2)
    ck = save_tiny(tmp_path / "mid.safetensors", cfg, 11)
    w4a8 = dict(device="cpu", gemm="fp8", act_format="fp8")

    def run(rt):
        text = torch.randn(1, 16, cfg.text_dim, generator=torch.Generator().manual_seed(5))
        return sample(rt, text, None, torch.zeros(vs), torch.zeros(as_), seed=3, steps=2)

    want = report_hashes(run(load_model(ck, RuntimeOptions(**w4a8), workload=wl)))
    adaln = 6 * 3 * cfg.hidden_size * cfg.time_embed_dim * 4 * cfg.num_layers  # fp32 on the CPU
    rt = load_model(ck, RuntimeOptions(**w4a8, host_budget=repr(adaln * 0.6 / 1e9)), workload=wl)
    assert rt.plan.adaln_from_file
    rt.plan.options.vram_budget = repr(smallest_budget(ModelMemory.from_plan(rt.plan), wl, "cpu") / 1e9)
    got = run(rt)
    mem = got.report["memory"]
    assert mem["streamed_blocks"] == [0, 1, 2, 3] and mem["attn_chunk_rows"] and mem["ffn_chunk_rows"]
    assert mem["adaln_from_file"] and mem["refiner_on_host"] and rt.model.refiner_on_host
    assert report_hashes(got) == want


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32], ids=["read_into_host", "cast_into_host"])
def test_adaln_kept_in_host_memory_equals_the_file(tmp_path, stored, monkeypatch):
    """AdaLN kept in host memory: read straight into its host tensor where the file stores the model's dtype
    (bf16), read and cast where it does not (fp32 file, bf16 model): the values are the file's (cast once)."""
    from safetensors import safe_open

    from h3_blackwell.runtime.io.checkpoint import Checkpoint, open_checkpoint

    ck = save_tiny(tmp_path / "t.safetensors", seed=5, dtype=stored)
    reads, real = [], Checkpoint.read_into
    monkeypatch.setattr(Checkpoint, "read_into",
                        lambda self, k, out, threads=1: reads.append(real(self, k, out, threads)) or reads[-1])
    rt = load_model(ck, RuntimeOptions(device="cpu", dtype="bfloat16", host_budget="1000"),
                    workload=Workload.from_shapes(VS, AS, 32, 2))
    assert rt.plan.choices["adaln"].choice == "rows per run"
    keys = [k for k in rt.model.state_dict() if ".adaln_proj." in k and k.startswith("blocks.")]
    assert keys and len(reads) == len(keys) and all(reads) is (stored == torch.bfloat16), reads
    with safe_open(str(ck), "pt") as f:
        for k in keys:
            got = rt.model.get_parameter(k) if k.endswith("weight") or k.endswith("bias") else None
            want = f.get_tensor(k).to(got.dtype)
            assert got.device.type == "cpu" and torch.equal(got, want), k
    c = open_checkpoint(ck)
    w = keys[0]
    into = torch.empty(c.shape(w), dtype=torch.bfloat16)
    assert c.read_into(w, into) is (stored == torch.bfloat16)  # a cast is the caller's, never a read
    assert not c.read_into(w, torch.empty(c.shape(w), dtype=torch.bfloat16).t())  # not contiguous
    assert not c.read_into("no.such.tensor", into)


def test_the_read_ahead_gives_the_files_bytes_and_names_a_bad_block(tmp_path):
    """Block j + 1 is read in a worker thread while block j is used: reading the blocks in order gives the file's
    tensors; a NaN in a block read ahead is raised by the read of that block, naming its tensor."""
    from safetensors.torch import load_file, save_file

    from h3_blackwell.runtime.errors import CheckpointError

    ck = save_tiny(tmp_path / "t.safetensors", seed=9)
    rt = _load(ck, "0.001")
    src = rt.model.adaln_source
    want = load_file(str(ck))
    for j in range(rt.config.num_layers):
        w, b = src.read(j, "cpu")
        assert set(src._ahead) == ({j + 1} if j + 1 < rt.config.num_layers else set())
        assert torch.equal(w, want[f"blocks.{j}.adaln_proj.linear.weight"].to(w.dtype))
        assert torch.equal(b, want[f"blocks.{j}.adaln_proj.linear.bias"].to(b.dtype))
    bad = dict(want)
    bad["blocks.1.adaln_proj.linear.weight"] = bad["blocks.1.adaln_proj.linear.weight"].clone()
    bad["blocks.1.adaln_proj.linear.weight"][3, 2] = float("nan")
    save_file(bad, str(tmp_path / "bad.safetensors"), metadata={"format": "pt"})
    rt = _load(tmp_path / "bad.safetensors", "0.001")
    rt.model.adaln_source.read(0, "cpu")  # block 1 is being read now
    with pytest.raises(CheckpointError, match="blocks.1.adaln_proj.linear.weight"):
        rt.model.adaln_source.read(1, "cpu")


def test_reads_out_of_order_reuse_two_buffers_and_never_hand_one_out(tmp_path):
    """The host buffers are reused (BLOCKS_IN_FLIGHT of them, whatever the order of the reads): a read out of order
    waits out the read-ahead it makes stale; every read gives the file's bytes, and a tensor returned earlier keeps
    them while later blocks are read into the buffers."""
    from safetensors.torch import load_file

    from h3_blackwell.runtime.io.adaln_file import BLOCKS_IN_FLIGHT

    ck = save_tiny(tmp_path / "t.safetensors", seed=4)
    src = _load(ck, "0.001").model.adaln_source
    want = load_file(str(ck))
    n = len(src.dtypes)
    order = [0, 2, 1, 1, n - 1, 0, 1, 2] + list(range(n))
    got = [(j, *src.read(j, "cpu")) for j in order]
    assert len(src._slots) == BLOCKS_IN_FLIGHT
    buffers = {s.data_ptr() for s in src._slots}
    for j, w, b in got:  # checked after all the reads: none of them changed an earlier result
        assert torch.equal(w, want[f"blocks.{j}.adaln_proj.linear.weight"].to(w.dtype)), j
        assert torch.equal(b, want[f"blocks.{j}.adaln_proj.linear.bias"].to(b.dtype)), j
        assert not any(s <= w.data_ptr() < s + src._slots[0].numel() for s in buffers)


def test_the_plan_keeps_adaln_on_a_card_that_holds_it_beside_every_block():
    """turbo8 at H3's shapes on an 80 GB card: every block fits with the 26 GB of AdaLN beside it, so the plan keeps
    them on the device (no pinned copy at the load, none per run); under a 30 GB budget the blocks fit but not the
    AdaLN beside them, and where anything streams, or off CUDA, the plan keeps them off the device."""
    mm = ModelMemory.build(FULL, torch.bfloat16, "fp8", "fp8", "sage2", "fused", True)
    vs, as_ = latent_shapes(1344, 768, 124, FULL.video_channels, FULL.audio_channels)
    turbo8 = Workload.from_shapes(vs, as_, 100, 8)
    host = decide(mm, turbo8, H100, None, host_free=128 * 10 ** 9)
    assert not host.streamed and host.adaln_host_bytes == mm.adaln_host_bytes > 25e9
    on = adaln_on_device(mm, turbo8, H100, None, 128 * 10 ** 9, host)
    assert on is not None and not on.streamed and on.ffn_chunk_rows is None and on.adaln_host_bytes == 0
    assert on.estimate.weights_resident == host.estimate.weights_resident + mm.adaln_host_bytes
    assert on.estimate.total <= on.budget_bytes
    assert decide(mm, turbo8, H100, int(30e9), host_free=128 * 10 ** 9).streamed == ()  # the blocks alone fit 30 GB
    assert adaln_on_device(mm, turbo8, H100, int(30e9), 128 * 10 ** 9) is None
    assert adaln_on_device(mm, _clip10s(), H100, int(7.5e9), 128 * 10 ** 9) is None
    cpu = DeviceMemory("cpu", "cpu", 500 * 10 ** 9, 500 * 10 ** 9)
    assert adaln_on_device(mm, turbo8, cpu, None, 128 * 10 ** 9) is None
    from dataclasses import replace

    assert adaln_on_device(replace(mm, adaln_on_host=False), turbo8, H100, None, 128 * 10 ** 9) is None


def test_adaln_the_plan_keeps_on_the_device_moves_to_host_memory_for_a_run_without_room(files):
    """The CPU standing in for a CUDA card (a simulated device memory): with room, the load keeps the AdaLN weights on
    the device and a run with room keeps them there; a run without room moves them to host memory first (the
    choice says so), and the latents stay those of AdaLN kept in host memory from the start, LoRA merges included;
    the request check counts them where that run would put them."""
    ck, lora = files
    roomy = DeviceMemory("cuda", "simulated card", 80 * 10 ** 9, 79 * 10 ** 9)
    rt = load_model(ck, RuntimeOptions(device="cpu", host_budget="1000"), workload=Workload.from_shapes(VS, AS, 32, 2),
                    device_memory=roomy)
    assert rt.plan.choices["adaln"].choice == "on the device" and not rt.plan.adaln_on_host
    assert rt.plan.memory.adaln_host_bytes == 0
    rt.fit_memory(VS, AS, 32, 2, device_memory=roomy)
    assert rt.plan.choices["adaln"].choice == "on the device"
    adaln = sum(t.numel() * t.element_size() for b in rt.model.blocks for t in b.adaln_proj.linear.parameters())
    # a budget that holds the run with the AdaLN weights in host memory, not with them on the device
    rt.plan.options.vram_budget = repr((rt.plan.memory.estimate.total - adaln // 2) / 1e9)
    checked = rt.check_memory(Workload.from_shapes(VS, AS, 32, 2), MemoryAsk("the run"), roomy)
    assert checked.streamed == () and checked.adaln_host_bytes == adaln  # checked as it will run: AdaLN moved off
    assert rt.plan.choices["adaln"].choice == "on the device"  # a check moves nothing
    rt.fit_memory(VS, AS, 32, 2, device_memory=roomy)
    adaln_choice = rt.plan.choices["adaln"]
    assert adaln_choice.choice == "rows per run" and "moved off the device" in adaln_choice.reason
    assert rt.plan.memory.adaln_host_bytes > 0
    kept = _load(ck, "1000")
    for r in (rt, kept):
        r.hashes = [_run(r)]
        apply_loras(r, [(str(lora), 0.8, "merge")])
        r.hashes.append(_run(r))
        apply_loras(r, [])
    assert rt.hashes == kept.hashes and rt.hashes[0] != rt.hashes[1]


def test_the_smallest_budget_counts_adaln_where_a_run_without_room_puts_it(files):
    """A plan that keeps AdaLN on the device (a simulated 80 GB card) names the smallest budget of the model as a run
    without room would place it (``from_plan(placed=False)``: AdaLN in host memory, the smallest budget of the load
    that kept it there); counted as placed, it is higher by the AdaLN bytes, and a load at the unplaced one streams
    every block (a GPU test found ``from_plan`` of such a plan naming a budget at which half the blocks stayed)."""
    ck, _ = files
    wl = Workload.from_shapes(VS, AS, 32, 2)
    roomy = DeviceMemory("cuda", "simulated card", 80 * 10 ** 9, 79 * 10 ** 9)
    on = load_model(ck, RuntimeOptions(device="cpu", host_budget="1000"), workload=wl, device_memory=roomy)
    assert on.plan.choices["adaln"].choice == "on the device"
    kept = _load(ck, "1000")
    least = smallest_budget(ModelMemory.from_plan(on.plan, placed=False), wl, "cuda")
    assert least == smallest_budget(ModelMemory.from_plan(kept.plan), wl, "cuda")
    adaln = sum(t.numel() * t.element_size() for b in on.model.blocks for t in b.adaln_proj.linear.parameters())
    assert smallest_budget(ModelMemory.from_plan(on.plan), wl, "cuda") == least + adaln
    assert on.plan.choices["adaln"].choice == "on the device"  # counting moved nothing
    at = load_model(ck, RuntimeOptions(device="cpu", host_budget="1000", vram_budget=repr(least / 1e9)), workload=wl,
                    device_memory=roomy)
    assert at.plan.memory.streamed == tuple(range(at.config.num_layers)) and at.plan.adaln_on_host


def test_an_offloaded_runtime_whose_adaln_must_move_off_comes_back_with_it_in_host_memory(files):
    """Offloaded (``park``: on the CPU the same moves, as copies) while the plan keeps AdaLN on the device, then a run
    without room for it: the AdaLN weights come back into host memory and every other tensor onto the device, and
    the latents are those of AdaLN kept in host memory from the start."""
    from h3_blackwell.runtime.offload import park

    ck, _ = files
    roomy = DeviceMemory("cuda", "simulated card", 80 * 10 ** 9, 79 * 10 ** 9)
    rt = load_model(ck, RuntimeOptions(device="cpu", host_budget="1000"), workload=Workload.from_shapes(VS, AS, 32, 2),
                    device_memory=roomy)
    adaln = sum(t.numel() * t.element_size() for b in rt.model.blocks for t in b.adaln_proj.linear.parameters())
    rt.plan.options.vram_budget = repr((rt.plan.memory.estimate.total - adaln // 2) / 1e9)
    rt.parked = park(rt)
    parked_adaln = [e for e in rt.parked.tensors if e[0] is rt.model.blocks[0].adaln_proj.linear]
    assert parked_adaln
    rt.fit_memory(VS, AS, 32, 2, device_memory=roomy)
    assert rt.parked is None and rt.plan.choices["adaln"].choice == "rows per run"
    w = rt.model.blocks[0].adaln_proj.linear.weight
    assert w.data_ptr() != parked_adaln[0][3].data_ptr() and torch.equal(w, parked_adaln[0][3])  # placed anew
    assert _run(rt) == _run(_load(ck, "1000"))
