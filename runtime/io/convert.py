"""Convert an H3 checkpoint to NVFP4 (ComfyUI ``comfy_quant`` format), streaming tensor by tensor.

The block linears ``blocks.N.attn.qkv_proj``, ``blocks.N.attn.out_proj``, ``blocks.N.mlp.fc1`` and
``blocks.N.mlp.fc2`` (weights in bf16/fp16/fp32) become nvfp4 layers: ``.weight`` (uint8, high nibble
first, 16-row padded), ``.weight_scale`` (e4m3, swizzled), ``.weight_scale_2`` (fp32), ``.comfy_quant``
(``{"format": "nvfp4"}``), also listed in the safetensors metadata ``_quantization_metadata``. Everything
else (norms, AdaLN, embeddings, heads, biases, layers that are already nvfp4) is written unchanged at its
source precision. The output is ComfyUI naming with QKV stacked ``[q; k; v]`` and fc1 ``[gate; up]``.
A Fun ControlNet file (``control_proj_in.weight`` present) converts the same way (``quantize_control``): its
control blocks' four linears become NVFP4, its names become core's native ones whatever the source naming.

Streaming: with the source shapes known (``shapes=``, which ``quantize_checkpoint`` takes from the
source header) the output header is computed and written first, then each tensor's bytes as it is
converted; host memory stays near one source tensor plus its NVFP4 form (quantization works 256 rows at a
time). Without shapes the bytes go to a spool file beside the output and the header is prepended at the
end (one extra sequential copy on disk, still one tensor in memory). The file is written under a unique
hidden name beside the output (``.OUT.PID.XXXXXXXX.partial``, ``atomic.temp_path``) and renamed when complete, so
two conversions to one output each install their own complete file (the last rename wins), and an error or an
interruption leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from ..model.config import QUANT_LINEARS as QUANTIZED_LINEAR, core_safe_config_metadata
from .header import TORCH_TO_ST as ST_DTYPE
from ..errors import H3Error
from ..ops import nvfp4
from . import comfy_quant as cq
from .atomic import no_space, refuse_replacing_inputs, temp_path, write_file
from .checkpoint import open_checkpoint
from .control import CONTROL_LINEARS, ControlView, is_control_file
from .finite import check_finite
from .verify import check_checkpoint

__all__ = ["QUANTIZED_LINEAR", "quantize_state_dict_streaming", "quantize_checkpoint", "quantize_control",
           "plan_output", "planned_bytes", "write_planned"]

# QUANTIZED_LINEAR: the block linears that become NVFP4 (ComfyUI names without ".weight"), shared with
# the loader: blocks.N.attn.qkv_proj, blocks.N.attn.out_proj, blocks.N.mlp.fc1, blocks.N.mlp.fc2.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT_SOURCES = ("F32", "F16", "BF16")
# source metadata that would make a reader treat our ComfyUI-layout output as another layout
_DROP_META = ("qkv_layout", "format", "_quantization_metadata")

Progress = Callable[[int, int, str], None]


def _target_layer(name: str) -> str | None:
    if not name.endswith(".weight"):
        return None
    layer = name[: -len(".weight")]
    return layer if QUANTIZED_LINEAR.match(layer) or CONTROL_LINEARS.match(layer) else None


def _check_target(name: str, dtype: str, shape: tuple) -> bool:
    """True when ``name`` is a block-linear weight to quantize; raises for sources we cannot convert."""
    if _target_layer(name) is None:
        return False
    if dtype == "U8":  # already nvfp4: passed through unchanged with its scales and marker
        return False
    if dtype not in _FLOAT_SOURCES:
        raise H3Error(f"{name} is stored as {dtype}: an already-quantized source (fp8/int8). The converter reads "
                      "bf16/fp16/fp32 (or nvfp4) checkpoints; convert from the original bf16 release instead")
    if len(shape) != 2:
        raise H3Error(f"{name} has shape {list(shape)}; a linear weight must be 2-D [out, in]")
    return True


def plan_output(shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Source (name -> (shape, safetensors dtype)) in iteration order -> output entries (name, dtype, shape)
    in write order."""
    out = []
    for name, (shape, dtype) in shapes.items():
        shape = tuple(int(s) for s in shape)
        if _check_target(name, dtype, shape):
            layer = name[: -len(".weight")]
            for suffix, (dt, shp) in cq.comfy_quant_shapes(*shape).items():
                out.append((layer + suffix, dt, tuple(shp)))
        else:
            out.append((name, dtype, shape))
    return out


def _nbytes(dtype: str, shape: tuple) -> int:
    n = _ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def _header_bytes(entries: list[tuple[str, str, tuple]], metadata: Mapping[str, str]) -> bytes:
    head: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for name, dtype, shape in entries:
        n = _nbytes(dtype, shape)
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer pads it
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(f, t: torch.Tensor) -> int:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return 0
    mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    f.write(mv)
    return len(mv)


def _metadata(source: Mapping[str, str] | None, layers: dict[str, dict]) -> dict[str, str]:
    meta = {k: str(v) for k, v in (source or {}).items() if k not in _DROP_META}
    merged = cq.parse_quantization_metadata(source)
    merged.update(layers)
    meta["format"] = "pt"
    if merged:
        meta["_quantization_metadata"] = cq.quantization_metadata(merged)
    return meta


