"""Fun ControlNet files (``model_patches/*.safetensors``): detection, the tower's spec, reading and loading.

Read exactly as ComfyUI core's ``ModelPatchLoader`` reads them (``comfy_extras/nodes_model_patch.py``):

- native keys only (no prefix): ``control_proj_in.weight``, and on block 0 ``adaln_proj.linear.weight``,
  ``after_proj.weight``, ``before_proj.weight``, ``attn.qkv_proj.weight``, ``attn.q_norm.weight``,
  ``mlp.fc1.weight`` must all be present;
- blocks N = the count of ``control_blocks.N.after_proj.weight`` from 0; places ``range(0, 50, 50 // N)``
  (v1: 0, 10, .., 40; v2: 0, 5, .., 45) unless the metadata ``control_blocks_places`` (a JSON list of N
  integers) says otherwise;
- metadata ``minimax_h3_fun_controlnet == "adaln_basis"``: curve-form adaLN (fp32, no SiLU); otherwise full
  form; ``inpaint_masked_pixel_mode == "post_norm"``: the post-norm inpaint flag;
- heads = qkv rows / (3 head_dim), ffn = fc1 rows / 2, hidden = control_proj_in rows, 196 input columns;
- every tensor of the tower and nothing else (core loads strictly); comfy_quant layers as core's
  mixed-precision ops read them.

Refused with what the file is and what to do: diffusers / VideoX-Fun naming (core crashes there with an
UnboundLocalError), prefixed names, a file that is no Fun ControlNet, bad places metadata. The fit with a
base model (form, adaLN width, dimensions, places) is checked by ``FunControl.check_base`` at apply time.

``load_control`` fills a tower built on the meta device one tensor at a time like the base's streaming load:
with the load plan's ``quantize`` the four block linears become NVFP4 (stored NVFP4 adopted, dense quantized on
the device) so the tower runs through the base's quantized BlockOps; full-form adaLN stays in host memory where
the plan keeps the base's there; everything else goes to the device at its parameter's dtype.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..model.control import ControlError, FunControl, block_config, check_fits, check_places
from ..ops.gemm_backends import Scratch
from ..ops.linear import Nvfp4Linear, StoredParts
from ..ops.streaming import SLOTS, BlockStreamer
from .checkpoint import dequantize_layer
from .comfy_quant import from_comfy_quant_tensors, parse_comfy_quant_marker, parse_quantization_metadata
from .finite import check_finite
from .header import read_header, read_tensor
from .verify import check_names_and_shapes

BASE_BLOCKS = 50  # core spreads the control blocks over the released model's 50 blocks
REQUIRED = ("control_proj_in.weight", "control_blocks.0.adaln_proj.linear.weight", "control_blocks.0.after_proj.weight",
            "control_blocks.0.before_proj.weight", "control_blocks.0.attn.qkv_proj.weight",
            "control_blocks.0.attn.q_norm.weight", "control_blocks.0.mlp.fc1.weight")
CONTROL_LINEARS = re.compile(r"^control_blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")
_DIFFUSERS_BLOCK = re.compile(r"\.(attn\.to_[qkv]|attn\.to_out\.0|attn\.norm_[qk]|ff\.net\.[02])\b")
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "model.")
_QUANT_SUFFIXES = (".comfy_quant", ".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale")
_QUANT_DTYPES = ("F8_E4M3", "F8_E5M2", "I8", "U8")


@dataclass(frozen=True)
class ControlSpec:
    """What a Fun ControlNet file holds: blocks and places, adaLN form and width, block dimensions."""

    blocks: int
    places: tuple[int, ...]
    curve_form: bool
    time_embed_dim: int
    hidden_size: int
    num_heads: int
    head_dim: int
    ffn_hidden_size: int
    inpaint_post_norm: bool = False

    @property
    def block_config(self):
        return block_config(self.hidden_size, self.num_heads, self.head_dim, self.ffn_hidden_size,
                            self.time_embed_dim, self.curve_form)

    def check_base(self, base) -> "ControlSpec":
        """Refuse a tower that does not fit the base model's H3Config (``FunControl.check_base``)."""
        check_fits(self.block_config, self.places, base)
        return self


