"""What a new user met on a fresh clone (issue 35, "First use"), each fixed and kept fixed here:

* typos: ``generate --ouput`` printed 23 lines of usage without naming ``--ouput``; ``--stepz`` pointed to the
  top-level help. Now one line names the option, the nearest known one and the command's help;
* ``forward --out`` but ``generate --output``: both spellings on both;
* ``exact across runs: True`` after a single run;
* a tiny CPU job beside one busy process took 36 s instead of 0.3 s (a 2-thread pool oversubscribed): CPU threads
  are chosen for the work (``runtime.cpu_thread_count``);
* a request far beyond the machine sat silent: a slow step shows its blocks with an ETA, and a run estimated to
  take hours is a warning (before it starts on the CPU, and from its first blocks everywhere);
* the first ``run_tiny.sh`` was silent for ~40 s while it installed;
* the README never said how to reach the CLI after its two commands, nor where its Python example's torch is.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from h3_blackwell.cli import commands, progress as P
from h3_blackwell.cli.main import main
from h3_blackwell.cli.parser import build_parser
from h3_blackwell.runtime import (Hooks, Launch, RuntimeOptions, SampleInputs, SamplingSettings, cpu_thread_count,
                                   load_model, make_job, run, sample, summary)
from h3_blackwell.runtime.options import SMALL_CPU_WORK

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# typos and spellings
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag, near, command", [
    (["generate", "--ouput", "out"], "--ouput", "--output", "generate"),
    (["generate", "--output", "out", "--stepz", "2"], "--stepz", "--steps", "generate"),
    (["generate", "--output", "out", "--seed", "-3", "--widht=64"], "--widht", "--width", "generate"),
    (["forward", "--modle", "m", "--inputs", "i", "--out", "o"], "--modle", "--model", "forward"),
    (["make-tiny", "t.safetensors", "--sed", "1"], "--sed", "--seed", "make-tiny"),
    (["--debugg", "generate", "--output", "out"], "--debugg", "--debug", None),
])
def test_an_unknown_option_is_named_with_the_nearest_one(capsys, argv, flag, near, command):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # no screen of usage
    prog = "h3-blackwell" + (f" {command}" if command else "")
    assert err[0] == f"error: {prog}: unknown option {flag}; did you mean {near}? (see {prog} --help)"


def test_an_unknown_option_far_from_every_known_one_has_no_suggestion(capsys):
    assert main(["generate", "--output", "out", "--zzzzzzzz"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --zzzzzzzz (see h3-blackwell generate --help)" in err and "did you mean" not in err


def test_abbreviations_and_option_values_that_look_like_flags_stay_accepted():
    a = build_parser().parse_args(["generate", "--outp", "d", "--seed", "-1", "--deno", "0.5"])
    assert (a.output, a.seed, a.denoise) == ("d", -1, 0.5)


@pytest.mark.parametrize("command, flag, dest", [("generate", "--out", "output"), ("generate", "--output", "output"),
                                                 ("forward", "--out", "out"), ("forward", "--output", "out")])
def test_out_and_output_are_both_spellings_on_both_commands(command, flag, dest):
    extra = ["--model", "m", "--inputs", "i"] if command == "forward" else []
    a = build_parser().parse_args([command, *extra, flag, "here"])
    assert getattr(a, dest) == "here"


# ---------------------------------------------------------------------------------------------
# the summary of one run
# ---------------------------------------------------------------------------------------------

def _report(runs: int, exact: bool = True) -> dict:
    return {"device": "CPU", "compute_capability": "cpu", "median_sampling_seconds": 1.0,
            "sampling_seconds": [1.0] * runs,
            "workload": {"resolution": [256, 256], "frames": 22, "packed_tokens": 554, "steps": 8},
            "latent_checksums": {"video_sha256": "a" * 64, "audio_sha256": "b" * 64,
                                 "exact_across_measured_runs": exact}}


def test_summary_of_one_run_claims_no_exactness_across_runs():
    one = summary(_report(1))
    assert "1 run, nothing to compare" in one and "exact across runs" not in one
    assert "exact across runs: False" in summary(_report(3, exact=False))
    assert "exact across runs: True" in summary(_report(2))


# ---------------------------------------------------------------------------------------------
# CPU threads
# ---------------------------------------------------------------------------------------------

def test_cpu_thread_count_picks_one_thread_for_small_work_and_the_free_cores_for_big():
    assert cpu_thread_count("auto", 554, 96, default=2, free=2) == 1  # the tiny model's job
    big_rows = SMALL_CPU_WORK // 96 + 1
    assert cpu_thread_count("auto", big_rows, 96, default=2, free=2) == 2
    assert cpu_thread_count("auto", big_rows, 96, default=8, free=3) == 3   # another process holds cores
    assert cpu_thread_count("auto", big_rows, 96, default=4, free=16) == 4  # never more than torch's own count
    assert cpu_thread_count("3", 554, 96, default=2, free=1) == 3           # a number is taken as given


def test_cpu_threads_option_reads_its_variable_then_omp_and_refuses_nonsense():
    assert RuntimeOptions.from_env({}).cpu_threads == "auto"
    assert RuntimeOptions.from_env({"H3_CPU_THREADS": "4", "OMP_NUM_THREADS": "2"}).cpu_threads == "4"
    assert RuntimeOptions.from_env({"OMP_NUM_THREADS": "2"}).cpu_threads == "2"
    assert RuntimeOptions.from_env({"OMP_NUM_THREADS": "2"}, cpu_threads="auto").cpu_threads == "auto"
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="cpu_threads.*auto or a positive whole number"):
            RuntimeOptions(cpu_threads=bad)
    assert "H3_CPU_THREADS" not in RuntimeOptions().as_env()  # the nodes never act on it: not configuration


def _job(tmp_path, *flags):
    a = build_parser().parse_args(["generate", "--output", str(tmp_path / "o"), "--device", "cpu", *flags])
    return commands.generate_job(a)


def test_generate_sets_one_thread_for_the_tiny_job_and_the_flag_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("H3_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert commands.cpu_threads(_job(tmp_path, "--cpu-threads", "auto")) == 1
        assert torch.get_num_threads() == 1
        assert commands.cpu_threads(_job(tmp_path, "--cpu-threads", "2")) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# progress within a step, and runs that take hours
# ---------------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_slow_step_shows_its_blocks_with_an_eta_and_an_hours_run_warns_once(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    p = P.Progress("sampling", steps=20, runs=1)
    for j in range(1, 51):  # 50 blocks of 12 s: a 10-minute step, 20 steps: 3:20 h
        clock.t += 12.0
        p.block(0, j, 50)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert "takes about 3:20:00 (one block took 12.0 s; 50 blocks x 20 steps x 1 run(s))" in err
    lines = [x for x in err.splitlines() if x.startswith("sampling step 1/20 blocks")]
    assert lines and "ETA" in lines[0] and "run ETA" in lines[0]
    first = lines[0]
    done = int(re.search(r"\] (\d+)/50", first).group(1))
    assert f"run ETA {P.clock(12.0 * 50 * 20 - 12.0 * done)}" in first  # the step's pace over the whole run


def test_a_fast_step_says_nothing_about_its_blocks(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    p = P.Progress("sampling", steps=8)
    for j in range(1, 4):
        clock.t += 0.01
        p.block(0, j, 3)
    assert capsys.readouterr().err == ""


class Recorder:
    """A progress object with ``block``: the steps and the (step, block, blocks) triples it was given."""

    def __init__(self):
        self.steps, self.seen = [], []

    def __call__(self, done, total):
        self.steps.append(done)

    def block(self, step, done, total):
        self.seen.append((step, done, total))


def test_the_runtime_reports_every_block_of_every_step():
    rt = load_model(None, RuntimeOptions(device="cpu"))
    n = rt.config.num_layers
    rec = Recorder()
    sample(rt, SampleInputs(torch.randn(1, 8, rt.config.text_dim), None, torch.zeros(1, 24, 2, 4, 4),
                            torch.zeros(1, 32, 2, 5)),
           SamplingSettings(seed=1, steps=2), hooks=Hooks(progress=rec, block=rec.block))
    assert rec.steps == [1, 2]
    assert rec.seen == [(i, j, n) for i in range(2) for j in range(1, n + 1)]


def test_a_job_hands_its_progress_blocks_to_the_sampler():
    """run(job): a progress object with ``block`` (the CLI's Progress) gets every block; a plain step callback
    (the nodes') gets the steps only."""
    rec = Recorder()
    job = make_job(None, sampling=SamplingSettings(seed=1, steps=2), options={"device": "cpu"},
                   launch=Launch(progress=lambda: rec))
    run(job)
    n = job.config.num_layers
    assert rec.steps == [1, 2] and rec.seen == [(i, j, n) for i in range(2) for j in range(1, n + 1)]
    plain = []
    run(make_job(None, sampling=SamplingSettings(seed=1, steps=2), options={"device": "cpu"},
                 launch=Launch(progress=lambda: (lambda done, total: plain.append(done)))))
    assert plain == [1, 2]


def test_a_cpu_run_of_hours_is_a_warning_before_it_starts(tmp_path, capsys, monkeypatch):
    big = _job(tmp_path, "--width", "8192", "--height", "8192", "--steps", "20")
    assert commands.warn_if_hours(big) >= P.WARN_AFTER_S
    assert "warning: this run needs at least" in capsys.readouterr().err
    tiny = _job(tmp_path)
    monkeypatch.setattr(commands, "measured_flops_per_s", lambda: pytest.fail("the tiny job must not be timed"))
    assert commands.warn_if_hours(tiny) is None and capsys.readouterr().err == ""


def test_the_flop_count_follows_the_model(tmp_path):
    """The lower bound's FLOPs: 2 x rows x (4 h inner + 3 h ffn) linear + 4 rows^2 inner attention per block."""
    job = _job(tmp_path, "--steps", "2")
    c = job.config
    video, audio = job.latents(c)
    rows = job.inputs.text.shape[-2] + 2 * audio.shape[3] + video.shape[2] * (video.shape[3] // 2) * (video.shape[4] // 2)
    per_block = 2 * rows * (4 * c.hidden_size * c.inner_dim + 3 * c.hidden_size * c.ffn_hidden_size) \
        + 4 * rows ** 2 * c.inner_dim
    assert commands.cpu_matmul_flops(job) == per_block * c.num_layers * 2


# ---------------------------------------------------------------------------------------------
# the scripts and the README
# ---------------------------------------------------------------------------------------------

def test_the_first_install_says_what_it_is_doing(tmp_path):
    """h3_install (run_tiny.sh, test.sh) announces the install before pip's silent minute; a stand-in venv whose
    python accepts everything keeps this test from installing anything."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    r = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/_env.sh && h3_install preview"], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "H3_VENV": str(venv)})
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith(f"installing h3-blackwell[preview] into {venv} "), r.stderr
    for script in ("run_tiny.sh", "test.sh"):
        assert "h3_install" in (ROOT / "scripts" / script).read_text()


def test_the_readme_says_how_to_reach_the_cli_and_the_examples_torch():
    text = (ROOT / "README.md").read_text()
    two = text[text.index("## Two commands"):text.index("## The CLI")]
    assert ".venv/bin/h3-blackwell" in two and "source .venv/bin/activate" in two
    assert ".venv/bin/python" in two  # the Python example's torch is the .venv's


def test_the_readme_install_section_covers_the_four_ways():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Installing into ComfyUI"):]
    section = section[:section.index("\n## ", 1)]
    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for needle in ("ComfyUI-Manager", f"comfy node install {name}", "pip install", "git clone",
                   "custom_nodes/"):
        assert needle in section, needle
    # each way's test (the lead reads this list when one of them changes)
    tests = {"tests/test_packaging.py": "test_wheel_installed_outside_the_checkout",
             "tests/test_comfy_meta.py": "test_custom_nodes_copy_loads_as_comfyui_loads_it"}
    for path, test in tests.items():
        assert f"def {test}" in (ROOT / path).read_text()
