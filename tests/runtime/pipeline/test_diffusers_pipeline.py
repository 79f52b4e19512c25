"""Our transformer inside diffusers' MiniMax H3 pipeline, and ``generate --pipeline --prompt``, on a tiny random
pipeline folder built offline (``runtime.pipeline.tiny``).

Oracles are diffusers' own: the pipeline with its stock ``MiniMaxH3Transformer3DModel`` (same weights) for the
latents, its layout builder for the layout reader, its decode blocks for ``decoded.safetensors``. Tolerances:
latents rel-L2 <= 1e-5 (both fp32, the same weights; only GEMM / attention summation order differs, ~1e-7 per op,
a few 1e-7 after the steps); decoded arrays 1e-3 (the same VAE weights and latents; the decode runs in fp32 on both
sides, so the measured gap is ~1e-7, and 1e-3 is the issue's bound).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import shutil

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("torchvision", reason="transformers' Qwen3-VL processor needs torchvision (scripts/test.sh)")
av = pytest.importorskip("av")

from diffusers import ModularPipeline  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,  # noqa: E402
                                                                   MiniMaxH3SetTimestepsStep)
from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fixtures.cli_contract import refused_inproc  # noqa: E402
from h3_blackwell.cli.main import main  # noqa: E402
from h3_blackwell.runtime import Decoded, DiffusersTransformer, folder_transformer, write_mp4  # noqa: E402
from h3_blackwell.runtime.model.layout import time_shift_sigma  # noqa: E402
from h3_blackwell.runtime.pipeline.folder import PipelineError  # noqa: E402
from h3_blackwell.runtime.pipeline.rows import read_layout  # noqa: E402
from h3_blackwell.runtime.pipeline.transformer import LAYOUT  # noqa: E402
from h3_blackwell.runtime.pipeline.tiny import TinyPipeline, save_tiny_pipeline  # noqa: E402

PROMPT = "a red fox runs through fresh snow, wind in the pines"


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "h3", TinyPipeline(seed=3))


@pytest.fixture(scope="module")
def pipe(folder):
    p = ModularPipeline.from_pretrained(str(folder))
    p.load_components(torch_dtype=torch.float32)
    return p


def _image(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# -- the layout reader against diffusers' layout builder ------------------------------------------------------------

@pytest.mark.parametrize("geom", [(7, 2, 4, 4, 5, (), None), (12, 7, 6, 4, 9, ("first",), [1, 1, 0, 0, 0, 1]),
                                  (5, 12, 4, 8, 30, ("first", "last"), None), (9, 37, 2, 2, 207, ("last",), None)])
def test_read_layout_matches_diffusers(geom):
    """Every geometry and keyframe set the t2va / fl2va layout step builds is read back and proved equal to ours:
    positions, tags and every row's timestep at several sigmas."""
    L, T, H, W, Ta, anchors, tags = geom
    text_tags = torch.tensor((tags * L)[:L] if tags else [1] * L)
    pos, tt, vidx, aidx, tidx, ncond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, T, H, W, Ta, (1, 2, 2), 2, 2, 0, anchors)
    lay = read_layout(tt, pos, vidx, aidx, tidx)
    frames = lay.pixel_frames
    assert (lay.latent_t, lay.lat_h, lay.lat_w, lay.audio_t, lay.cond_rows) == (T, H, W, Ta, ncond)
    assert lay.keyframes == tuple(0 if a == "first" else frames - 1 for a in anchors)
    lay.check(tt, pos)
    for sigma in (1.0, 0.83, 0.2, 0.013):
        t_a = 1.0 - time_shift_sigma(sigma, 12.0, 3.0)
        uniq, inv = MiniMaxH3SetTimestepsStep.build_row_timesteps(vidx, aidx, ncond, 0, L, 1.0 - sigma, t_a,
                                                                  max(1.0 - sigma, 0.999), 1.0)
        lay.check_times(uniq[inv], 1.0 - float(torch.tensor(1.0 - sigma, dtype=torch.float32)), (12.0, 3.0))