def _what_it_is(path: Path, keys: list[str]) -> str:
    """The refusal for a file that is not a native Fun ControlNet: what it looks like and what to do."""
    ctrl = [k for k in keys if ".control_blocks." in f".{k}" or k.startswith("control_")]
    if any(_DIFFUSERS_BLOCK.search(k) for k in ctrl):
        base = " with the base transformer (transformer_blocks.*)" if any(
            k.split(".", 1)[0] == "transformer_blocks" or ".transformer_blocks." in k for k in keys) else ""
        return (f"{path.name} is a MiniMax H3 Fun ControlNet in diffusers / VideoX-Fun naming{base} "
                f"(e.g. {sorted(k for k in ctrl if _DIFFUSERS_BLOCK.search(k))[0]}); ComfyUI core's ModelPatchLoader "
                "and this runtime read core's native names (control_blocks.N.attn.qkv_proj, mlp.fc1 = [gate; up]); "
                "core crashes on this file with an UnboundLocalError. Convert it with `h3-blackwell quantize "
                f"{path.name} OUT.safetensors` (writes native names, NVFP4 block linears)")
    for p in _PREFIXES:
        if any(k.startswith(p + "control_proj_in.") for k in keys):
            return (f"{path.name} is a Fun ControlNet whose names carry the prefix {p!r}; core's ModelPatchLoader "
                    "reads unprefixed names (control_proj_in.weight, control_blocks.N....) and does not load it; "
                    f"rewrite it with `h3-blackwell quantize {path.name} OUT.safetensors`")
    missing = [k for k in REQUIRED if k not in keys]
    return (f"{path.name} is not a MiniMax H3 Fun ControlNet: expected core's native keys {list(REQUIRED[:3])}...; "
            f"missing {missing[:3]}; found keys like {sorted(keys)[:4]}. A Fun ControlNet for H3 goes in "
            "models/model_patches (minimax_h3_fun_controlnet_union_*.safetensors)")


class ControlFile:
    """A Fun ControlNet file opened from its header (no tensor read but the few-byte comfy_quant markers).

    spec: the ControlSpec; keys() / shape() / dtype_name() / tensor() / quant_format(): the reading interface of
    ``runtime.io.checkpoint.Checkpoint`` (so ``dequantize_layer`` and ``check_names_and_shapes`` take it).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header = read_header(self.path)
        self.metadata = dict(self.header.metadata)
        keys = list(self.header.tensors)
        if not all(k in self.header.tensors for k in REQUIRED):
            raise CheckpointError(_what_it_is(self.path, keys))
        self.spec = _spec(self.path.name, {k: tuple(v.shape) for k, v in self.header.tensors.items()}, self.metadata)

    @property
    def name(self) -> str:
        return self.path.name

    def keys(self) -> list[str]:
        return list(self.header.tensors)

    def shape(self, k: str) -> tuple:
        return tuple(self.header.tensors[k].shape)

    def dtype_name(self, k: str) -> str:
        return self.header.tensors[k].dtype

    def tensor(self, k: str, device="cpu") -> torch.Tensor:
        if k not in self.header.tensors:
            raise CheckpointError(f"tensor {k!r} is not in {self.path}")
        return read_tensor(self.header, k).to(device)

    def quant_layers(self) -> set[str]:
        have = self.keys()
        layers = {k[: -len(".comfy_quant")] for k in have if k.endswith(".comfy_quant")}
        layers |= set(parse_quantization_metadata(self.metadata))
        return layers | {k[: -len(".weight")] for k in have if k.endswith(".weight")
                         and self.dtype_name(k) in _QUANT_DTYPES}

    def quant_format(self, layer: str) -> dict | None:
        marker = layer + ".comfy_quant"
        try:
            if marker in self.header.tensors:
                return parse_comfy_quant_marker(read_tensor(self.header, marker))
            layers = parse_quantization_metadata(self.metadata)
        except ValueError as e:
            raise CheckpointError(f"{self.name}: {marker}: {e}; re-export the file") from None
        if layer in layers:
            return layers[layer]
        dt = self.header.tensors.get(layer + ".weight")
        if dt is not None and dt.dtype in ("F8_E4M3", "F8_E5M2"):
            return {"format": "float8_e4m3fn" if dt.dtype == "F8_E4M3" else "float8_e5m2"}
        if dt is not None and dt.dtype == "I8":
            return {"format": "int8_tensorwise"}
        if dt is not None and dt.dtype == "U8":
            return {"format": "nvfp4"}
        return None

    def check_base(self, base) -> "ControlFile":
        """Refuse a tower that does not fit the base model's H3Config (``FunControl.check_base``), from headers."""
        check_fits(self.spec.block_config, self.spec.places, base)
        return self

    def expected(self) -> dict[str, tuple]:
        """Names and shapes of every tensor the tower needs (its dense layout)."""
        with torch.device("meta"):
            tower = FunControl(self.spec.block_config, self.spec.places)
        return {k: tuple(v.shape) for k, v in tower.state_dict().items()}

    def check(self) -> "ControlFile":
        """Every tensor present with its shape (quantized layers by their stored layout) and no other tensor
        (core loads the tower strictly). Headers only."""
        want = self.expected()
        quant = self.quant_layers()
        check_names_and_shapes(want, self, quant, str(self.path), self.spec.blocks,
                               f"a {self.spec.blocks}-block Fun ControlNet (hidden {self.spec.hidden_size})")
        extra = [k for k in self.keys() if k not in want and not any(
            k.endswith(s) and k[: -len(s)] in quant for s in _QUANT_SUFFIXES + (".weight",))]
        if extra:
            raise CheckpointError(f"{self.name}: {len(extra)} tensor(s) that a Fun ControlNet does not have, e.g. "
                                  f"{extra[:4]}; core's ModelPatchLoader loads strictly and refuses them too")
        return self


