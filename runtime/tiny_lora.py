"""Random LoRAs for the tiny H3, one ground truth written in every key form (for tests and smoke runs).

``tiny_lora_truth(cfg, seed)`` draws the updates in ComfyUI layout; ``save_tiny_lora(path, truth, form)``
writes them in one naming form; ``expected_merge`` evaluates the merge contract of ``runtime.lora``
(float64, rounded once to fp32) from the truth, independently of the loader.

Forms: ``comfy`` (bare ComfyUI names, lora_A/lora_B + ``.alpha``; a q/k/v-split update of qkv_proj is
written fused as the turbo LoRAs ship it: concatenated A, block-diagonal B, alpha x3), ``diffusion_model``
(prefix + lora_down/lora_up), ``lora_unet`` (kohya underscores), ``diffusers`` (``transformer_blocks``,
``to_q/to_k/to_v``, ``ff.net.0.proj`` with the halves swapped, ``to_out.0``, ``ff.net.2``, ``norm_out.linear``,
``context_embedder``) and ``peft`` (diffusers names under ``transformer.``, ``.lora_A.default.weight``,
alpha only in the ``lora_adapter_metadata`` JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import TINY, H3Config

FORMS = ("comfy", "diffusion_model", "lora_unet", "diffusers", "peft")


@dataclass
class LoraPart:
    """``(alpha / rank) * up @ down`` added to rows ``rows`` of ``module``'s weight (ComfyUI layout)."""

    module: str
    rows: tuple[int, int]
    down: torch.Tensor  # [r, K]
    up: torch.Tensor  # [rows, r]
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclass
class LoraTruth:
    parts: list[LoraPart]
    diffs: dict[str, torch.Tensor] = field(default_factory=dict)  # "module.weight|bias" -> full delta
    alpha_keys: bool = True

    def tensors(self) -> set[str]:
        """Names of the model tensors this LoRA changes (``module.weight`` / ``module.bias``)."""
        return {p.module + ".weight" for p in self.parts} | set(self.diffs)

    def modules(self) -> set[str]:
        return {p.module for p in self.parts}

    def delta(self, tname: str, shape) -> torch.Tensor:
        """The float64 update of one tensor at strength 1 (for side-path references)."""
        d = torch.zeros(shape, dtype=torch.float64)
        for p in sorted(self._parts(tname), key=lambda p: p.rows):
            d[p.rows[0]:p.rows[1]] += (p.up.double() @ p.down.double()) * (p.alpha / p.rank)
        if tname in self.diffs:
            d += self.diffs[tname].double()
        return d

    def _parts(self, tname: str) -> list[LoraPart]:
        return [p for p in self.parts if p.module + ".weight" == tname]


def expected_merge(w0: torch.Tensor, stack: list[tuple[LoraTruth, float]], tname: str) -> torch.Tensor:
    """The merge contract evaluated from ground truths: fp32(W0 + sum over the stack, in order, of
    s * (alpha / r) * up @ down per part (by rows), then s * diff), in float64."""
    acc = w0.double().clone()
    for truth, s in stack:
        for p in sorted(truth._parts(tname), key=lambda p: p.rows):
            acc[p.rows[0]:p.rows[1]] += (p.up.double() @ p.down.double()) * (s * (p.alpha / p.rank))
        if tname in truth.diffs:
            acc += truth.diffs[tname].double() * s
    return acc.float()


def _rand(g, shape, std, dtype):
    return (torch.randn(shape, generator=g) * std).to(dtype)


