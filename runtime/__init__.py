"""h3-blackwell runtime: pure PyTorch (+ Triton, + an optional cuBLASLt extension). Never imports ComfyUI.

Public surface::

    from h3_blackwell.runtime import load_model, sample, RuntimeOptions
    rt = load_model("h3.safetensors")            # or load_model(None): the embedded tiny model
    res = sample(rt, text_states, token_tags, video, audio, seed=1, steps=20)
    res.video, res.audio, res.report
"""

from .model.config import H3Config
from .load import H3Runtime, load_model
from .errors import H3Error, Interrupted
from .options import RuntimeOptions
from .sampling.sampler import SampleResult, sample
from .io.control import ControlFile, load_control, open_control
from .model.control import ControlError, FunControl, bind_control
from .model.conditioning import H3Conditioning
from .lora.apply import sync_loras
from .sampling.model_call import ModelCall, weight_shapes
from .fc2 import tune as fc2_tune  # the FC2 cuBLASLt sweep behind `h3-blackwell tune-fc2`

__all__ = ["H3Config", "H3Runtime", "load_model", "H3Error", "Interrupted", "RuntimeOptions", "SampleResult",
           "sample", "fc2_tune", "H3Conditioning", "sync_loras", "ModelCall", "weight_shapes",
           "ControlFile", "load_control", "open_control", "ControlError", "FunControl", "bind_control"]
