"""Compare the float64 oracle (core_h3.py) with ComfyUI core's own MiniMax H3 model code, on the CPU.

Not a pytest module and not run by CI (it needs a ComfyUI checkout, which is never committed). Usage::

    cd <ComfyUI checkout> && python <repo>/tests/oracles/check_core.py [--json out.json] [--runtime]

The checkout must carry the newest core semantics (Comfy-Org/ComfyUI ``comfy/ldm/minimax/model.py`` 01a56b76
and ``MiniMaxH3._denoise_mask_values`` of ``comfy/model_base.py`` 094c74c1): denoise masks, per-row
modulation, PDD heads, velocity scaling by the mask. Core's model runs in float32 with every case of
``cases.py``: its payload is built as ``MiniMaxH3.extra_conds`` builds it (cond latents keyframes first,
then refs) and its masks go through core's own ``_denoise_mask_values`` from full-size sampler masks.
``--runtime`` also runs this repository's runtime (its fp32 reference stack, as ``forward --payload --dense`` runs
it) on the same weights and payload; the package must be importable (PYTHONPATH to a directory holding
``h3_blackwell``).

``--configs NAME,...`` (or ``all``) runs the whole comparison at each configuration of ``configs.CONFIGS`` instead of
the one tiny config (``CFG``): core's model built with that configuration's arguments, the cases redrawn at its
latent and text widths (``configs.adapt_case``), and the runtime loaded through its checkpoint loader from a
safetensors file of core's state dict with no metadata (a file of another size arrives that way), its detected
config compared with the configuration field by field, and core's state dict with ``configs.core_shapes`` (the
spec tests/runtime/model/test_configs_core.py builds its files from). The JSON then holds one entry per
configuration; a configuration of ``configs.KNOWN_DIFFERENCES`` is recorded with its reason and not held to the bound.

Cases the checkout's core cannot run are skipped and recorded with the reason (denoise masks need core's
``MiniMaxH3._denoise_mask_values``, PDD heads a ``FinalLayer`` taking ``sample_sigmas``); a configuration with
``gate_compress`` on a core whose model has no such argument builds core's model without the (unread) tensor.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases as case_mod  # noqa: E402
import configs  # noqa: E402
import core_h3  # noqa: E402

CFG = configs.BASE
CURVE_GRID = configs.CURVE_GRID


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_state_dict(model: torch.nn.Module, seed: int, head_bank: int = 1) -> dict:
    """Random weights for every entry of core's state dict (configs.random_weights over its shapes)."""
    return configs.random_weights({k: tuple(v.shape) for k, v in model.state_dict().items()}, seed, head_bank)


def core_features() -> dict:
    """What the checkout's core model code supports beyond the oldest core H3: denoise masks, PDD heads,
    gate_compress."""
    import comfy.ldm.minimax.model as mm
    import comfy.model_base

    return {"masks": hasattr(comfy.model_base.MiniMaxH3, "_denoise_mask_values"),
            "pdd": "sample_sigmas" in inspect.signature(mm.FinalLayer.forward).parameters,
            "gate_compress": "gate_compress" in inspect.signature(mm.MiniMaxH3Model.__init__).parameters}


def unsupported(case, features: dict) -> str | None:
    """Why the checkout's core cannot run ``case`` (None: it can)."""
    p = case["payload"]
    if (p.get("denoise_mask") is not None or p.get("audio_denoise_mask") is not None) and not features["masks"]:
        return "this checkout's core has no denoise masks (MiniMaxH3._denoise_mask_values)"
    if case.get("head_bank", 1) > 1 and not features["pdd"]:
        return "this checkout's core has no PDD heads (FinalLayer.forward takes no sample_sigmas)"
    return None


def core_kwargs(cfg: dict, case: dict, features: dict) -> dict:
    """Core's MiniMaxH3Model arguments for ``case`` under the configuration ``cfg`` (curve form per
    configs.curve_grid; gate_compress only where core's model takes it)."""
    kw = dict(cfg, adaln_curve_grid=configs.curve_grid(cfg, case))
    if not features["gate_compress"]:
        kw.pop("gate_compress", None)
    return kw


