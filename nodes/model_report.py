"""H3 Model Run Report: the report of the last sampling run of the loader's MODEL output (core's samplers drive
it), as H3_DIAGNOSTICS for H3 Diagnostics. Connect the sampler's LATENT: it orders the node after the run and its
streams give the report's latent sha256."""

from __future__ import annotations

from ._common import CATEGORY
from .core_model import run_report
from .latents import pixel_frames, read_latent


class H3ModelReport:
    TITLE = "H3 Model Run Report"
    DESCRIPTION = ("The run report (backends, per-call timings, FC2 dispatch counts, LoRAs, latent sha256) of the "
                   "last sampling run of the H3 loader's MODEL output, for H3 Diagnostics.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("H3_DIAGNOSTICS",)
    RETURN_NAMES = ("diagnostics",)
    OUTPUT_TOOLTIPS = ("the run report, for H3 Diagnostics",)
    FUNCTION = "report"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "the MODEL output of H3 NVFP4 Model Loader (or a patched copy of it) that "
                                           "the sampler ran"}),
            "latent": ("LATENT", {"tooltip": "the sampler's output: orders this node after the run; its hashes go "
                                             "into the report"}),
        }}

    def report(self, model, latent):
        video, audio = read_latent(latent, self.TITLE)
        rep = run_report(model, video, audio, self.TITLE)
        rep["workload"]["frames"] = pixel_frames(video.shape[2])
        return (rep,)
