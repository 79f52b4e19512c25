"""The memory estimate counts every packed row (issue 26): text, targets, and each keyframe's and reference's
condition rows, however many times the payload names one tensor. A request that cannot fit is refused before the
model loads (generate, forward, and the tensor job of the nodes); a real allocation failure of the CPU allocator
is reported as out of memory, in one process and in a sequence-parallel worker.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from fixtures.cli_contract import check_refusal, leftovers, marked, refused_inproc, run, unique_mark, wait_gone
from h3_blackwell.runtime import conditioning_from_payload
from h3_blackwell.runtime.model.cond_rows import keyframe_specs
from h3_blackwell.runtime.model.layout import build_layout
from h3_blackwell.runtime import budget
from h3_blackwell.runtime.sampling import request

GB = 1e9


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    g = torch.Generator().manual_seed(0)
    p = d / "in.safetensors"
    save_file({"video": torch.randn(1, 24, 2, 4, 4, generator=g), "audio": torch.randn(1, 32, 2, 4, generator=g),
               "text_states": torch.randn(1, 4, 5120, generator=g), "sigma": torch.tensor([0.5]),
               "kf": torch.randn(1, 24, 1, 4, 4, generator=g), "ref": torch.randn(1, 24, 1, 4, 4, generator=g),
               "aud": torch.randn(1, 32, 2, 3, generator=g)}, str(p))
    return p


def _payload(d, n_keyframes: int = 0, n_refs: int = 0):
    p = d / f"p{n_keyframes}_{n_refs}.json"
    p.write_text(json.dumps({"keyframes": [{"resolved_frame_index": 0, "latent": "kf"}] * n_keyframes,
                             "refs": [{"kind": "image", "latent_h": 4, "latent_w": 4, "latent": "ref"}] * n_refs}))
    return p


@pytest.fixture
def small_host(monkeypatch):
    """A host with 2 GB available, and a model load that fails the test: the refusal must come first."""
    import h3_blackwell.runtime.load as load_mod

    monkeypatch.setattr(budget, "host_available_bytes", lambda: int(2 * GB))

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the memory check")

    monkeypatch.setattr(load_mod, "load_model", no_load)


# ---------------------------------------------------------------------------------------------
# the count is the packed sequence's
# ---------------------------------------------------------------------------------------------

CASES = {
    "t2va": {},
    "keyframes": {"keyframes": [{"resolved_frame_index": 0, "latent": "k1"},
                                {"resolved_frame_index": 1, "latent": "k5", "audio_latent": "a3"},
                                {"resolved_frame_index": 4, "audio_latent": "a3"}] * 3},
    "refs": {"refs": [{"kind": "image", "latent_h": 6, "latent_w": 4, "latent": "r64"},
                      {"kind": "video", "latent_t": 2, "latent_h": 4, "latent_w": 8, "ref_audio_t": 0,
                       "latent": "v48"},
                      {"kind": "video_audio", "latent_t": 2, "latent_h": 4, "latent_w": 8, "ref_audio_t": 3,
                       "latent": "v48", "audio_latent": "a3"},
                      {"kind": "audio", "ref_audio_t": 3, "audio_latent": "a3"}] * 2},
}


@pytest.mark.parametrize("case,hw", [(c, hw) for c in sorted(CASES) for hw in ((4, 4), (5, 7))
                                     if hw == (4, 4) or c != "keyframes"])  # keyframes need an even latent grid
def test_rows_are_the_packed_sequence_length(case, hw):
    g = torch.Generator().manual_seed(0)
    h, w = hw
    t = {"k1": torch.randn(1, 24, 1, h, w, generator=g), "k5": torch.randn(1, 24, 2, h, w, generator=g),
         "a3": torch.randn(1, 32, 2, 3, generator=g), "r64": torch.randn(1, 24, 1, 6, 4, generator=g),
         "v48": torch.randn(1, 24, 2, 4, 8, generator=g)}
    cond = conditioning_from_payload(CASES[case], t)
    video, audio, text = (1, 24, 7, h, w), (1, 32, 2, 26), 9
    cond.check_target(video, audio, 24, 32)
    layout = build_layout(text, video[2], h, w, audio[3], keyframe_specs(cond), cond.refs)
    assert request.latent_rows(video, audio, text, cond) == layout.seq_len
    assert request.latent_rows(video, audio, text) == build_layout(text, video[2], h, w, audio[3]).seq_len


def test_one_tensor_named_a_thousand_times_is_a_thousand_blocks_of_rows():
    kf = torch.randn(1, 24, 1, 4, 4)
    one = conditioning_from_payload({"keyframes": [{"resolved_frame_index": 0, "latent": "k"}]}, {"k": kf})
    many = conditioning_from_payload({"keyframes": [{"resolved_frame_index": 0, "latent": "k"}] * 1000}, {"k": kf})
    assert request.condition_rows(one) == 4 and request.condition_rows(many) == 4000


# ---------------------------------------------------------------------------------------------
# refused before the load
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_keyframes,n_refs", [(20000, 0), (0, 20000), (10000, 10000)])
def test_thousands_of_keyframes_naming_one_tensor_are_refused_before_the_load(n_keyframes, n_refs, inputs, tmp_path,
                                                                              small_host, capsys):
    p = _payload(tmp_path, n_keyframes, n_refs)
    line = refused_inproc(capsys, ["generate", "--output", tmp_path / "o", "--inputs", inputs, "--payload", p,
                                   "--steps", "1"], "80,020 packed rows", "needs ~", "2.0 GB")
    assert "lower" in line and not (tmp_path / "o").exists()


def test_forward_refuses_them_too(inputs, tmp_path, small_host, capsys):
    from h3_blackwell.runtime.model.tiny import save_tiny

    tiny = save_tiny(tmp_path / "tiny.safetensors", seed=0)
    p = _payload(tmp_path, 20000)
    refused_inproc(capsys, ["forward", "--model", tiny, "--inputs", inputs, "--payload", p, "--out",
                            tmp_path / "v.safetensors"], "80,020 packed rows", "needs ~", "keyframes")
    assert not (tmp_path / "v.safetensors").exists()


def test_the_tensor_job_refuses_them_too(monkeypatch):
    """The nodes' path: a resident model's job counts the condition rows as well."""
    from h3_blackwell.runtime import H3Error, RuntimeOptions, SampleInputs, SamplingSettings, load_model, tensor_job

    rt = load_model(None, RuntimeOptions(device="cpu", quantize=False))
    monkeypatch.setattr(budget, "host_available_bytes", lambda: int(2 * GB))
    kf = torch.randn(1, 24, 1, 4, 4)
    cond = conditioning_from_payload({"keyframes": [{"resolved_frame_index": 0, "latent": "k"}] * 20000}, {"k": kf})
    with pytest.raises(H3Error, match=r"80,020 packed rows.*needs ~"):
        tensor_job(rt, SampleInputs(torch.randn(1, 4, 5120), None, torch.zeros(1, 24, 2, 4, 4),
                                    torch.zeros(1, 32, 2, 4), cond), SamplingSettings(seed=0, steps=1))
    few = conditioning_from_payload({"keyframes": [{"resolved_frame_index": 0, "latent": "k"}] * 10}, {"k": kf})
    tensor_job(rt, SampleInputs(torch.randn(1, 4, 5120), None, torch.zeros(1, 24, 2, 4, 4), torch.zeros(1, 32, 2, 4),
                                few), SamplingSettings(seed=0, steps=1))


def test_a_few_keyframes_still_pass(inputs, tmp_path, monkeypatch):
    from h3_blackwell.runtime import JobFiles, SamplingSettings, make_job

    monkeypatch.setattr(budget, "host_available_bytes", lambda: int(2 * GB))
    job = make_job(None, sampling=SamplingSettings(seed=0, steps=1),
                   files=JobFiles(inputs=str(inputs), payload=str(_payload(tmp_path, 10))))
    assert len(job.inputs.conditioning.keyframes) == 10


def test_refused_on_any_machine_without_patches(tmp_path):
    """A real process, the machine's own memory: 20,000 keyframes of a 1024x1024 latent are 20.5 M rows."""
    g = torch.Generator().manual_seed(0)
    inp = tmp_path / "in.safetensors"
    save_file({"video": torch.randn(1, 24, 2, 64, 64, generator=g), "audio": torch.randn(1, 32, 2, 4, generator=g),
               "text_states": torch.randn(1, 4, 5120, generator=g), "kf": torch.randn(1, 24, 1, 64, 64, generator=g)},
              str(inp))
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"keyframes": [{"resolved_frame_index": 0, "latent": "kf"}] * 20000}))
    rc, _, err = run(["generate", "--output", tmp_path / "o", "--inputs", inp, "--payload", p, "--steps", "1"],
                     timeout=180)
    check_refusal(rc, err, 2, ["20,482,0", "packed rows", "needs ~", "keyframes"])
    assert "H3 model" not in err  # refused before the load printed its plan
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------
# the CPU allocator running out, for real
# ---------------------------------------------------------------------------------------------

