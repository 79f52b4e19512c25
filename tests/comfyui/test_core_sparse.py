"""Core's "Model Sparse Attention" (its own nodes_sparse_attention.py, read by commit, cached outside git and loaded
as a custom node file: tests/fixtures/core_src.py) on our MODEL in the real ComfyUI on the CPU. As in core, the sparse
path is not eligible on the CPU, so dense runs: the latents equal the plain graph's; our MODEL records the node's
settings (H3 Model Run Report's ``core_sparse_node``). vsa is accepted on our MODEL (core's node finds core's
MiniMaxH3Model), and the loader's MODEL without attention=sparse is not refused on the CPU."""

import pytest

from comfyui.graphs import _ksampler, _node, core_inputs, diagnostics_json, load_latent
from comfyui.server import require_success
from fixtures.core_src import core_file, missing_reason

pytestmark = pytest.mark.comfyui


def _prompt(name: str, selection: dict | None) -> dict:
    p = {"load": _node("H3B_ModelLoader", model="tiny.safetensors", gemm="auto", attention="reference", fc2_lt="on",
                       adaln_cache=True)}
    p.update(core_inputs("o_"))
    model = ["load", 1]
    if selection is not None:
        p["sparse"] = _node("BlockSparseAttention", model=model, start_percent=0.3, end_percent=1.0,
                            dense_blocks="1", min_tokens=0, extra_tokens=256, sink_conditioning="exact_kv",
                            verbose=False, **selection)
        model = ["sparse", 0]
    p["out"] = _ksampler(model, 440420, 4, 1.0, "euler", "simple", ["o_g1", 0], ["o_g1", 0], ["o_lat", 0])
    p["save"] = _node("H3BTest_SaveLatent", samples=["out", 0], name=name)
    p["report"] = _node("H3B_ModelReport", model=model, latent=["out", 0])
    p["diag"] = _node("H3B_Diagnostics", diagnostics=["report", 0], filename_prefix=f"h3_blackwell/{name}",
                      expected_video_sha256="")
    return p


def test_core_sparse_node_on_our_model_records_and_runs_dense(comfyui_server):
    if core_file() is None:
        pytest.skip(missing_reason())
    srv = comfyui_server
    assert "BlockSparseAttention" in srv.get_json("/object_info"), "core's node file did not load"
    require_success(srv.run(_prompt("sparse_plain", None), timeout=600), srv)
    plain = load_latent(srv, "sparse_plain")
    for method, sel in (("sla", {"selection": "sla", "selection.keep_percent": 12.5}),
                        ("vsa", {"selection": "vsa", "selection.keep_percent": 10.0}),
                        ("sol-attn", {"selection": "sol-attn", "selection.tau": 1.5})):
        name = f"sparse_{method}"
        require_success(srv.run(_prompt(name, sel), timeout=600), srv)
        got = load_latent(srv, name)
        for stream in ("video", "audio"):
            assert got[stream].equal(plain[stream]), f"{method}: dense on the CPU must equal the plain graph"
        node = diagnostics_json(srv, name).get("core_sparse_node") or {}
        assert node.get("method") == method and node.get("dense_blocks") == [1], node
        assert node.get("sinks") == "exact_kv" and node["ran"].startswith("dense") and "CPU" in node["ran"], node
        assert node["extra_tokens"] == (0 if method == "vsa" else 256), node
        if method == "sol-attn":
            assert node["tau"] == 1.5, node
        else:
            assert node["keep_percent"] == sel["selection.keep_percent"], node