# -- diffusers' pipeline: our transformer against its stock one ----------------------------------------------------

def _latents(pipe, transformer, **kw):
    pipe.update_components(transformer=transformer)
    out = pipe(prompt=PROMPT, height=64, width=96, num_frames=124, num_inference_steps=4,
               generator=torch.Generator().manual_seed(7), output=["latents", "audio_latents"], **kw)
    return out["latents"], out["audio_latents"]


@pytest.fixture(scope="module")
def ours(folder):
    return DiffusersTransformer.from_file(folder_transformer(folder), dense=True, device="cpu", dtype="float32")


@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_pipeline_with_our_transformer_equals_stock(pipe, ours, task):
    stock = pipe.transformer
    kw = {} if task == "t2va" else {"image": _image(1, 80, 60), "last_image": _image(2, 96, 64)}
    try:
        sv, sa = _latents(pipe, stock, **kw)
        ov, oa = _latents(pipe, ours, **kw)
        again_v, again_a = _latents(pipe, ours, **kw)  # a repeated request: planned whole from the last run's sigmas
    finally:
        pipe.update_components(transformer=stock)
    assert sv.abs().mean() > 0.1 and sa.abs().mean() > 0.1  # a real signal
    assert rel_l2(ov, sv) <= 1e-5, rel_l2(ov, sv)
    assert rel_l2(oa, sa) <= 1e-5, rel_l2(oa, sa)
    assert ours.call.run.schedule is not None  # the second run found its schedule
    assert rel_l2(again_v, sv) <= 1e-5 and rel_l2(again_a, sa) <= 1e-5
    if task == "fl2va":  # the keyframes reach the model: not the t2va result
        tv, _ = _latents(pipe, stock)
        assert rel_l2(ov, tv) > 1e-3


def test_other_shapes_and_seed(tmp_path):
    """Another folder: 64-wide heads with 48 rotated channels, three blocks, a 52-layer conditioner of width 48, a
    portrait canvas of 141 frames and a last frame only; our loader reads its diffusers-named transformer as is."""
    from h3_blackwell.runtime.model.config import H3Config

    cfg = H3Config(hidden_size=80, num_layers=3, num_refiner_layers=2, num_heads=2, head_dim=64, ffn_hidden_size=128,
                   text_dim=48, time_embed_hidden_size=64, time_embed_dim=40, rope_inv_freq_len=8)
    folder = save_tiny_pipeline(tmp_path / "wide", TinyPipeline(dit=cfg, seed=11, conditioner_layers=52, vae_width=4))
    p = ModularPipeline.from_pretrained(str(folder))
    p.load_components(torch_dtype=torch.float32)
    ours = DiffusersTransformer.from_file(folder_transformer(folder), dense=True, device="cpu", dtype="float32")
    assert ours.rt.config == cfg
    res = []
    for transformer in (p.transformer, ours):
        p.update_components(transformer=transformer)
        out = p(prompt="wide heads", height=96, width=64, num_frames=141, num_inference_steps=3,
                last_image=_image(3, 70, 40), generator=torch.Generator().manual_seed(5),
                output=["latents", "audio_latents"])
        res.append((out["latents"], out["audio_latents"]))
    assert rel_l2(res[1][0], res[0][0]) <= 1e-5 and rel_l2(res[1][1], res[0][1]) <= 1e-5


