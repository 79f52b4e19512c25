"""Compare the Fun ControlNet oracle (core_control.py), this repository's runtime and ComfyUI core's own control
code, on the CPU. Not a pytest module and not run by CI (it needs a ComfyUI checkout, never committed). Usage::

    cd <ComfyUI checkout> && PYTHONPATH=<dir holding h3_blackwell> python <repo>/tests/oracles/check_core_control.py \\
        --patch-module fun_patch.py [--json out.json] [--note "..."]

The checkout must have core's ``comfy/ldm/minimax/controlnet.py`` (9b7fcfe0) and a ``model.py`` that hands
``layout`` to its ``patches_replace["dit"]`` entries (01a56b76 does). ``--patch-module``: a file defining core's
``MiniMaxH3FunControlPatch`` and ``MiniMaxH3FunControlBlockPatch`` (``comfy_extras/nodes_minimax_h3.py`` @
542de101, the fades PR), loaded by path so a checkout whose node file predates them can run the check.

Core's side: ``MiniMaxH3Model`` and ``MiniMaxH3FunControl`` built with ``comfy.ops.disable_weight_init`` at the
tiny dimensions (the same weights everywhere), the patch's ``diffusion_model_wrapper`` around the model's
``_forward`` with one ``MiniMaxH3FunControlBlockPatch`` per place in ``transformer_options["patches_replace"]``
and the sampler's sigma in ``transformer_options["sigmas"]``, the hint latent handed in as the patch's
prepared ``control_latent``. The hint preparation itself (``nodes.control.prepare_hint``) is compared with the
patch's own ``prepare_control_latent`` on a stand-in VAE (``hints`` in the JSON). Cases: tests/oracles/control_cases.py
(the masked one needs a model.py with denoise masks and is skipped when the checkout's has none).

``--configs NAME,...`` (or ``all``) runs every case at each configuration of ``configs.CONTROL_CONFIGS`` instead of
the one tiny config: a base configuration (core's names) and the places of the control blocks (None: each case's
own); the tower is built at the base's block dimensions, in curve form where the configuration is.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import check_core  # noqa: E402
import configs  # noqa: E402
import control_cases  # noqa: E402
import core_control  # noqa: E402


def _load_patch_module(path: str):
    spec = importlib.util.spec_from_file_location("core_fun_patch", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def core_tower(csd: dict, places, curve: bool, c: dict):
    """Core's MiniMaxH3FunControl at the block dimensions of the configuration ``c`` (core's names)."""
    import comfy.ldm.minimax.controlnet as cn
    import comfy.ops

    m = cn.MiniMaxH3FunControl(control_in_dim=49, injection_layers=tuple(places), hidden_size=c["hidden_size"],
                               num_attention_heads=c["num_attention_heads"], attention_head_dim=c["attention_head_dim"],
                               ffn_hidden_size=c["ffn_hidden_size"], time_embed_dim=c["time_embed_dim"],
                               use_adaln_curves=curve, dtype=torch.float32, device="cpu",
                               operations=comfy.ops.disable_weight_init)
    m.load_state_dict({k: v.float() for k, v in csd.items()}, strict=True)
    return m.eval().requires_grad_(False)  # as ModelPatchLoader leaves it


def run_core(case, sd, csd, patch_mod, cfg: dict):
    grid = configs.curve_grid(cfg, case)
    m = check_core.core_model(sd, dict(cfg, adaln_curve_grid=grid))
    ctl = case["control"]
    patch = patch_mod.MiniMaxH3FunControlPatch(
        types.SimpleNamespace(model=core_tower(csd, case["places"], grid is not None, cfg)), None, None, None, None,
        ctl.get("strength", 1.0), ctl.get("sigma_start", 1.0), ctl.get("sigma_end", 0.0),
        ctl.get("fade_in_frames", 0), ctl.get("fade_out_frames", 0))
    patch.control_latent = ctl["hint"].float()
    patch.control_latent_shape = tuple(case["video"].shape)
    replace = {("double_block", p): patch_mod.MiniMaxH3FunControlBlockPatch(patch, p, None) for p in case["places"]}
    sigma = torch.tensor([case["sigma"]], dtype=torch.float32)
    opts = {"patches_replace": {"dit": replace}, "sigmas": sigma}
    kw = check_core.core_masks({**case, "payload": case["payload"]})

    def executor(x, t, c, to, **k):
        return m._forward(x, t, c, to, **k)

    with torch.no_grad():
        v, a = patch.diffusion_model_wrapper(executor, [case["video"], case["audio"]], sigma * 1000.0,
                                             case["text_states"], transformer_options=opts,
                                             minimax_payload=check_core.core_payload(case), **kw)
    return v, a, patch.active


def run_runtime(case, sd, csd, cfg):
    """The runtime (H3Config ``cfg``) with the tower loaded from a file of ``csd`` as ModelPatchLoader reads it."""
    from h3_blackwell.runtime import RuntimeOptions, bind_control
    from h3_blackwell.runtime.io.payload import conditioning_from_payload
    from h3_blackwell.runtime.io.control import load_control
    from h3_blackwell.runtime.model.h3 import H3Model
    from h3_blackwell.runtime.sampling.schedule import model_sigma
    from safetensors.torch import save_file

    m = H3Model(cfg, torch.float32)
    m.load_state_dict(sd)
    cond = conditioning_from_payload({**case["payload"], "control": case["control"]})
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tower.safetensors"
        meta = {"control_blocks_places": json.dumps(list(case["places"]))}
        if cfg.curve_form:
            meta["minimax_h3_fun_controlnet"] = "adaln_basis"
        save_file({k: v.contiguous() for k, v in csd.items()}, str(path), metadata=meta)
        plan_like = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, quantize=False,
                                          adaln_on_host=False, options=RuntimeOptions(device="cpu"))
        tower = load_control(path, plan_like, cfg)
    sigma = float(model_sigma(torch.tensor(case["sigma"])))
    with torch.no_grad():
        plan = m.plan(case["text_states"], tuple(case["video"].shape), tuple(case["audio"].shape), [sigma],
                      token_tags=case["token_tags"], cond=cond)
        bind_control(m, tower, cond.control, plan, [float(torch.tensor(case["sigma"], dtype=torch.float32))])
        return m.evaluate(plan, 0, case["video"], case["audio"])


class TinyVAE:
    """A stand-in for core's H3 video VAE (16x16 average pooling, core's frame rule 17k+5 -> 5k+2, a fixed 3 -> 24
    channel map): the hint preparation is compared with one encoder for both sides."""

    def __init__(self):
        self.proj = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))

    def spacial_compression_encode(self):
        return 16

    def encode(self, pixels):
        x = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float(), 16)
        n = x.shape[0]
        t = 2 if n <= 5 else (n - 5) // 17 * 5 + 2
        x = torch.stack([c.mean(0) for c in torch.tensor_split(x, t)])
        return torch.einsum("oc,tchw->othw", self.proj, x)[None]


def hint_cases():
    """(name, target latent shape, control video [n,3,h,w] or None, mask or None, source video or None)."""
    g = torch.Generator().manual_seed(9)
    mask = torch.rand(3, 40, 70, generator=g)
    return [("control_square_to_3x2", (1, 24, 7, 4, 6), torch.rand(10, 3, 48, 48, generator=g), None, None),
            ("control_wide_long", (1, 24, 12, 4, 6), torch.rand(50, 3, 33, 70, generator=g), None, None),
            ("inpaint_with_source", (1, 24, 7, 6, 4), None, mask, torch.rand(4, 3, 50, 30, generator=g)),
            ("inpaint_black_holes_and_control", (1, 24, 2, 4, 6), torch.rand(2, 3, 64, 96, generator=g),
             mask[0], None)]


def check_hints(patch_mod) -> dict:
    """nodes.control.prepare_hint vs core's MiniMaxH3FunControlPatch.prepare_control_latent (comfy.utils'
    common_upscale, core's thresholds and trilinear visibility) on the same stand-in VAE."""
    from h3_blackwell.nodes.control import prepare_hint

    out = {}
    for name, target, ctl, mask, src in hint_cases():
        vae = TinyVAE()
        core = patch_mod.MiniMaxH3FunControlPatch(None, vae, ctl, mask, src, 1.0, 1.0, 0.0)
        core.prepare_control_latent(target)
        ours = prepare_hint(vae, target, ctl, mask, src if mask is not None else None)
        out[name] = {"shape": list(ours.shape), "max_abs_diff": float((ours - core.control_latent).abs().max()),
                     "equal": bool(torch.equal(ours, core.control_latent))}
        print("hint", name, json.dumps(out[name]))
    return out


