"""The H3 Fun ControlNet node: core's inputs and defaults, the hint prepared as core's prepare_control_latent does
(frame fitting, bilinear centre crop, mask thresholds, the visibility channel, VAE encodes) on a tiny VAE, and the
H3 Sampler running the tower exactly as the runtime's sample does with that hint."""

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.tiny_control import save_tiny_control  # noqa: E402
from fixtures.comfy_standins import SAMPLE_ARGS, core_conditioning, core_empty_latent  # noqa: E402

from h3_blackwell.nodes import NODES  # noqa: E402
from h3_blackwell.nodes._common import H3NodeError  # noqa: E402
from h3_blackwell.nodes.control import (NO_FILE, ControlledModel, H3FunControlNetApply, percent_to_sigma,  # noqa: E402
                                        prepare_hint)
from h3_blackwell.nodes.sampler import H3Sampler  # noqa: E402
from h3_blackwell.runtime import load_control  # noqa: E402
from fixtures.sampling import sample  # noqa: E402
from h3_blackwell.runtime import conditioning_from_payload  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402


class TinyVAE:
    """A stand-in for core's H3 video VAE: pixels [F, H, W, 3] in [0, 1] -> [1, 24, T, H/16, W/16] with core's frame
    rule (17k+5 -> 5k+2; fewer than 6 -> 2): 16x16 average pooling, the frames split into T chunks and averaged,
    a fixed 3 -> 24 channel map. Records what it was given."""

    def __init__(self, seed=0):
        self.proj = torch.randn(24, 3, generator=torch.Generator().manual_seed(seed))
        self.calls = []

    def spacial_compression_encode(self):
        return 16

    def encode(self, pixels):
        self.calls.append(pixels.clone())
        x = F.avg_pool2d(pixels.movedim(-1, 1).float(), 16)
        n = x.shape[0]
        t = 2 if n <= 5 else (n - 5) // 17 * 5 + 2
        x = torch.stack([c.mean(0) for c in torch.tensor_split(x, t)])  # [T, 3, h, w]
        return torch.einsum("oc,tchw->othw", self.proj, x)[None]


def _crop_bilinear(frames, top, left, h, w, out_h, out_w):
    return F.interpolate(frames[..., top:top + h, left:left + w], size=(out_h, out_w), mode="bilinear",
                         align_corners=False)


def test_node_contract_is_cores():
    assert NODES["H3B_FunControlNetApply"] is H3FunControlNetApply
    it = H3FunControlNetApply.INPUT_TYPES()
    req, opt = it["required"], it["optional"]
    assert list(req) == ["model", "vae", "strength", "start_percent", "end_percent"]
    assert {k: v for k, v in req["strength"][1].items() if k != "tooltip"} == {"default": 1.0, "min": 0.0,
                                                                               "max": 10.0, "step": 0.01}
    assert req["start_percent"][1]["default"] == 0.0 and req["end_percent"][1]["default"] == 1.0
    assert {"model_patch", "control_name", "control_video", "mask", "source_video", "fade_in_frames",
            "fade_out_frames"} == set(opt)
    assert opt["model_patch"][0] == "MODEL_PATCH" and opt["control_video"][0] == "IMAGE" and opt["mask"][0] == "MASK"
    assert opt["fade_in_frames"][1]["default"] == 0 and opt["fade_in_frames"][1]["max"] == 3600
    assert H3FunControlNetApply.RETURN_TYPES == ("H3_MODEL",)


def test_percent_to_sigma_is_the_flow_schedule():
    assert percent_to_sigma(0.0, 12.0) == 1.0 and percent_to_sigma(1.0, 12.0) == 0.0
    assert percent_to_sigma(0.5, 12.0) == pytest.approx(6.0 / 6.5)
    assert percent_to_sigma(0.25, 1.0) == pytest.approx(0.75)


