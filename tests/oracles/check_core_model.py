"""Acceptance of the H3 MODEL (H3 NVFP4 Model Loader's second output) inside a ComfyUI with core H3, on the CPU.

Not a pytest module and not run by CI (it needs a ComfyUI checkout, which is never committed). Core's own nodes run
the same graph twice on the same ``make-tiny`` file: once on core's ``UNETLoader`` model, once on our MODEL (the
runtime loaded dense: ``H3_NVFP4=0``, fp32, attention reference); the two LATENTs must agree within 1e-3 rel-L2
per stream, and H3 Model Run Report must take our LATENT and refuse core's (same shapes, other values). Graphs:

- ``shift_ksampler``: ``MiniMaxH3SigmaShift`` (video 8, audio 2) + ``KSampler`` (euler, simple);
- ``guides_ksampler_advanced``: ``MiniMaxH3AddGuide`` first frame (index 0) and last frame (index -1) +
  ``KSamplerAdvanced`` (dpmpp_2m, beta);
- ``lora_shift_ksampler``: ``LoraLoaderModelOnly`` at strength 0.8 before the shift, then as the first graph;
- ``custom_advanced_refs``: a ``MiniMaxH3ReferenceToVideo``-shaped conditioning (two images, a video with its
  soundtrack, an audio) through ``SamplerCustomAdvanced`` (BasicGuider, res_multistep, simple), the template's
  sampling path.
- ``partial_denoise_and_steps``: KSampler at denoise 0.6 on a filled latent, then KSamplerAdvanced steps 2..5 of 8
  with leftover noise on the guided conditioning;
- ``off_schedule_sigmas``: dpm_2 / karras and heun / normal (model calls between the schedule's sigmas);
- ``noise_mask``: SetLatentNoiseMask (right half regenerated) + KSampler;
- ``cfg_two_with_negative``: KSampler at cfg 2.5 with a ConditioningZeroOut negative (two conditionings per step);
- ``fun_controlnet_ksampler`` (only with ``--fun-patch-module``, from a checkout that has core's
  ``comfy/ldm/minimax/controlnet.py``): core's Fun ControlNet (a v1-shaped tiny tower, a control video through a
  stand-in VAE, strength 0.8, a sigma window inside the schedule) recorded on each MODEL as
  ``MiniMaxH3FunControlNetApply`` records it (its diffusion-model wrapper and one block patch per injection layer,
  the patch classes loaded from that file, as tests/oracles/check_core_control.py loads them), then KSampler.

The guide images go through a stand-in VAE (a fixed projection of 16x16 pixel blocks to 24 channels): the graphs
need latents of the real shapes, not real VAE weights. Usage::

    cd <ComfyUI checkout> && <its python> <repo>/tests/oracles/check_core_model.py [--json out.json]

The repository must be importable as ``h3_blackwell`` (the script puts a link to it on sys.path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-3


def _import_path() -> None:
    """Make ``import h3_blackwell`` resolve to this checkout (a link named h3_blackwell in a temp folder)."""
    link_dir = Path(tempfile.mkdtemp(prefix="h3b-pkg-"))
    (link_dir / "h3_blackwell").symlink_to(REPO)
    sys.path.insert(0, str(link_dir))
    sys.path.insert(1, str(REPO / "tests"))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class StandInVAE:
    """``encode(pixels [F, H, W, 3])`` -> ``[1, 24, t, H/16, W/16]`` (t = 1 for one frame, 5k+2 for 17k+5):
    mean of each 16x16 block through a fixed 3->24 projection (seed 7), so guides carry image content."""

    def __init__(self):
        self.proj = torch.randn(24, 3, generator=torch.Generator().manual_seed(7))

    def encode(self, pixels):
        f, h, w, _ = pixels.shape
        blocks = pixels[..., :3].float().reshape(f, h // 16, 16, w // 16, 16, 3).mean(dim=(2, 4))  # [F, h, w, 3]
        lat = torch.einsum("fhwc,dc->dfhw", blocks, self.proj)
        t = 1 if f < 5 else (f - 5) // 17 * 5 + 2
        idx = torch.linspace(0, f - 1, t).round().long()
        return lat[:, idx][None]


def setup(work: Path):
    sys.argv = ["main.py", "--cpu"]
    sys.path.insert(0, os.getcwd())  # the ComfyUI checkout
    import comfy.options

    comfy.options.enable_args_parsing()
    import folder_paths
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    for kind in ("diffusion_models", "loras"):
        (work / kind).mkdir(parents=True, exist_ok=True)
        folder_paths.add_model_folder_path(kind, str(work / kind), is_default=True)
    from h3_blackwell.runtime.model.config import TINY
    from h3_blackwell.runtime.model.tiny import save_tiny

    save_tiny(work / "diffusion_models" / "tiny.safetensors", seed=0, dtype=torch.bfloat16)
    from fixtures.tiny_lora import save_tiny_lora, tiny_lora_truth

    save_tiny_lora(work / "loras" / "tiny_lora.safetensors", tiny_lora_truth(TINY, seed=3), "diffusion_model")
    return nodes


def _v3(node_cls, **kw):
    out = node_cls.execute(**kw)
    return out.result if hasattr(out, "result") else out


def _streams(latent):
    v, a = latent["samples"].unbind()
    return v.float(), a.float()


def text_conditioning(tokens: int = 12, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(1, tokens, 5120, generator=g)
    tags = torch.ones(tokens, dtype=torch.long)
    tags[3:6] = 0  # a vision span inside the text, as the minimax CLIP tags it
    return [[states, {"minimax_token_tags": tags}]]


def graphs(nodes):
    """name -> fn(model) -> LATENT, each a graph of core's nodes around the given MODEL."""
    h3 = nodes.NODE_CLASS_MAPPINGS
    shift_cls, guide_cls = h3["MiniMaxH3SigmaShift"], h3["MiniMaxH3AddGuide"]
    empty_cls = h3["EmptyMiniMaxH3LatentAV"]
    (latent,) = _v3(empty_cls, width=128, height=96, length=22)
    pos = text_conditioning()
    vae = StandInVAE()
    g = torch.Generator().manual_seed(11)
    first, last = torch.rand(1, 96, 128, 3, generator=g), torch.rand(1, 96, 128, 3, generator=g)
    (guided,) = _v3(guide_cls, positive=pos, latent=latent, frame_idx=0, vae=vae, image=first)
    (guided,) = _v3(guide_cls, positive=guided, latent=latent, frame_idx=-1, vae=vae, image=last)

    def shift_ksampler(model):
        (m,) = _v3(shift_cls, model=model, shift_video=8.0, shift_audio=2.0)
        return nodes.KSampler().sample(m, 440420, 6, 1.0, "euler", "simple", pos, pos, latent)[0]

    def guides_ksampler_advanced(model):
        return nodes.KSamplerAdvanced().sample(model, "enable", 77, 6, 1.0, "dpmpp_2m", "beta", guided, guided,
                                               latent, 0, 10000, "disable")[0]

    def lora_shift_ksampler(model):
        (m,) = nodes.LoraLoaderModelOnly().load_lora_model_only(model, "tiny_lora.safetensors", 0.8)
        return shift_ksampler(m)

    def custom_advanced_refs(model):
        refs = ref_conditioning(pos)
        cs = {k: h3[k] for k in ("BasicGuider", "RandomNoise", "KSamplerSelect", "BasicScheduler",
                                 "SamplerCustomAdvanced")}
        (guider,) = _v3(cs["BasicGuider"], model=model, conditioning=refs)
        (noise,) = _v3(cs["RandomNoise"], noise_seed=5)
        (sampler,) = _v3(cs["KSamplerSelect"], sampler_name="res_multistep")
        (sigmas,) = _v3(cs["BasicScheduler"], model=model, scheduler="simple", steps=5, denoise=1.0)
        out = _v3(cs["SamplerCustomAdvanced"], noise=noise, guider=guider, sampler=sampler, sigmas=sigmas,
                  latent_image=latent)
        return out[0]

    g2 = torch.Generator().manual_seed(13)
    v0, a0 = latent["samples"].unbind()
    filled = {"samples": type(latent["samples"])((torch.randn(v0.shape, generator=g2),
                                                   torch.randn(a0.shape, generator=g2)))}
    mask = torch.zeros(1, 96, 128)
    mask[:, :, 64:] = 1.0  # regenerate the right half
    (masked,) = nodes.SetLatentNoiseMask().set_mask(filled, mask)
    (negative,) = nodes.ConditioningZeroOut().zero_out(pos)

    def partial_denoise_and_steps(model):
        half = nodes.KSampler().sample(model, 9, 8, 1.0, "euler", "simple", pos, pos, filled, denoise=0.6)[0]
        return nodes.KSamplerAdvanced().sample(model, "enable", 9, 8, 1.0, "res_multistep", "simple", guided, guided,
                                               half, 2, 5, "enable")[0]

    def off_schedule_sigmas(model):  # dpm_2 and heun evaluate between the schedule's sigmas
        a = nodes.KSampler().sample(model, 3, 4, 1.0, "dpm_2", "karras", guided, guided, latent)[0]
        return nodes.KSampler().sample(model, 3, 3, 1.0, "heun", "normal", pos, pos, a, denoise=0.5)[0]

    def noise_mask(model):
        return nodes.KSampler().sample(model, 21, 5, 1.0, "euler", "simple", pos, pos, masked)[0]

    def cfg_two_with_negative(model):
        return nodes.KSampler().sample(model, 4, 4, 2.5, "euler", "simple", guided, negative, latent)[0]

    return {"shift_ksampler": shift_ksampler, "guides_ksampler_advanced": guides_ksampler_advanced,
            "lora_shift_ksampler": lora_shift_ksampler, "custom_advanced_refs": custom_advanced_refs,
            "partial_denoise_and_steps": partial_denoise_and_steps, "off_schedule_sigmas": off_schedule_sigmas,
            "noise_mask": noise_mask, "cfg_two_with_negative": cfg_two_with_negative}


