"""The streaming load: one pass over a checkpoint (or the embedded tiny state dict) into a model built on the
meta device, converting or adopting each block linear as it arrives.

For every tensor, in the model's order: read it (plain reads, never mmap, never unpickle), check it is finite,
then

- a block linear (``blocks.N.{attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2}``) with ``quantize`` on: its
  stored NVFP4 tensors are adopted as they are, or its dense weight (dequantized when stored as fp8/int8)
  is cast to the compute dtype on the device and quantized there (``ops.block.to_nvfp4_linear``, the same
  quantizer ``quantize`` uses); the dense copy is dropped before the next tensor is read;
- a full-form AdaLN projection when the plan keeps AdaLN rows per run: straight into pinned host memory;
- anything else: onto the device at the parameter's dtype.

Peak device memory during a load is therefore the resident result plus about one source tensor (and the
quantizer's temporaries for it). Errors name the tensor: missing keys, wrong shapes, non-finite values.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import CheckpointError
from ..model.config import QUANT_LINEARS
from ..ops.block import to_nvfp4_linear
from ..ops.linear import Scratch
from .checkpoint import dequantize_layer
from .finite import check_finite
from .verify import check_names_and_shapes, quant_layers

Progress = Callable[[int, int, str], None]


class StateDictSource:
    """A ComfyUI-named state dict (the embedded tiny model) behind the checkpoint reading interface."""

    def __init__(self, sd: dict[str, torch.Tensor], name: str, config=None):
        self._sd = sd
        self.name = name
        self.config = config

    def keys(self) -> list[str]:
        return list(self._sd)

    def shape(self, k: str) -> tuple:
        return tuple(self._sd[k].shape)

    def quant_format(self, layer: str) -> dict | None:
        return None

    def tensor(self, k: str, device="cpu") -> torch.Tensor:
        return self._sd[k].to(device)


def _set(model, name: str, value, as_parameter: bool = True) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Module):
        mod._modules[leaf] = value
    elif isinstance(getattr(mod, leaf), torch.nn.Parameter) and as_parameter:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


class _Loader:
    """One streaming pass (module docstring)."""

    def __init__(self, model, src, plan, progress: Progress | None):
        self.model, self.src, self.plan, self.progress = model, src, plan, progress
        self.device, self.dtype = plan.device, plan.dtype
        self.quant = quant_layers(src)
        self.scratch = Scratch()
        self.stored = set(plan.stored_nvfp4)
        self.have = set(src.keys())

    def _dense(self, layer: str) -> torch.Tensor:
        """A block linear's weight at the compute dtype on the device (dequantized when stored quantized)."""
        if layer in self.quant:
            fmt = self.src.quant_format(layer) or {"format": "int8_tensorwise"}
            w = dequantize_layer(self.src, layer, fmt, self.device)
        else:
            w = self.src.tensor(layer + ".weight", self.device)
        check_finite(layer + ".weight", w)
        return w.to(self.dtype)

    def _linear(self, layer: str, shape: tuple) -> None:
        if layer in self.stored:
            names = [x for x in self.src.keys() if x.startswith(layer + ".") and x.count(".") == layer.count(".") + 1]
            tensors = {x: self.src.tensor(x, self.device) for x in names}
            for x, t in tensors.items():
                check_finite(x, t)
            lin = to_nvfp4_linear(layer, None, shape, stored=tensors, backend=self.plan.gemm,
                                  act_scale=self.plan.options.act_scale, out_dtype=self.dtype, scratch=self.scratch)
        else:
            w = self._dense(layer)
            lin = to_nvfp4_linear(layer, w, shape, stored=None, backend=self.plan.gemm,
                                  act_scale=self.plan.options.act_scale, out_dtype=self.dtype, scratch=self.scratch)
            del w
        _set(self.model, layer, lin)

    def _to_host(self, k: str, p) -> None:
        t = self.src.tensor(k, "cpu")
        check_finite(k, t)
        host = torch.empty(tuple(p.shape), dtype=p.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(t)
        _set(self.model, k, host)

    def _tensor(self, k: str, p) -> None:
        layer = k[:-7] if k.endswith(".weight") else None
        if layer is not None and layer in self.quant:
            t = dequantize_layer(self.src, layer, self.src.quant_format(layer) or {"format": "int8_tensorwise"},
                                 self.device)
        elif k in self.have or k == "rope.inv_freq":
            t = self.src.tensor(k, self.device)
        else:
            return
        check_finite(k, t)
        _set(self.model, k, t.to(device=self.device, dtype=p.dtype))

    def run(self) -> None:
        want = dict(self.model.state_dict(keep_vars=True))
        label = getattr(self.src, "name", None) or self.src.headers[0].path.name
        check_names_and_shapes(want, self.src, self.quant, label, self.plan.config.num_layers)
        keys = list(want)
        adaln_host = self.plan.adaln_on_host
        for i, k in enumerate(keys):
            if self.progress:
                self.progress(i, len(keys), k)
            p = want[k]
            layer = k[:-7] if k.endswith(".weight") else None
            if self.plan.quantize and layer is not None and QUANT_LINEARS.match(layer):
                self._linear(layer, tuple(p.shape))
            elif adaln_host and k.startswith("blocks.") and ".adaln_proj." in k:
                self._to_host(k, p)
            else:
                self._tensor(k, p)
        left = [n for n, t in list(self.model.named_parameters()) + list(self.model.named_buffers()) if t.is_meta]
        if left:
            raise CheckpointError(f"{label}: no tensor for {left[:5]}")


def stream_load(model, src, plan, progress: Progress | None = None) -> None:
    """Fill ``model`` (built on the meta device) from ``src`` (a Checkpoint or StateDictSource) as the load
    plan says (module docstring). Raises CheckpointError naming the tensor for bad input."""
    _Loader(model, src, plan, progress).run()
