"""Our transformer inside diffusers' H3 pipeline on a GPU (run: python3 -m pytest -m gpu
tests/gpu/test_diffusers_pipeline_gpu.py; needs the pipeline wheels, scripts/pipeline_carry.sh).

The tiny random pipeline folder (runtime.pipeline.tiny) on CUDA: the dense fp32 stack equals the stock transformer
(fp32 on the same device) within 1e-4 rel-L2 (CUDA kernels' summation order; the CPU test holds 1e-5), and the
fast stack the load plan picks (NVFP4 / W4A8 block linears, fast attention) stays finite and within 0.5 rel-L2 of it:
four-bit weights on a random tiny model move its latents by tens of percent (printed with -s), while a broken
layout, sign or conditioning gives 1 or more.
"""

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("torchvision", reason="transformers' Qwen3-VL processor needs torchvision")

from diffusers import ModularPipeline  # noqa: E402

from h3_blackwell.runtime import DiffusersTransformer, folder_transformer  # noqa: E402
from h3_blackwell.runtime.pipeline.tiny import TinyPipeline, save_tiny_pipeline  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_pipeline_on_cuda(tmp_path):
    folder = save_tiny_pipeline(tmp_path / "h3", TinyPipeline(seed=4))
    pipe = ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(torch_dtype=torch.float32)
    pipe.to("cuda")
    ckpt = folder_transformer(folder)
    runs = {}
    for name, transformer in (("stock", pipe.transformer),
                              ("dense", DiffusersTransformer.from_file(ckpt, dense=True, device="cuda",
                                                                       dtype="float32")),
                              ("fast", DiffusersTransformer.from_file(ckpt, device="cuda"))):
        pipe.update_components(transformer=transformer)
        out = pipe(prompt="a tiny fox on a GPU", height=64, width=96, num_frames=124, num_inference_steps=4,
                   generator=torch.Generator().manual_seed(2), output=["latents", "audio_latents"])
        runs[name] = (out["latents"].float().cpu(), out["audio_latents"].float().cpu())
    (sv, sa), (dv, da), (fv, fa) = runs["stock"], runs["dense"], runs["fast"]
    assert rel_l2(dv, sv) <= 1e-4 and rel_l2(da, sa) <= 1e-4, (rel_l2(dv, sv), rel_l2(da, sa))
    assert torch.isfinite(fv).all() and torch.isfinite(fa).all()
    print(f"\nfast vs dense rel-L2: video {rel_l2(fv, dv):.4g}, audio {rel_l2(fa, da):.4g}")
    assert rel_l2(fv, dv) < 0.5 and rel_l2(fa, da) < 0.5, (rel_l2(fv, dv), rel_l2(fa, da))
