"""Checkpoints: safetensors streamed tensor by tensor, three naming schemes, quantized sources.

Naming schemes (all map to ComfyUI/original names, the runtime's own):
- ``comfy``: ComfyUI / original single files (``blocks.N.attn.qkv_proj.weight`` stacked ``[q; k; v]``);
  optional ``model.diffusion_model.`` / ``diffusion_model.`` prefixes are stripped.
- ``diffusers``: ``MiniMaxH3Transformer3DModel`` names; q/k/v split (concatenated back), fc1 halves
  swapped (``[up; gate]`` -> ``[gate; up]``), ``rope.inv_freq`` absent (recomputed).
- ``raw``: the MiniMaxAI release shards: original names but QKV rows interleaved per head
  (``[h0: q k v | h1: q k v | ...]``). Names and shapes cannot tell it from ``comfy``; it is chosen when
  the checkpoint is a sharded ``*.index.json`` with original names, when the metadata says
  ``qkv_layout=interleaved``, or explicitly with ``scheme="raw"``.

Tensors are read with plain file reads into a buffer of exactly their size (never ``mmap`` of the whole
file, never unpickling), converted, and moved to the target device one at a time, so host memory stays
near the largest tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import CheckpointError
from ..model.config import H3Config
from .detect import config_from_shapes
from ..model.h3 import H3Model
from .comfy_quant import from_comfy_quant, parse_comfy_quant_marker, parse_quantization_metadata
from .header import Header, fits_into, read_header, read_tensor
from .keys import QKV_PART, deinterleave_qkv, detect_scheme, diffusers_to_comfy_name, strip_prefix

# ---------------------------------------------------------------------------------------------
# the checkpoint
# ---------------------------------------------------------------------------------------------

@dataclass
class _Source:
    header: Header
    key: str  # key in the file


def _read_raw(src: _Source) -> torch.Tensor:
    """Read one tensor's bytes with a plain read into a buffer of exactly its size (``header.read_tensor``)."""
    return read_tensor(src.header, src.key)