def gate_compress_weights(cfg: dict, seed: int) -> dict:
    """``blocks.N.attn.to_gate_compress.weight`` [heads * head_dim, hidden] ~ N(0, 1/hidden) for every block."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["hidden_size"])
    return {f"blocks.{i}.attn.to_gate_compress.weight": torch.randn(shape, generator=g) * shape[1] ** -0.5
            for i in range(cfg["num_layers"])}


def core_model(sd: dict, kw: dict | None = None):
    """Core's MiniMaxH3Model built with the arguments ``kw`` (default ``CFG``, full form) holding ``sd``."""
    import comfy.ldm.minimax.model as mm
    import comfy.ops

    kw = dict(CFG, adaln_curve_grid=None) if kw is None else kw
    m = mm.MiniMaxH3Model(**kw, dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    for name, t in sd.items():  # direct assignment: a PDD bank has n x the rows core builds
        mod_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
        mod = m.get_submodule(mod_name)
        if isinstance(getattr(mod, attr), torch.nn.Parameter):
            setattr(mod, attr, torch.nn.Parameter(t.clone(), requires_grad=False))
        else:
            getattr(mod, attr).copy_(t)
    return m.eval()


def core_masks(case) -> dict:
    """Full-size sampler masks through core's own _denoise_mask_values."""
    import comfy.model_base
    import comfy.utils

    p = case["payload"]
    if p.get("denoise_mask") is None and p.get("audio_denoise_mask") is None:
        return {}
    vs, as_ = list(case["video"].shape), list(case["audio"].shape)
    vm = p.get("denoise_mask")
    am = p.get("audio_denoise_mask")
    vfull = torch.ones(vs) if vm is None else vm.expand(vs).contiguous()
    afull = torch.ones(as_) if am is None else am.expand(as_).contiguous()
    packed, shapes = comfy.utils.pack_latents([vfull, afull])
    fake = types.SimpleNamespace(diffusion_model=types.SimpleNamespace(patch_size=(1, 2, 2)))
    cls = comfy.model_base.MiniMaxH3
    fake._pool_masks_to_token_grid = lambda masks: cls._pool_masks_to_token_grid(fake, masks)
    fake._token_grid_masks = lambda dm, ls: cls._token_grid_masks(fake, dm, ls)
    return cls._denoise_mask_values(fake, packed, shapes)


def core_payload(case) -> dict:
    p = case["payload"]
    out = {"text_token_tags": case["token_tags"], "seed": p.get("seed", 0), "audio_scale": 1.0}
    kfs, refs = p.get("keyframes"), p.get("refs")
    if kfs is not None:
        out["keyframes"] = kfs
        out["cond_video_latents"] = [k["latent"] for k in kfs if k.get("latent") is not None]
        out["cond_audio_latents"] = [k["audio_latent"] for k in kfs if k.get("audio_latent") is not None]
    if refs is not None:
        out["refs"] = refs
        out["cond_video_latents"] = out.get("cond_video_latents", []) + [r["latent"] for r in refs if "latent" in r]
        out["cond_audio_latents"] = out.get("cond_audio_latents", []) + [
            r["audio_latent"] for r in refs if r.get("audio_latent") is not None]
    for k in ("visual_cond_noise_aug", "audio_cond_noise_aug"):
        if k in p:
            out[k] = p[k]
    return out


def run_core(case, sd, kw):
    m = core_model(sd, kw)
    opts = {}
    if case["payload"].get("sample_sigmas") is not None:
        opts["sample_sigmas"] = case["payload"]["sample_sigmas"]
    ts = torch.tensor([case["sigma"]], dtype=torch.float32) * 1000.0
    with torch.no_grad():
        v, a = m([case["video"], case["audio"]], ts, case["text_states"], transformer_options=opts,
                 minimax_payload=core_payload(case), **core_masks(case))
    return v, a


def run_runtime(case, sd, cfg: dict | None = None, from_file: bool = False):
    """This repository's runtime (fp32 reference stack) on the same weights and conditioning, as ``forward
    --payload --dense`` runs it -> (video, audio, {field: (detected, expected)} config differences).

    cfg: the configuration (core's names; default ``CFG``). from_file: load through the checkpoint loader from a
    safetensors file of ``sd`` with no metadata (the config detected from the shapes), else build ``H3Model`` with
    the configuration mapped to an H3Config and load ``sd`` into it."""
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from h3_blackwell.runtime.io.payload import conditioning_from_payload
    from h3_blackwell.runtime.model.h3 import H3Model
    from h3_blackwell.runtime.sampling.schedule import model_sigma

    from safetensors.torch import save_file

    cfg = CFG if cfg is None else cfg
    expected = configs.runtime_config(cfg, configs.curve_grid(cfg, case), case.get("head_bank", 1))
    diff, ops = {}, None
    if from_file:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "core_state_dict.safetensors"
            save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
            rt = load_model(path, RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="reference"))
        m, ops = rt.model, rt.ops
        diff = configs.config_differences(rt.config, expected)
    else:
        m = H3Model(expected, torch.float32)
        m.load_state_dict(sd)
    cond = conditioning_from_payload(case["payload"])
    sigma = float(model_sigma(torch.tensor(case["sigma"])))
    with torch.no_grad():
        plan = m.plan(case["text_states"], tuple(case["video"].shape), tuple(case["audio"].shape), [sigma],
                      token_tags=case["token_tags"], cond=cond)
        v, a = m.evaluate(plan, 0, case["video"], case["audio"], ops)
    return v, a, diff