def check_config(cfg: dict, places, patch_mod, masks_ok: bool) -> dict:
    """Every control case at the base configuration ``cfg`` (core's names) with the control blocks at ``places``
    (None: each case's own) -> {case: record}."""
    from fixtures.tiny_control import tiny_control_state_dict
    from h3_blackwell.runtime.model.tiny import tiny_state_dict

    rel = check_core.rel_l2
    out = {}
    for name, case in control_cases.make_cases().items():
        if (case["payload"].get("denoise_mask") is not None or case["payload"].get("audio_denoise_mask") is not None) \
                and not masks_ok:
            out[name] = {"skipped": "this checkout's model.py has no denoise masks"}
            continue
        case = configs.adapt_case(dict(case, places=tuple(places or case["places"])), cfg, seed=len(name))
        rcfg = configs.runtime_config(cfg, configs.curve_grid(cfg, case))
        sd = tiny_state_dict(rcfg, seed=1)
        csd = tiny_control_state_dict(rcfg, len(case["places"]), seed=11)
        cv, ca, active = run_core(case, sd, csd, patch_mod, cfg)
        ov, oa = core_control.core_forward_control(sd, csd, case["places"], case["video"], case["audio"],
                                                   case["text_states"], case["sigma"], case["control"],
                                                   token_tags=case["token_tags"], payload=case["payload"])
        rv, ra = run_runtime(case, sd, csd, rcfg)
        bv, _ = core_control.o.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                           token_tags=case["token_tags"], payload=case["payload"])
        rec = {"core_active": bool(active), "places": list(case["places"]),
               "core_vs_oracle_video": rel(cv, ov), "core_vs_oracle_audio": rel(ca, oa),
               "runtime_vs_core_video": rel(rv, cv), "runtime_vs_core_audio": rel(ra, ca),
               "control_effect_video": rel(bv, ov)}
        out[name] = rec
        print(name, json.dumps(rec))
    return out


