"""The read-ahead (runtime.io.prefetch.ReadAhead) and the streaming load that uses it: every read handed out in
order with the bytes of a direct read, never more than its byte bound held, a failed read raised with its tensor's
name when that tensor is asked for, no thread left behind; and a load with the read-ahead gives the model a load
without it gives, bit for bit."""

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from h3_blackwell.runtime import load as load_mod
from h3_blackwell.runtime.errors import CheckpointError
from h3_blackwell.runtime.io import prefetch
from h3_blackwell.runtime.io.checkpoint import open_checkpoint
from h3_blackwell.runtime.io.convert import quantize_checkpoint
from h3_blackwell.runtime.io.header import read_header, read_tensor
from h3_blackwell.runtime.io.keys import comfy_to_diffusers_state_dict, interleave_qkv
from h3_blackwell.runtime.io.prefetch import ReadAhead
from h3_blackwell.runtime.load import load_model
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict
from h3_blackwell.runtime.options import RuntimeOptions


def _random_file(path, n=24, seed=0):
    """n tensors of assorted sizes and dtypes, random and never zero -> (path, names in file order)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(n):
        rows = 1 + int(torch.randint(1, 300, (1,), generator=g))
        t = torch.rand(rows, 37, generator=g) + 0.5
        sd[f"t{i:02d}"] = t.to((torch.float32, torch.bfloat16, torch.float16)[i % 3])
    save_file(sd, str(path))
    return path, sorted(sd)


def _nbytes(hdr):
    return lambda name: hdr.tensors[name].offsets[1] - hdr.tensors[name].offsets[0]


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("max_bytes", [1, 3000, 60_000, 1 << 30])
def test_reads_come_back_in_order_identical_and_within_the_bound(tmp_path, max_bytes):
    path, names = _random_file(tmp_path / "r.safetensors")
    hdr = read_header(path)
    order = names + names[::3] + names[:5]  # a name may be asked for again: each occurrence is one read
    size = _nbytes(hdr)
    threads = []

    def read(name):
        threads.append(threading.current_thread())
        return read_tensor(hdr, name)

    with ReadAhead(order, read, size, max_bytes=max_bytes, threads=4) as ra:
        for name in order:
            assert ra.held_bytes <= max(max_bytes, max(size(n) for n in names))
            got = ra.get(name)
            assert _same_bytes(got, read_tensor(hdr, name)), name
    largest = max(size(n) for n in order)
    assert ra.peak_held_bytes <= max(max_bytes, largest)
    assert ra.held_bytes == 0 and len(threads) == len(order)
    assert threading.main_thread() not in threads  # the reads ran on the workers
    assert ra.read_bytes == sum(size(n) for n in order) and ra.read_seconds > 0  # every read counted once
    if max_bytes < min(size(n) for n in names):
        assert ra.peak_held_bytes == largest  # one read at a time: the bound is below any tensor
    elif max_bytes >= sum(size(n) for n in order):
        assert ra.peak_held_bytes == sum(size(n) for n in order)  # everything read ahead at once


def test_asking_out_of_order_or_after_close_is_refused(tmp_path):
    path, names = _random_file(tmp_path / "r.safetensors", n=4)
    hdr = read_header(path)
    with ReadAhead(names, lambda n: read_tensor(hdr, n), _nbytes(hdr), threads=2) as ra:
        with pytest.raises(ValueError, match=f"next declared read is '{names[0]}'"):
            ra.get(names[1])
        for n in names:
            ra.get(n)
        with pytest.raises(ValueError, match="more reads than it declared"):
            ra.get(names[0])
    with pytest.raises(RuntimeError, match="after close"):
        ra.get(names[0])


@pytest.mark.parametrize("error", [OSError("disk went away"), CheckpointError("the file shrank")])
def test_a_failed_read_raises_with_its_name_when_asked_for_and_threads_end(tmp_path, error):
    path, names = _random_file(tmp_path / "r.safetensors", n=10)
    hdr = read_header(path)
    bad = names[6]
    base = threading.active_count()

    def read(name):
        if name == bad:
            raise error
        return read_tensor(hdr, name)

    with pytest.raises(type(error)) as e:
        with ReadAhead(names, read, _nbytes(hdr), max_bytes=1 << 30, threads=4) as ra:
            for name in names[:6]:  # the reads before it are handed out whole, though its read failed meanwhile
                assert _same_bytes(ra.get(name), read_tensor(hdr, name))
            ra.get(bad)
    assert e.value is error and any(repr(bad) in note for note in getattr(e.value, "__notes__", [repr(bad)]))
    assert threading.active_count() == base


def test_an_error_of_the_caller_shuts_the_threads_down(tmp_path):
    path, names = _random_file(tmp_path / "r.safetensors", n=12)
    hdr = read_header(path)
    base = threading.active_count()
    with pytest.raises(KeyError):
        with ReadAhead(names, lambda n: read_tensor(hdr, n), _nbytes(hdr), threads=4) as ra:
            ra.get(names[0])
            assert threading.active_count() > base
            raise KeyError("the caller's own error")
    assert threading.active_count() == base and ra.held_bytes == 0


# ---------------------------------------------------------------------------------------------
# the streaming load with the read-ahead on and off
# ---------------------------------------------------------------------------------------------

class _Counted(ReadAhead):
    """The loader's ReadAhead, remembered: the test sees it ran and handed out every declared read."""
    made: list = []

    def __init__(self, names, *a, **kw):
        super().__init__(names, *a, **kw)
        self.declared, self.handed = len(names), 0
        _Counted.made.append(self)

    def get(self, name):
        t = super().get(name)
        self.handed += 1
        return t