class Checkpoint:
    """An H3 DiT checkpoint opened from its headers only.

    keys(): ComfyUI names of the logical tensors; shape(name); tensor(name, device) reads one tensor,
    already in ComfyUI layout (QKV stacked, fc1 [gate; up]); iter_tensors(device) streams them all.
    Quantized layers (``comfy_quant`` markers, fp8, int8) are passed through as stored; see ``quant_format``.
    """

    def __init__(self, headers: list[Header], scheme: str, name: str | None = None):
        self.headers = headers
        self.scheme = scheme
        self.name = str(headers[0].path) if name is None else name  # the path it was opened with (reports, LoRA)
        self.verified = False  # io.verify.check_checkpoint passed: every name and shape fits self.config
        self.metadata: dict[str, str] = {}
        for h in headers:
            self.metadata.update(h.metadata)
        self._sources: dict[str, list[_Source]] = {}
        self._shapes: dict[str, tuple] = {}
        self._dtypes: dict[str, str] = {}
        raw_shapes = {}
        for h in headers:
            for k, info in h.tensors.items():
                raw_shapes[strip_prefix(k)] = info.shape
                name = strip_prefix(k)
                if scheme == "diffusers":
                    cn = diffusers_to_comfy_name(name)
                    if cn is None:
                        continue
                else:
                    cn = name
                self._sources.setdefault(cn, []).append(_Source(h, k))
                self._dtypes.setdefault(cn, info.dtype)
        try:
            self.config = config_from_shapes(raw_shapes, "diffusers" if scheme == "diffusers" else "comfy",
                                             self.metadata)
        except CheckpointError as e:  # detection reads names, shapes and metadata only: say which file they are from
            raise CheckpointError(f"{self.name}: {e}") from None
        for cn, srcs in self._sources.items():
            shapes = [s.header.tensors[s.key].shape for s in srcs]
            if len(srcs) > 1:
                self._shapes[cn] = (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])
            else:
                self._shapes[cn] = tuple(shapes[0])
        if scheme == "diffusers":
            for cn, srcs in self._sources.items():
                if cn.endswith("attn.qkv_proj.weight"):
                    parts = sorted(srcs, key=lambda s: "qkv".index(QKV_PART.search(s.key).group(1)))
                    if len(parts) != 3:
                        raise CheckpointError(f"diffusers checkpoint: {cn} needs to_q, to_k and to_v; found "
                                              f"{[p.key for p in parts]}")
                    self._sources[cn] = parts
            if "rope.inv_freq" not in self._sources:
                self._shapes["rope.inv_freq"] = (self.config.rope_inv_freq_len,)

    # -- introspection -------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def dtype_name(self, name: str) -> str:
        return self._dtypes.get(name, "F32")

    def quant_format(self, layer: str) -> dict | None:
        """The comfy_quant descriptor of a layer (``{"format": "nvfp4", ...}``), None when unquantized."""
        marker = layer + ".comfy_quant"
        try:
            if marker in self._sources:
                return parse_comfy_quant_marker(_read_raw(self._sources[marker][0]))
            layers = parse_quantization_metadata(self.metadata)
        except ValueError as e:
            raise CheckpointError(f"{self.headers[0].path.name}: {marker}: {e}; re-export the file") from None
        if layer in layers:
            return layers[layer]
        if self._dtypes.get(layer + ".weight") in ("F8_E4M3", "F8_E5M2") and layer + ".weight_scale" in self._sources:
            return {"format": "float8_e4m3fn" if self._dtypes[layer + ".weight"] == "F8_E4M3" else "float8_e5m2"}
        return None

    # -- reading ---------------------------------------------------------------------------------
    def tensor(self, name: str, device="cpu") -> torch.Tensor:
        """One tensor in ComfyUI layout, moved to ``device`` (read at its stored dtype)."""
        if name == "rope.inv_freq" and name not in self._sources:
            c = self.config
            inv = c.rope_theta ** (-torch.arange(c.rope_inv_freq_len, dtype=torch.float64) / c.rope_inv_freq_len)
            return inv.float().to(device)
        if name not in self._sources:
            raise CheckpointError(f"tensor {name!r} is not in {self.headers[0].path}")
        srcs = self._sources[name]
        parts = [_read_raw(s) for s in srcs]
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        relaid = self._relaid(name, t.dtype)
        if relaid == "qkv":
            block = self.config
            t = deinterleave_qkv(t, block.num_heads, block.head_dim)
        elif relaid == "fc1":
            up, gate = t.chunk(2, dim=0)
            t = torch.cat([gate, up])
        return t.to(device)

    def nbytes(self, name: str) -> int:
        """The bytes ``tensor(name)`` returns (its stored bytes, shards summed), read from the headers only; raises
        CheckpointError for a name the checkpoint does not hold, as ``tensor`` does."""
        if name == "rope.inv_freq" and name not in self._sources:
            return 4 * self.config.rope_inv_freq_len  # recomputed as fp32
        if name not in self._sources:
            raise CheckpointError(f"tensor {name!r} is not in {self.headers[0].path}")
        return sum(s.header.tensors[s.key].offsets[1] - s.header.tensors[s.key].offsets[0]
                   for s in self._sources[name])

    def _relaid(self, name: str, dtype: torch.dtype) -> str | None:
        """The layout change ``tensor`` makes on the way to ComfyUI layout: "qkv" (a raw file's interleaved QKV of
        a float dtype), "fc1" (diffusers' [up; gate]), or None."""
        if name.endswith("attn.qkv_proj.weight") and self.scheme == "raw" and dtype.is_floating_point:
            return "qkv"
        if self.scheme == "diffusers" and name.endswith("mlp.fc1.weight"):
            return "fc1"
        return None

    def read_into(self, name: str, out: torch.Tensor, threads: int = 1) -> bool:
        """Read tensor ``name`` straight into ``out`` (a contiguous CPU tensor, e.g. pinned host memory) where it
        is stored whole at ``out``'s dtype and shape in one file and needs no layout change (``threads``: read in
        that many parts at once, ``header.read_tensor``). -> False (nothing read) otherwise: the caller copies
        ``tensor(name)`` in."""
        srcs = self._sources.get(name)
        if not srcs or len(srcs) != 1 or self._relaid(name, out.dtype) is not None or \
                not fits_into(srcs[0].header.tensors[srcs[0].key], out):
            return False
        read_tensor(srcs[0].header, srcs[0].key, out, threads)
        return True

    def read_host(self, name: str, dtype: torch.dtype, pin: bool = False, threads: int = 1) -> torch.Tensor:
        """Tensor ``name`` in new host memory at ``dtype`` (page-locked with ``pin``): read straight there where the
        file allows (``read_into``, in ``threads`` parts), else read (``tensor``) and cast into it."""
        out = torch.empty(self.shape(name), dtype=dtype, pin_memory=pin)
        if not self.read_into(name, out, threads):
            out.copy_(self.tensor(name, "cpu"))
        return out

    def iter_tensors(self, device="cpu", progress: Callable[[int, int, str], None] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        keys = self.keys()
        for i, k in enumerate(keys):
            if progress:
                progress(i, len(keys), k)
            yield k, self.tensor(k, device)


def open_checkpoint(path: str | Path, scheme: str | None = None) -> Checkpoint:
    """Open a ``.safetensors`` file or a sharded ``*.safetensors.index.json`` (headers only).

    scheme: None (detect), "comfy", "diffusers" or "raw" (see module docstring).
    """
    name, path = str(path), Path(path)
    sharded = path.name.endswith(".json")
    if sharded:
        if not path.exists():
            raise CheckpointError(f"checkpoint index not found: {path}")
        try:
            index = json.loads(path.read_text())
            files = sorted(set(index["weight_map"].values()))
            if not all(isinstance(f, str) for f in files):
                raise TypeError("weight_map values must be shard file names (strings)")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError,
                RecursionError) as e:
            raise CheckpointError(f"{path}: not a safetensors index (expected a JSON object with 'weight_map'): {e}") from None
        headers = [read_header(path.parent / f) for f in files]
        missing = [k for k, f in index["weight_map"].items()
                   if k not in headers[files.index(f)].tensors]
        if missing:
            raise CheckpointError(f"{path}: index lists {len(missing)} tensors not found in their shards, e.g. {missing[:3]}")
    else:
        if path.suffix in (".ckpt", ".pt", ".pth", ".bin", ".pkl"):
            raise CheckpointError(f"{path}: pickle checkpoints are never loaded (arbitrary code); convert it to "
                                  ".safetensors first")
        headers = [read_header(path)]
    keys = [k for h in headers for k in h.tensors]
    detected = detect_scheme(keys)
    meta = {}
    for h in headers:
        meta.update(h.metadata)
    if scheme is None:
        scheme = detected
        layout = (meta.get("qkv_layout") or meta.get("format") or "").lower()
        if detected == "comfy" and (layout in ("interleaved", "per_head", "raw") or sharded):
            scheme = "raw"
    elif scheme not in ("comfy", "diffusers", "raw"):
        raise CheckpointError(f"scheme={scheme!r}: expected comfy, diffusers or raw")
    elif (scheme == "diffusers") != (detected == "diffusers"):
        raise CheckpointError(f"scheme={scheme!r} was requested but the names are {detected}-style")
    return Checkpoint(headers, scheme, name)