def run_core_sampling(sd, masks: bool, steps: int = 3, sampler: str = "euler"):
    """Core's own sampling pieces on the sampling case: ModelSamplingAV + CONST, the simple scheduler,
    KSamplerX0Inpaint with MiniMaxH3.scale_latent_inpaint / _denoise_mask_values, k-diffusion's euler, around
    core's MiniMaxH3Model (the audio carried at audio_scale 4). -> (video, audio, sigmas)."""
    import comfy.k_diffusion.sampling as kd
    import comfy.model_base
    import comfy.model_sampling as cms
    import comfy.samplers
    import comfy.utils

    video0, audio0, text, tags, payload = case_mod.sampling_case(masks)

    class Sampling(cms.ModelSamplingAV, cms.CONST):
        pass

    ms = Sampling(types.SimpleNamespace(sampling_settings={"shift": 12.0, "audio_shift": 3.0}))
    ms.set_parameters(shift=12.0, audio_shift=3.0)
    cls = comfy.model_base.MiniMaxH3

    class Base:  # the MiniMaxH3 BaseModel around core's diffusion model, without the model patcher
        _pool_masks_to_token_grid = cls._pool_masks_to_token_grid
        _token_grid_masks = cls._token_grid_masks
        _denoise_mask_values = cls._denoise_mask_values
        scale_latent_inpaint = cls.scale_latent_inpaint
        audio_scale = cls.audio_scale

    base = Base()
    base.diffusion_model = core_model(sd)
    base.model_sampling = ms
    scale = ms.audio_scale
    packed_latent, shapes = comfy.utils.pack_latents([video0, audio0 * scale])
    base.latent_shapes = shapes
    gen = torch.Generator("cpu").manual_seed(int(payload["seed"]))
    noise = comfy.utils.pack_latents([torch.randn(video0.shape, generator=gen), torch.randn(audio0.shape, generator=gen)])[0]
    dmask = None
    if masks:
        dmask = comfy.utils.pack_latents([payload["denoise_mask"].expand(video0.shape).contiguous(),
                                          payload["audio_denoise_mask"].expand(audio0.shape).contiguous()])[0]
    sigmas = comfy.samplers.simple_scheduler(ms, steps)
    case = {"token_tags": tags, "payload": {k: v for k, v in payload.items()
                                            if k not in ("denoise_mask", "audio_denoise_mask")}}
    mp = dict(core_payload(case), audio_scale=scale)
    conds = {} if dmask is None else base._denoise_mask_values(dmask, shapes)

    def model(x, sigma, model_options={}, seed=None):
        xs = comfy.utils.unpack_latents(x, shapes)
        out = base.diffusion_model(xs, ms.timestep(sigma).float(), text, transformer_options={},
                                   minimax_payload=dict(mp), **conds)
        return ms.calculate_denoised(sigma, comfy.utils.pack_latents(list(out))[0].float(), x)

    k = comfy.samplers.KSamplerX0Inpaint(_Callable(model, base), sigmas)
    k.latent_image, k.noise = packed_latent, noise
    x = ms.noise_scaling(sigmas[0], noise, packed_latent)
    with torch.no_grad():
        out = getattr(kd, f"sample_{sampler}")(k, x, sigmas, extra_args={"denoise_mask": dmask, "model_options": {},
                                                                       "seed": 0}, disable=True)
    v, a = comfy.utils.unpack_latents(out, shapes)
    return v, a / scale, sigmas


