"""Block streaming on the CPU (runtime.ops.streaming): the streamed blocks' bytes live in host buffers and are
copied into two slot buffers before each block computes (the CPU emulation of the device copies). Every run
must give the resident run's latent hashes: the W4A4, W4A8 and dense stacks, LoRA (merged bytes stream, side
paths), First-Block Cache, sparse attention, sequence parallelism and re-planning at sampling start. The FFN
chunked over rows (where every op is row-local) runs its GEMMs on fewer rows, so it equals the one-pass run to
fp32 reassociation, at a stated tolerance."""

import json

import pytest
import torch

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime import RuntimeOptions, load_model
from fixtures.chunks import chunked_evaluations
from fixtures.sampling import sample
from h3_blackwell.runtime.budget import ModelMemory, Workload, chunkings, estimate, smallest_budget
from h3_blackwell.runtime.load import StateDictSource
from h3_blackwell.runtime.lora import apply as L
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.layout import latent_shapes
from h3_blackwell.runtime.model.tiny import tiny_state_dict
from h3_blackwell.runtime.ops.stream_ops import StreamOps
from h3_blackwell.runtime.parallel.group import ParallelContext
from fixtures.reports import report_hashes
from tests.fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth

CPU = dict(device="cpu")
STEPS = 2
VSHAPE, ASHAPE = latent_shapes(128, 96, 22)  # 32 text + 74 audio + 84 video = 190 rows
STACKS = {"w4a4": {}, "w4a8": dict(gemm="fp8", act_format="fp8"), "dense": dict(quantize=False)}


def _workload(steps=STEPS):
    return Workload.from_shapes(VSHAPE, ASHAPE, 32, steps)


def _inputs(seed=1):
    text = torch.randn(1, 32, 5120, generator=torch.Generator().manual_seed(seed))
    return text, None, torch.zeros(VSHAPE), torch.zeros(ASHAPE)


def _gb(nbytes):
    return repr(nbytes / 1e9)


def _load(kw, budget_bytes=None, src=None, steps=STEPS):
    opts = RuntimeOptions(**CPU, **kw, **({} if budget_bytes is None else {"vram_budget": _gb(budget_bytes)}))
    return load_model(src, opts, workload=_workload(steps))


def _all_streamed_budget(kw, src=None, steps=STEPS):
    """Every block streamed, the FFN in its smallest row chunks, the attention half unchunked (the budget's
    query-row chunks come only below it; test_attention_rows.py covers them)."""
    rt = _load(kw, src=src, steps=steps)
    mm, wl = ModelMemory.from_plan(rt.plan), _workload(steps)
    ffn = [c for c, attn, _ in chunkings(mm, wl, "cpu") if attn is None][-1]
    return estimate(mm, wl, 0, 2, ffn, "cpu").total


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_streaming_loop_gives_the_residentreport_hashes(stack):
    kw = STACKS[stack]
    resident = _load(kw)
    assert resident.plan.memory.streamed == () and "nothing streams" in resident.plan.choices["memory"].reason
    want = report_hashes(sample(resident, *_inputs(), seed=7, steps=STEPS))
    rt = _load(kw, _all_streamed_budget(kw))
    assert rt.plan.memory.streamed == (0, 1, 2) and rt.plan.memory.emulated
    res = sample(rt, *_inputs(), seed=7, steps=STEPS)
    for j in (0, 1, 2):  # between blocks a streamed linear holds its host tensors (what a LoRA merge writes)
        for name, hl in rt.streamer.host[j].items():
            assert hl.holds(rt.model.blocks[j].get_submodule(name)), (j, name)
    assert report_hashes(res) == want
    mem = res.report["memory"]
    block = rt.plan.memory.block_bytes
    assert mem["streamed_blocks"] == [0, 1, 2] and mem["resident_blocks"] == []
    assert mem["evaluations"] == STEPS and mem["bytes_copied_per_step"] == 3 * rt.streamer.block_bytes(0)
    assert abs(rt.streamer.block_bytes(0) - block) <= 8 * 256  # the plan's block bytes vs the real buffers
    assert mem["copy_exposed_ms_per_step"] == mem["copy_ms_per_step"] >= 0  # CPU: synchronous copies
    assert mem["host_bytes_streamed_weights"] == rt.streamer.host_bytes and mem["vram_budget_bytes"] > 0
    assert mem["estimate"]["total_bytes"] <= mem["vram_budget_bytes"]
    # the streamed linears' host buffers were made ahead of the pass (NVFP4 stacks), none by the main thread
    planned = 12 if kw.get("quantize", True) else 0
    assert rt.load_phases["streamed_host_buffers_made_ahead"] == {"taken": planned, "planned": planned}


