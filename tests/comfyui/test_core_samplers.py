"""Core's samplers (KSampler, KSamplerAdvanced, SamplerCustomAdvanced, with MiniMaxH3SigmaShift, MiniMaxH3AddGuide,
LoraLoaderModelOnly) on our MODEL (H3 NVFP4 Model Loader's second output) against core's own H3 model (UNETLoader),
same tiny weights, in one prompt to the real ComfyUI: tests/oracles/check_core_model.py's check, through the server.

The server runs our runtime dense (H3_NVFP4=0, fp32, attention "reference"), as the oracle does: the comparison is of
the adapter, not of NVFP4. Tolerance 1e-3 rel-L2 per stream (the oracle's; measured ~1e-7: both sides are fp32 on
the same torch, they differ in summation order only)."""

import pytest

from comfyui.graphs import CORE_GRAPHS, core_vs_ours, diagnostics_json, load_latent, rel_l2
from comfyui.server import require_success

pytestmark = pytest.mark.comfyui
TOL = 1e-3


@pytest.mark.parametrize("name", CORE_GRAPHS)
def test_core_sampler_on_our_model_matches_core_model(comfyui_dense_server, name):
    srv = comfyui_dense_server
    require_success(srv.run(core_vs_ours(name), timeout=600), srv)
    core, ours = load_latent(srv, f"{name}_core"), load_latent(srv, f"{name}_ours")
    assert set(core) == set(ours) == {"video", "audio"}, (sorted(core), sorted(ours))
    for stream in ("video", "audio"):
        assert ours[stream].shape == core[stream].shape, (stream, ours[stream].shape, core[stream].shape)
        assert ours[stream].isfinite().all() and ours[stream].abs().max() > 0.1, f"{stream}: a degenerate result"
        err = rel_l2(ours[stream], core[stream])
        assert err <= TOL, f"{name} {stream}: our MODEL differs from core's model by rel-L2 {err:.3g} (> {TOL})"
    report = diagnostics_json(srv, f"{name}_report")
    assert report["workload"]["model_calls"] > 0, report["workload"]  # our runtime ran it, not core's model code
    if name == "lora_shift_ksampler":
        assert "merged" in ((report["backends"].get("lora") or {}).get("reason") or ""), report["backends"]


def test_lora_changes_the_result(comfyui_dense_server):
    """The LoRA graph must differ from the plain one, else its comparison would not test the LoRA path."""
    srv = comfyui_dense_server
    for name in ("shift_ksampler", "lora_shift_ksampler"):
        if not (srv.base_dir / "output" / "h3b_probe" / f"{name}_core.safetensors").is_file():
            require_success(srv.run(core_vs_ours(name), timeout=600), srv)
    plain, lora = load_latent(srv, "shift_ksampler_core"), load_latent(srv, "lora_shift_ksampler_core")
    assert rel_l2(lora["video"], plain["video"]) > 10 * TOL