def fun_graph(nodes, patch_mod):
    """``fun_controlnet_ksampler`` (module docstring): fn(model) -> LATENT."""
    import types

    import comfy.patcher_extension
    from check_core_control import TinyVAE, core_tower
    from fixtures.tiny_control import tiny_control_state_dict
    from h3_blackwell.runtime.model.config import TINY

    h3 = nodes.NODE_CLASS_MAPPINGS
    (latent,) = _v3(h3["EmptyMiniMaxH3LatentAV"], width=128, height=96, length=22)
    pos = text_conditioning()
    places = (0, 2)
    csd = tiny_control_state_dict(TINY, len(places), seed=11, dtype=torch.bfloat16)
    frames = torch.rand(9, 3, 80, 112, generator=torch.Generator().manual_seed(17))  # [n, 3, h, w] as core's node

    def fun_controlnet_ksampler(model):
        patch = patch_mod.MiniMaxH3FunControlPatch(types.SimpleNamespace(model=core_tower(csd, places, False)),
                                                   TinyVAE(), frames, None, None, 0.8, 0.95, 0.3)
        m = model.clone()
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "minimax_h3_fun_control",
                               patch.diffusion_model_wrapper)
        for layer in places:
            prev = m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {}).get(
                ("double_block", layer))
            m.set_model_patch_replace(patch_mod.MiniMaxH3FunControlBlockPatch(patch, layer, prev), "dit",
                                      "double_block", layer)
        return plain(m)

    def plain(model):
        return nodes.KSampler().sample(model, 31, 6, 1.0, "euler", "simple", pos, pos, latent)[0]

    return fun_controlnet_ksampler, plain


