"""A Fun ControlNet graph in the real ComfyUI: H3 Fun ControlNet (a tiny tower file in models/model_patches, a
control video through a stand-in VAE) into the H3 Sampler, on the loader's default stack. The tower must run (the
run report names it, active in every step) and change the result; the same graph without the ControlNet is the
baseline. Core's own Fun ControlNet is not in this ComfyUI snapshot (VENDOR.md), so the values are checked against
core's code only by tests/oracles/check_core_control.py."""

import pytest

from comfyui.graphs import diagnostics_json, load_latent, ours_small, rel_l2
from comfyui.server import require_success

pytestmark = pytest.mark.comfyui


def _fun_prompt(strength: float, save_as: str) -> dict:
    p = ours_small("embedded tiny (seed 0)", save_as, steps=3, seed=31)
    p["10"] = {"class_type": "H3BTest_StandInVAE", "inputs": {"seed": 0}}
    p["11"] = {"class_type": "H3BTest_RandomFrames", "inputs": {"frames": 22, "height": 128, "width": 128, "seed": 17}}
    p["12"] = {"class_type": "H3B_FunControlNetApply", "inputs": {
        "model": ["1", 0], "vae": ["10", 0], "strength": strength, "start_percent": 0.0, "end_percent": 1.0,
        "control_name": "tiny_fun.safetensors", "control_video": ["11", 0]}}
    p["4"]["inputs"]["model"] = ["12", 0]
    return p


def test_fun_controlnet_graph_runs_the_tower(comfyui_server):
    srv = comfyui_server
    require_success(srv.run(_fun_prompt(0.8, "fun_on"), timeout=600), srv)
    report = diagnostics_json(srv, "fun_on")
    control = report.get("control") or {}
    active = control.get("active_steps")
    assert control.get("tower", "").startswith("Fun ControlNet 2 blocks") and active == [0, 1, 2], (
        f"the run report shows no tower active in the 3 steps: {control}")
    assert control.get("strength") == 0.8, control
    require_success(srv.run(_fun_prompt(0.0, "fun_off"), timeout=600), srv)  # strength 0: the model unchanged
    assert not diagnostics_json(srv, "fun_off").get("control"), "strength 0 still attached the tower"
    on, off = load_latent(srv, "fun_on"), load_latent(srv, "fun_off")
    for stream in ("video", "audio"):
        assert on[stream].isfinite().all(), stream
    effect = rel_l2(on["video"], off["video"])
    assert effect > 1e-2, f"the Fun ControlNet changed the video by rel-L2 {effect:.3g} only"
