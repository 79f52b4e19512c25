"""bench/user_jobs.py end to end on the CPU (--tiny): a resident and a capped row of our stack, each in its own child
process, the JSON merged across calls, the README table generated from it; and the run report's host RSS peak."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "user_jobs.py"), "--tiny", "--stacks", "ours", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_tiny_rows_merge_and_table(tmp_path):
    out, work = tmp_path / "uj.json", tmp_path / "work"
    p = _bench("--rows", "turbo8:resident", "--out", str(out), "--workdir", str(work), "--runs", "2", "--profile-step")
    assert p.returncode == 0, p.stderr[-2000:]
    p = _bench("--rows", "turbo8:8:1", "--out", str(out), "--workdir", str(work), "--merge")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = {(r["job"], r["cap_gb"]): r for r in res["rows"]}
    assert set(rows) == {("turbo8", None), ("turbo8", 8)}
    resident, capped = rows[("turbo8", None)]["ours"], rows[("turbo8", 8)]["ours"]
    assert "error" not in resident and "error" not in capped, (resident, capped)
    assert capped["memory"]["streamed_blocks"] and not resident["memory"]["streamed_blocks"]
    key = ("video_sha256", "audio_sha256")
    assert [capped["latent_checksums"][k] for k in key] == [resident["latent_checksums"][k] for k in key]  # no byte
    assert capped["latent_checksums"]["exact_across_measured_runs"] is None  # one run: nothing compared
    assert capped["hashes_equal_resident"] is True
    assert capped["step_ratio_to_resident"] == pytest.approx(capped["step_seconds"] / resident["step_seconds"])
    assert resident["measured_runs"] == 2 and resident["latent_checksums"]["exact_across_measured_runs"]
    prof = resident["step_profile"]  # one more step under torch.profiler, after the timed runs
    assert prof["clock"] == "cpu" and prof["top"] and prof["self_seconds_total"] > 0
    assert all(0 < t["share"] <= 1 and t["calls"] >= 1 for t in prof["top"]) and "step_profile" not in capped
    assert 0 < resident["job_seconds"] and resident["step_seconds"] > 0
    # the job is the load, the LoRA and the first run, whole; the second run (the hash check) is a run of its own
    per_run = resident["sampling_seconds_per_run"]
    assert len(per_run) == 2 and resident["job_seconds"] >= resident["load_seconds"] + resident["lora_seconds"] + per_run[0]
    assert resident["host_peak_rss_bytes"] > 10 ** 8 and rows[("turbo8", 8)]["lora_rank_source"]
    assert capped["measured_runs"] == 1  # the row's own runs (job:cap:runs) over --runs
    assert resident["lease"] == capped["lease"] and resident["lease"]
    assert rows[("turbo8", 8)]["speedup"] is None and "did not run" in rows[("turbo8", 8)]["speedup_note"]
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    gen = [sys.executable, str(ROOT / "bench" / "user_jobs_table.py"), "--json", str(out), "--readme", str(readme)]
    assert subprocess.run(gen, timeout=60).returncode == 0
    text = readme.read_text()
    assert "| turbo8 | 8 GB |" in text and res["date"][:10] in text
    assert text.index("| turbo8 | resident |") < text.index("| turbo8 | 8 GB |")  # resident first, whatever the merge
    assert f"| {resident['lease'][:8]} |" in text  # both stacks' lease, once where they agree
    ratio = capped["step_seconds"] / resident["step_seconds"]
    assert f"ours {ratio:.2f}x its resident step, the resident hashes" in text  # the capped row against resident
    assert subprocess.run(gen + ["--check"], timeout=60).returncode == 0
    missing = subprocess.run(gen[:2] + ["--json", str(tmp_path / "none.json"), "--readme", str(readme)], timeout=60)
    assert missing.returncode == 2


@pytest.mark.comfyui
def test_tiny_row_runs_core_stack_from_the_vendored_comfyui(tmp_path):
    """Core's side of a row with the vendored ComfyUI's modules on the CPU (its own venv), as a workflow loads it:
    core's fp8 file of the same random weights through UNETLoader's ``comfy.sd.load_diffusion_model``, the turbo
    LoRA through LoraLoaderModelOnly's ``load_lora_for_models`` (every layer of the file matched by core's key map),
    ``load_models_gpu``; the sparse job is recorded with core's missing feature, not dropped."""
    from tests.comfyui.server import comfyui_paths

    src, py = comfyui_paths()
    out = tmp_path / "uj.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "user_jobs.py"), "--tiny", "--rows",
                        "turbo8:resident,turbo8_sparse:resident", "--out", str(out), "--workdir", str(tmp_path / "w"),
                        "--comfyui", str(src), "--core-python", str(py)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["job"]: r for r in json.loads(out.read_text())["rows"]}
    core = rows["turbo8"]["core"]
    assert "error" not in core, core.get("traceback", core)
    assert core["lora"]["patched_weights"] == core["lora"]["lora_layers"] > 0, core["lora"]
    assert core["loaded_by"].startswith("comfy.sd.load_diffusion_model") and "load_models_gpu" in core["loaded_by"]
    assert core["load_seconds"] > 0 and core["sampling_seconds"] > 0 and core["compute_dtype"] == "float32"
    res = json.loads(out.read_text())
    assert set(res["files"]) == {"ours", "core", "checkpoints_in"}, res["files"]
    assert "error" not in res["files"]["ours"] and "error" not in res["files"]["core"]
    assert res["files"]["checkpoints_in"] == {"ours": "the work folder (a small model)",
                                              "core": "the work folder (a small model)"}
    assert all(res["warmup"][s]["job_seconds"] > 0 for s in ("ours", "core")), res["warmup"]
    assert rows["turbo8"]["speedup"] == core["job_seconds"] / rows["turbo8"]["ours"]["job_seconds"]
    assert "missing feature" in rows["turbo8_sparse"]["core"]["error"] and rows["turbo8_sparse"]["speedup"] is None


