"""API-format prompts for the comfyui tests, and reading back what the probe nodes saved."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from comfyui.server import REPO

SMOKE = REPO / "workflows" / "h3_smoke_tiny.api.json"


def smoke_prompt(**sampler) -> dict:
    """workflows/h3_smoke_tiny.api.json with the sampler's (node 4) inputs updated."""
    p = json.loads(SMOKE.read_text())
    p["4"]["inputs"].update(sampler)
    return p


def ours_small(model: str, save_as: str, steps: int = 2, seed: int = 7) -> dict:
    """Our loader (a file of models/diffusion_models) -> H3 Sampler on a 128x128x22 canvas -> the probe's
    SaveLatent and H3 Diagnostics (the run report with its latent sha256)."""
    p = smoke_prompt(steps=steps, seed=seed)
    p["1"]["inputs"]["model"] = model
    p["3"]["inputs"].update(width=128, height=128, frames=22)
    p["5"]["inputs"]["filename_prefix"] = f"h3_blackwell/{save_as}"
    p["6"] = {"class_type": "H3BTest_SaveLatent", "inputs": {"samples": ["4", 0], "name": save_as}}
    return p


def load_latent(srv, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(srv.base_dir) / "output" / "h3b_probe" / f"{name}.safetensors"
    assert path.is_file(), f"expected the probe's latent file {path}; not found. Server log:\n{srv.log_tail()}"
    return load_file(str(path))


def diagnostics_json(srv, prefix: str) -> dict:
    """The run report H3 Diagnostics wrote as output/h3_blackwell/<prefix>_NNNNN_.json (the newest)."""
    found = sorted((Path(srv.base_dir) / "output" / "h3_blackwell").glob(f"{prefix}_*.json"))
    assert found, f"expected H3 Diagnostics' JSON output/h3_blackwell/{prefix}_*.json; none. Log:\n{srv.log_tail()}"
    return json.loads(found[-1].read_text())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --- core's samplers around a MODEL (tests/oracles/check_core_model.py's graphs, as server prompts) --------------
def _node(cls: str, **inputs) -> dict:
    return {"class_type": cls, "inputs": inputs}


def core_inputs(prefix: str) -> dict:
    """The nodes both branches share: text conditioning, the empty H3 latent, two guides through a stand-in VAE."""
    p = prefix
    return {
        f"{p}pos": _node("H3BTest_TextConditioning", tokens=12, seed=1234),
        f"{p}lat": _node("EmptyMiniMaxH3LatentAV", width=128, height=96, length=22),
        f"{p}vae": _node("H3BTest_StandInVAE", seed=7),
        f"{p}img0": _node("H3BTest_RandomFrames", frames=1, height=96, width=128, seed=11),
        f"{p}img1": _node("H3BTest_RandomFrames", frames=1, height=96, width=128, seed=12),
        f"{p}g0": _node("MiniMaxH3AddGuide", positive=[f"{p}pos", 0], latent=[f"{p}lat", 0], frame_idx=0,
                        vae=[f"{p}vae", 0], image=[f"{p}img0", 0]),
        f"{p}g1": _node("MiniMaxH3AddGuide", positive=[f"{p}g0", 0], latent=[f"{p}lat", 0], frame_idx=-1,
                        vae=[f"{p}vae", 0], image=[f"{p}img1", 0]),
        f"{p}neg": _node("ConditioningZeroOut", conditioning=[f"{p}pos", 0]),
    }


def _ksampler(model, seed, steps, cfg, sampler, scheduler, pos, neg, latent, denoise=1.0):
    return _node("KSampler", model=model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                 positive=pos, negative=neg, latent_image=latent, denoise=denoise)