def tiny_lora_truth(cfg: H3Config = TINY, seed: int = 0, rank: int = 4, alpha: float | None = 2.0,
                    dtype: torch.dtype = torch.bfloat16, blocks: bool = True, refiner: bool = True,
                    adaln: bool = True, extras: bool = True, diffs: bool = False,
                    modules: tuple[str, ...] | None = None) -> LoraTruth:
    """Random updates for ``cfg``: every block linear (qkv as three q/k/v parts), the refiner linears (qkv as
    one dense part), block and final AdaLN linears, condition_proj; ``diffs`` adds a norm ``.diff`` and an
    AdaLN ``.diff_b``; ``modules`` keeps only those modules. alpha None: no alpha in the file (alpha = rank).
    Values: down ~ N(0, 1/K), up ~ N(0, 0.25/r), stored in ``dtype`` (never zero)."""
    g = torch.Generator().manual_seed(int(seed))
    h, inner, f, t = cfg.hidden_size, cfg.inner_dim, cfg.ffn_hidden_size, cfg.time_embed_dim
    parts: list[LoraPart] = []

    def add(module, out, k, rows=None):
        if modules is not None and module not in modules:
            return
        a = float(rank) if alpha is None else float(alpha)
        rows = rows or (0, out)
        parts.append(LoraPart(module, rows, _rand(g, (rank, k), k ** -0.5, dtype),
                              _rand(g, (rows[1] - rows[0], rank), 0.5 * rank ** -0.5, dtype), a))

    if blocks:
        for i in range(cfg.num_layers):
            for j in range(3):
                add(f"blocks.{i}.attn.qkv_proj", 3 * inner, h, (j * inner, (j + 1) * inner))
            add(f"blocks.{i}.attn.out_proj", h, inner)
            add(f"blocks.{i}.mlp.fc1", 2 * f, h)
            add(f"blocks.{i}.mlp.fc2", h, f)
            if adaln:
                add(f"blocks.{i}.adaln_proj.linear", 18 * h, t)
    if refiner:
        for i in range(cfg.num_refiner_layers):
            add(f"token_refiner.blocks.{i}.attn.qkv_proj", 3 * inner, h)
            add(f"token_refiner.blocks.{i}.attn.out_proj", h, inner)
            add(f"token_refiner.blocks.{i}.mlp.fc1", 2 * f, h)
            add(f"token_refiner.blocks.{i}.mlp.fc2", h, f)
    if adaln:
        add("final_layer.adaln_proj.linear", 2 * h, t)
    if extras:
        add("condition_proj", h, cfg.text_dim)
    truth = LoraTruth(parts, alpha_keys=alpha is not None)
    if diffs:
        truth.diffs["blocks.0.norm1.weight"] = _rand(g, (h,), 0.05, dtype)
        if cfg.num_layers > 1:
            truth.diffs["blocks.1.adaln_proj.linear.bias"] = _rand(g, (18 * h,), 0.02, dtype)
    return truth


# ---------------------------------------------------------------------------------------------
# writing one form
# ---------------------------------------------------------------------------------------------

def _diffusers_name(module: str) -> str:
    for c, d in (("token_refiner.blocks.", "token_refiner.refiner_blocks."), ("blocks.", "transformer_blocks.")):
        if module.startswith(c):
            head, rest = module[len(c):].split(".", 1)
            rest = {"attn.out_proj": "attn.to_out.0", "mlp.fc2": "ff.net.2",
                    "mlp.fc1": "ff.net.0.proj"}.get(rest, rest)
            return f"{d}{head}.{rest}"
    top = {"final_layer.adaln_proj.linear": "norm_out.linear", "condition_proj": "context_embedder"}
    return top.get(module, module)