class _Callable:
    """KSamplerX0Inpaint's inner_model: called for the denoised, with .inner_model the BaseModel."""

    def __init__(self, fn, base):
        self.fn, self.inner_model = fn, base
        # res_multistep reads the model sampling's noise_scale through the patcher
        self.model_patcher = types.SimpleNamespace(get_model_object=lambda name: getattr(base, name))

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def check_sampling(results: dict, runtime: bool) -> None:
    """Core's sampling pieces vs the float64 sampling oracle (and the runtime's sample()) on the sampling case."""
    import core_sampling

    for masks, sampler in ((False, "euler"), (True, "euler"), (True, "res_multistep")):
        name = ("sampling_masked" if masks else "sampling_guided") + ("" if sampler == "euler" else "_" + sampler)
        probe = __import__("comfy.ldm.minimax.model", fromlist=["x"]).MiniMaxH3Model(
            **dict(CFG, adaln_curve_grid=None), dtype=torch.float32, device="meta",
            operations=__import__("comfy.ops", fromlist=["x"]).disable_weight_init)
        sd = random_state_dict(probe, seed=77)
        cv, ca, sigmas = run_core_sampling(sd, masks, sampler=sampler)
        video0, audio0, text, tags, payload = case_mod.sampling_case(masks)
        r = {}
        if sampler == "euler":  # the float64 sampling oracle is euler only
            ov, oa = core_sampling.core_sample_euler(sd, video0, audio0, text, tags, payload, payload["seed"], sigmas)
            r = {"core_vs_oracle_video": rel_l2(cv, ov), "core_vs_oracle_audio": rel_l2(ca, oa)}
        if runtime:
            from h3_blackwell.runtime.io.payload import conditioning_from_payload
            from h3_blackwell.runtime.sampling.sampler import sample
            from h3_blackwell.runtime.sampling.schedule import get_sigmas

            rv, ra = _runtime_sample(sd, video0, audio0, text, tags, conditioning_from_payload(payload), sample,
                                     sampler)
            r["core_vs_runtime_video"], r["core_vs_runtime_audio"] = rel_l2(rv, cv), rel_l2(ra, ca)
            r["core_vs_runtime_sigmas"] = rel_l2(get_sigmas("simple", len(sigmas) - 1, 12.0, 1.0), sigmas)
        results[name] = r
        print(f"{name:28s} " + " ".join(f"{k[8:]} {v:.2e}" for k, v in r.items()))