def ref_conditioning(pos):
    """Two reference images, a 22-frame video with its soundtrack and an audio, as MiniMaxH3ReferenceToVideo
    writes them (images, then videos, then audio)."""
    g = torch.Generator().manual_seed(21)
    refs = [{"kind": "image", "picture_index": 1, "latent_h": 6, "latent_w": 8,
             "latent": torch.randn(1, 24, 1, 6, 8, generator=g)},
            {"kind": "image", "picture_index": 2, "latent_h": 4, "latent_w": 6,
             "latent": torch.randn(1, 24, 1, 4, 6, generator=g)},
            {"kind": "video_audio", "latent_t": 7, "latent_h": 6, "latent_w": 8, "ref_audio_t": 37,
             "latent": torch.randn(1, 24, 7, 6, 8, generator=g),
             "audio_latent": torch.randn(1, 32, 2, 37, generator=g)},
            {"kind": "audio", "ref_audio_t": 20, "audio_latent": torch.randn(1, 32, 2, 20, generator=g)}]
    return [[pos[0][0], {**pos[0][1], "minimax_refs": refs}]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", nargs="*", help="graph names to run (default: all)")
    ap.add_argument("--fun-patch-module", help="a file defining core's MiniMaxH3FunControlPatch and "
                    "MiniMaxH3FunControlBlockPatch (see check_core_control.py): adds fun_controlnet_ksampler")
    ap.add_argument("--note", default="", help="what checkout this ran in (recorded)")
    ap.add_argument("--fast", action="store_true", help="our MODEL on the loader's default stack (NVFP4 blocks; on the "
                    "CPU their exact emulation) instead of dense fp32: a run of the fast path, compared with the "
                    "NVFP4 bound (3e-2) instead of 1e-3")
    a = ap.parse_args()
    _import_path()
    tol = 3e-2 if a.fast else TOL
    if not a.fast:
        os.environ["H3_NVFP4"] = "0"  # our runtime dense: the comparison is of the adapter, not of NVFP4
    work = Path(tempfile.mkdtemp(prefix="h3b-core-model-"))
    nodes = setup(work)
    import comfy.model_management as mm
    from h3_blackwell.nodes.loader import H3ModelLoader
    from h3_blackwell.nodes.diagnostics import report_text
    from h3_blackwell.nodes.model_report import H3ModelReport

    core_model = nodes.UNETLoader().load_unet("tiny.safetensors", "default")[0]
    rt, ours = H3ModelLoader().load("tiny.safetensors", "auto", "auto" if a.fast else "reference", "on", True)
    results = {"comfyui": "kat3ri/ComfyUI snapshot (upstream 2026-08-15), --cpu", "torch": torch.__version__,
               "tolerance_rel_l2": tol, "our_model": {"dtype": str(rt.dtype), "stack": rt.ops.name,
                                                      "attention": rt.plan.attention},
               "core_model_dtype": str(core_model.model_dtype()), "graphs": {}}
    if a.note:
        results["note"] = a.note
    if a.fun_patch_module:
        results["fun_patch_module"] = a.fun_patch_module
    ok = True
    refs = {}
    todo = graphs(nodes)
    fun_plain = None
    if a.fun_patch_module:
        from check_core_control import _load_patch_module

        todo["fun_controlnet_ksampler"], fun_plain = fun_graph(nodes, _load_patch_module(a.fun_patch_module))
    for name, fn in todo.items():
        if a.only and name not in a.only:
            continue
        t0 = time.perf_counter()
        core_lat = fn(core_model)
        ref = _streams(core_lat)
        t1 = time.perf_counter()
        lat = fn(ours)
        t2 = time.perf_counter()
        got = _streams(lat)
        refs[name] = ref
        errs = {"video": rel_l2(got[0], ref[0]), "audio": rel_l2(got[1], ref[1])}
        report = H3ModelReport().report(ours, lat)[0]
        try:  # core's latent: the same shapes, other values, so not our MODEL's last run's output
            H3ModelReport().report(ours, core_lat)
            refused_other = False
        except Exception as e:  # noqa: BLE001 - the node's error type lives in the pack
            refused_other = "not the output of this model's last sampling run" in str(e)
        passed = all(v <= tol for v in errs.values()) and refused_other
        report_text(report)  # H3 Diagnostics can show it
        ok &= passed
        results["graphs"][name] = {"rel_l2": errs, "passed": passed, "report_refuses_core_latent": refused_other,
                                   "core_seconds": round(t1 - t0, 3),
                                   "ours_seconds": round(t2 - t1, 3), "video_shape": list(ref[0].shape),
                                   "audio_shape": list(ref[1].shape),
                                   "report": {"model_calls": report["workload"]["model_calls"],
                                              "packed_tokens": report["workload"]["packed_tokens"],
                                              "lora": (report["backends"].get("lora") or {}).get("reason"),
                                              "fc2_dispatch": {k: report["fc2_dispatch"].get(k) for k in
                                                               ("runs", "consistent_with_configuration")},
                                              "latents_finite": report["latents_finite"],
                                              "control_calls": (report.get("control") or {}).get(
                                                  "model_calls_with_control", 0)}}
        print(f"{name}: video {errs['video']:.3g}, audio {errs['audio']:.3g} rel-L2 -> "
              f"{'ok' if passed else 'FAIL'} ({report['workload']['model_calls']} calls)")
    if "lora_shift_ksampler" in refs and "shift_ksampler" in refs:
        # the LoRA must change core's result (else the comparison would not test the LoRA path)
        effect = rel_l2(refs["lora_shift_ksampler"][0], refs["shift_ksampler"][0])
        results["lora_effect_on_core_video_rel_l2"] = effect
        ok &= effect > 10 * TOL
        print(f"LoRA x0.8 changes core's video by rel-L2 {effect:.3g}")
    fun = results["graphs"].get("fun_controlnet_ksampler")
    if fun is not None:  # our run carried the tower (its report's control block), and the tower changes core's result
        effect = rel_l2(refs["fun_controlnet_ksampler"][0], _streams(fun_plain(core_model))[0])
        results["fun_effect_on_core_video_rel_l2"] = effect
        ok &= fun["report"]["control_calls"] > 0 and effect > 10 * TOL
        print(f"the Fun ControlNet changes core's video by rel-L2 {effect:.3g}; our MODEL ran the tower in "
              f"{fun['report']['control_calls']} of {fun['report']['model_calls']} calls")
    rep = results["graphs"].get("lora_shift_ksampler", {}).get("report", {})
    ok &= not rep or "merged" in (rep.get("lora") or "")  # the run carried the LoRA
    mm.unload_all_models()
    results["passed"] = ok
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