def test_pipeline_ref2va_with_our_transformer_equals_stock(pipe, ours):
    """ref2va (the `transformer_ref` partition; here the same weights): an image, a video with its soundtrack and an
    audio-only reference, read back from the rows as our references."""
    from diffusers.modular_pipelines.minimax_h3.references import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                                   MiniMaxH3VideoReference)

    g = np.random.default_rng(9)
    refs = [MiniMaxH3ImageReference(image=_image(6, 64, 48)),
            MiniMaxH3VideoReference(frames=g.integers(0, 256, (24, 64, 96, 3), dtype=np.uint8), fps=24.0,
                                    audio=0.1 * torch.randn(2, 32000, generator=torch.Generator().manual_seed(1)),
                                    sample_rate=32000),
            MiniMaxH3AudioReference(audio=0.1 * torch.randn(2, 16000, generator=torch.Generator().manual_seed(2)),
                                    sample_rate=32000)]

    def latents(transformer):
        pipe.update_components(transformer_ref=transformer)
        out = pipe(prompt=PROMPT, references=refs, height=64, width=96, num_frames=124, num_inference_steps=3,
                   generator=torch.Generator().manual_seed(3), output=["latents", "audio_latents"])
        return out["latents"], out["audio_latents"]

    try:
        sv, sa = latents(pipe.transformer)
        ov, oa = latents(ours)
    finally:
        pipe.update_components(transformer_ref=None)
    assert rel_l2(ov, sv) <= 1e-5, rel_l2(ov, sv)
    assert rel_l2(oa, sa) <= 1e-5, rel_l2(oa, sa)
    assert [r.kind for r in ours._seen.layout.refs] == ["image", "video_audio", "audio"]


def test_transformer_interface(ours):
    """What diffusers' loop reads: config.patch_size and the layout names in forward's signature."""
    params = inspect.signature(ours.forward).parameters
    assert set(LAYOUT) <= set(params) and "self" not in params
    assert tuple(ours.config.patch_size) == (1, 2, 2)


def test_transformer_refuses_what_it_cannot_honour(ours, pipe):
    with pytest.raises(Exception, match="attention_kwargs"):
        pipe.update_components(transformer=ours)
        try:
            pipe(prompt=PROMPT, height=64, width=64, num_frames=124, num_inference_steps=2,
                 attention_kwargs={"scale": 1.0}, output="latents")
        finally:
            pipe.update_components(transformer=None)


# -- generate --pipeline --prompt -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated(folder, tmp_path_factory):
    """One ``generate --prompt`` run with both keyframes: its output folder, decoded arrays and audio rate."""
    tmp = tmp_path_factory.mktemp("gen")
    _image(4, 70, 50).save(tmp / "first.png")
    _image(5, 96, 64).save(tmp / "last.png")
    out, err = tmp / "out", io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["generate", "--pipeline", str(folder), "--prompt", PROMPT, "--first-frame", str(tmp / "first.png"),
                   "--last-frame", str(tmp / "last.png"), "--width", "96", "--height", "64", "--frames", "22",
                   "--steps", "3", "--dense", "--device", "cpu", "--output", str(out)])
    assert rc == 0, err.getvalue()[-3000:]
    with safe_open(str(out / "decoded.safetensors"), "pt") as f:
        rate = int(f.metadata()["sample_rate"])
    return out, load_file(str(out / "decoded.safetensors")), rate


def test_generate_prompt_writes_decoded_and_mp4(folder, pipe, generated):
    out, dec, rate = generated
    lat = load_file(str(out / "latents.safetensors"))
    # diffusers' own decode of the same latents
    res = pipe.blocks.sub_blocks["decode"].init_pipeline(str(folder))
    res.load_components(torch_dtype=torch.float32)
    theirs = res(latents=lat["video"], audio_latents=lat["audio"][0].permute(1, 0, 2).contiguous(), output_type="pt",
                 output=["videos", "audio", "sampling_rate"])
    tv, ta = theirs["videos"][0].float(), theirs["audio"][0].float()
    assert dec["video"].shape == (22, 3, 64, 96) and dec["audio"].shape == ta.shape and ta.shape[0] == 2
    assert rate == theirs["sampling_rate"]
    assert (dec["video"] - tv).abs().max() <= 1e-3 and (dec["audio"] - ta).abs().max() <= 1e-3
    assert dec["video"].std() > 0.01 and dec["audio"].abs().mean() > 0  # decoded content, not a constant
    got = _read_mp4(out / "video.mp4")
    assert got["video_codec"] == "h264" and got["audio_codec"] == "aac"
    _check_against_arrays(got, dec["video"], dec["audio"], rate)
    report = (out / "report.json").read_text()
    assert '"keyframes": [\n      0,\n      21\n    ]' in report
    tokens = json.loads(report)["pipeline"]["prompt_tokens"]
    assert tokens > len(PROMPT.encode()) + 2 * 12  # the prompt's bytes plus two "<Picture i>: " labels and vision blocks