def _fused(parts: list[LoraPart]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Parts of one module -> one (down, up, alpha) over all its rows: concatenated A, block-diagonal B."""
    if len(parts) == 1 and parts[0].rows[0] == 0:
        p = parts[0]
        return p.down, p.up, p.alpha
    ranks, scales = {p.rank for p in parts}, {p.alpha / p.rank for p in parts}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError("fusing parts needs one rank and one alpha/rank")
    n_rows = max(p.rows[1] for p in parts)
    down = torch.cat([p.down for p in parts])
    up = torch.zeros(n_rows, down.shape[0], dtype=parts[0].up.dtype)
    c = 0
    for p in parts:
        up[p.rows[0]:p.rows[1], c:c + p.rank] = p.up
        c += p.rank
    return down, up, parts[0].alpha * len(parts)


def _split_rows(module: str, parts: list[LoraPart], n_out: int) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """Parts of one module -> diffusers (name, down, up, alpha) entries: qkv_proj as to_q/to_k/to_v (a dense
    update becomes three entries sharing A), fc1 with the halves swapped."""
    d = _diffusers_name(module)
    if module.endswith("attn.qkv_proj"):
        third = n_out // 3
        out = []
        for j, q in enumerate("qkv"):
            lo, hi = j * third, (j + 1) * third
            for p in parts:
                if p.rows == (lo, hi):
                    out.append((d.replace("qkv_proj", f"to_{q}"), p.down, p.up, p.alpha))
                elif p.rows[0] <= lo and hi <= p.rows[1]:
                    out.append((d.replace("qkv_proj", f"to_{q}"), p.down, p.up[lo - p.rows[0]:hi - p.rows[0]], p.alpha))
        return out
    down, up, alpha = _fused(parts)
    if module.endswith("mlp.fc1"):
        half = up.shape[0] // 2
        up = torch.cat([up[half:], up[:half]])  # ComfyUI [gate; up] -> diffusers [up; gate]
    return [(d, down, up, alpha)]


def lora_state_dict(truth: LoraTruth, form: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of ``truth`` in ``form``."""
    if form not in FORMS:
        raise ValueError(f"form {form!r}: expected one of {FORMS}")
    by_module: dict[str, list[LoraPart]] = {}
    for p in truth.parts:
        by_module.setdefault(p.module, []).append(p)
    sd: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for module, parts in by_module.items():
        parts = sorted(parts, key=lambda p: p.rows)
        n_out = max(p.rows[1] for p in parts)
        if form in ("comfy", "diffusion_model", "lora_unet"):
            down, up, alpha = _fused(parts)
            entries = [(module, down, up, alpha)]
        else:
            entries = _split_rows(module, parts, n_out)
        for name, down, up, alpha in entries:
            a_t = torch.tensor(alpha, dtype=torch.float32)
            if form == "comfy":
                sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = down, up
                key_alpha = f"{name}.alpha"
            elif form == "diffusion_model":
                sd[f"diffusion_model.{name}.lora_down.weight"], sd[f"diffusion_model.{name}.lora_up.weight"] = down, up
                key_alpha = f"diffusion_model.{name}.alpha"
            elif form == "lora_unet":
                base = "lora_unet_" + name.replace(".", "_")
                sd[f"{base}.lora_down.weight"], sd[f"{base}.lora_up.weight"] = down, up
                key_alpha = f"{base}.alpha"
            elif form == "diffusers":
                sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = down, up
                key_alpha = f"{name}.alpha"
            else:  # peft
                sd[f"transformer.{name}.lora_A.default.weight"] = down
                sd[f"transformer.{name}.lora_B.default.weight"] = up
                key_alpha = None
                meta["lora_adapter_metadata"] = json.dumps({"transformer.lora_alpha": alpha,
                                                            "transformer.r": int(down.shape[0])})
            if truth.alpha_keys and key_alpha is not None:
                sd[key_alpha] = a_t
    if form == "peft" and not truth.alpha_keys:
        meta.pop("lora_adapter_metadata", None)
    for tname, d in truth.diffs.items():
        if form != "comfy":
            raise ValueError("diffs are written in the comfy form only")
        module, pname = tname.rsplit(".", 1)
        sd[f"{module}.{'diff' if pname == 'weight' else 'diff_b'}"] = d
    if form == "peft":
        alphas = {p.alpha / p.rank for p in truth.parts}
        if len(alphas) > 1:
            raise ValueError("the peft form stores one alpha for all modules")
    return {k: v.clone().contiguous() for k, v in sd.items()}, meta


def save_tiny_lora(path: str | Path, truth: LoraTruth, form: str) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd, meta = lora_state_dict(truth, form)
    save_file(dict(sorted(sd.items())), str(path), metadata=meta or None)
    return path
