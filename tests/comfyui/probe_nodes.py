"""Test-only ComfyUI nodes, copied by tests/comfyui/server.py into the scratch base directory as
``custom_nodes/h3b_test_probe/__init__.py`` (never part of the pack). They run inside the server's own Python (the
ComfyUI venv) and import nothing of the pack:

- ``H3BTest_SaveLatent``: writes a LATENT to ``output/h3b_probe/<name>.safetensors`` (keys ``video`` and ``audio`` for
  an H3 audio+video latent, ``samples`` for a plain one), so a test compares values, not only hashes;
- ``H3BTest_TextConditioning``: random text states [1, tokens, 5120] (seeded) with a vision span in the token tags, as
  tests/oracles/check_core_model.py's ``text_conditioning``;
- ``H3BTest_StandInVAE``: a stand-in for the H3 video VAE (16x16 average pooling, core's frame rule 17k+5 -> 5k+2, a
  fixed 3 -> 24 channel map), for guides and the Fun ControlNet hint;
- ``H3BTest_RandomFrames``: seeded random IMAGE frames [F, H, W, 3] in [0, 1].
"""

import os

import torch

CATEGORY = "h3b_test_probe"


def _streams(samples):
    if getattr(samples, "is_nested", False) and hasattr(samples, "tensors"):
        video, audio = samples.tensors
        return {"video": video, "audio": audio}
    if isinstance(samples, (list, tuple)):
        video, audio = samples
        return {"video": video, "audio": audio}
    return {"samples": samples}


class SaveLatent:
    CATEGORY = CATEGORY
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "save"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "name": ("STRING", {"default": "latent"})}}

    def save(self, samples, name):
        import folder_paths
        from safetensors.torch import save_file

        folder = os.path.join(folder_paths.get_output_directory(), "h3b_probe")
        os.makedirs(folder, exist_ok=True)
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in _streams(samples["samples"]).items()}
        save_file(tensors, os.path.join(folder, f"{name}.safetensors"))
        return {"ui": {"h3b_probe": [f"h3b_probe/{name}.safetensors"]}}


class _Maker:
    """A node of INT inputs only: ``INTS`` = {name: (default, min, max)}; ``make(**ints)`` returns the output."""

    CATEGORY = CATEGORY
    FUNCTION = "make"
    INTS: dict = {}

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {name: ("INT", {"default": d, "min": lo, "max": hi})
                             for name, (d, lo, hi) in cls.INTS.items()}}


class TextConditioning(_Maker):
    RETURN_TYPES = ("CONDITIONING",)
    INTS = {"tokens": (12, 4, 256), "seed": (1234, 0, 2**31)}

    def make(self, tokens, seed):
        g = torch.Generator().manual_seed(seed)
        states = torch.randn(1, tokens, 5120, generator=g)
        tags = torch.ones(tokens, dtype=torch.long)
        tags[3:6] = 0  # a vision span inside the text, as the minimax CLIP tags it
        return ([[states, {"minimax_token_tags": tags}]],)


class _VAE:
    def __init__(self, seed):
        self.proj = torch.randn(24, 3, generator=torch.Generator().manual_seed(seed))

    def spacial_compression_encode(self):
        return 16

    def encode(self, pixels):
        x = torch.nn.functional.avg_pool2d(pixels[..., :3].movedim(-1, 1).float(), 16)
        n = x.shape[0]
        t = 1 if n < 5 else (n - 5) // 17 * 5 + 2
        x = torch.stack([c.mean(0) for c in torch.tensor_split(x, t)])  # [T, 3, h, w]
        return torch.einsum("oc,tchw->othw", self.proj, x)[None]


class StandInVAE(_Maker):
    RETURN_TYPES = ("VAE",)
    INTS = {"seed": (7, 0, 2**31)}

    def make(self, seed):
        return (_VAE(seed),)


class RandomFrames(_Maker):
    RETURN_TYPES = ("IMAGE",)
    INTS = {"frames": (1, 1, 400), "height": (96, 16, 4096), "width": (128, 16, 4096), "seed": (11, 0, 2**31)}

    def make(self, frames, height, width, seed):
        return (torch.rand(frames, height, width, 3, generator=torch.Generator().manual_seed(seed)),)


NODE_CLASS_MAPPINGS = {"H3BTest_SaveLatent": SaveLatent, "H3BTest_TextConditioning": TextConditioning,
                       "H3BTest_StandInVAE": StandInVAE, "H3BTest_RandomFrames": RandomFrames}