def _files(d):
    """Checkpoints of every read path the loader takes: bf16 with fp32 islands, stored NVFP4, fp8 and int8 layers,
    diffusers names (q/k/v concatenated, fc1 halves swapped, rope recomputed), raw shards (QKV deinterleaved)."""
    cfg = TINY
    tiny = save_tiny(d / "tiny.safetensors", seed=5)
    nvfp4 = d / "nvfp4.safetensors"
    quantize_checkpoint(tiny, nvfp4)
    sd = tiny_state_dict(cfg, seed=6, dtype=torch.float32)
    w = sd["blocks.0.mlp.fc1.weight"]
    scale = w.abs().max() / 448.0
    sd["blocks.0.mlp.fc1.weight"] = (w / scale).to(torch.float8_e4m3fn)
    sd["blocks.0.mlp.fc1.weight_scale"] = scale.reshape(())
    sd["blocks.0.mlp.fc1.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    w = sd["blocks.1.attn.out_proj.weight"]
    rs = w.abs().amax(dim=1, keepdim=True) / 127.0
    sd["blocks.1.attn.out_proj.weight"] = torch.round(w / rs).clamp(-127, 127).to(torch.int8)
    sd["blocks.1.attn.out_proj.weight_scale"] = rs
    sd["blocks.1.attn.out_proj.comfy_quant"] = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()),
                                                            dtype=torch.uint8)
    save_file(sd, str(d / "fp8_int8.safetensors"))
    dense = tiny_state_dict(cfg, seed=7)
    save_file(comfy_to_diffusers_state_dict(dense), str(d / "diffusers.safetensors"))
    raw = {k: (interleave_qkv(v, cfg.num_heads, cfg.head_dim) if k.endswith("qkv_proj.weight") else v)
           for k, v in dense.items()}
    keys = sorted(raw)
    wm = {}
    for i, ks in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        f = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: raw[k] for k in ks}, str(d / f))
        wm.update({k: f for k in ks})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return {"tiny": tiny, "nvfp4": nvfp4, "fp8_int8": d / "fp8_int8.safetensors",
            "diffusers": d / "diffusers.safetensors", "raw": d / "model.safetensors.index.json"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _files(tmp_path_factory.mktemp("prefetch"))


HOST = dict(device="cpu", dtype="float32", host_budget="1000")  # AdaLN kept in host memory: the host reads too


def _load(path, opts, monkeypatch, threads, max_bytes=prefetch.READ_AHEAD_BYTES):
    monkeypatch.setattr(prefetch, "READ_AHEAD_THREADS", threads)
    monkeypatch.setattr(prefetch, "READ_AHEAD_BYTES", max_bytes)
    monkeypatch.setattr(load_mod, "ReadAhead", _Counted)
    _Counted.made.clear()
    calls = []
    rt = load_model(path, RuntimeOptions(**opts), progress=lambda i, n, k: calls.append((i, n, k)))
    return rt, calls, list(_Counted.made)


@pytest.mark.parametrize("name,opts", [
    ("tiny", dict(HOST)), ("tiny", dict(HOST, quantize=False)), ("nvfp4", dict(HOST)),
    ("nvfp4", dict(HOST, quantize=False)), ("fp8_int8", dict(HOST)), ("fp8_int8", dict(HOST, quantize=False)),
    ("diffusers", dict(HOST, quantize=False)), ("raw", dict(device="cpu", dtype="float32"))])
def test_a_load_with_the_read_ahead_is_bit_identical_to_one_without(files, name, opts, monkeypatch):
    off, off_calls, none = _load(files[name], opts, monkeypatch, threads=0)
    assert none == []
    for threads, max_bytes in ((4, prefetch.READ_AHEAD_BYTES), (3, 1)):  # far ahead; one read at a time
        on, on_calls, (ra,) = _load(files[name], opts, monkeypatch, threads, max_bytes)
        assert ra.handed == ra.declared > 0 and ra.held_bytes == 0
        assert on_calls == off_calls
        a, b = off.model.state_dict(), on.model.state_dict()
        assert list(a) == list(b)
        for k in a:
            assert _same_bytes(a[k], b[k]), (name, k)
        if opts.get("host_budget") and name != "raw":
            assert on.plan.adaln_on_host and a["blocks.0.adaln_proj.linear.weight"].device.type == "cpu"


def test_a_load_refuses_a_non_finite_tensor_by_name_and_ends_its_threads(tmp_path, monkeypatch):
    sd = tiny_state_dict(TINY, seed=8)
    sd["blocks.1.mlp.fc2.weight"][3, 4] = float("nan")
    p = tmp_path / "nan.safetensors"
    save_file(sd, str(p))
    base = threading.active_count()
    with pytest.raises(CheckpointError, match=r"'blocks\.1\.mlp\.fc2\.weight'.*must be finite"):
        _load(p, HOST, monkeypatch, threads=4)
    assert threading.active_count() == base


def test_a_file_that_shrinks_during_the_load_still_raises_checkpoint_error(tmp_path, monkeypatch):
    p = save_tiny(tmp_path / "tiny.safetensors", seed=9)
    real = load_mod.make_plan

    def plan_then_truncate(*a, **kw):  # the headers were checked whole; the bytes go before the reads
        plan = real(*a, **kw)
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
        return plan

    monkeypatch.setattr(load_mod, "make_plan", plan_then_truncate)
    base = threading.active_count()
    with pytest.raises(CheckpointError, match="truncated while reading"):
        _load(p, HOST, monkeypatch, threads=4)
    assert threading.active_count() == base


def test_checkpoint_nbytes_is_what_tensor_returns(files):
    for name in ("tiny", "nvfp4", "diffusers", "raw"):
        ck = open_checkpoint(files[name])
        for k in ck.keys():
            t = ck.tensor(k)
            assert ck.nbytes(k) == t.numel() * t.element_size(), (name, k)


def test_a_tensor_read_in_parallel_parts_gives_the_plain_reads_bytes(tmp_path, monkeypatch):
    """``read_tensor(..., threads=N)`` reads N contiguous parts at once (parts of at least PART_BYTES): the same
    bytes as one read, into a new buffer or into ``out``; a file cut short is still refused as truncated."""
    from h3_blackwell.runtime.io import header as H

    t = torch.randn(257, 1031, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    path = tmp_path / "one.safetensors"
    save_file({"w": t}, str(path))
    monkeypatch.setattr(H, "PART_BYTES", 4096)
    hdr = H.read_header(path, "test file")
    for threads in (1, 2, 5, 64):
        assert torch.equal(H.read_tensor(hdr, "w", threads=threads), t)
        out = torch.empty_like(t)
        assert H.read_tensor(hdr, "w", out, threads=threads) is out and torch.equal(out, t)
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        H.read_tensor(hdr, "w", threads=5)


def test_a_load_says_where_its_time_went(files):
    """load_model's ``load_phases``: its steps' seconds sum to ``load_seconds``; the pass's own parts fit in the pass;
    the read-ahead threads read every byte the pass asked of the file (the tiny file's tensors, once each)."""
    path = files["tiny"]
    rt = load_model(str(path), RuntimeOptions(device="cpu", dtype="float32"))
    ph = rt.load_phases
    steps = [ph[k] for k in ("plan", "model_and_source", "pass", "streamer_and_placement", "fc2_and_ops")]
    assert all(v >= 0 for v in steps) and abs(sum(steps) - rt.load_seconds) < 1e-3
    parts = ph["pass_parts"]
    assert sum(parts[k] for k in load_mod.LOAD_PARTS) <= ph["pass"] + 1e-3
    hdr = read_header(path)
    assert parts["read_ahead_bytes"] == sum(t.offsets[1] - t.offsets[0] for t in hdr.tensors.values())
    assert parts["read_ahead_thread_seconds"] > 0 and parts["finite_checks"] > 0
