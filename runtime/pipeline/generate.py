"""``generate --prompt``'s runtime side: a generate job given the conditioner's text states and keyframes, and the
mp4 of the decoded arrays (h264 video at 24 fps and AAC audio through PyAV, as diffusers' own H3 export writes them)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import torch

from ..job import Job, tensor_job
from ..sampling.sampler import SampleInputs
from .folder import Decoded, PipelineError

__all__ = ["prompt_job", "write_mp4", "pcm16_stereo", "FPS"]

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
    """``decoded`` as an mp4 at ``path``, with the conventions of diffusers' own H3 export
    (``diffusers.utils.encode_video``), so the same arrays give the same streams:

    - video: frames [F, 3, H, W] in [0, 1] -> uint8 by ``round(x * 255)``, one h264 stream (libx264 at its own
      defaults, no rate option: crf 23, preset medium), yuv420p, at ``fps`` (an integer rate);
    - audio: [channels, samples] -> stereo (one channel is duplicated), clipped to [-1, 1] and taken to 16-bit PCM
      as ``int16(x * 32767)`` (toward zero) before the encoder, as diffusers does; one AAC stream at the encoder's
      default bit rate and the decoded rate, time base 1 / rate.
    """
    import av

    frames = (decoded.video.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    # planar float of the 16-bit values (k / 32768, exact in fp32): what the encoder's own s16 -> fltp step gives
    audio = (pcm16_stereo(decoded.audio).float() / 32768).numpy()
    with av.open(str(path), "w", format="mp4") as box:
        vs = box.add_stream("libx264", rate=int(fps))
        vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        aus = box.add_stream("aac", rate=decoded.rate)
        aus.codec_context.layout = "stereo"
        aus.codec_context.time_base = Fraction(1, decoded.rate)
        for f in frames:
            box.mux(vs.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        box.mux(vs.encode())
        for k in range(0, audio.shape[1], AAC_FRAME):
            af = av.AudioFrame.from_ndarray(audio[:, k:k + AAC_FRAME].copy(), format="fltp", layout="stereo")
            af.sample_rate, af.pts = decoded.rate, k
            box.mux(aus.encode(af))
        box.mux(aus.encode())


def pcm16_stereo(audio: torch.Tensor) -> torch.Tensor:
    """Audio [channels, samples] (float, nominally in [-1, 1]) -> int16 [2, samples]: one channel duplicated, two
    kept; clipped to [-1, 1], scaled by 32767 and truncated toward zero (diffusers' ``encode_video`` conversion)."""
    if audio.dim() != 2 or audio.shape[0] not in (1, 2):
        raise PipelineError(f"audio for the mp4: expected [channels, samples] with 1 or 2 channels; found shape "
                         f"{list(audio.shape)}; mix it down to stereo first")
    return (audio.float().clamp(-1, 1) * 32767).to(torch.int16).expand(2, -1).contiguous()