def _six_blocks():
    cfg = TINY.replace(num_layers=6)
    return StateDictSource(tiny_state_dict(cfg, 3, torch.float32), "tiny, 6 blocks", cfg)


def test_partial_streaming_spreads_the_resident_blocks_and_keeps_first_block_cache_exact():
    kw = STACKS["w4a8"]
    src = _six_blocks()
    mm = ModelMemory.from_plan(_load(kw, src=src, steps=4).plan)
    budget = estimate(mm, _workload(4), 2, 2, None, "cpu").total  # two resident blocks beside two slots
    resident, rt = _load(kw, src=src, steps=4), _load(kw, budget, src=src, steps=4)
    assert rt.plan.memory.resident == (1, 4) and rt.plan.memory.streamed == (0, 2, 3, 5)
    for fbc in (None, 0.3):  # First-Block Cache: skipped tails leave prefetched slots that the next step uses
        want = sample(resident, *_inputs(), seed=5, steps=4, first_block_cache=fbc)
        got = sample(rt, *_inputs(), seed=5, steps=4, first_block_cache=fbc)
        assert report_hashes(got) == report_hashes(want)
        if fbc is not None:
            assert got.report["first_block_cache"] == want.report["first_block_cache"]


def test_the_load_waits_for_its_checks_only_before_a_streamed_linear_leaves(monkeypatch):
    """With blocks 1 and 4 resident and 0, 2, 3 and 5 streamed: the load hands exactly the streamed blocks' linears to
    ``adopt``, and reads its finite checks back before each of those, not before a resident block's linear (a
    read-back waits for every copy queued; the resident ones stay where they are)."""
    from h3_blackwell.runtime.io.finite import FiniteChecks
    from h3_blackwell.runtime.ops.streaming import LINEAR_NAMES, BlockStreamer

    kw, src = STACKS["w4a8"], _six_blocks()
    budget = estimate(ModelMemory.from_plan(_load(kw, src=src, steps=4).plan), _workload(4), 2, 2, None, "cpu").total
    events, adopt, flush = [], BlockStreamer.adopt, FiniteChecks.flush
    monkeypatch.setattr(BlockStreamer, "adopt", lambda self, layer, m: events.append(("adopt", layer)) or
                        adopt(self, layer, m))
    monkeypatch.setattr(FiniteChecks, "flush", lambda self: events.append(("flush", None)) or flush(self))
    rt = _load(kw, budget, src=src, steps=4)
    assert rt.plan.memory.streamed == (0, 2, 3, 5)
    adopted = [layer for what, layer in events if what == "adopt"]
    assert adopted == [f"blocks.{j}.{n}" for j in (0, 2, 3, 5) for n in LINEAR_NAMES]
    assert all(events[i - 1][0] == "flush" for i, e in enumerate(events) if e[0] == "adopt")
    # at most the adopts' flushes, the periodic ones (every 32 tensors) and the last: none per resident linear
    tensors = len(rt.model.state_dict())
    assert sum(e[0] == "flush" for e in events) <= len(adopted) + tensors // 32 + 1


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    return save_tiny_lora(tmp_path_factory.mktemp("lora") / "l.safetensors", tiny_lora_truth(TINY, seed=1), "comfy")