def _worst(records: dict) -> float:
    return max((v for r in records.values() for k, v in r.items() if k.startswith(("core_vs", "runtime_vs"))),
               default=0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patch-module", required=True)
    ap.add_argument("--json")
    ap.add_argument("--note", default="")
    ap.add_argument("--configs", default="",
                    help=f"comma-separated names of configs.CONTROL_CONFIGS or 'all' "
                         f"({', '.join(configs.CONTROL_CONFIGS)})")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())  # the ComfyUI checkout
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = True
    import comfy.ldm.minimax.model as mm

    names = list(configs.CONTROL_CONFIGS) if a.configs == "all" else [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in configs.CONTROL_CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(configs.CONTROL_CONFIGS)}")
    patch_mod = _load_patch_module(a.patch_module)
    masks_ok = "denoise_mask" in inspect.signature(mm.MiniMaxH3Model._forward).parameters
    out = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "note": a.note,
                    "torch": torch.__version__, "bound": 1e-5}}
    if not names:
        out["cases"] = check_config(configs.BASE, None, patch_mod, masks_ok)
        worst = _worst(out["cases"])
    else:
        out["configs"] = {}
        for name in names:
            over, places = configs.CONTROL_CONFIGS[name]
            print(f"== config {name}: {json.dumps(over)} places {places}")
            res = check_config(configs.core_config(over), places, patch_mod, masks_ok)
            out["configs"][name] = {"core_arguments": configs.core_config(over), "places": places,
                                    "worst": _worst(res), "cases": res}
        worst = max(c["worst"] for c in out["configs"].values())
        for name, c in out["configs"].items():
            print(f"{name:40s} worst {c['worst']:.2e}")
    out["hints"] = check_hints(patch_mod)
    out["worst"] = worst
    out["passed"] = worst <= 1e-5 and all(h["equal"] for h in out["hints"].values())
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print("worst rel-L2", worst, "PASS" if out["passed"] else "FAIL")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
