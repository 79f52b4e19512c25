"""h3-blackwell runtime: pure PyTorch (+ Triton, + an optional cuBLASLt extension). Never imports ComfyUI.

This package's names are its public API: ``cli/`` and ``nodes/`` import nothing else from the runtime (a test
enforces it; README "Public API")::

    from h3_blackwell.runtime import SamplingSettings, make_job, run
    job = make_job("h3.safetensors", sampling=SamplingSettings(seed=1, steps=20))  # validated once
    res = run(job)                                       # plan -> load -> LoRAs -> sample -> report
    res.video, res.audio, res.report

    from h3_blackwell.runtime import SampleInputs, load_model, sample  # a resident model, sampled many times
    rt = load_model("h3.safetensors")            # or load_model(None): the embedded tiny model
    res = sample(rt, SampleInputs(text_states, token_tags, video, audio), SamplingSettings(seed=1, steps=20))
"""

# the job: one request validated once, one run (runtime/job.py, model_spec.py, forward.py)
from .job import Canvas, Job, JobFiles, Launch, make_job, run, tensor_job
from .model_spec import ModelSpec, open_model, runtime_options
from .forward import ForwardJob, forward_job, run_forward
# a resident model and sampling
from .model.config import H3Config
from .options import (CHOICES, FC2_MODES, SPARSE_EXTRA_TOKENS_CHOICES, LossySettings, Measure, RuntimeOptions,
                      SamplingSettings, cpu_thread_count)
from .plan import resolve_device
from .load import H3Runtime, load_model
from .resident import ResidentModel
from .sampling.sampler import Hooks, SampleInputs, SampleResult, sample
from .sampling.model_call import CallOptions, ModelCall, weight_shapes
from .model.conditioning import ConditioningError, ControlHint, H3Conditioning
from .io.payload import conditioning_from_payload, conditioning_to_payload
from .lora.spec import LoraSpec
from .lora.apply import LoraView, sync_loras
from .io.control import ControlFile, ControlSpec, load_control, open_control
from .model.control import ControlError, FunControl, bind_control
# errors
from .errors import CheckpointError, H3Error, Interrupted, is_out_of_memory
from .sampling.request import RequestError
# request checks, outputs, reports
from .sampling.request import MAX_NOISE_INDEX, SEED_RANGE, check_int, check_output_file, latent_rows
from .io.atomic import save_tensors, write_dir, write_file
from .sampling.report import latent_sha256, nonfinite_message, summary
from .sampling.preview import latent_to_rgb, write_preview_webp
# latent geometry and masks (the nodes' empty latent and noise masks)
from .model.layout import audio_frames, latent_frames, snap_frames
from .sampling.noise_mask import audio_denoise_mask, video_denoise_mask
from .ops.sparse_routing import percent_to_sigma
# files: make-tiny, quantize, the FC2 sweep behind `h3-blackwell tune-fc2`
from .model.tiny import save_tiny
from .io.convert import quantize_checkpoint
from .fc2 import tune as fc2_tune

__all__ = [
    "Job", "JobFiles", "Canvas", "Launch", "ModelSpec", "make_job", "open_model", "run", "runtime_options",
    "tensor_job", "SamplingSettings", "LossySettings", "Measure", "SampleInputs", "Hooks",
    "ForwardJob", "forward_job", "run_forward",
    "H3Config", "RuntimeOptions", "CHOICES", "FC2_MODES", "SPARSE_EXTRA_TOKENS_CHOICES", "resolve_device",
    "H3Runtime", "load_model", "ResidentModel", "SampleResult", "sample",
    "ModelCall", "CallOptions", "weight_shapes", "ConditioningError", "ControlHint", "H3Conditioning", "conditioning_from_payload",
    "conditioning_to_payload", "LoraSpec", "LoraView", "sync_loras",
    "ControlFile", "ControlSpec", "load_control", "open_control", "ControlError", "FunControl", "bind_control",
    "CheckpointError", "H3Error", "Interrupted", "is_out_of_memory", "RequestError",
    "MAX_NOISE_INDEX", "SEED_RANGE", "check_int", "check_output_file", "save_tensors", "write_dir", "write_file",
    "latent_sha256", "nonfinite_message", "summary", "latent_to_rgb", "write_preview_webp",
    "audio_frames", "latent_frames", "snap_frames", "percent_to_sigma", "audio_denoise_mask", "video_denoise_mask",
    "save_tiny", "quantize_checkpoint", "fc2_tune",
    "cpu_thread_count", "latent_rows",
]