@pytest.mark.parametrize("mode", ["merge", "side"])
def test_lora_merged_bytes_stream_and_side_paths_run_beside_them(lora_file, mode):
    from h3_blackwell.runtime.lora.merge import side_device_bytes

    kw = STACKS["w4a8"]
    resident = _load(kw)
    L.apply_loras(resident, [(str(lora_file), 0.7, mode)])
    side = side_device_bytes(resident.model, resident.device)  # side paths: held beside the budget's estimate
    assert (side > 0) == (mode == "side")
    rt = _load(kw, _all_streamed_budget(kw) + side)
    plain = report_hashes(sample(rt, *_inputs(), seed=2, steps=STEPS))  # merge: slots now hold the plain bytes
    L.apply_loras(rt, [(str(lora_file), 0.7, mode)])
    want = report_hashes(sample(resident, *_inputs(), seed=2, steps=STEPS))
    assert want != plain
    got = sample(rt, *_inputs(), seed=2, steps=STEPS)
    assert report_hashes(got) == want  # merge: the merged host bytes are copied again
    assert got.report["memory"]["streamed_blocks"] == [0, 1, 2]  # side: every block streams beside the side paths
    L.remove_loras(rt)
    assert isinstance(rt.ops, StreamOps) and report_hashes(sample(rt, *_inputs(), seed=2, steps=STEPS)) == plain


def test_sparse_attention_streams():
    kw = dict(quantize=False, attention="sparse", sparse_min_tokens=0, sparse_extra_tokens=0, dtype="float32")
    want = report_hashes(sample(_load(kw), *_inputs(), seed=4, steps=STEPS))
    assert report_hashes(sample(_load(kw, _all_streamed_budget(kw)), *_inputs(), seed=4, steps=STEPS)) == want


def test_sequence_parallel_world_of_one_streams():
    kw = STACKS["w4a8"]
    ctx = ParallelContext(0, 1, torch.device("cpu"), "gloo")
    want = report_hashes(sample(_load(kw), *_inputs(), seed=6, steps=STEPS, parallel=ctx))
    got = sample(_load(kw, _all_streamed_budget(kw)), *_inputs(), seed=6, steps=STEPS, parallel=ctx)
    assert report_hashes(got) == want and got.report["memory"]["streamed_blocks"] == [0, 1, 2]


def test_sequence_parallel_two_ranks_stream(tmp_path, monkeypatch):
    """generate --sequence-parallel 2 (gloo workers): every rank streams its blocks and the latents are the
    resident sequence-parallel run's."""
    base = ["--dense", "--dtype", "float32", "--device", "cpu", "--steps", "2", "--width", "64", "--height", "64",
            "--frames", "5", "--text-tokens", "9", "--sequence-parallel", "2"]
    v, a = latent_shapes(64, 64, 5)
    rt = load_model(None, RuntimeOptions(**CPU, quantize=False, dtype="float32"),
                    workload=Workload.from_shapes(v, a, 9, 2))
    budget = smallest_budget(ModelMemory.from_plan(rt.plan), Workload.from_shapes(v, a, 9, 2), "cpu")
    assert cli.main(["generate", "--output", str(tmp_path / "one"), *base]) == 0
    assert cli.main(["generate", "--output", str(tmp_path / "st"), *base, "--vram-budget", _gb(budget)]) == 0
    one, st = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "st"))
    assert st["latent_checksums"]["video_sha256"] == one["latent_checksums"]["video_sha256"]
    assert st["latent_checksums"]["audio_sha256"] == one["latent_checksums"]["audio_sha256"]
    assert st["memory"]["streamed_blocks"] == [0, 1, 2] and one["memory"]["streamed_blocks"] == []
    assert st["sequence_parallel"]["latents_identical_across_ranks"]