def _count(keys, fmt: str) -> int:
    n = 0
    while fmt.format(n) in keys:
        n += 1
    return n


def _spec(name: str, shapes: dict[str, tuple], meta: dict[str, str]) -> ControlSpec:
    blocks = _count(shapes, "control_blocks.{}.after_proj.weight")
    if blocks > BASE_BLOCKS:
        raise ControlError(f"{name}: {blocks} control blocks; core spreads them over {BASE_BLOCKS} base blocks and "
                           "cannot place more")
    places: object = tuple(range(0, BASE_BLOCKS, BASE_BLOCKS // blocks))
    if "control_blocks_places" in meta:
        try:
            places = json.loads(meta["control_blocks_places"])
        except json.JSONDecodeError as e:
            raise ControlError(f"{name}: metadata control_blocks_places is not JSON ({e}); expected a list of "
                               f"{blocks} block indices") from None
    places = check_places(list(places) if isinstance(places, tuple) else places, blocks)
    head_dim = shapes["control_blocks.0.attn.q_norm.weight"][0]
    qkv = shapes["control_blocks.0.attn.qkv_proj.weight"]
    hidden, cols = shapes["control_proj_in.weight"]
    if cols != 196:
        raise ControlError(f"{name}: control_proj_in.weight has {cols} input columns; core's tower takes 49 "
                           "channels x (1x2x2) = 196; the file is not an H3 Fun ControlNet")
    t_dim = shapes["control_blocks.0.adaln_proj.linear.weight"][-1]
    # the form comes from the metadata alone, as in core (a curve-width file without it reads as full form and
    # is refused at apply time with what the metadata should say)
    curve = meta.get("minimax_h3_fun_controlnet") == "adaln_basis"
    return ControlSpec(blocks, places, curve, t_dim, hidden, qkv[0] // (3 * head_dim), head_dim,
                       shapes["control_blocks.0.mlp.fc1.weight"][0] // 2,
                       meta.get("inpaint_masked_pixel_mode") == "post_norm")


def open_control(path: str | Path) -> ControlFile:
    """Open and check a Fun ControlNet file from its header (no weights read); ControlError / CheckpointError with
    what the file is and what to do otherwise."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"control file not found: {path}")
    return ControlFile(p).check()


# ---------------------------------------------------------------------------------------------
# other namings, for the converter
# ---------------------------------------------------------------------------------------------

_D2N = (("attn.to_out.0.", "attn.out_proj."), ("attn.norm_q.", "attn.q_norm."), ("attn.norm_k.", "attn.k_norm."),
        ("ff.net.2.", "mlp.fc2."))
CONTROL_METADATA = ("control_blocks_places", "minimax_h3_fun_controlnet", "inpaint_masked_pixel_mode")


class ControlView:
    """A Fun ControlNet file read under core's native names whatever its naming: native, prefixed
    (``diffusion_model.`` / ``transformer.`` / ...), or diffusers / VideoX-Fun (``attn.to_q/to_k/to_v`` fused into
    ``qkv_proj`` as [q; k; v], ``ff.net.0.proj`` [up; gate] swapped to ``mlp.fc1`` [gate; up], ``to_out.0``,
    ``norm_q/norm_k``, ``ff.net.2``). A VideoX-Fun file holding the whole transformer yields its control branch
    only. keys() / shape() / dtype_name() / tensor(): the converter's source interface."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header = read_header(self.path)
        self.metadata = dict(self.header.metadata)
        self.scheme = "native"
        self._parts: dict[str, list[str]] = {}
        for k in self.header.tensors:
            name = k
            for p in _PREFIXES:
                if name.startswith(p):
                    name = name[len(p):]
                    self.scheme = "prefixed" if self.scheme == "native" else self.scheme
                    break
            if not (name.startswith("control_blocks.") or name.startswith("control_proj_in.")):
                continue
            m = re.match(r"^(control_blocks\.\d+\.)(.*)$", name)
            if m:
                head, rest = m.groups()
                if re.match(r"^attn\.to_[qkv]\.weight$", rest):
                    self.scheme = "diffusers"
                    name = head + "attn.qkv_proj.weight"
                elif rest.startswith("ff.net.0.proj."):
                    self.scheme = "diffusers"
                    name = head + "mlp.fc1." + rest[len("ff.net.0.proj."):]
                else:
                    for d, n in _D2N:
                        if rest.startswith(d):
                            self.scheme, name = "diffusers", head + n + rest[len(d):]
                            break
            self._parts.setdefault(name, []).append(k)
        for name, parts in self._parts.items():
            if name.endswith("attn.qkv_proj.weight") and len(parts) > 1:
                if len(parts) != 3:
                    raise CheckpointError(f"{self.path.name}: {name} needs to_q, to_k and to_v; found {parts}")
                self._parts[name] = sorted(parts, key=lambda x: "qkv".index(x[-len("q.weight")]))
        if not all(k in self._parts for k in REQUIRED):
            raise CheckpointError(_what_it_is(self.path, list(self.header.tensors)))
        self.spec = _spec(self.path.name, {k: self.shape(k) for k in self._parts}, self.metadata)

    def keys(self) -> list[str]:
        return list(self._parts)

    def shape(self, k: str) -> tuple:
        shapes = [tuple(self.header.tensors[p].shape) for p in self._parts[k]]
        return (sum(s[0] for s in shapes),) + shapes[0][1:] if len(shapes) > 1 else shapes[0]

    def dtype_name(self, k: str) -> str:
        return self.header.tensors[self._parts[k][0]].dtype

    def tensor(self, k: str, device="cpu") -> torch.Tensor:
        parts = [read_tensor(self.header, p) for p in self._parts[k]]
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        if k.endswith("mlp.fc1.weight") and ".ff.net.0.proj." in f".{self._parts[k][0]}":
            up, gate = t.chunk(2, dim=0)
            t = torch.cat([gate, up])
        return t.to(device)

    def check(self) -> "ControlView":
        """Every tensor of the tower with its shape, nothing else (the converter writes only a loadable file)."""
        with torch.device("meta"):
            tower = FunControl(self.spec.block_config, self.spec.places)
        want = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
        check_names_and_shapes(want, self, set(), str(self.path), self.spec.blocks,
                               f"a {self.spec.blocks}-block Fun ControlNet (hidden {self.spec.hidden_size})")
        extra = [k for k in self.keys() if k not in want]
        if extra:
            raise CheckpointError(f"{self.path.name}: {len(extra)} tensor(s) that a Fun ControlNet does not have, e.g. "
                                  f"{extra[:4]}")
        quant = [k for k in self.keys() if self.dtype_name(k) in _QUANT_DTYPES or k.endswith(_QUANT_SUFFIXES)]
        if quant:
            raise CheckpointError(f"{self.path.name}: already quantized tensors ({quant[:3]}); the converter reads "
                                  "bf16 / fp16 / fp32 towers")
        return self

    def metadata_out(self) -> dict[str, str]:
        """Core's control metadata of the source (places, adaLN form, inpaint mode), the places always written."""
        meta = {k: self.metadata[k] for k in CONTROL_METADATA if k in self.metadata}
        meta["control_blocks_places"] = json.dumps(list(self.spec.places))
        return meta


def is_control_file(path: str | Path) -> bool:
    """True when the file's header holds a Fun ControlNet's ``control_proj_in.weight`` (under any prefix)."""
    try:
        keys = read_header(path).tensors
    except CheckpointError:
        return False
    return any(k == "control_proj_in.weight" or k.endswith(".control_proj_in.weight") for k in keys)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def _set(module, name: str, value) -> None:
    *path, leaf = name.split(".")
    mod = module
    for p in path:
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Module):
        mod._modules[leaf] = value
    elif leaf in mod._parameters:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def load_control(path, plan, base_config=None) -> FunControl:
    """The tower of ``path`` on ``plan``'s device and dtype (a LoadPlan: ``rt.plan``), its block linears NVFP4
    when the plan quantizes (module docstring). ``path``: a file, an opened ``ControlFile``, or any source with
    its reading interface (``spec``, ``name``, ``keys``, ``tensor``, ``quant_layers``, ``quant_format``; the
    benches' random towers). ``base_config``: refuse early a tower that does not fit it. Where the plan's memory
    budget streams the tower (``plan.memory.tower_streams``: it was planned with this tower), each control
    block's four linears move to pinned host memory as they load and stream through the tower's own device
    buffers (``tower.streamer``, a ``BlockStreamer``; ``H3Runtime.fit_memory`` moves them when a later plan
    decides otherwise). Raises ControlError / CheckpointError naming the problem."""
    cf = path if hasattr(path, "spec") else open_control(path)
    spec = cf.spec
    tower_cfg = spec.block_config
    if base_config is not None:
        check_fits(tower_cfg, spec.places, base_config)
    dev, dtype = plan.device, plan.dtype
    with torch.device("meta"):
        tower = FunControl(tower_cfg, spec.places, dtype, inpaint_post_norm=spec.inpaint_post_norm)
    quant = cf.quant_layers()
    scratch = getattr(plan, "scratch", None) or Scratch()  # the base's GEMM scratch (one of them runs at a time)
    host_adaln = plan.adaln_on_host and not spec.curve_form
    memory = getattr(plan, "memory", None)
    streams = bool(memory is not None and memory.tower_streams)
    streamer = BlockStreamer(tower.control_blocks, range(len(spec.places)) if streams else (), dev,
                             memory.slots if memory is not None else SLOTS)

    def adopt(layer: str) -> None:  # a streamed control block's linear: its tensors to host memory at once
        streamer.adopt("blocks." + layer.split(".", 1)[1], tower.get_submodule(layer))

    for k, p in tower.state_dict(keep_vars=True).items():
        layer = k[: -len(".weight")] if k.endswith(".weight") else None
        if layer is not None and plan.quantize and CONTROL_LINEARS.match(layer):
            _set(tower, layer, _linear(cf, layer, layer in quant, tuple(p.shape), plan, scratch))
            adopt(layer)
            continue
        if k.endswith(".bias") and CONTROL_LINEARS.match(k[:-5]):
            continue  # (block linears have no bias)
        if layer is not None and layer in quant:
            t = dequantize_layer(cf, layer, cf.quant_format(layer) or {"format": "int8_tensorwise"}, dev)
        else:
            t = cf.tensor(k, "cpu" if (host_adaln and ".adaln_proj." in k) else dev)
        check_finite(k, t, source=cf.name)
        if host_adaln and ".adaln_proj." in k:
            host = torch.empty(tuple(p.shape), dtype=p.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(t)
            _set(tower, k, host)
        else:
            _set(tower, k, t.to(device=dev, dtype=p.dtype))
            if layer is not None and CONTROL_LINEARS.match(layer):
                adopt(layer)  # a dense block linear (the plan does not quantize)
    left = [n for n, t in list(tower.named_parameters()) + list(tower.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{cf.name}: no tensor for {left[:5]}")
    streamer.finish()
    tower.streamer = streamer
    towers = getattr(plan, "towers", None)
    if towers is not None:
        towers.add(tower)  # a later run without it plans around the device bytes it holds (fit_memory)
    return tower.eval().requires_grad_(False)


def _linear(cf, layer: str, stored_quant: bool, shape: tuple, plan, scratch) -> Nvfp4Linear:
    """One control block linear as an Nvfp4Linear: its stored NVFP4 tensors adopted, or its dense weight
    (dequantized when stored as fp8 / int8) quantized on the device."""
    kw = dict(plan.linear_choices(), scratch=scratch)
    fmt = cf.quant_format(layer) if stored_quant else None
    if fmt is not None and fmt.get("format") == "nvfp4":
        names = [x for x in cf.keys() if x.startswith(layer + ".") and x.count(".") == layer.count(".") + 1]
        tensors = {x: cf.tensor(x, plan.device) for x in names}
        for x, t in tensors.items():
            check_finite(x, t, source=cf.name)
        q = from_comfy_quant_tensors(tensors, layer, shape=shape, metadata=cf.metadata)
        return Nvfp4Linear(q.weight, stored=StoredParts(tensors.get(f"{layer}.bias"), q.input_scale,
                                                        q.pre_quant_scale), **kw)
    w = dequantize_layer(cf, layer, fmt, plan.device) if fmt is not None else cf.tensor(layer + ".weight", plan.device)
    check_finite(layer + ".weight", w, source=cf.name)
    return Nvfp4Linear.from_float(w.to(plan.dtype).detach(), **kw)
