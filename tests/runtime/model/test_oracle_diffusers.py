"""Architecture oracle: our fp32 reference forward == diffusers' MiniMaxH3Transformer3DModel.

The diffusers side gets its packed layout from diffusers' own ``build_packed_sequence`` and its
per-row timesteps from the formulas of h3-comfyui-facts.md §1 written out here, so neither the layout
nor the timestep assignment is shared with the code under test. Weights go through our key map.
Tolerance rel-L2 <= 1e-5: both sides are fp32; the only differences are summation order in the GEMMs
and attention kernels (~1e-7 relative per op, a few 1e-6 after the block stack).
"""

import pytest
import torch

from h3_blackwell.runtime.io.keys import comfy_to_diffusers_state_dict
from h3_blackwell.runtime.io.payload import conditioning_from_payload
from h3_blackwell.runtime.model.config import H3Config
from h3_blackwell.runtime.model.layout import pad_video, patchify_video, unpatchify_video
from h3_blackwell.runtime.model.tiny import tiny_model, tiny_state_dict
from h3_blackwell.runtime.pipeline.tiny import diffusers_kwargs

diffusers = pytest.importorskip("diffusers")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep  # noqa: E402

CONFIGS = {
    # odd latent H/W: the model pads circularly to the 2x2 patch grid
    "padded": (H3Config(hidden_size=64, num_layers=2, num_refiner_layers=2, num_heads=2, head_dim=32,
                        ffn_hidden_size=96, text_dim=40, time_embed_hidden_size=64, time_embed_dim=32,
                        rope_inv_freq_len=4), (2, 5, 7), 9, [], None),
    # keyframes first + last, text with vision tags: 3 distinct timesteps, all three modality tags
    "fl2va": (H3Config(hidden_size=96, num_layers=3, num_refiner_layers=2, num_heads=4, head_dim=32,
                       ffn_hidden_size=160, text_dim=48, time_embed_hidden_size=80, time_embed_dim=48,
                       rope_inv_freq_len=4), (7, 4, 6), 12, ["first", "last"], [1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1]),
    # another shape family: head_dim 64 with 48 rotated channels, one refiner block
    "wide_heads": (H3Config(hidden_size=80, num_layers=2, num_refiner_layers=1, num_heads=2, head_dim=64,
                            ffn_hidden_size=128, text_dim=32, time_embed_hidden_size=64, time_embed_dim=40,
                            rope_inv_freq_len=8), (2, 4, 4), 5, [], None),
}


def shifted(sigma, s_from, s_to):
    b = sigma / (s_from - (s_from - 1) * sigma)
    return s_to * b / (1 + (s_to - 1) * b)


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def diffusers_model(cfg, sd):
    m = MiniMaxH3Transformer3DModel(**diffusers_kwargs(cfg))
    missing, unexpected = m.load_state_dict(comfy_to_diffusers_state_dict(sd), strict=False)
    assert not unexpected, unexpected
    assert all("rope" in k for k in missing), missing
    return m.eval()