def test_replanning_at_sampling_start_moves_blocks_and_keeps_thereport_hashes():
    kw = STACKS["w4a4"]
    rt = _load(kw)
    want = report_hashes(sample(rt, *_inputs(), seed=8, steps=STEPS))
    rt.plan.options.vram_budget = _gb(_all_streamed_budget(kw))  # as a new budget for the next run
    res = sample(rt, *_inputs(), seed=8, steps=STEPS)
    assert rt.plan.memory.streamed == (0, 1, 2) and report_hashes(res) == want
    assert res.report["memory"]["bytes_copied_per_step"] > 0
    rt.plan.options.vram_budget = "auto"  # CPU auto: back to resident, the blocks' tensors own storage again
    res = sample(rt, *_inputs(), seed=8, steps=STEPS)
    assert rt.plan.memory.streamed == () and rt.streamer.host == {} and report_hashes(res) == want
    assert res.report["memory"]["bytes_copied_per_step"] == 0


# FFN row chunks vs one pass over all 190 rows. Every FFN op is row-local, so a chunk computes the same math on its
# rows; what can differ is the fp32 GEMM itself: fc1/fc2 run with M = 128 or 64 instead of 190, and the BLAS may
# block K differently for another M (MKL's AVX2 kernels do for K = 160: fc2 moves ~3000 elements by an ulp;
# AVX-512 does not). So the chunked output is the unchunked one to fp32 reassociation, never pinned bytes:
# dense, per element |d| <= 2 gamma_K sum|x||w| with K <= 160, rel-L2 ~6e-8 seen -> 1e-5; w4a8 quantizes fc2's input
# per row to e4m3, where an ulp can move one code by an e4m3 step (2^-3 of that element) -> 1e-3. A chunking that
# is not row-local (W4A4's amax over all rows, which the plan never chunks) is off by ~1e-2, a wrong segment or a
# dropped chunk by far more.
CHUNK_TOL = {"dense": 1e-5, "w4a8": 1e-3}


@pytest.mark.parametrize("stack", ["w4a8", "dense"])
def test_ffn_row_chunks_equal_one_pass_where_row_local(stack):
    rt = _load(STACKS[stack])
    assert ModelMemory.from_plan(rt.plan).ffn_row_local
    text, _, _, _ = _inputs()
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    want, chunked, moved = chunked_evaluations(rt, text, (VSHAPE, ASHAPE), rt.ops.set_ffn_chunk_rows)
    for rows, got, again in chunked:
        errs = [rel(got[i], want[i]) for i in (0, 1)]
        assert max(errs) <= CHUNK_TOL[stack], (rows, errs)
        assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1]), rows  # same chunking, same bytes
    assert rel(moved[0], want[0]) > CHUNK_TOL[stack]


def test_w4a4_dynamic_scale_is_not_chunked():
    """The SwiGLU bytes of W4A4 with a dynamic scale take one amax over all rows: the plan never chunks it."""
    mm = ModelMemory.from_plan(_load({}).plan)
    assert not mm.ffn_row_local and "amax over all rows" in mm.ffn_row_local_why
    assert smallest_budget(mm, _workload(), "cpu") == estimate(mm, _workload(), 0, 2, None, "cpu").total


def test_model_call_plans_the_budget_for_the_size_it_sees():
    """A host-driven run (ModelCall: core's KSampler on the MODEL output) plans the budget again at its first call,
    for the latents it is handed, as ``sample`` does at its start; the outputs stay the resident ones, and a
    second conditioning of the same size (CFG) keeps the decision."""
    from h3_blackwell.runtime.sampling.model_call import ModelCall

    kw = STACKS["w4a8"]
    rt = _load(kw)
    text = _inputs()[0]
    g = torch.Generator().manual_seed(3)
    v, a = torch.randn(VSHAPE, generator=g), torch.randn(ASHAPE, generator=g)
    call = ModelCall(rt)
    call.begin_run([1.0, 0.5, 0.0])
    want = call(v, a, 1.0, text)
    call.end_run()
    assert rt.plan.memory.streamed == ()
    rt.plan.options.vram_budget = _gb(_all_streamed_budget(kw))  # a smaller budget for the next run
    call.begin_run([1.0, 0.5, 0.0])
    got = call(v, a, 1.0, text)
    assert rt.plan.memory.streamed == (0, 1, 2) and rt.plan.memory.workload.steps == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    decided = rt.plan.memory
    call(v, a, 1.0, -text)  # CFG's second conditioning, same size: no re-plan
    call(v, a, 1.0, text[:, :20])  # a shorter one keeps the decision made for the larger
    assert rt.plan.memory is decided
    call.end_run()


