"""Checkpoints with VSA's ``attn.to_gate_compress`` (FastH3) load in every format: ComfyUI names, a prefixed
file, diffusers names, the raw release, and NVFP4 comfy_quant (our quantize; and a file whose gate itself is
NVFP4 as core's quantizer may write it): the gate is detected and read with the same values."""

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from h3_blackwell.runtime.io.checkpoint import open_checkpoint
from h3_blackwell.runtime.io.keys import comfy_to_diffusers_state_dict
from h3_blackwell.runtime.load import load_model
from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.tiny import tiny_state_dict
from h3_blackwell.runtime.options import RuntimeOptions

GATE = dataclasses.replace(TINY, gate_compress=True)
DENSE = RuntimeOptions(device="cpu", dtype="float32", quantize=False)
KEY = "blocks.1.attn.to_gate_compress.weight"


@pytest.fixture(scope="module")
def gate_sd():
    sd = tiny_state_dict(GATE, seed=3)
    assert KEY in sd and sd[KEY].shape == (GATE.inner_dim, GATE.hidden_size)
    return sd


@pytest.mark.parametrize("form", ["comfy", "prefixed", "diffusers"])
def test_gate_loads_in_every_naming(form, gate_sd, tmp_path):
    path = tmp_path / f"{form}.safetensors"
    sd = {"comfy": gate_sd, "prefixed": {f"model.diffusion_model.{k}": v for k, v in gate_sd.items()},
          "diffusers": comfy_to_diffusers_state_dict(gate_sd)}[form]
    save_file(sd, str(path))
    ck = open_checkpoint(path)
    assert ck.config.gate_compress, form
    rt = load_model(path, DENSE)
    assert torch.equal(rt.model.blocks[1].attn.to_gate_compress.weight, gate_sd[KEY]), form


def test_gate_survives_nvfp4_quantize(gate_sd, tmp_path):
    from h3_blackwell.runtime.io.convert import quantize_checkpoint

    src = tmp_path / "bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 and "blocks" in k else v
               for k, v in gate_sd.items()}, str(src))
    quantize_checkpoint(src, tmp_path / "q.safetensors")
    rt = load_model(tmp_path / "q.safetensors", RuntimeOptions(device="cpu"))
    assert rt.plan.config.gate_compress
    w = rt.model.blocks[1].attn.to_gate_compress.weight
    assert torch.equal(w.float(), gate_sd[KEY].to(torch.bfloat16).float())


def test_gate_stored_as_nvfp4_comfy_quant_loads_dequantized(gate_sd, tmp_path):
    """A comfy_quant file whose gate is itself NVFP4 (core's quantizer may write any linear so): the gate
    loads as its exact dequantized value (it is not one of the NVFP4 block linears the stack runs)."""
    from h3_blackwell.runtime.io.comfy_quant import to_comfy_quant
    from h3_blackwell.runtime.ops import nvfp4

    sd = {k: v for k, v in gate_sd.items() if k != KEY}
    t = nvfp4.quantize(gate_sd[KEY])
    sd.update(to_comfy_quant(t, KEY[: -len(".weight")]))
    path = tmp_path / "gate_nvfp4.safetensors"
    save_file(sd, str(path))
    rt = load_model(path, DENSE)
    want = nvfp4.dequantize(t).float()
    got = rt.model.blocks[1].attn.to_gate_compress.weight
    assert got.shape == gate_sd[KEY].shape and torch.equal(got, want[: got.shape[0], : got.shape[1]])
    rel = float((got - gate_sd[KEY]).norm() / gate_sd[KEY].norm())
    assert rel < 0.2, rel                       # NVFP4's rounding of N(0, 1/fan_in) weights (~0.1)