def test_control_hint_frames_crop_and_encode():
    """T = 7 latent frames -> 22 pixel frames; a 10-frame square clip holds its last frame, is centre-cropped to
    the 3:2 canvas (rows 8..40 of 48) and resized bilinear to 64 x 96; the encode is the hint."""
    vae = TinyVAE()
    clip = torch.rand(10, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    hint = prepare_hint(vae, (1, 24, 7, 4, 6), control_video=clip)
    assert hint.shape == (1, 24, 7, 4, 6) and len(vae.calls) == 1
    got = vae.calls[0]
    assert got.shape == (22, 64, 96, 3)
    held = clip[[min(i, 9) for i in range(22)]]
    want = _crop_bilinear(held, 8, 0, 32, 48, 64, 96).movedim(1, -1)
    assert torch.equal(got, want)
    assert torch.equal(hint, vae.encode(want))
    # a wider clip is cropped left and right: 64 wide at 3:2 of 32 rows -> 48 columns from 8
    vae = TinyVAE()
    wide = torch.rand(30, 3, 32, 64, generator=torch.Generator().manual_seed(2))
    prepare_hint(vae, (1, 24, 7, 4, 6), control_video=wide)
    assert torch.equal(vae.calls[0], _crop_bilinear(wide[:22], 0, 8, 32, 48, 64, 96).movedim(1, -1))


def test_inpaint_hint_mask_visibility_and_masked_source():
    """With a mask the hint is [control or zeros (24) | visibility (1) | masked source (24)]: the mask binarised at
    0.5, fitted like the frames, re-binarised; the source multiplied by 1 - mask before the encode; the visibility
    trilinearly resized to the latent."""
    g = torch.Generator().manual_seed(3)
    vae = TinyVAE()
    mask = (torch.rand(3, 40, 60, generator=g) > 0.5).float() * 0.7 + 0.2  # 0.2 (keep) or 0.9 (regenerate)
    source = torch.rand(4, 3, 40, 60, generator=g)
    hint = prepare_hint(vae, (1, 24, 2, 4, 6), mask=mask, source_video=source)
    assert hint.shape == (1, 49, 2, 4, 6)
    assert torch.equal(hint[:, :24], torch.zeros(1, 24, 2, 4, 6))
    # 5 pixel frames for T = 2; 40 x 60 is 3:2 already: no crop
    m = (mask > 0.5).float()[[0, 1, 2, 2, 2]][:, None]
    m = F.interpolate(m, size=(64, 96), mode="bilinear", align_corners=False)
    vis = 1.0 - (m > 0.5).float()
    src = F.interpolate(source[[0, 1, 2, 3, 3]], size=(64, 96), mode="bilinear", align_corners=False)
    assert torch.equal(vae.calls[0], (src * vis).movedim(1, -1))
    assert torch.equal(hint[:, 25:], vae.encode((src * vis).movedim(1, -1)))
    vis_lat = F.interpolate(vis.squeeze(1)[None, None], size=(2, 4, 6), mode="trilinear", align_corners=False)
    assert torch.equal(hint[:, 24:25], vis_lat)
    assert 0.0 < float(vis.mean()) < 1.0
    # no source video: the masked source is black; a control video fills the first 24 channels
    vae = TinyVAE()
    ctl = torch.rand(5, 3, 64, 96, generator=g)
    hint = prepare_hint(vae, (1, 24, 2, 4, 6), control_video=ctl, mask=mask)
    assert torch.equal(vae.calls[1], torch.zeros(5, 64, 96, 3))
    assert torch.equal(hint[:, :24], vae.encode(ctl.movedim(1, -1)))


def test_encode_must_give_the_target_shape():
    class WrongVAE(TinyVAE):
        def spacial_compression_encode(self):
            return 8

    with pytest.raises(Exception, match="target video latent"):
        prepare_hint(WrongVAE(), (1, 24, 2, 4, 6), control_video=torch.rand(5, 3, 64, 96))


# ---------------------------------------------------------------------------------------------
# the node on the pack's model and the H3 Sampler
# ---------------------------------------------------------------------------------------------

class FakePatch:
    """What core's ModelPatchLoader returns for an H3 Fun ControlNet: a patcher whose .model is the tower module
    (here the runtime's own FunControl, dense, given core's attribute names)."""

    def __init__(self, tower):
        tower.injection_layers = tower.places
        self.model = tower


@pytest.fixture(scope="module")
def tower_file(tmp_path_factory):
    return save_tiny_control(tmp_path_factory.mktemp("ctl") / "tower.safetensors", TINY, (0, 2), seed=5)


def _apply(model, tower_file, **kw):
    args = dict(model=model, vae=TinyVAE(), strength=0.8, start_percent=0.0, end_percent=1.0)
    args.update(kw)
    if "model_patch" not in kw and "control_name" not in kw:
        args["model_patch"] = FakePatch(load_control(tower_file, types.SimpleNamespace(
            device=torch.device("cpu"), dtype=torch.float32, quantize=False, adaln_on_host=False), TINY))
    return H3FunControlNetApply().apply(**args)[0]


def test_strength_zero_or_nothing_to_control_returns_the_model(comfy, tiny, tower_file):
    assert _apply(tiny, tower_file, strength=0.0, control_video=torch.rand(5, 64, 64, 3)) is tiny
    assert _apply(tiny, tower_file) is tiny
    with pytest.raises(H3NodeError, match="exactly one"):
        _apply(tiny, tower_file, control_video=torch.rand(5, 64, 64, 3), model_patch=None, control_name=NO_FILE)


def test_sampler_runs_the_tower_like_the_runtime(comfy, tiny, tower_file):
    g = torch.Generator().manual_seed(4)
    clip = torch.rand(9, 64, 64, 3, generator=g)  # IMAGE [frames, h, w, C]
    m = _apply(tiny, tower_file, control_video=clip, start_percent=0.0, end_percent=0.6, fade_in_frames=2)
    assert isinstance(m, ControlledModel) and m.config is tiny.config
    latent = core_empty_latent(64, 64, 22)
    out, report = H3Sampler().sample(m, core_conditioning(), latent, **SAMPLE_ARGS)
    assert report["control"]["strength"] == 0.8 and report["control"]["fades"] == [2, 0]
    # the same run through the runtime: hint prepared by hand (core's rules), tower loaded on the model's plan
    video, audio = latent["samples"].tensors
    hint = prepare_hint(TinyVAE(), video.shape, control_video=clip[..., :3].movedim(-1, 1))
    cond = core_conditioning()
    ctl = {"hint": hint, "strength": 0.8, "sigma_start": 1.0, "sigma_end": percent_to_sigma(0.6, 12.0),
           "fade_in_frames": 2, "fade_out_frames": 0}
    payload = {"seed": SAMPLE_ARGS["seed"], "control": ctl}
    res = sample(tiny, cond[0][0], cond[0][1]["minimax_token_tags"], video, audio, seed=SAMPLE_ARGS["seed"],
                 steps=SAMPLE_ARGS["steps"], conditioning=conditioning_from_payload(payload),
                 control=m.fun_control.tower(tiny))
    got_v, got_a = out["samples"].tensors
    assert torch.equal(got_v, res.video) and torch.equal(got_a, res.audio)
    plain, _ = H3Sampler().sample(tiny, core_conditioning(), core_empty_latent(64, 64, 22), **SAMPLE_ARGS)
    assert not torch.equal(plain["samples"].tensors[0], got_v)


def test_mismatched_tower_refused_at_apply(comfy, tiny, tmp_path):
    curve = save_tiny_control(tmp_path / "curve.safetensors", TINY.replace(adaln_curve_grid=33), (0, 2), seed=5)
    fake = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, quantize=False,
                                 adaln_on_host=False)
    with pytest.raises(H3NodeError, match="curve-form"):
        _apply(tiny, None, control_video=torch.rand(5, 64, 64, 3),
               model_patch=FakePatch(load_control(curve, fake)))