def test_lora_side_paths_count_against_the_budget(lora_file):
    """LoRA side paths hold their A and B on the device beside the weights: a given budget is planned less those
    bytes (the report says so), the base streams to make room, and the latents stay the resident run's."""
    from h3_blackwell.runtime.lora.merge import side_device_bytes

    kw = STACKS["w4a8"]
    rt = _load(kw)
    L.apply_loras(rt, [(str(lora_file), 0.7, "side")])
    want = sample(rt, *_inputs(), seed=2, steps=STEPS)
    total = want.report["memory"]["estimate"]["total_bytes"]
    side = side_device_bytes(rt.model, rt.device)
    assert side > 0
    budget = total + side - 1  # the run and the side paths together, less a byte
    rt.plan.options.vram_budget = _gb(budget)
    got = sample(rt, *_inputs(), seed=2, steps=STEPS)
    mem = got.report["memory"]
    assert "the LoRA side paths hold" in mem["budget"] and abs(mem["vram_budget_bytes"] - (budget - side)) <= 1
    assert mem["estimate"]["total_bytes"] + side <= budget and mem["streamed_blocks"]
    assert report_hashes(got) == report_hashes(want)
    L.remove_loras(rt)
    assert side_device_bytes(rt.model, rt.device) == 0
    assert "side paths" not in sample(rt, *_inputs(), seed=2, steps=STEPS).report["memory"]["budget"]


def test_a_budget_too_small_beside_side_paths_names_one_that_runs(lora_file):
    """Where side paths make a budget too small, the error names the budget that runs with them (the run's smallest
    plus the side bytes) and says nothing moved; that budget then runs."""
    import re

    from h3_blackwell.runtime.budget import BudgetError
    from h3_blackwell.runtime.lora.merge import side_device_bytes

    kw = STACKS["w4a8"]
    least = smallest_budget(ModelMemory.from_plan(_load(kw).plan), _workload(), "cpu")
    rt = _load(kw)
    L.apply_loras(rt, [(str(lora_file), 0.7, "side")])
    resident = sample(rt, *_inputs(), seed=2, steps=STEPS)
    want = report_hashes(resident)
    side = side_device_bytes(rt.model, rt.device)
    rt.plan.options.vram_budget = _gb(least)  # enough without the side paths, too little beside them
    with pytest.raises(BudgetError) as e:
        sample(rt, *_inputs(), seed=2, steps=STEPS)
    msg = str(e.value)
    assert "merge mode" in msg and "nothing moved" in msg and "nothing was loaded" not in msg, msg
    named = float(re.search(r"H3_VRAM_BUDGET to ([0-9.]+) or more", msg).group(1)) * 1e9
    assert named >= least + side
    rt.plan.options.vram_budget = repr(named / 1e9)
    got = sample(rt, *_inputs(), seed=2, steps=STEPS)
    assert got.report["memory"]["outside_bytes"] == side
    if got.report["memory"]["attn_chunk_rows"] is None:
        assert report_hashes(got) == want
    else:  # the smallest budget chunks the attention half: the side paths' low-rank GEMMs then run on fewer rows,
        # which the CPU's matmul may sum in another order (fp32 reassociation, rel-L2 ~1e-7 seen) -> 1e-5
        for a, b in ((got.video, resident.video), (got.audio, resident.audio)):
            assert float((a.double() - b.double()).norm() / b.double().norm()) <= 1e-5