@pytest.mark.parametrize("channels", [2, 1])
def test_mp4_is_diffusers_export_of_the_same_arrays(generated, tmp_path, channels):
    """Our mp4 against diffusers' own H3 export (``diffusers.utils.encode_video``) of the same decoded arrays, both
    read back with PyAV. The two feed one libx264 / AAC encoder, in this process, the same uint8 frames and 16-bit
    samples with the same settings, so their decoded contents agree to the codec's determinism (measured: identical
    bytes). Bounds: video mean abs <= 1/255 (one uint8 step; a writer at crf 12 with float audio is 0.044 away on
    these frames) and audio rms difference <= 1% of the signal's (that writer: 68%). Mono is written as stereo by both."""
    from diffusers.utils import encode_video

    out, dec, rate = generated
    audio = dec["audio"][:channels]
    ours, theirs = tmp_path / "ours.mp4", tmp_path / "theirs.mp4"
    if channels == 2:
        ours = out / "video.mp4"  # what generate wrote
    else:
        write_mp4(ours, Decoded(dec["video"], audio, rate))
    encode_video(dec["video"].permute(0, 2, 3, 1).numpy(), fps=24, output_path=str(theirs), audio=audio,
                 audio_sample_rate=rate)
    a, b = _read_mp4(ours), _read_mp4(theirs)
    same = ("video_codec", "audio_codec", "size", "fps", "rate", "channels", "pix_fmt")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert a["channels"] == 2 and a["video"].shape == b["video"].shape and a["audio"].shape == b["audio"].shape
    assert (a["video"] - b["video"]).abs().mean() <= 1 / 255
    assert (a["audio"] - b["audio"]).pow(2).mean().sqrt() <= 0.01 * b["audio"].pow(2).mean().sqrt()
    for got in (a, b):
        _check_against_arrays(got, dec["video"], audio.expand(2, -1), rate)


def test_mp4_audio_must_be_mono_or_stereo(tmp_path):
    video = torch.rand(2, 3, 16, 16)
    with pytest.raises(PipelineError, match="1 or 2 channels"):
        write_mp4(tmp_path / "x.mp4", Decoded(video, torch.rand(3, 4096) - 0.5, 16000))
    assert not (tmp_path / "x.mp4").exists()


def _read_mp4(path) -> dict:
    """An mp4's streams as PyAV reads them: codecs, size, rates, and the decoded frames [F, 3, H, W] in [0, 1] and
    audio [channels, samples]."""
    with av.open(str(path)) as box:
        assert [s.type for s in box.streams] in (["video", "audio"], ["audio", "video"])
        vs, aus = box.streams.video[0], box.streams.audio[0]
        info = {"video_codec": vs.codec_context.name, "audio_codec": aus.codec_context.name,
                "size": (vs.codec_context.width, vs.codec_context.height), "fps": vs.average_rate,
                "rate": aus.rate, "channels": aus.codec_context.channels, "pix_fmt": vs.codec_context.pix_fmt}
        frames = [f.to_ndarray(format="rgb24") for f in box.decode(video=0)]
        box.seek(0)
        audio = np.concatenate([f.to_ndarray() for f in box.decode(audio=0)], axis=1)
    info["video"] = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255
    info["audio"] = torch.from_numpy(audio).float()
    return info


