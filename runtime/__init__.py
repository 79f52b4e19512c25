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
from .options import (CHOICES, FC2_MODES, SPARSE_EXTRA_TOKENS_CHOICES, SPARSE_METHODS, SPARSE_SINKS,
                      SparseSettings, parse_dense_blocks, LossySettings, PRESETS, Measure, RuntimeOptions,
                      SamplingSettings, cpu_thread_count)
from .plan import resolve_device
from .load import H3Runtime, load_model
from .interface import Runtime
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
# diffusers' H3 pipeline: our transformer in it, and its conditioner / VAEs around our sampling (generate --prompt)
from .pipeline.transformer import DiffusersTransformer
from .pipeline.folder import Decoded, PipelineFolder, PromptRequest, folder_transformer, open_pipeline
from .pipeline.generate import prompt_job, write_mp4

# The public API (README "Public API"): what a node pack or a script needs. The other names imported above stay
# importable for the tests and the benches (types such as Job, H3Runtime, SampleResult; the error subclasses,
# all H3Errors), but nothing outside the runtime builds on them: cli/ and nodes/ import only these (a test checks).
__all__ = [
    # a request, validated once, and its run
    "make_job", "tensor_job", "run", "open_model", "ModelSpec", "runtime_options",
    "forward_job", "run_forward",
    # a resident model, its options and sampling
    "load_model", "sample", "Runtime", "RuntimeOptions", "CHOICES", "FC2_MODES", "SPARSE_EXTRA_TOKENS_CHOICES",
    "SPARSE_METHODS", "SPARSE_SINKS", "SparseSettings", "parse_dense_blocks", "PRESETS",
    "resolve_device", "ModelCall", "CallOptions", "weight_shapes", "ResidentModel",
    # a run's settings as values, passed whole from the request to the plan to the loop
    "SamplingSettings", "LossySettings", "Measure", "SampleInputs", "Hooks", "JobFiles", "Canvas", "Launch",
    # conditioning, LoRA, the Fun ControlNet
    "H3Conditioning", "ConditioningError", "ControlHint", "conditioning_from_payload", "conditioning_to_payload",
    "LoraSpec", "LoraView", "sync_loras", "ControlSpec", "open_control", "load_control",
    # errors: every refusal is an H3Error
    "H3Error", "Interrupted", "is_out_of_memory",
    # latent geometry, noise masks and batch indices (the nodes' latents)
    "latent_frames", "audio_frames", "snap_frames", "video_denoise_mask", "audio_denoise_mask", "percent_to_sigma",
    "MAX_NOISE_INDEX",
    # outputs and reports: atomic writes, the report summary and fingerprints, previews
    "write_file", "write_dir", "save_tensors", "check_output_file", "summary", "nonfinite_message", "latent_sha256",
    "latent_to_rgb", "write_preview_webp",
    # the file commands: make-tiny, quantize, tune-fc2 (and the seed range make-tiny checks)
    "save_tiny", "quantize_checkpoint", "fc2_tune", "SEED_RANGE", "check_int",
    # CPU runs: torch's thread count for a job's size (packed rows)
    "cpu_thread_count", "latent_rows",
    # diffusers' H3 pipeline: our transformer inside it; generate --prompt (its conditioner, VAEs, an mp4)
    "DiffusersTransformer", "open_pipeline", "folder_transformer", "PipelineFolder", "PromptRequest", "Decoded", "prompt_job", "write_mp4",
]