def core_graph(name: str, b: str, model: list) -> dict:
    """Branch ``b`` of graph ``name`` on ``model`` (an output reference): {node id: node}; its result is ``{b}out``."""
    pos, neg, lat, guided = [f"{b}pos", 0], [f"{b}neg", 0], [f"{b}lat", 0], [f"{b}g1", 0]
    nodes = core_inputs(b)
    if name == "shift_ksampler":
        nodes[f"{b}shift"] = _node("MiniMaxH3SigmaShift", model=model, shift_video=8.0, shift_audio=2.0)
        nodes[f"{b}out"] = _ksampler([f"{b}shift", 0], 440420, 6, 1.0, "euler", "simple", pos, pos, lat)
    elif name == "lora_shift_ksampler":
        nodes[f"{b}lora"] = _node("LoraLoaderModelOnly", model=model, lora_name="tiny_lora.safetensors",
                                  strength_model=0.8)
        nodes[f"{b}shift"] = _node("MiniMaxH3SigmaShift", model=[f"{b}lora", 0], shift_video=8.0, shift_audio=2.0)
        nodes[f"{b}out"] = _ksampler([f"{b}shift", 0], 440420, 6, 1.0, "euler", "simple", pos, pos, lat)
    elif name == "guides_ksampler_advanced":
        nodes[f"{b}out"] = _node("KSamplerAdvanced", model=model, add_noise="enable", noise_seed=77, steps=6, cfg=1.0,
                                 sampler_name="dpmpp_2m", scheduler="beta", positive=guided, negative=guided,
                                 latent_image=lat, start_at_step=0, end_at_step=10000,
                                 return_with_leftover_noise="disable")
    elif name == "custom_advanced":
        nodes.update({f"{b}guider": _node("BasicGuider", model=model, conditioning=guided),
                      f"{b}noise": _node("RandomNoise", noise_seed=5),
                      f"{b}sampler": _node("KSamplerSelect", sampler_name="res_multistep"),
                      f"{b}sigmas": _node("BasicScheduler", model=model, scheduler="simple", steps=5, denoise=1.0)})
        nodes[f"{b}out"] = _node("SamplerCustomAdvanced", noise=[f"{b}noise", 0], guider=[f"{b}guider", 0],
                                 sampler=[f"{b}sampler", 0], sigmas=[f"{b}sigmas", 0], latent_image=lat)
    elif name == "cfg_two_with_negative":
        nodes[f"{b}out"] = _ksampler(model, 4, 4, 2.5, "euler", "simple", guided, neg, lat)
    else:
        raise ValueError(f"unknown graph {name!r}")
    return nodes


CORE_GRAPHS = ("shift_ksampler", "lora_shift_ksampler", "guides_ksampler_advanced", "custom_advanced",
               "cfg_two_with_negative")


def core_vs_ours(name: str, model_file: str = "tiny.safetensors") -> dict:
    """One prompt: graph ``name`` on core's UNETLoader model (branch c_) and on our loader's MODEL (branch o_),
    each saved by the probe as ``{name}_core`` / ``{name}_ours``."""
    p = {"c_unet": _node("UNETLoader", unet_name=model_file, weight_dtype="default"),
         "o_load": _node("H3B_ModelLoader", model=model_file, gemm="auto", attention="reference", fc2_lt="on",
                         adaln_cache=True)}
    p.update(core_graph(name, "c_", ["c_unet", 0]))
    p.update(core_graph(name, "o_", ["o_load", 1]))
    p["c_save"] = _node("H3BTest_SaveLatent", samples=["c_out", 0], name=f"{name}_core")
    p["o_save"] = _node("H3BTest_SaveLatent", samples=["o_out", 0], name=f"{name}_ours")
    # the run report takes only our MODEL's own last output: proof that our runtime ran this branch
    p["o_report"] = _node("H3B_ModelReport", model=["o_load", 1], latent=["o_out", 0])
    p["o_diag"] = _node("H3B_Diagnostics", diagnostics=["o_report", 0], filename_prefix=f"h3_blackwell/{name}_report",
                        expected_video_sha256="")
    return copy.deepcopy(p)
