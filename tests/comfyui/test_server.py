"""The pack inside the real ComfyUI (vendored 0f1fa67a, on the CPU), on the loader's default stack: what
scripts/comfy_smoke.sh checked by hand — node definitions, the smoke workflow and its hash, the expected-hash check,
node errors, an interrupt — plus a model change between prompts."""

import json
import subprocess
import time

import pytest

from comfyui.graphs import SMOKE, diagnostics_json, load_latent, ours_small, rel_l2, smoke_prompt
from comfyui.server import messages, require_success

pytestmark = pytest.mark.comfyui


def _comfy_run(h3b_cli, srv, out, *args, timeout=600):
    cmd, env = h3b_cli()
    return subprocess.run([*cmd, "comfy-run", str(args[0]) if args else str(SMOKE), "--server", srv.url, "--output",
                           str(out), *args[1:]], env=env, capture_output=True, text=True, timeout=timeout)


def _generate(h3b_cli, install, out, *args) -> str:
    """``h3-blackwell generate`` in ComfyUI's own Python (the same torch build as the server): its video sha256."""
    cmd, env = h3b_cli(install[1])
    r = subprocess.run([*cmd, "generate", "--output", str(out), *args], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"h3-blackwell generate failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads((out / "report.json").read_text())["latent_checksums"]["video_sha256"]


def _fixed(choices):
    """A combo's choices less model files and the "(no ... files)" placeholder: what does not depend on folders."""
    return [c for c in choices if not (c.endswith(".safetensors") or c.startswith("("))]


def test_object_info_serves_the_pack_as_nodes_defines_it(comfyui_server):
    from h3_blackwell.nodes import NODES

    info = comfyui_server.get_json("/object_info")
    missing = [i for i in NODES if i not in info]
    assert not missing, f"/object_info lacks {missing}; server log:\n{comfyui_server.log_tail()}"
    for node_id, cls in NODES.items():
        served, spec = info[node_id], cls.INPUT_TYPES()
        assert served["category"] == "H3 Blackwell" and served["display_name"] == cls.TITLE, node_id
        assert served["output"] == list(cls.RETURN_TYPES) and served["output_name"] == list(cls.RETURN_NAMES), node_id
        assert bool(served["output_node"]) == bool(getattr(cls, "OUTPUT_NODE", False)), node_id
        for section in ("required", "optional"):
            mine = spec.get(section, {})
            assert served["input_order"].get(section, []) == list(mine), (node_id, section)
            for name, (kind, opts) in mine.items():
                s_kind, s_opts = served["input"][section][name][0], served["input"][section][name][1]
                if isinstance(kind, list):  # file lists depend on the server's folders: the fixed entries
                    options = s_opts["options"] if s_kind == "COMBO" else s_kind
                    assert _fixed(options) == _fixed(kind), (node_id, name, options, kind)
                else:
                    assert s_kind == kind, (node_id, name, s_kind)
                for key in ("default", "min", "max", "step", "control_after_generate", "tooltip"):
                    assert s_opts.get(key) == opts.get(key), (node_id, name, key, s_opts.get(key), opts.get(key))
    # the model files the tests made are offered by the loader
    kind, opts = info["H3B_ModelLoader"]["input"]["required"]["model"][:2]
    assert {"tiny.safetensors", "tiny_b.safetensors"} <= set(opts["options"] if kind == "COMBO" else kind)


def test_smoke_workflow_equals_generate(comfyui_server, comfyui_install, h3b_cli, tmp_path):
    srv = comfyui_server
    r = _comfy_run(h3b_cli, srv, tmp_path / "fetched")
    assert r.returncode == 0, f"comfy-run of {SMOKE.name} failed:\n{r.stdout}\n{r.stderr}\n{srv.log_tail()}"
    written = sorted((srv.base_dir / "output" / "h3_blackwell").glob("smoke_*_.json"))
    assert written, "no diagnostics JSON in the server's output folder"
    fetched = tmp_path / "fetched" / "h3_blackwell" / written[-1].name
    assert fetched.read_bytes() == written[-1].read_bytes(), "the JSON fetched through /view differs"
    report = json.loads(written[-1].read_text())
    assert report["latent_checksums"]["video"]["shape"] == [1, 24, 7, 16, 16], report["latent_checksums"]
    cli_sha = _generate(h3b_cli, comfyui_install, tmp_path / "generate")
    assert report["latent_checksums"]["video_sha256"] == cli_sha, "ComfyUI's latent differs from generate's"


def test_expected_hash_passes_when_right_and_fails_when_wrong(comfyui_server, h3b_cli, tmp_path):
    srv = comfyui_server
    r = _comfy_run(h3b_cli, srv, tmp_path / "a", str(SMOKE), "--quiet")
    assert r.returncode == 0, r.stderr
    sha = diagnostics_json(srv, "smoke")["latent_checksums"]["video_sha256"]
    right = _comfy_run(h3b_cli, srv, tmp_path / "b", str(SMOKE), "--quiet", "--set", f"5.expected_video_sha256={sha}")
    assert right.returncode == 0, f"the matching expected hash was refused:\n{right.stderr}"
    wrong = _comfy_run(h3b_cli, srv, tmp_path / "c", str(SMOKE), "--quiet", "--set",
                       f"5.expected_video_sha256={'0' * 64}")
    assert wrong.returncode == 1 and "H3 Diagnostics: video latent sha256 mismatch" in wrong.stderr, (
        f"a wrong expected hash did not fail loudly (rc {wrong.returncode}):\n{wrong.stderr}")


def test_out_of_range_widget_is_refused_as_a_node_error(comfyui_server):
    status, body = comfyui_server.queue(smoke_prompt(steps=500))
    assert status == 400, (status, body)
    errors = body["node_errors"]["4"]
    assert errors["class_type"] == "H3B_Sampler", errors
    assert any("steps" in json.dumps(e) and "bigger than max" in e.get("details", "") + e.get("message", "")
               for e in errors["errors"]), errors


def test_wrong_latent_is_a_node_error_and_the_server_goes_on(comfyui_server):
    srv = comfyui_server
    p = smoke_prompt(steps=2, seed=11)
    p["3"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    entry = srv.run(p)
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = messages(entry)["execution_error"]
    assert err["node_id"] == "4" and err["node_type"] == "H3B_Sampler", err
    assert "H3 Sampler: expected an H3 audio+video LATENT" in err["exception_message"], err
    assert srv.get_json("/system_stats")  # still serving
    require_success(srv.run(smoke_prompt(steps=2, seed=12)), srv)


def _wait_running(srv, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.get_json("/queue").get("queue_running"):
            return
        time.sleep(0.2)
    raise AssertionError(f"the prompt did not start within {timeout:.0f} s")


def test_interrupt_stops_a_long_run_and_the_model_runs_again(comfyui_server):
    srv = comfyui_server
    require_success(srv.run(smoke_prompt(steps=2, seed=20)), srv)  # the loaders are cached from here on
    status, body = srv.queue(smoke_prompt(steps=200, seed=21))
    assert status == 200, body
    _wait_running(srv)
    time.sleep(2.0)  # into the sampler's 200 steps (the loaders are cached)
    t0 = time.monotonic()
    assert srv.request("/interrupt", {})[0] == 200
    entry = srv.wait(body["prompt_id"], timeout=300)
    took = time.monotonic() - t0
    assert entry["status"]["status_str"] == "error", entry["status"]
    stopped = messages(entry).get("execution_interrupted")
    assert stopped is not None and stopped["node_id"] == "4", messages(entry)
    assert took < 60, f"the run took {took:.0f} s to stop after /interrupt"
    require_success(srv.run(smoke_prompt(steps=2, seed=22)), srv)


def test_model_change_between_prompts(comfyui_server, comfyui_install, comfyui_models, h3b_cli, tmp_path):
    """tiny.safetensors, then tiny_b.safetensors (other weights) in the loader: each prompt's latent equals
    `generate --model` of that file, and the two differ."""
    srv = comfyui_server
    shas = {}
    for name in ("tiny.safetensors", "tiny_b.safetensors"):
        tag = name.split(".")[0]
        require_success(srv.run(ours_small(name, f"change_{tag}")), srv)
        shas[name] = diagnostics_json(srv, f"change_{tag}")["latent_checksums"]["video_sha256"]
        want = _generate(h3b_cli, comfyui_install, tmp_path / tag, "--model", str(comfyui_models[name]), "--width",
                         "128", "--height", "128", "--frames", "22", "--steps", "2", "--seed", "7")
        assert shas[name] == want, f"{name}: the server's latent is not generate's on that file"
    a, b = load_latent(srv, "change_tiny"), load_latent(srv, "change_tiny_b")
    assert rel_l2(a["video"], b["video"]) > 1e-2, "the second checkpoint gave the first one's result"