def _runtime_sample(sd, video0, audio0, text, tags, cond, sample, sampler):
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from h3_blackwell.runtime.model.config import config_metadata

    from safetensors.torch import save_file

    cfg = configs.runtime_config(CFG)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path),
                  metadata={"config": config_metadata(cfg)})
        rt = load_model(path, RuntimeOptions(device="cpu", dtype="float32", quantize=False))
        from h3_blackwell.runtime import SampleInputs, SamplingSettings

        res = sample(rt, SampleInputs(text, tags, video0, audio0, cond),
                     SamplingSettings(seed=cond.seed, steps=3, sampler=sampler))
    return res.video, res.audio


def check_config(cfg: dict, all_cases: dict, runtime: bool, from_file: bool, features: dict) -> dict:
    """Every case at the configuration ``cfg``: core's model vs the float64 oracle (and the runtime) -> {case:
    record}; a case this core cannot run is {"skipped": why}."""
    import comfy.ldm.minimax.model as mm
    import comfy.ops

    results = {}
    for name, case in all_cases.items():
        why = unsupported(case, features)
        if why is not None:
            results[name] = {"skipped": why}
            print(f"{name:28s} skipped: {why}")
            continue
        case = configs.adapt_case(case, cfg, seed=len(name))
        kw = core_kwargs(cfg, case, features)
        probe = mm.MiniMaxH3Model(**kw, dtype=torch.float32, device="meta", operations=comfy.ops.disable_weight_init)
        shapes = [(k, tuple(v.shape)) for k, v in probe.state_dict().items()]
        shapes_ok = shapes == list(configs.core_shapes(kw).items())  # the spec tests/runtime uses without core
        sd = random_state_dict(probe, seed=len(name), head_bank=case.get("head_bank", 1))
        ours = dict(sd)
        if cfg.get("gate_compress") and not kw.get("gate_compress"):
            ours.update(gate_compress_weights(cfg, seed=len(name)))  # core's dense forward never reads them
        cv, ca = run_core(case, sd, kw)
        ov, oa = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                      token_tags=case["token_tags"], payload=case["payload"])
        # sensitivity: the same evaluation without the case's conditioning (PDD: another step of the schedule)
        bare = {}
        if "sample_sigmas" in case["payload"]:
            bare["sample_sigmas"] = torch.tensor([1.0, case["sigma"], 0.0])
        bv, ba = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                      token_tags=case["token_tags"], payload=bare)
        r = {"core_vs_oracle_video": rel_l2(cv, ov), "core_vs_oracle_audio": rel_l2(ca, oa),
             "core_vs_unconditioned_video": rel_l2(cv, bv), "core_vs_unconditioned_audio": rel_l2(ca, ba),
             "shapes": [list(cv.shape), list(ca.shape)], "core_shapes_match": shapes_ok}
        if not shapes_ok:
            print(f"{name:28s} CORE'S STATE DICT DIFFERS FROM configs.core_shapes")
        if runtime:
            rv, ra, diff = run_runtime(case, ours, cfg, from_file)
            r["core_vs_runtime_video"], r["core_vs_runtime_audio"] = rel_l2(rv, cv), rel_l2(ra, ca)
            if from_file:
                r["detected_config_differences"] = {k: list(v) for k, v in diff.items()}
            print(f"{'':28s} runtime vs core: video {r['core_vs_runtime_video']:.2e} "
                  f"audio {r['core_vs_runtime_audio']:.2e}" + (f" DETECTED CONFIG DIFFERS {diff}" if diff else ""))
        results[name] = r
        print(f"{name:28s} oracle: video {r['core_vs_oracle_video']:.2e} audio {r['core_vs_oracle_audio']:.2e}"
              f" | unconditioned: video {r['core_vs_unconditioned_video']:.2e}"
              f" audio {r['core_vs_unconditioned_audio']:.2e}")
    return results