def _convert(name: str, box: list, device) -> list[tuple[str, torch.Tensor]]:
    """One source tensor (handed over in ``box`` so the only reference can be dropped as soon as it is
    quantized) -> the output tensors (on CPU) that replace it, in write order."""
    t = box.pop()
    dt = ST_DTYPE.get(t.dtype)
    if dt is None:
        raise H3Error(f"{name}: dtype {t.dtype} cannot be stored in safetensors by this writer")
    if not _check_target(name, dt, tuple(t.shape)):
        return [(name, t)]
    layer = name[: -len(".weight")]
    q = nvfp4.quantize(t.to(device))
    del t  # the source is freed here (when the iterator keeps no reference), before the on-disk copy
    parts = cq.to_comfy_quant(q, layer)
    del q
    return [(k, v.to("cpu")) for k, v in parts.items()]


def _write_planned(tensor_iter: Iterable[tuple[str, torch.Tensor]], partial: Path,
                   shapes: Mapping[str, tuple[tuple[int, ...], str]], device: torch.device,
                   progress: Progress | None, metadata: Mapping[str, str] | None, layers: dict[str, dict]) -> int:
    """The header first (planned from ``shapes``), then every converted tensor in that order, checked against
    the plan. Fills ``layers``; returns the tensor bytes written."""
    plan = plan_output(shapes)
    for name, (shape, dtype) in shapes.items():
        if _check_target(name, dtype, tuple(shape)):
            layers[name[: -len(".weight")]] = {"format": "nvfp4"}
    total = len(shapes)

    def converted():
        i = 0
        for name, t in tensor_iter:  # not enumerate(): its cached result tuple would keep the
            box = [t]                # previous tensor alive while the next one is made
            del t
            if progress:
                progress(i, total, name)
            i += 1
            for oname, ot in _convert(name, box, device):
                yield oname, ot
                del ot

    return _stream_planned(partial, plan, converted(), _metadata(metadata, layers))


def _stream_planned(path: Path, plan: list[tuple[str, str, tuple]], items: Iterable[tuple[str, torch.Tensor]],
                    metadata: Mapping[str, str] | None) -> int:
    """The header of ``plan`` into ``path``, then each tensor ``items`` yields, checked to be the next one the
    plan holds (name, dtype, shape). -> the tensor bytes written."""
    expected = {n: (d, s) for n, d, s in plan}
    order = [n for n, _, _ in plan]
    written = pos = 0
    with open(path, "wb") as f:
        f.write(_header_bytes(plan, metadata or {}))
        for oname, ot in items:
            if pos >= len(order) or order[pos] != oname:
                want = order[pos] if pos < len(order) else "nothing (the plan is complete)"
                raise H3Error(f"source yielded {oname!r} but the header planned {want!r} next; pass "
                              "shapes in the iteration order of the tensors")
            d, s = expected[oname]
            if ST_DTYPE.get(ot.dtype) != d or tuple(ot.shape) != s:
                raise H3Error(f"{oname}: header planned {d} {list(s)}, found {ST_DTYPE.get(ot.dtype, ot.dtype)} "
                              f"{list(ot.shape)}; the shapes given do not match the tensors")
            written += _write_tensor(f, ot)
            pos += 1
            del ot
    if pos != len(order):
        raise H3Error(f"source ended after {pos} of {len(order)} planned tensors; next missing: {order[pos]!r}")
    return written


def planned_bytes(plan: Iterable[tuple[str, str, tuple]]) -> int:
    """The tensor bytes of a file of ``plan`` entries (name, safetensors dtype, shape); the header adds a few KB."""
    return sum(_nbytes(d, s) for _, d, s in plan)