# ---------------------------------------------------------------------------------------------
# loading into a model
# ---------------------------------------------------------------------------------------------

def expected_keys(cfg: H3Config) -> dict[str, tuple]:
    """ComfyUI names and shapes of every tensor an H3 DiT of this config needs."""
    with torch.device("meta"):
        m = H3Model(cfg, torch.float32)
    out = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    return out


def _row_scale(ck: Checkpoint, layer: str, device) -> torch.Tensor:
    """An fp8 / int8 weight's scale as fp32: one value [], or one per row [N, 1] (stored [N] or [N, 1]; io.verify
    refuses other shapes)."""
    scale = ck.tensor(layer + ".weight_scale", device).float()
    return scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())


def dequantize_reads(layer: str, fmt: dict) -> list[str]:
    """The tensors ``dequantize_layer(ck, layer, fmt, ...)`` reads with ``ck.tensor``, in its order (a reader that
    reads ahead declares them; an unsupported format reads the weight, then raises)."""
    if fmt.get("format") == "nvfp4":
        return [layer + s for s in (".weight", ".weight_scale", ".weight_scale_2")]
    if fmt.get("format") in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise"):
        return [layer + ".weight", layer + ".weight_scale"]
    return [layer + ".weight"]


def dequantize_layer(ck: Checkpoint, layer: str, fmt: dict, device) -> torch.Tensor:
    """Dequantize a stored quantized linear weight to fp32 [N, K] (fp8, int8_tensorwise +convrot, nvfp4). ``ck``: any
    reader with ``tensor(name, device)``; it is asked for ``dequantize_reads(layer, fmt)`` in that order."""
    name = fmt.get("format")
    w = ck.tensor(layer + ".weight", device)
    if name in ("float8_e4m3fn", "float8_e5m2"):
        dt = torch.float8_e4m3fn if name == "float8_e4m3fn" else torch.float8_e5m2
        return w.view(dt).float() * _row_scale(ck, layer, device)
    if name == "int8_tensorwise":
        wf = w.view(torch.int8).float() * _row_scale(ck, layer, device)
        if fmt.get("convrot"):
            g = int(fmt.get("convrot_groupsize", 256))
            wf = unrotate_convrot(wf, g)
        return wf
    if name == "nvfp4":
        from ..ops import nvfp4

        scale = ck.tensor(layer + ".weight_scale", device)
        q = from_comfy_quant(w, scale, ck.tensor(layer + ".weight_scale_2", device))
        return nvfp4.dequantize(q).float()
    raise CheckpointError(f"{layer}: quantization format {name!r} is not supported "
                          "(supported: nvfp4, float8_e4m3fn, float8_e5m2, int8_tensorwise)")


def hadamard(g: int, dtype=torch.float64) -> torch.Tensor:
    """Normalised regular Hadamard of size g (a power of 4): Kronecker powers of the 4x4 regular matrix / sqrt(g)."""
    base = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=dtype)
    h = torch.ones(1, 1, dtype=dtype)
    n = 1
    while n < g:
        h = torch.kron(h, base)
        n *= 4
    if n != g:
        raise CheckpointError(f"convrot_groupsize {g} is not a power of 4")
    return h / (g ** 0.5)


def unrotate_convrot(w: torch.Tensor, g: int) -> torch.Tensor:
    """Undo the offline rotation W' = W H_g^T per g-wide K group: W = W' H_g (H is orthogonal)."""
    n, k = w.shape
    h = hadamard(g).to(w.device, torch.float32)
    return (w.reshape(n, k // g, g) @ h).reshape(n, k)


def detect_config(path: str | Path) -> tuple[H3Config, str, Header]:
    """(config, naming scheme, header) for a safetensors file or a sharded ``*.index.json``; reads headers only."""
    ck = open_checkpoint(path)
    return ck.config, ck.scheme, ck.headers[0]