def _check_against_arrays(got: dict, video, audio, rate):
    """An mp4 read back (``_read_mp4``) against the decoded arrays it was written from.

    Video: h264 at libx264's default crf 23 (diffusers' export) in yuv420p keeps luma at full resolution and chroma
    at half. Random-weight frames are per-pixel noise, h264's worst case: luma is measured ~0.03 mean abs here
    (bound 0.05), pixel-level colour noise is lost, each frame's mean colour is kept (bound 0.03).
    Audio: AAC's priming is trimmed on decode (best alignment at lag 0) and the last frame is padded. The random-weight
    audio is saturated noise (about 2/3 of samples at +-1), a perceptual codec's worst case: measured correlation
    ~0.66 (bound 0.5) and every 1024-sample block's rms within 0.85..0.99 of the original's (bounds 0.7..1.15)."""
    v = got["video"]
    assert (got["fps"], got["rate"], got["size"]) == (24, rate, (video.shape[3], video.shape[2]))
    assert v.shape == video.shape
    luma = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    assert ((v - video) * luma).sum(1).abs().mean() < 0.05
    assert (v.mean((2, 3)) - video.mean((2, 3))).abs().max() < 0.03
    a, n = got["audio"], audio.shape[1]
    assert a.shape[0] == audio.shape[0] and n <= a.shape[1] < n + 1024
    lags = range(-1024, 1025, 8)
    assert max(lags, key=lambda k: float((a[:, 1024 + k:1024 + k + 8192] * audio[:, 1024:9216]).sum())) == 0
    x = a[:, :n]
    assert (x * audio).sum() / (x.norm() * audio.norm()) > 0.5
    m = n // 1024 * 1024
    ratio = x[:, :m].reshape(-1, 1024).pow(2).mean(1).sqrt() / audio[:, :m].reshape(-1, 1024).pow(2).mean(1).sqrt()
    assert 0.7 <= ratio.min() and ratio.max() <= 1.15


def test_stages_keep_to_the_device_budget(folder):
    """A stage whose weights exceed the device budget runs on the CPU (decided from the files; no device needed)."""
    from h3_blackwell.runtime import open_pipeline
    from h3_blackwell.runtime.pipeline.tiny import TINY_PIPELINE_DIT

    small = open_pipeline(folder, TINY_PIPELINE_DIT, "0.000001")  # 1 kB
    assert small._device(("text_encoder",), torch.device("cuda"), "encode").type == "cpu"
    roomy = open_pipeline(folder, TINY_PIPELINE_DIT, "10")
    assert roomy._device(("text_encoder",), torch.device("cuda"), "encode").type == "cuda"
    assert small.stages == {"encode": "cpu"} and roomy.stages == {"encode": "cuda"}


# -- bad input: one error line, nothing written ---------------------------------------------------------------------

def _args(folder, out, *extra):
    return ["generate", "--pipeline", str(folder), "--prompt", PROMPT, "--width", "64", "--height", "64", "--frames",
            "22", "--steps", "2", "--dense", "--device", "cpu", "--output", str(out), *extra]


def test_generate_prompt_refusals(folder, tmp_path, capsys):
    out = tmp_path / "out"
    broken = tmp_path / "no_vae"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "vae")
    refused_inproc(capsys, _args(broken, out, "--model", folder_transformer(folder)), "missing vae")
    refused_inproc(capsys, ["generate", "--pipeline", str(folder), "--prompt", "x" * 300, "--output", str(out)],
                   "at most 256 tokens", "found 300")
    (tmp_path / "bad.png").write_text("not an image")
    refused_inproc(capsys, _args(folder, out, "--first-frame", tmp_path / "bad.png"), "--first-frame", "bad.png")
    refused_inproc(capsys, _args(folder, out, "--last-frame", tmp_path / "none.png"), "--last-frame")
    tiny = tmp_path / "tiny.safetensors"  # the embedded tiny DiT: its text width is not the conditioner's
    assert main(["make-tiny", str(tiny)]) == 0
    refused_inproc(capsys, _args(folder, out, "--model", tiny), "conditioner's hidden size", "text width")
    refused_inproc(capsys, ["generate", "--prompt", PROMPT, "--output", str(out)], "--pipeline")
    assert not out.exists()
