"""Model configurations other than the tiny one (tests/oracles/configs.py: head counts and widths, inner dim above,
equal to and below hidden, odd sizes, 1 to 6 blocks, 0 to 2 refiner blocks, rope over part or all of a head,
other latent and text widths, the time embedder and curve tables, to_gate_compress, PDD banks, masks).

A checkpoint of another size reaches the runtime as a file of tensors: here a file of core's state dict for each
configuration (``configs.core_shapes``, core's module tree, checked against core's own model by
``tests/oracles/check_core.py --configs``) holding random weights (never zero), with no metadata. The runtime must
detect the configuration from the shapes alone and then equal the float64 oracle of core's semantics
(tests/oracles/core_h3.py); the same configurations against core's own model code are recorded in
tests/oracles/check_core_configs_results.json. The Fun ControlNet at other block counts and places is checked the
same way against the control oracle (tests/oracles/core_control.py).
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cases as case_mod  # noqa: E402
import configs  # noqa: E402
import control_cases  # noqa: E402
import core_control  # noqa: E402
import core_h3  # noqa: E402
from fixtures.tiny_control import save_tiny_control, tiny_control_state_dict  # noqa: E402

from h3_blackwell.runtime import RuntimeOptions, bind_control, load_control, load_model  # noqa: E402
from h3_blackwell.runtime.io.detect import config_from_shapes  # noqa: E402
from h3_blackwell.runtime.io.payload import conditioning_from_payload  # noqa: E402
from h3_blackwell.runtime.model.h3 import H3Model  # noqa: E402
from h3_blackwell.runtime.sampling.schedule import model_sigma  # noqa: E402

CASES = case_mod.make_cases()
CONTROL_CASES = control_cases.make_cases()
DENSE = RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="reference")
# fp32 runtime vs the float64 oracle: fp32 rounding through at most 5 blocks, measured <= 3.5e-7 at every
# configuration here; the bound is check_core.py's, with room for the 1025-row curve table, which multiplies the
# fp32 rounding of t by 1024 in its row position
BOUND = 1e-5

# every configuration runs ref2va (every reference kind) and one more case, so each case runs somewhere; the
# PDD banks at 16 and 48 video channels, the masks at 3 x 16 and 2 x 64 heads
SECOND_CASE = {"base": "fl2va_first_last", "heads2x64": "audio_mask",
               "heads3x16_5blocks_norefiner": "video_mask_partial", "heads6x8_1block": "image_and_audio_guide",
               "odd_hidden_full_rope": "pdd_mid_schedule", "inner_eq_hidden": "audio_guide",
               "wide_latents": "pdd_first_step", "curve_1025x8": "clip_guide_and_video_ref",
               "curve_17x5_odd": "pdd_mid_schedule", "gate_compress": "curve_form_fl2va",
               "text_dim_eq_hidden": "fl2va_first_last"}
PAIRS = [(c, n) for c in configs.CONFIGS for n in ("ref2va", SECOND_CASE[c])]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _core_file(tmp_path, cfg: dict, grid, bank: int, seed: int):
    """A metadata-free safetensors file of core's state dict at ``cfg`` -> (path, weights)."""
    sd = configs.random_weights(configs.core_shapes(dict(cfg, adaln_curve_grid=grid)), seed, bank)
    path = tmp_path / "core_state_dict.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path, sd


def test_second_case_covers_every_config_and_case():
    assert set(SECOND_CASE) == set(configs.CONFIGS)
    assert {n for _, n in PAIRS} == set(CASES)


@pytest.mark.parametrize("name", list(configs.CONFIGS))
@pytest.mark.parametrize("bank,curve", [(1, False), (8, False), (1, True)])
def test_config_detected_from_core_state_dict_shapes(name, bank, curve):
    """Every field a state dict determines comes back from core's shapes alone (no metadata): a PDD bank of 8, the
    curve form and gate_compress included."""
    cfg = configs.core_config(name)
    grid = configs.curve_grid(cfg, {"curve": curve})
    shapes = configs.core_shapes(dict(cfg, adaln_curve_grid=grid))
    shapes = {k: ((v[0] * bank,) + v[1:] if k.split(".")[:2] in (["final_layer", "video_out"],
                                                                 ["final_layer", "audio_out"]) else v)
              for k, v in shapes.items()}
    found = config_from_shapes(shapes)
    assert configs.config_differences(found, configs.runtime_config(cfg, grid, bank)) == {}