def diffusers_forward(theirs, cfg, video, audio, text, token_tags, sigma, anchors=(), keyframes=()):
    """diffusers' output in our layout (video [1,C,T,H,W], audio [1,Ca,2,Ta]) with its own packed layout and
    per-row timesteps written out from the formulas; also the distinct timestep values."""
    T, H, W, Ta = video.shape[2], video.shape[3], video.shape[4], audio.shape[3]
    vp = pad_video(video)
    hp, wp = vp.shape[3], vp.shape[4]
    pos, tt, vidx, aidx, tidx, ncond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        token_tags, T, hp, wp, Ta, (1, 2, 2), 2, 2, 0, tuple(anchors))
    cond_rows = []
    for kf in keyframes:
        r = patchify_video(pad_video(kf["latent"]))
        noise = torch.randn(r.shape, generator=torch.Generator("cpu").manual_seed(5))
        cond_rows.append(0.999 * r + 0.001 * noise)
    rows = torch.cat(cond_rows + [patchify_video(vp)])
    t_v = 1 - sigma
    t_a = 1 - shifted(sigma, 12.0, 3.0)
    t_c = max(t_v, 0.999)
    row_t = torch.full((pos.shape[0],), t_v, dtype=torch.float64)
    row_t[aidx] = t_a
    row_t[vidx[:ncond]] = t_c
    values = sorted(set(row_t.tolist()))
    t_idx = torch.tensor([values.index(v) for v in row_t.tolist()])
    with torch.no_grad():
        dv, da = theirs(rows[None], audio[0].permute(1, 2, 0).reshape(1, 2 * Ta, -1), text,
                        torch.tensor(values, dtype=torch.float32), t_idx, tt, pos, vidx, aidx, tidx,
                        return_dict=False)
    dvid = unpatchify_video(dv[0, ncond:], T, hp, wp, cfg.video_channels)[..., :H, :W]
    daud = da[0].reshape(2, Ta, -1).permute(2, 0, 1)[None]
    return dvid, daud, values


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_diffusers(name):
    cfg, (T, H, W), L, anchors, tags = CONFIGS[name]
    seed = 3 + len(name)
    ours = tiny_model(cfg, seed=seed)
    theirs = diffusers_model(cfg, tiny_state_dict(cfg, seed=seed))
    g = torch.Generator().manual_seed(11)
    Ta = 6
    video = torch.randn(1, cfg.video_channels, T, H, W, generator=g)
    audio = torch.randn(1, cfg.audio_channels, 2, Ta, generator=g)
    text = torch.randn(1, L, cfg.text_dim, generator=g)
    token_tags = torch.tensor(tags if tags else [1] * L, dtype=torch.long)
    keyframes = [{"resolved_frame_index": 0 if a == "first" else 17 * ((T - 2) // 5) + 4,
                  "latent": torch.randn(1, cfg.video_channels, 1, H, W, generator=g)} for a in anchors]
    sigma = 0.7
    with torch.no_grad():
        ov, oa = ours(video, audio, text, sigma, token_tags=token_tags,
                      cond=conditioning_from_payload({"keyframes": keyframes, "seed": 5}))

    dvid, daud, values = diffusers_forward(theirs, cfg, video, audio, text, token_tags, sigma, anchors, keyframes)
    assert len(values) == (3 if anchors else 2)
    assert ov.abs().mean() > 0.05 and oa.abs().mean() > 0.05  # a real signal, not ~0
    assert rel_l2(ov, -dvid) <= 1e-5, rel_l2(ov, -dvid)
    assert rel_l2(oa, -daud) <= 1e-5, rel_l2(oa, -daud)


def test_key_map_matches_diffusers_converter():
    """Our comfy->diffusers map gives exactly what diffusers' own single-file converter gives."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    cfg = CONFIGS["padded"][0]
    sd = tiny_state_dict(cfg, seed=1)
    theirs = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        dict(sd), {"num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim})
    ours = comfy_to_diffusers_state_dict(sd)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_cli_forward_float32_equals_diffusers(tmp_path, capsys):
    """`h3-blackwell forward --dtype float32` on an fp32 checkpoint, with no other flag, is the reference
    evaluation: it equals diffusers at rel-L2 <= 1e-5 (same tolerance and reason as above)."""
    from safetensors.torch import load_file, save_file

    from h3_blackwell.cli.main import main
    from h3_blackwell.runtime.model.tiny import save_tiny

    cfg = CONFIGS["fl2va"][0]
    model = save_tiny(tmp_path / "fp32.safetensors", cfg, seed=9, dtype=torch.float32)
    g = torch.Generator().manual_seed(12)
    video = torch.randn(1, cfg.video_channels, 7, 4, 6, generator=g)
    audio = torch.randn(1, cfg.audio_channels, 2, 6, generator=g)
    text = torch.randn(1, 12, cfg.text_dim, generator=g)
    tags = torch.tensor(CONFIGS["fl2va"][4], dtype=torch.long)
    save_file({"video": video, "audio": audio, "text_states": text, "sigma": torch.tensor([0.6]),
               "token_tags": tags}, str(tmp_path / "in.safetensors"))
    assert main(["forward", "--model", str(model), "--inputs", str(tmp_path / "in.safetensors"),
                 "--out", str(tmp_path / "out.safetensors"), "--dtype", "float32"]) == 0
    got = load_file(str(tmp_path / "out.safetensors"))
    theirs = diffusers_model(cfg, load_file(str(model)))
    dvid, daud, _ = diffusers_forward(theirs, cfg, video, audio, text, tags, 0.6)
    assert got["video"].abs().mean() > 0.05
    assert rel_l2(got["video"], -dvid) <= 1e-5, rel_l2(got["video"], -dvid)
    assert rel_l2(got["audio"], -daud) <= 1e-5, rel_l2(got["audio"], -daud)
