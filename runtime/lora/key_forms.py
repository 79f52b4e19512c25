"""Reading H3 LoRA files: every key form, mapped onto the model's ComfyUI module names and validated.

A key is ``<module><suffix>``. Module forms (one file may mix them):

=========================================== ===========================================================
``blocks.3.attn.qkv_proj``                   ComfyUI / original module name (bare)
``diffusion_model.blocks.3.attn.qkv_proj``   also ``model.diffusion_model.``, ``transformer.``, ``base_model.model.``
``lora_unet_blocks_3_attn_qkv_proj``         kohya: the dots of a ComfyUI name written as underscores
``transformer_blocks.3.attn.to_q`` / k / v   diffusers: each updates one contiguous third of qkv_proj's rows
``transformer_blocks.3.attn.to_qkv``         diffusers, fused: all of qkv_proj
``transformer_blocks.3.ff.net.0.proj``       diffusers fc1: rows ``[up; gate]``, swapped to ComfyUI's ``[gate; up]``
other diffusers names                        through ``checkpoint.diffusers_to_comfy_name`` (``to_out.0``,
                                             ``ff.net.2``, ``norm_out.linear``, ``context_embedder``, ...)
=========================================== ===========================================================

Suffixes: ``.lora_A.weight`` / ``.lora_B.weight`` (PEFT, also ``.lora_A.<adapter>.weight``),
``.lora_down.weight`` / ``.lora_up.weight``, ``.lora.down.weight`` / ``.lora.up.weight``, ``.alpha``,
``.diff`` (a full weight delta) and ``.diff_b`` (a bias delta).

The turbo LoRAs' ComfyUI files need nothing special: their qkv LoRA is an ordinary update of
``qkv_proj`` whose A is the concatenation of the q/k/v A's and whose B is block-diagonal (rank 3r,
alpha already x3), and their fc1 B is already in ``[gate; up]`` order.

Alpha, per module: the ``.alpha`` tensor; else the diffusers/PEFT adapter metadata ``lora_alpha``
(safetensors metadata ``lora_adapter_metadata``); else kohya's ``ss_network_alpha``; else alpha = rank
(scale 1, ComfyUI's rule). The update of a module at strength s is ``s * (alpha / rank) * B @ A``.

Validation happens before anything touches the model; all problems of one file end in ONE
:class:`LoraError` (keys that match nothing, wrong ranks, shapes of another model, unsupported
formats). The one documented skip: AdaLN LoRAs made for the full-form time embedding (width 2688) on a
curve-form ("pruned") checkpoint, whose AdaLN linears take the 8-wide table row; those tensors are
listed with the reason, the rest applies.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..io.finite import check_finite
from ..io.header import read_tensors
from ..io.keys import diffusers_to_comfy_name
from ..errors import CheckpointError, H3Error

LOWRANK, DIFF, DIFF_B = "lowrank", "diff", "diff_b"
_KIND_ORDER = {LOWRANK: 0, DIFF: 1, DIFF_B: 2}


class LoraError(H3Error):
    """A LoRA file cannot be applied to this model. The message lists every problem of the file."""


# ---------------------------------------------------------------------------------------------
# the file
# ---------------------------------------------------------------------------------------------

@dataclass
class LoraFile:
    """The tensors (CPU, as stored) and safetensors metadata of one LoRA file."""

    path: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    @property
    def name(self) -> str:
        return Path(self.path).name


def read_lora_file(path: str | Path) -> LoraFile:
    """Read a ``.safetensors`` LoRA (pickle formats are never loaded: they can run code)."""
    p = Path(path)
    if not p.is_file():
        raise LoraError(f"LoRA file not found: {p}")
    if p.suffix.lower() in (".ckpt", ".pt", ".pth", ".bin", ".pkl"):
        raise LoraError(f"{p.name}: pickle files are never loaded (they can run code); convert the LoRA to "
                        ".safetensors first")
    try:  # the checked header reader of every input: extents, dtypes, names and metadata before any byte
        hdr, tensors = read_tensors(p, "LoRA file")
    except (CheckpointError, OSError) as e:
        raise LoraError(f"{p.name} is not a readable safetensors file ({e})") from None
    meta = dict(hdr.metadata)
    for k, t in tensors.items():  # one reduction per tensor: a NaN factor would make every latent NaN
        check_finite(k, t, LoraError, p.name, "the LoRA is damaged or was trained to divergence; re-export it")
    return LoraFile(str(p), tensors, meta)


# ---------------------------------------------------------------------------------------------
# key forms
# ---------------------------------------------------------------------------------------------

_SUFFIX = re.compile(
    r"^(?P<mod>.+?)\.(?:"
    r"lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_\-]+)?\.weight"
    r"|lora_(?P<du>down|up)\.weight"
    r"|lora\.(?P<du2>down|up)\.weight"
    r"|(?P<alpha>alpha)|(?P<diff>diff)|(?P<diffb>diff_b))$")
_LYCORIS = re.compile(r"\.(hada_w[12]_[ab]|hada_t[12]|lokr_w[12](_[ab])?|lokr_t2|lora_mid\.weight|dora_scale|"
                      r"oft_blocks|oft_diag|b_norm|w_norm)$")
_TEXT_ENCODER = re.compile(r"^(lora_te\d?_|text_encoders?\.|te\d?\.|cond_stage_model\.|conditioner\.)")
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.")
_D_BLOCK = r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\."
_D_QKV = re.compile(_D_BLOCK + r"attn\.to_([qkv])$")
_D_QKV_FUSED = re.compile(_D_BLOCK + r"attn\.to_qkv$")
_D_FC1 = re.compile(_D_BLOCK + r"ff\.net\.0\.proj$")
_CURVE_ADALN = re.compile(r"^(blocks\.\d+|final_layer)\.adaln_proj\.linear$")
_FAMILIES = (
    (re.compile(r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks)[._]"), "Flux"),
    (re.compile(r"(self_attn|cross_attn)[._][qkvo]([._]|$)"), "Wan"),
    (re.compile(r"(^|[._])(input_blocks|output_blocks|down_blocks|up_blocks|mid_block)[._]"),
     "a Stable Diffusion UNet"),
    (re.compile(r"(^|[._])attn[12][._]"), "an SD3 / LTX-Video / HunyuanVideo style transformer"),
    (re.compile(r"(^|[._])layers[._]\d+[._](self_attn|mlp)[._]"), "a language model"),
)
_ROLE_NAMES = {"down": ("lora_A", "lora_down"), "up": ("lora_B", "lora_up")}


@dataclass
class _Group:
    """The tensors of one module as named in the file."""

    raw: str  # module name after prefix stripping
    form: str  # comfy | diffusion_model | lora_unet | peft | diffusers (resolved later)
    tensors: dict = field(default_factory=dict)  # role -> (key, tensor); roles down, up, alpha, diff, diff_b


def _split_key(key: str) -> tuple[str, str, str] | None:
    """key -> (module name without prefixes, role, prefix form) or None when the suffix is not a LoRA suffix."""
    m = _SUFFIX.match(key)
    if m is None:
        return None
    if m["ab"]:
        role = "down" if m["ab"] == "A" else "up"
    elif m["du"] or m["du2"]:
        role = m["du"] or m["du2"]
    else:
        role = "alpha" if m["alpha"] else ("diff" if m["diff"] else "diff_b")
    mod, form = m["mod"], "comfy"
    if mod.startswith("lora_unet_"):
        return mod[len("lora_unet_"):], role, "lora_unet"
    for p in _PREFIXES:
        if mod.startswith(p):
            mod = mod[len(p):]
            form = "peft" if p in ("base_model.model.", "transformer.") else "diffusion_model"
    if m["ab"] and re.search(r"\.lora_[AB]\.[A-Za-z0-9_\-]+\.weight$", key):
        form = "peft"
    return mod, role, form


def _alpha_from_metadata(meta: dict[str, str]) -> tuple[float | None, str]:
    raw = meta.get("lora_adapter_metadata")
    if raw:
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            d = {}
        for k in ("transformer.lora_alpha", "lora_alpha"):
            if isinstance(d, dict) and isinstance(d.get(k), (int, float)):
                return float(d[k]), f"metadata lora_adapter_metadata[{k}]"
    for k in ("lora_alpha", "ss_network_alpha"):
        v = meta.get(k)
        if v is not None:
            try:
                f = float(v)
            except ValueError:
                continue
            if math.isfinite(f):
                return f, f"metadata {k}"
    return None, ""


# ---------------------------------------------------------------------------------------------
# matching against a model
# ---------------------------------------------------------------------------------------------

@dataclass
class LoraUpdate:
    """One update of one model module, in ComfyUI layout (rows = the module's output rows ``[a, b)``).

    lowrank: ``down`` [r, K], ``up`` [b-a, r] (float, as stored); the update at strength s is
    ``s * (alpha / r) * up @ down`` on rows a:b of the weight. diff: ``delta`` [b-a, K] added to rows
    a:b of the weight. diff_b: ``delta`` [b-a] added to the bias.
    """

    module: str
    kind: str
    rows: tuple[int, int]
    keys: tuple[str, ...]
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    alpha: float | None = None
    delta: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def unit_scale(self) -> float:
        """alpha / rank: the scale at strength 1."""
        return float(self.alpha) / self.rank

    @property
    def param(self) -> str:
        return "bias" if self.kind == DIFF_B else "weight"

    def sort_key(self):
        return (self.module, _KIND_ORDER[self.kind], self.rows)


@dataclass
class LoraMatch:
    """A LoRA file matched to a model: the updates to apply and the tensors skipped (with why)."""

    file: LoraFile
    updates: list[LoraUpdate]
    skipped: list[dict]
    forms: list[str]
    alpha_source: str

    @property
    def targets(self) -> list[str]:
        return sorted({u.module for u in self.updates})


def _linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(out, in) of a linear-like module (nn.Linear, Nvfp4Linear), else None."""
    o, i = getattr(module, "out_features", None), getattr(module, "in_features", None)
    return (int(o), int(i)) if isinstance(o, int) and isinstance(i, int) else None


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4 and tuple(t.shape[2:]) == (1, 1):  # 1x1-conv shaped linear LoRA (some trainers)
        return t.reshape(t.shape[0], t.shape[1])
    return t


def _model_name(cfg) -> str:
    form = f"curve-form AdaLN (table {cfg.adaln_curve_grid}x{cfg.time_embed_dim})" if cfg.curve_form \
        else f"full-form AdaLN (time embedding {cfg.time_embed_dim})"
    return (f"H3 DiT hidden {cfg.hidden_size}, {cfg.num_layers} blocks, inner {cfg.inner_dim}, "
            f"FFN {cfg.ffn_hidden_size}, {form}")


class _Resolver:
    """Module names of the file -> (ComfyUI module name, row part) for one model."""

    def __init__(self, model: nn.Module):
        self.modules = dict(model.named_modules())
        self.underscored = {n.replace(".", "_"): n for n in self.modules if n}

    def resolve(self, raw: str, form: str) -> tuple[str, tuple, str] | None:
        """-> (comfy module, part, form) with part () whole, ("third", i) a third of the rows, ("swap",)
        fc1 halves swapped; None when the name means nothing in an H3 DiT."""
        if form == "lora_unet":
            name = self.underscored.get(raw)
            return (name, (), form) if name else None
        if raw in self.modules and raw:
            return raw, (), form
        dform = "peft" if form == "peft" else "diffusers"
        m = _D_QKV.match(raw)
        if m:
            return f"{self._block(m)}.attn.qkv_proj", ("third", "qkv".index(m.group(3))), dform
        m = _D_QKV_FUSED.match(raw)
        if m:
            return f"{self._block(m)}.attn.qkv_proj", (), dform
        m = _D_FC1.match(raw)
        if m:
            return f"{self._block(m)}.mlp.fc1", ("swap",), dform
        c = diffusers_to_comfy_name(raw + ".weight")
        if c is not None and c.endswith(".weight"):
            return c[: -len(".weight")], (), dform
        return None

    @staticmethod
    def _block(m) -> str:
        return ("blocks." if m.group(1) == "transformer_blocks" else "token_refiner.blocks.") + m.group(2)


def _group_keys(lf: LoraFile) -> tuple[dict[tuple[str, str], _Group], list[str], list[str], list[dict]]:
    """Sort the file's keys into one group per (module, form). Returns (groups, unrecognized keys, LyCORIS keys,
    skipped text-encoder keys with their reason)."""
    groups: dict[tuple[str, str], _Group] = {}
    unrecognized, lycoris, skipped = [], [], []
    for key, t in lf.tensors.items():
        if _TEXT_ENCODER.match(key):
            skipped.append({"key": key, "reason": "text-encoder tensor: this loader patches the H3 DiT only"})
            continue
        if _LYCORIS.search(key):
            lycoris.append(key)
            continue
        sp = _split_key(key)
        if sp is None:
            unrecognized.append(key)
            continue
        mod, role, form = sp
        g = groups.setdefault((mod, form), _Group(mod, form))
        if role in g.tensors:
            unrecognized.append(key)  # the same role twice for one module (e.g. two adapters)
            continue
        g.tensors[role] = (key, t)
    return groups, unrecognized, lycoris, skipped


class _Target:
    """One group resolved onto a module: its name, the module, its (out, in) dims when it is a linear, the rows
    this group updates (None when the part cannot be cut from it), the part, and whether the curve-form AdaLN
    skip applies."""

    def __init__(self, name: str, part: tuple, mod: nn.Module, curve_form: bool):
        self.name, self.part, self.mod = name, part, mod
        self.dims = _linear_dims(mod)
        self.rows = _rows(part, self.dims[0]) if self.dims else None
        self.curve_skip = curve_form and bool(_CURVE_ADALN.match(name)) and self.dims is not None


class _Matcher:
    """The state of one :func:`match_lora`: the updates found, the problems (by kind, in key order), one example
    per module of a wrong shape, the skipped keys, the key forms and alpha sources seen."""

    def __init__(self, lf: LoraFile, model: nn.Module, cfg, skipped: list[dict]):
        self.cfg, self.res, self.skipped = cfg, _Resolver(model), skipped
        self.meta_alpha, self.meta_src = _alpha_from_metadata(lf.metadata)
        self.problems: dict[str, list[str]] = {"nothing": [], "incomplete": [], "rank": [], "shape": [],
                                               "dtype": [], "duplicate": []}
        self.shape_examples: dict[str, str] = {}  # module -> the first example of its wrong shape
        self.updates: list[LoraUpdate] = []
        self.forms: set[str] = set()
        self.alpha_sources: set[str] = set()
        self.seen: dict[tuple, str] = {}

    def shape_problem(self, name: str, example: str) -> bool:
        """Record a shape problem of ``name`` (the first example per module is kept); returns False."""
        self.problems["shape"].append(name)
        self.shape_examples.setdefault(name, example)
        return False

    def add(self, u: LoraUpdate) -> bool:
        """Add ``u`` unless another key already updates the same rows (then a duplicate problem); True if added."""
        if _dup(self.seen, u, self.problems):
            return False
        self.updates.append(u)
        return True

    def skip(self, keys, reason: str) -> bool:
        """Record ``keys`` as skipped for ``reason``; returns False."""
        self.skipped.extend({"key": k, "reason": reason} for k in keys)
        return False

    def group(self, g: _Group) -> None:
        """Resolve one group, check it, and add its low-rank and diff updates (or record why not)."""
        keys = tuple(k for k, _ in g.tensors.values())
        r = self.res.resolve(g.raw, g.form)
        if r is not None and r[0] in ("time_embedder.proj_in", "time_embedder.proj_out") and self.cfg.curve_form:
            self.skip(keys, "curve-form (pruned) checkpoint: it has no time_embedder (the adaln_t_table replaces "
                            "it), so this time-embedder LoRA cannot apply")
            return
        if r is None or r[0] not in self.res.modules:
            self.problems["nothing"].extend(keys)
            return
        name, part, form = r
        self.forms.add(form)
        bad_dtype = [f"{k} ({t.dtype})" for k, t in g.tensors.values() if not t.is_floating_point()]
        if bad_dtype:
            self.problems["dtype"].extend(bad_dtype)
            return
        has_ab = "down" in g.tensors or "up" in g.tensors
        if has_ab and not ("down" in g.tensors and "up" in g.tensors):
            have = "down" if "down" in g.tensors else "up"
            miss = "up" if have == "down" else "down"
            self.problems["incomplete"].append(f"{g.tensors[have][0]} has no {'/'.join(_ROLE_NAMES[miss])} partner")
            return
        if "alpha" in g.tensors and not has_ab:
            self.problems["incomplete"].append(f"{g.tensors['alpha'][0]} has no lora_A/lora_B pair")
            return
        target = _Target(name, part, self.res.modules[name], self.cfg.curve_form)
        if has_ab and not self.lowrank(g, target, keys):
            return  # a group whose pair is refused, skipped or a duplicate contributes no diffs either
        for role, kind in (("diff", DIFF), ("diff_b", DIFF_B)):
            if role in g.tensors:
                self.diff(g.tensors[role], kind, target)

    def lowrank(self, g: _Group, t: _Target, keys: tuple[str, ...]) -> bool:
        """The down/up pair of ``g``: rank, shape and alpha checks, then one LOWRANK update; True if added."""
        name, dims = t.name, t.dims
        down, up = _as_matrix(g.tensors["down"][1]), _as_matrix(g.tensors["up"][1])
        if down.dim() != 2 or up.dim() != 2:
            return self.shape_problem(name, f"{name}: lora down {list(down.shape)} / up {list(up.shape)} are "
                                            "not 2-D matrices")
        if down.shape[0] != up.shape[1]:
            self.problems["rank"].append(f"{name}: {g.tensors['down'][0]} has rank {down.shape[0]} but "
                                         f"{g.tensors['up'][0]} has rank {up.shape[1]}")
            return False
        if down.shape[0] == 0:  # alpha / rank would divide by zero; an empty pair changes nothing
            self.problems["rank"].append(f"{name}: {g.tensors['down'][0]} {list(down.shape)} and {g.tensors['up'][0]} "
                                         f"{list(up.shape)} have rank 0; expected rank >= 1")
            return False
        if t.curve_skip and down.shape[1] != dims[1]:
            return self.skip(keys, f"curve-form (pruned) checkpoint: {name} takes the {dims[1]}-wide adaln_t_table "
                                   f"row, this LoRA was made for the {down.shape[1]}-wide full-form time embedding")
        if dims is None:
            return self.shape_problem(name, f"{name} is not a linear layer ({type(t.mod).__name__}); a low-rank "
                                            "update needs one")
        want_rows = t.rows[1] - t.rows[0] if t.rows else None
        if t.rows is None or down.shape[1] != dims[1] or up.shape[0] != want_rows:
            return self.shape_problem(name, f"{name}: LoRA down {list(down.shape)} / up {list(up.shape)}, the "
                                            f"layer is [{dims[0]}, {dims[1]}] (in {dims[1]}, out {dims[0]}"
                                            + (f", this part {want_rows} rows)" if t.part else ")"))
        alpha = self.alpha(g, name, down)
        if alpha is None:
            return False
        if t.part == ("swap",):
            up = torch.cat([up[up.shape[0] // 2:], up[: up.shape[0] // 2]])
        return self.add(LoraUpdate(name, LOWRANK, t.rows, (g.tensors["down"][0], g.tensors["up"][0]), down=down, up=up,
                            alpha=alpha))

    def alpha(self, g: _Group, name: str, down: torch.Tensor) -> float | None:
        """The group's alpha (its tensor, else the file's metadata, else the rank), or None after recording a
        shape problem (a non-scalar or non-finite alpha)."""
        if "alpha" in g.tensors:
            a = g.tensors["alpha"][1]
            if a.numel() != 1:
                self.shape_problem(name, f"{g.tensors['alpha'][0]} has shape {list(a.shape)}; alpha is a scalar")
                return None
            alpha, src = float(a.float().reshape(())), "alpha tensors"
        elif self.meta_alpha is not None:
            alpha, src = self.meta_alpha, self.meta_src
        else:
            alpha, src = float(down.shape[0]), "none in the file: alpha = rank (scale 1, as ComfyUI)"
        if not math.isfinite(alpha):
            self.shape_problem(name, f"{name}: alpha is {alpha}")
            return None
        self.alpha_sources.add(src)
        return alpha

    def diff(self, keyed: tuple[str, torch.Tensor], kind: str, t: _Target) -> bool:
        """A full weight (DIFF) or bias (DIFF_B) delta: shape check, then one update of the target's rows."""
        key, d = keyed
        name = t.name
        pname = "bias" if kind == DIFF_B else "weight"
        if t.curve_skip and kind == DIFF and d.dim() == 2 and d.shape[1] != t.dims[1]:
            return self.skip((key,), f"curve-form (pruned) checkpoint: {name} takes the {t.dims[1]}-wide "
                                     f"adaln_t_table row, this diff is {d.shape[1]} wide")
        shape = tuple(_param_shape(t.mod, pname) or ())
        if not shape:
            return self.shape_problem(name, f"{key}: {name} has no {pname}")
        lo, hi = t.rows if t.rows else (0, shape[0])
        want = (hi - lo,) + shape[1:]
        if t.part == ("swap",) and tuple(d.shape) == want:
            d = torch.cat([d[d.shape[0] // 2:], d[: d.shape[0] // 2]])
        if tuple(d.shape) != want:
            return self.shape_problem(name, f"{key}: delta {list(d.shape)}, the {pname} part is {list(want)}")
        return self.add(LoraUpdate(name, kind, (lo, hi), (key,), delta=d))


def match_lora(lf: LoraFile, model: nn.Module, cfg) -> LoraMatch:
    """Map every key of ``lf`` onto ``model``; raise ONE LoraError listing every problem.

    model: the H3Model (ComfyUI module names); cfg: its H3Config (curve form decides the AdaLN skip).
    """
    groups, unrecognized, lycoris, skipped = _group_keys(lf)
    m = _Matcher(lf, model, cfg, skipped)
    for g in groups.values():
        m.group(g)
    _raise_if_problems(lf, cfg, m.problems, m.shape_examples, unrecognized, lycoris, m.updates, m.skipped)
    m.updates.sort(key=LoraUpdate.sort_key)
    alpha_source = "; ".join(sorted(m.alpha_sources)) or "n/a (no low-rank pairs)"
    return LoraMatch(lf, m.updates, m.skipped, sorted(m.forms), alpha_source)


def _rows(part: tuple, out: int) -> tuple[int, int] | None:
    if not part or part == ("swap",):
        return (0, out) if part != ("swap",) or out % 2 == 0 else None
    if out % 3:
        return None
    n = out // 3
    return n * part[1], n * (part[1] + 1)


def _param_shape(mod: nn.Module, pname: str) -> tuple | None:
    if pname == "weight":
        dims = _linear_dims(mod)
        if dims is not None:
            return dims
    p = getattr(mod, pname, None)
    return tuple(p.shape) if isinstance(p, torch.Tensor) else None


def _dup(seen: dict, u: LoraUpdate, problems: dict) -> bool:
    k = (u.module, u.kind, u.rows)
    if k in seen:
        problems["duplicate"].append(f"{u.keys[0]} and {seen[k]} both update {u.module} rows {u.rows[0]}:{u.rows[1]}")
        return True
    seen[k] = u.keys[0]
    return False


def _guess_family(keys: list[str]) -> str | None:
    for rx, fam in _FAMILIES:
        if any(rx.search(k) for k in keys):
            return fam
    return None


def _examples(items: list[str], n: int = 3) -> str:
    s = ", ".join(repr(x) if not x.startswith(("blocks", "token_refiner", "final_layer")) or " " not in x else x
                  for x in items[:n])
    return s + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _raise_if_problems(lf, cfg, problems, shape_examples, unrecognized, lycoris, updates, skipped) -> None:
    parts = []
    n_lora_keys = len(lf.tensors) - len(unrecognized)
    if not lf.tensors:
        raise LoraError(f"LoRA {lf.name} holds no tensors")
    if unrecognized and n_lora_keys == 0:
        raise LoraError(f"LoRA {lf.name} has no LoRA tensors (no lora_A/lora_B, lora_down/lora_up, alpha, diff "
                        f"or diff_b keys); found e.g. {_examples(sorted(unrecognized))}. Is it a model checkpoint? "
                        "Load DiT checkpoints with the model loader, LoRAs here.")
    if lycoris:
        parts.append(f"{len(lycoris)} tensors use a LyCORIS/DoRA format this loader does not apply (LoHa, LoKr, "
                     f"LoCon mid, DoRA scale), e.g. {_examples(sorted(lycoris))}; convert it to a plain LoRA")
    if unrecognized:
        parts.append(f"{len(unrecognized)} keys are not LoRA tensors, e.g. {_examples(sorted(unrecognized))}")
    nothing = sorted(problems["nothing"])
    if nothing:
        fam = _guess_family(nothing)
        whole = not updates and not problems["shape"] and not problems["rank"]
        what = (f"this looks like a LoRA for {fam}, not MiniMax H3" if fam
                else "it was made for another model" if whole else "those modules are not in this H3 DiT")
        parts.append(f"{len(nothing)} keys match no module of this H3 DiT, e.g. {_examples(nothing)} ({what})")
    if problems["rank"]:
        parts.append(f"{len(problems['rank'])} pairs have mismatched ranks or rank 0: {_examples(problems['rank'], 2)}")
    if problems["incomplete"]:
        parts.append(f"{len(problems['incomplete'])} incomplete pairs: {_examples(problems['incomplete'], 2)}")
    if problems["dtype"]:
        parts.append(f"{len(problems['dtype'])} tensors are not floating point: {_examples(problems['dtype'], 2)}")
    if problems["duplicate"]:
        parts.append(f"{len(problems['duplicate'])} updates are given twice (the same module under two names): "
                     f"{_examples(problems['duplicate'], 2)}")
    bad = sorted(set(problems["shape"]))
    if bad:
        total = len(set(bad) | {u.module for u in updates})
        other = " - it was made for another model (or another H3 size)" if len(bad) == total else ""
        ex = "; ".join(list(shape_examples.values())[:2]) or _examples(bad, 2)
        parts.append(f"{len(bad)} of {total} target layers have the wrong shape{other}: {ex}")
    if not parts and not updates:
        if skipped:
            reasons = sorted({s["reason"] for s in skipped})
            raise LoraError(f"LoRA {lf.name}: every tensor was skipped, nothing would change ({'; '.join(reasons)})")
        raise LoraError(f"LoRA {lf.name} updates nothing in this model")
    if parts:
        raise LoraError(f"LoRA {lf.name} cannot be applied to this model ({_model_name(cfg)}): " + "; ".join(parts)
                        + ". Nothing was changed; pick a LoRA made for this MiniMax H3 checkpoint.")
