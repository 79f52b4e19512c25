"""``generate --prompt``'s runtime side: a generate job given the conditioner's text states and keyframes, and the
mp4 of the decoded arrays (h264 video at 24 fps and AAC audio, through PyAV)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..job import Job, tensor_job
from ..sampling.sampler import SampleInputs
from .folder import Decoded

__all__ = ["prompt_job", "write_mp4", "FPS"]

FPS = 24  # H3 generates at 24 frames per second (MiniMaxH3ModularPipeline.fps)
AAC_FRAME = 1024  # samples per AAC frame


def prompt_job(job: Job, text: torch.Tensor, tags: torch.Tensor, cond) -> Job:
    """``job`` (generate's, validated with placeholder text) with the conditioner's text states [1, L, text_dim],
    tags [L] and keyframe conditioning (or None), validated again as a tensor request: the text's width and
    finiteness, the keyframes against the target, the memory of the real packed size."""
    video, audio = job.inputs.video, job.inputs.audio
    if video is None:
        video, audio = job.latents(job.config)
    inputs = SampleInputs(text, tags, video, audio, cond)
    return tensor_job(job.model, inputs, job.sampling, ("the conditioner's text states", "latents"),
                      lossy=job.lossy, measure=job.measure, hooks=job.hooks, progress=job.progress,
                      workload_extra=dict(job.workload_extra), print_plan=job.print_plan, output=job.output)


def write_mp4(path: str | Path, decoded: Decoded, fps: int = FPS) -> None:
    """``decoded`` as an mp4 at ``path``: one h264 stream (yuv420p, crf 12) of its frames at ``fps`` and one AAC
    stream of its audio at its sample rate (stereo, or mono for one channel)."""
    import av

    frames = (decoded.video.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    audio = decoded.audio.float().contiguous().numpy()
    with av.open(str(path), "w", format="mp4") as box:
        vs = box.add_stream("libx264", rate=fps)
        vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        vs.options = {"crf": "12"}
        aus = box.add_stream("aac", rate=decoded.rate)
        aus.layout = "stereo" if audio.shape[0] == 2 else "mono"
        for f in frames:
            box.mux(vs.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        box.mux(vs.encode())
        for k in range(0, audio.shape[1], AAC_FRAME):
            af = av.AudioFrame.from_ndarray(audio[:, k:k + AAC_FRAME].copy(), format="fltp", layout=aus.layout.name)
            af.sample_rate, af.pts = decoded.rate, k
            box.mux(aus.encode(af))
        box.mux(aus.encode())