def _worst(results: dict, prefix: str) -> float:
    return max((v for r in results.values() for k, v in r.items() if k.startswith(prefix)), default=0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--runtime", action="store_true")
    ap.add_argument("--random", type=int, default=0, help="also N random cases (cases.random_case)")
    ap.add_argument("--sampling", action="store_true", help="also core's sampler pieces (inpainting masks)")
    ap.add_argument("--configs", default="",
                    help=f"comma-separated names of configs.CONFIGS or 'all' ({', '.join(configs.CONFIGS)}): run "
                         "every case at each of them, the runtime loaded from a metadata-free file")
    ap.add_argument("--note", default="", help="recorded verbatim in the JSON (e.g. what the checkout's changes are)")
    ap.add_argument("--comfy-head", default="", help="the checkout's commit, recorded when it is no git repository")
    a = ap.parse_args(argv)
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = True
    names = list(configs.CONFIGS) if a.configs == "all" else [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in configs.CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(configs.CONFIGS)}")
    features = core_features()
    print("core supports:", json.dumps(features))
    all_cases = dict(case_mod.make_cases())
    all_cases.update({f"random_{i}": case_mod.random_case(i) for i in range(a.random)})
    per_config, detected_ok = {}, True
    for name in names or ["base"]:
        if names:
            print(f"== config {name}: {json.dumps(configs.CONFIGS[name])}")
        results = check_config(configs.core_config(name), all_cases, a.runtime, bool(names), features)
        detected_ok &= not any(r.get("detected_config_differences") or r.get("core_shapes_match") is False
                               for r in results.values())
        per_config[name] = results
    if a.sampling:
        check_sampling(per_config["base"] if not names else per_config.setdefault("base_sampling", {}), a.runtime)
    held = {f"{c}/{k}": r for c, res in per_config.items() if c not in configs.KNOWN_DIFFERENCES
            for k, r in res.items()}
    every = {f"{c}/{k}": r for c, res in per_config.items() for k, r in res.items()}
    worst = max(_worst(held, "core_vs_oracle"), _worst(held, "core_vs_runtime"))
    skipped = sorted(k for k, r in every.items() if "skipped" in r)
    if a.json:
        import subprocess

        import comfy

        root = Path(list(comfy.__path__)[0]).resolve().parent
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--stat", "--", "comfy/ldm/minimax", "comfy/model_base.py",
                                "comfy/samplers.py"], capture_output=True, text=True).stdout.strip().splitlines()
        meta = {"command": " ".join(["python"] + sys.argv), "comfy_checkout": str(root),
                "comfy_head": head.strip() or a.comfy_head,
                "comfy_local_changes": dirty, "torch": torch.__version__, "bound": 1e-5, "note": a.note}
        if not names:
            body = {"meta": meta, "cases": per_config["base"]}
        else:
            meta["core_features"] = features
            body = {"meta": meta, "configs": {
                c: {"core_arguments": configs.core_config(c) if c in configs.CONFIGS else None,
                    "worst_core_vs_oracle": _worst(res, "core_vs_oracle"),
                    "worst_core_vs_runtime": _worst(res, "core_vs_runtime"),
                    "cases_run": sum(1 for r in res.values() if "skipped" not in r),
                    **({"known_difference": configs.KNOWN_DIFFERENCES[c]} if c in configs.KNOWN_DIFFERENCES else {}),
                    "cases": res} for c, res in per_config.items()},
                "worst": worst, "configs_and_shapes_match": detected_ok, "skipped": len(skipped)}
        Path(a.json).write_text(json.dumps(body, indent=2) + "\n")
    if names:
        for c, res in per_config.items():
            print(f"{c:36s} worst core vs oracle {_worst(res, 'core_vs_oracle'):.2e}  "
                  f"core vs runtime {_worst(res, 'core_vs_runtime'):.2e}"
                  + (" (known difference, not held to the bound)" if c in configs.KNOWN_DIFFERENCES else ""))
    if skipped:
        print(f"{len(skipped)} case runs skipped (see the JSON / the lines above)")
    print(f"worst rel-L2 {worst:.2e} (bound 1e-5)"
          + ("" if detected_ok else "; A DETECTED CONFIG OR CORE'S STATE DICT DIFFERS (see above)"))
    return 0 if worst <= 1e-5 and detected_ok else 1


if __name__ == "__main__":
    sys.exit(main())