@pytest.mark.parametrize("name", list(configs.CONFIGS))
@pytest.mark.parametrize("curve", [False, True])
def test_model_names_every_weight_as_core(name, curve):
    """The runtime's module tree at each configuration holds core's state dict, name for name and shape for shape
    (the names core's LoRA loaders address through the MODEL's ``weight_shapes``)."""
    cfg = configs.core_config(name)
    grid = configs.curve_grid(cfg, {"curve": curve})
    m = H3Model(configs.runtime_config(cfg, grid), torch.float32, device="meta")
    core = configs.core_shapes(dict(cfg, adaln_curve_grid=grid))
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == core


@pytest.mark.parametrize("name,case_name", PAIRS)
def test_runtime_from_core_file_equals_core_oracle(name, case_name, tmp_path):
    cfg = configs.core_config(name)
    case = configs.adapt_case(CASES[case_name], cfg, seed=len(case_name))
    grid, bank = configs.curve_grid(cfg, case), case.get("head_bank", 1)
    path, sd = _core_file(tmp_path, cfg, grid, bank, seed=len(case_name))
    rt = load_model(path, DENSE)
    assert configs.config_differences(rt.config, configs.runtime_config(cfg, grid, bank)) == {}
    v, a = rt.model(case["video"], case["audio"], case["text_states"], case["sigma"], token_tags=case["token_tags"],
                    cond=conditioning_from_payload(case["payload"]), ops=rt.ops)
    ov, oa = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                  token_tags=case["token_tags"], payload=case["payload"])
    assert v.shape == ov.shape and a.shape == oa.shape
    assert _rel(v, ov) <= BOUND and _rel(a, oa) <= BOUND, (_rel(v, ov), _rel(a, oa))


# one case per control configuration: the keyframes with a 24-channel hint, the 49-channel inpaint hint with refs
CONTROL_PAIRS = [(c, "hint24_keyframes" if i % 2 else "inpaint49_refs_odd")
                 for i, c in enumerate(configs.CONTROL_CONFIGS)]


@pytest.mark.parametrize("name,case_name", CONTROL_PAIRS)
def test_control_tower_at_config_equals_core_oracle(name, case_name, tmp_path):
    """A Fun ControlNet of 1 to 5 blocks at the base's first, gapped and last blocks, on bases of other sizes."""
    over, places = configs.CONTROL_CONFIGS[name]
    cfg = configs.core_config(over)
    case = CONTROL_CASES[case_name]
    case = configs.adapt_case(dict(case, places=tuple(places or case["places"])), cfg, seed=len(case_name))
    grid = configs.curve_grid(cfg, case)
    path, sd = _core_file(tmp_path, cfg, grid, 1, seed=1)
    rt = load_model(path, DENSE)
    tower_path = save_tiny_control(tmp_path / "tower.safetensors", rt.config, case["places"], seed=11)
    tower = load_control(tower_path, rt.plan, rt.config)
    csd = tiny_control_state_dict(rt.config, len(case["places"]), seed=11)  # what save_tiny_control wrote
    cond = conditioning_from_payload({**case["payload"], "control": case["control"]})
    sigma = float(model_sigma(torch.tensor(case["sigma"])))
    with torch.no_grad():
        plan = rt.model.plan(case["text_states"], tuple(case["video"].shape), tuple(case["audio"].shape), [sigma],
                             token_tags=case["token_tags"], cond=cond)
        bind_control(rt.model, tower, cond.control, plan, [control_cases.f32(case["sigma"])])
        v, a = rt.model.evaluate(plan, 0, case["video"], case["audio"], rt.ops)
    ov, oa = core_control.core_forward_control(sd, csd, case["places"], case["video"], case["audio"],
                                               case["text_states"], case["sigma"], case["control"],
                                               token_tags=case["token_tags"], payload=case["payload"])
    bv, _ = core_h3.core_forward(sd, case["video"], case["audio"], case["text_states"], case["sigma"],
                                 token_tags=case["token_tags"], payload=case["payload"])
    assert _rel(ov, bv) > 1e-3  # the tower moves the output
    assert _rel(v, ov) <= BOUND and _rel(a, oa) <= BOUND, (_rel(v, ov), _rel(a, oa))