# 300 MB of address space beyond what the imports took: the estimate (host memory) admits the run, the reference
# attention's 846 MB score chunk (1024x1024, 22 frames: 7,274 rows) then fails in the allocator. One process: the
# limit is set before the CLI runs; sequence-parallel: only in the workers (a sitecustomize on their path), so the
# launcher itself has the memory to report it
_AS_LIMIT = """
import os, resource
if {only_workers} is False or os.environ.get("RANK") is not None:
    import torch
    import h3_blackwell.runtime
    vm = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize')][0]
    resource.setrlimit(resource.RLIMIT_AS, (vm + (300 << 20), resource.RLIM_INFINITY))
"""


@pytest.mark.parametrize("sp", [None, 2])
def test_the_cpu_allocator_running_out_is_out_of_memory(sp, tmp_path):
    argv = ["generate", "--output", tmp_path / "o", "--width", "1024", "--height", "1024", "--frames", "22", "--steps",
            "1", *(["--sequence-parallel", str(sp)] if sp else [])]
    mark = unique_mark("oom")
    if sp:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_AS_LIMIT.format(only_workers=True))
        path = os.pathsep.join([str(site), *(p for p in sys.path if p)])
        rc, _, err = run(argv, timeout=300, HARDEN_TEST_MARK=mark, PYTHONPATH=path)
    else:
        rc, _, err = run(argv, prelude=_AS_LIMIT.format(only_workers=False), timeout=300, HARDEN_TEST_MARK=mark)
    line = check_refusal(rc, err, 2)
    assert "out of memory" in line, line
    if sp:
        assert "rank" in line, line
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)
    assert wait_gone(marked(mark), 10) == []  # no worker outlives the run