def test_the_node_path_plans_the_budget_with_the_tower_before_loading_it(tower_file):
    """The H3 Sampler asks for the tower with the run's latent shapes: the budget is planned with the tower first,
    so a budget that cannot hold it resident loads it streamed (its linears straight to host memory)."""
    from h3_blackwell.nodes.control import ControlAttachment
    from h3_blackwell.runtime import RuntimeOptions, load_model, open_control
    from h3_blackwell.runtime.budget import SLOTS, ModelMemory, TowerSize, Workload, estimate

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32"))
    vs, as_ = (1, 24, 2, 4, 6), (1, 32, 2, 8)
    wl = Workload.from_shapes(vs, as_, 6, 3, None, TowerSize.of(open_control(tower_file)))
    full = estimate(ModelMemory.from_plan(rt.plan), wl, rt.config.num_layers, SLOTS, None, "cpu").total
    rt.plan.options.vram_budget = repr((full - 1) / 1e9)
    att = ControlAttachment(str(tower_file), None, 1.0, 0.0, 1.0, None, None, None)
    tower = att.tower(rt, (vs, as_), 6, 3)
    assert rt.plan.memory.tower_streams and tower.streamer.order == [0, 1]
    assert tower.streamer.host_bytes > 0 and set(tower.streamer.host) == {0, 1}  # the linears live in host buffers
    assert att.tower(rt) is tower  # cached for the plan