def test_a_page_locked_host_buffer_is_unregistered_once_when_released_or_dropped(monkeypatch):
    """cudaHostRegister'ed host buffers must be unregistered before their memory is freed: a registration left on
    freed memory makes later copies from whatever is allocated there fail ("invalid argument"). Registration is
    recorded here (the CPU has none); tests/gpu/test_streaming_gpu.py checks the real one."""
    import gc

    from h3_blackwell.runtime.ops import host_buffers as hb

    calls = []
    monkeypatch.setattr(hb, "host_empty", lambda n, pin: (torch.empty(n, dtype=torch.uint8), "registered"))
    monkeypatch.setattr(hb, "_unregister", calls.append)
    lin = torch.nn.Linear(64, 32, bias=False)
    dropped = hb.HostLinear(lin, pin=True)
    ptr = dropped.buffer.data_ptr()
    del dropped
    gc.collect()
    assert calls == [ptr]  # dropped without release: unregistered by its finalizer
    released = hb.HostLinear(lin, pin=True)
    ptr = released.buffer.data_ptr()
    released.release()
    del released
    gc.collect()
    assert calls[1:] == [ptr]  # released, then dropped: unregistered once


def test_buffers_made_ahead_are_handed_over_in_order_or_made_by_their_taker(monkeypatch):
    """BuffersAhead: each planned key gets its buffer of the planned size, made on the worker in the planned order;
    an unplanned key, a size that differs and a worker that fails leave the taker to make its own (None), and close
    frees (unregisters) every buffer not taken, once."""
    from h3_blackwell.runtime.ops import host_buffers as hb

    made, freed = [], []

    def fake_empty(n, pin):
        made.append(n)
        return torch.full((n,), 7, dtype=torch.uint8), "registered"

    monkeypatch.setattr(hb, "host_empty", fake_empty)
    monkeypatch.setattr(hb, "host_free", lambda buf, how: freed.append(buf.numel()))
    ahead = hb.BuffersAhead([("a", 10), ("b", 20), ("c", 30), ("d", 40)], pin=True)
    a = ahead.take("a", 10)
    assert a is not None and a[0].numel() == 10 and a[1] == "registered"
    assert ahead.take("zz", 10) is None  # never planned
    assert ahead.take("b", 21) is None and freed == [20]  # planned at another size: freed, the taker makes its own
    assert ahead.take("a", 10) is None  # handed over once
    d = ahead.take("d", 40)  # the last one: every buffer is made by now, in order
    assert d is not None and d[0].numel() == 40 and made == [10, 20, 30, 40]
    ahead.close()
    assert sorted(freed) == [20, 30] and ahead.taken == 2  # c, never taken, freed by close
    assert ahead.take("c", 30) is None  # closed: nothing left

    def failing(n, pin):
        raise RuntimeError("no page-locked memory")

    monkeypatch.setattr(hb, "host_empty", failing)
    broken = hb.BuffersAhead([("a", 10)], pin=True)
    assert broken.take("a", 10) is None and isinstance(broken.error, RuntimeError)
    broken.close()


def test_a_linear_takes_its_buffer_made_ahead_and_holds_the_same_bytes():
    """HostLinear with a buffer made ahead: the module's bytes in it, as in one it makes itself."""
    from h3_blackwell.runtime.ops import host_buffers as hb

    lin = torch.nn.Linear(64, 32, bias=False)
    own = hb.HostLinear(lin, pin=False)
    ahead = hb.BuffersAhead([("x", own.nbytes)], pin=False)
    got = hb.HostLinear(lin, pin=False, ahead=ahead, key="x")
    assert ahead.taken == 1 and got.nbytes == own.nbytes
    assert torch.equal(got.views["weight"], lin.weight) and torch.equal(own.views["weight"], lin.weight)
    ahead.close()
