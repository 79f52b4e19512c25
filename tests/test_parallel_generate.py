"""``generate --sequence-parallel 2`` on the CPU (gloo, 2 worker processes, the embedded tiny model: 4 heads,
fp32 reference blocks) against the single-process run, and its up-front errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from h3_blackwell.cli import main as cli
from h3_blackwell.runtime.model.config import TINY

BASE = ["--dense", "--dtype", "float32", "--device", "cpu", "--steps", "2"]
# 9 text + 16 audio + 8 video = 33 packed rows: 17 per rank, the boundary inside the audio segment, 1 padding row
SMALL = ["--width", "64", "--height", "64", "--frames", "5", "--text-tokens", "9"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _pair(tmp_path, extra):
    assert cli.main(["generate", "--output", str(tmp_path / "one"), *BASE, *extra]) == 0
    assert cli.main(["generate", "--output", str(tmp_path / "sp"), *BASE, *extra, "--sequence-parallel", "2"]) == 0
    one, sp = (load_file(str(tmp_path / d / "latents.safetensors")) for d in ("one", "sp"))
    rep = json.loads((tmp_path / "sp" / "report.json").read_text())
    return one, sp, rep


def _check(one, sp, rep, rows, chunk, pad):
    # fp32 on both sides; the ranks run the same per-row and per-head math, only GEMM blocking over fewer rows
    # and the reduction order inside attention can differ (~1e-7 seen): 1e-5 is the bound
    for k in ("video", "audio"):
        assert _rel(sp[k], one[k]) <= 1e-5, (k, _rel(sp[k], one[k]))
    assert rep["workload"]["packed_tokens"] == rows
    s = rep["sequence_parallel"]
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["latents_identical_across_ranks"]
    assert (s["rows_per_rank"], s["padding_rows"]) == (chunk, pad)
    hd = TINY.num_heads * TINY.head_dim
    assert s["all_to_all"]["bytes_per_block"] == chunk * 4 * hd * 4  # qkv (3 H D) out + output (H D) back, fp32
    assert s["all_to_all"]["calls_per_step"] == 2 * TINY.num_layers
    assert [r["rank"] for r in s["ranks"]] == [0, 1]
    for r in s["ranks"]:
        run = r["runs"][0]
        assert len(run["per_step_seconds"]) == 2 and len(run["all_to_all_seconds_per_step"]) == 2
        assert all(t > 0 for t in run["all_to_all_seconds_per_step"])
        assert "peak_allocated_bytes" in run


def test_sequence_parallel_2_matches_single_process(tmp_path):
    # default tiny canvas: 32 text + 74 audio + 448 video rows = 554; the boundary at 277 cuts the video segment
    one, sp, rep = _pair(tmp_path, [])
    _check(one, sp, rep, rows=554, chunk=277, pad=0)


def test_sequence_parallel_2_segments_straddle_the_boundary_with_padding(tmp_path):
    # 64x64, 5 frames, 9 text tokens: 9 text + 16 audio + 8 video = 33 rows -> 17 per rank, one padding row at
    # the tail of rank 1; the boundary at 17 cuts the audio segment [9, 25), whose two parts take their
    # modulation from the same row on both ranks
    one, sp, rep = _pair(tmp_path, SMALL)
    _check(one, sp, rep, rows=33, chunk=17, pad=1)


@pytest.mark.parametrize("stack, tol, why", [
    # W4A8 (the Hopper default): per-row e4m3 scales make every producer row-local; what differs is the fp32
    # accumulation order of the GEMMs over fewer rows, and such a last-bit change can move one e4m3 code (2^-4)
    (["--act-format", "fp8", "--gemm", "fp8"], 2e-3, "W4A8"),
    # W4A4 with the dynamic scale: each rank takes the amax of its own rows, so the NVFP4 codes themselves differ
    # (a valid quantization each; W4A4's own error against exact math is ~5e-2, bench/NOTES.md)
    (["--act-format", "nvfp4"], 3e-2, "W4A4 dynamic"),
])
def test_sequence_parallel_2_runs_the_quantized_stacks(tmp_path, stack, tol, why):
    args = ["--dtype", "float32", "--device", "cpu", "--steps", "2", *SMALL, *stack]
    assert cli.main(["generate", "--output", str(tmp_path / "one"), *args]) == 0
    assert cli.main(["generate", "--output", str(tmp_path / "sp"), *args, "--sequence-parallel", "2"]) == 0
    one, sp = (load_file(str(tmp_path / d / "latents.safetensors")) for d in ("one", "sp"))
    rep = json.loads((tmp_path / "sp" / "report.json").read_text())
    assert rep["backends"]["act_format"]["choice"] == ("fp8" if why == "W4A8" else "nvfp4")
    for k in ("video", "audio"):
        assert _rel(sp[k], one[k]) <= tol, (why, k, _rel(sp[k], one[k]))
    s = rep["sequence_parallel"]
    assert s["latents_identical_across_ranks"]
    assert s["numerics"].startswith("W4A4") == (why == "W4A4 dynamic")


@pytest.mark.parametrize("extra, expect", [
    (["--sequence-parallel", "3"], "error: --sequence-parallel 3 does not divide the model's 4 attention heads; "
                                   "use one of [1, 2, 4]"),
    (["--sequence-parallel", "0"], "error: --sequence-parallel 0: expected an integer >= 1"),
    (["--sequence-parallel", "2", "--device", "cuda"], "error: --sequence-parallel 2 needs 2 CUDA devices"),
])
def test_bad_degree_is_one_error_line_before_any_work(tmp_path, capsys, extra, expect):
    if "cuda" in extra and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 CUDA devices")
    assert cli.main(["generate", "--output", str(tmp_path / "o"), "--dense", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expect), err
    assert not (tmp_path / "o").exists()


def test_torchrun_environment_runs_the_distributed_path_in_process(tmp_path, monkeypatch, capsys):
    # what torchrun --nproc-per-node 1 sets: this process is rank 0 of a world of one (gloo, in process)
    from h3_blackwell.runtime.parallel.launch import free_port

    assert cli.main(["generate", "--output", str(tmp_path / "one"), *BASE]) == 0
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["generate", "--output", str(tmp_path / "tr"), *BASE]) == 0
    one, tr = (load_file(str(tmp_path / d / "latents.safetensors")) for d in ("one", "tr"))
    rep = json.loads((tmp_path / "tr" / "report.json").read_text())
    s = rep["sequence_parallel"]
    assert s["launch"] == "torchrun" and s["world_size"] == 1
    assert s["all_to_all"]["calls_per_step"] == 0 and s["all_to_all"]["bytes_per_block"] == 0  # nothing exchanged
    # the sharded evaluation of a world of one runs the same ops on the same rows as the plain path: same bytes
    for k in ("video", "audio"):
        assert torch.equal(tr[k], one[k]), (k, _rel(tr[k], one[k]))
    with pytest.raises(SystemExit):  # the flag must agree with torchrun's world size
        raise SystemExit(cli.main(["generate", "--output", str(tmp_path / "x"), *BASE, "--sequence-parallel", "2"]))
    assert "--sequence-parallel 2 but torchrun started WORLD_SIZE=1" in capsys.readouterr().err