_AIMDO_ORDER = r"""
import json, sys, types
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import _core_model as C
import user_jobs as U
seen = {}

def before(cli):
    seen["reserve_vram"] = cli.args.reserve_vram
    seen["memory_modules_imported"] = sorted(m for m in ("comfy.model_management", "comfy.model_patcher",
                                                         "comfy_aimdo.host_buffer") if m in sys.modules)
    # core_aimdo_load as on CUDA (this CPU run passes --cpu, where core keeps DynamicVRAM off)
    dyn = types.SimpleNamespace(args=cli.args, enables_dynamic_vram=lambda: True)
    seen["load"] = U.core_aimdo_load(dyn, True)
    seen["load_cpu"] = U.core_aimdo_load(cli, False)

C.import_core("pytorch", True, __import__("pathlib").Path(sys.argv[1]), ("--reserve-vram", "2.5"), before)
import comfy_aimdo.control, comfy_aimdo.host_buffer
seen["host_buffer_bound"] = comfy_aimdo.host_buffer.lib is not None and \
    comfy_aimdo.host_buffer.lib is comfy_aimdo.control.lib
print(json.dumps(seen))
"""


@pytest.mark.comfyui
def test_core_stack_loads_aimdo_before_core_modules_and_keeps_the_cap_flag(tmp_path):
    """main.py's order for the in-process core stack: core's CLI flags (the cap's --reserve-vram as well as the
    attention flag) are parsed, then comfy-aimdo's library is loaded, then core's modules are imported, so
    ``comfy_aimdo.host_buffer`` binds the library (on the H100 the reverse order left it None, and core's
    ModelPatcherDynamic failed in HostBuffer)."""
    from tests.comfyui.server import comfyui_paths

    src, py = comfyui_paths()
    script = tmp_path / "order.py"
    script.write_text(_AIMDO_ORDER)
    p = subprocess.run([str(py), str(script), str(src), str(ROOT / "bench")], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["reserve_vram"] == 2.5 and seen["memory_modules_imported"] == [], seen
    assert seen["load"] == "loaded" and seen["load_cpu"].startswith("off: core enables DynamicVRAM only on CUDA")
    assert seen["host_buffer_bound"], seen


def test_a_stack_kept_from_an_earlier_call_is_compared_only_within_one_lease(tmp_path):
    """--merge keeps the stack a call does not run; the row's speedup needs both stacks from one lease (the boot id)
    and one card, else it is None and ``speedup_note`` says why."""
    out, work = tmp_path / "uj.json", tmp_path / "work"
    assert _bench("--rows", "turbo8:resident:1", "--out", str(out), "--workdir", str(work)).returncode == 0
    res = json.loads(out.read_text())
    ours = res["rows"][0]["ours"]
    boot = Path("/proc/sys/kernel/random/boot_id")
    assert "error" not in ours and ours["lease"] and (not boot.is_file() or ours["lease"] == boot.read_text().strip())
    for lease, compared in ((ours["lease"], True), ("another-boot", False)):
        # core's side as an earlier call would have left it (a fixture: the CPU suite runs no core here)
        res["rows"][0]["core"] = {"job_seconds": 3.0, "device": ours["device"], "lease": lease}
        out.write_text(json.dumps(res))
        p = _bench("--rows", "turbo8:resident:1", "--out", str(out), "--workdir", str(work), "--merge")
        assert p.returncode == 0, p.stderr[-2000:]
        row = json.loads(out.read_text())["rows"][0]
        assert row["core"]["job_seconds"] == 3.0 and row["core"]["lease"] == lease  # kept
        if compared:
            assert row["speedup"] == pytest.approx(3.0 / row["ours"]["job_seconds"]) and "speedup_note" not in row
        else:
            assert row["speedup"] is None and "different leases" in row["speedup_note"]
    bad = _bench("--rows", "turbo8:8:0", "--out", str(out), "--workdir", str(work))
    assert bad.returncode != 0 and "runs must be 1 or more" in bad.stderr


def test_a_job_the_carried_core_cannot_run_is_recorded_without_its_files(tmp_path):
    """turbo8_sparse on core's side: the carried snapshot has no sparse-attention node, so the row records that
    error at once, with the call's lease, without writing core's checkpoint or starting a child."""
    out, work = tmp_path / "uj.json", tmp_path / "work"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "user_jobs.py"), "--tiny", "--stacks", "core", "--rows",
                        "turbo8_sparse:8:1,turbo8_sparse:resident:1", "--out", str(out), "--workdir", str(work)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert len(rows) == 2 and "core" not in res["files"] and "core" not in res["warmup"]  # no files, no warm-up
    for r in rows:
        assert r["core"]["error"].startswith("missing feature: core's sparse-attention node") and r["core"]["lease"]
        assert r["speedup"] is None and "did not run" in r["speedup_note"]
    assert not any(work.glob("**/*core_fp8*"))  # core's checkpoint was never written