def write_planned(out_path: str | os.PathLike, plan: list[tuple[str, str, tuple]],
                  items: Iterable[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None) -> int:
    """A safetensors file of ``plan`` (name, safetensors dtype, shape in file order) from ``items`` yielding
    ``(name, tensor)`` in that order, one at a time: the header is written first, so host memory holds one
    tensor. Each tensor must match its entry (H3Error naming it otherwise). Installed whole or not at all
    (``atomic.write_file``; a full disk is an OutputError saying so). -> the tensor bytes written."""
    written = []
    write_file(out_path, lambda tmp: written.append(_stream_planned(tmp, plan, items, metadata)))
    return written[0]


def _write_spooled(tensor_iter: Iterable[tuple[str, torch.Tensor]], out_path: Path, partial: Path,
                   device: torch.device, progress: Progress | None, metadata: Mapping[str, str] | None,
                   layers: dict[str, dict]) -> int:
    """Shapes unknown: the converted tensors into a spool file beside ``out_path``, then the header and the
    spool into ``partial``. Fills ``layers``; returns the tensor bytes written."""
    spool = temp_path(out_path, ".spool")
    entries = []
    written = 0
    try:
        with open(spool, "wb") as f:
            i = 0
            for name, t in tensor_iter:
                box = [t]
                del t
                if progress:
                    progress(i, 0, name)
                i += 1
                for oname, ot in _convert(name, box, device):
                    if oname.endswith(".comfy_quant") and oname != name:
                        layers[oname[: -len(".comfy_quant")]] = {"format": "nvfp4"}
                    entries.append((oname, ST_DTYPE[ot.dtype], tuple(ot.shape)))
                    written += _write_tensor(f, ot)
                    del ot
        with open(partial, "wb") as f, open(spool, "rb") as src:
            f.write(_header_bytes(entries, _metadata(metadata, layers)))
            while chunk := src.read(64 << 20):
                f.write(chunk)
    finally:
        spool.unlink(missing_ok=True)
    return written


def quantize_state_dict_streaming(tensor_iter: Iterable[tuple[str, torch.Tensor]], out_path: str | os.PathLike,
                                  device: str | torch.device = "cpu", progress: Progress | None = None, *,
                                  shapes: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                                  metadata: Mapping[str, str] | None = None) -> dict:
    """Stream ``(comfy_name, tensor)`` pairs into an NVFP4 safetensors file at ``out_path``.

    device: where the block linears are quantized ("cpu" or "cuda"; the bytes are identical).
    progress(i, total, name): called before each source tensor (total 0 when shapes are unknown).
    shapes: optional ``{name: (shape, safetensors dtype)}`` of the source in iteration order: the header
    is then written first. metadata: source safetensors metadata to carry over (layout keys dropped,
    ``_quantization_metadata`` merged). Returns a summary dict (layers, tensors, bytes, path).
    """
    out_path = Path(out_path)
    partial = temp_path(out_path)
    device = torch.device(device)
    layers: dict[str, dict] = {}
    try:
        if shapes is not None:
            written = _write_planned(tensor_iter, partial, shapes, device, progress, metadata, layers)
        else:
            written = _write_spooled(tensor_iter, out_path, partial, device, progress, metadata, layers)
        os.replace(partial, out_path)
    except BaseException as e:
        partial.unlink(missing_ok=True)
        full = no_space(e, out_path)
        if full is not None:
            raise full from None
        raise
    return {"path": str(out_path), "quantized_layers": len(layers), "bytes": written}


def quantize_checkpoint(in_path: str | os.PathLike, out_path: str | os.PathLike, device: str = "cpu",
                        progress: Progress | None = None, scheme: str | None = None) -> dict:
    """``h3-blackwell quantize IN OUT``: open any H3 checkpoint (ComfyUI, diffusers or raw-release naming,
    single file or sharded index) and write its NVFP4 ComfyUI form, header first."""
    if Path(in_path).resolve() == Path(out_path).resolve():
        raise H3Error(f"input and output are the same file ({in_path}); choose another output path")
    if Path(out_path).is_dir():
        raise H3Error(f"output {out_path} is a directory; expected a file path such as "
                      f"{Path(out_path) / 'h3_nvfp4.safetensors'}")
    if is_control_file(in_path):
        return quantize_control(in_path, out_path, device, progress)
    ck = open_checkpoint(in_path, scheme=scheme)
    refuse_replacing_inputs([out_path], {"input shard": [h.path for h in ck.headers]})  # a sharded input's files
    check_checkpoint(ck)  # every tensor present with its shape, before anything is written
    shapes = {k: (tuple(ck.shape(k)), ck.dtype_name(k)) for k in ck.keys()}
    # the config entry names only core's keys under "transformer" (core merges them into its model's
    # arguments); ours go under "h3_blackwell". This also repairs files from an older make-tiny.
    meta = {**ck.metadata, "config": core_safe_config_metadata(ck.metadata.get("config"), ck.config)}
    return quantize_state_dict_streaming(_finite_stream(ck.iter_tensors("cpu"), str(in_path)), out_path, device,
                                         progress, shapes=shapes, metadata=meta)


def quantize_control(in_path: str | os.PathLike, out_path: str | os.PathLike, device: str = "cpu",
                     progress: Progress | None = None) -> dict:
    """``h3-blackwell quantize CONTROL OUT`` for a Fun ControlNet (``runtime.io.control``): core's native names
    (from native, prefixed or diffusers / VideoX-Fun naming), the control blocks' four linears NVFP4 like the
    base's, everything else at its source precision, core's metadata (places always written, the adaLN form and
    inpaint mode carried), header first. The output loads through core's ModelPatchLoader and ``--control``."""
    view = ControlView(in_path).check()
    shapes = {k: (tuple(view.shape(k)), view.dtype_name(k)) for k in view.keys()}
    stream = ((k, view.tensor(k)) for k in view.keys())
    return quantize_state_dict_streaming(_finite_stream(stream, str(in_path)), out_path, device, progress,
                                         shapes=shapes, metadata=view.metadata_out())


def _finite_stream(tensors: Iterable[tuple[str, torch.Tensor]], source: str):
    """The same (name, tensor) stream, each tensor checked finite (CheckpointError naming it) as it passes.
    Holds no reference to a tensor once the consumer asks for the next one."""
    for name, t in tensors:
        check_finite(name, t, source=source)
        pair = (name, t)
        del t
        yield pair
        del pair
