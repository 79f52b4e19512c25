"""PDD head banks delivered inside a LoRA file, as third-party converters write them for ComfyUI.

Keys (any of the LoRA prefixes: bare, ``diffusion_model.``, ``model.diffusion_model.``, ``transformer.``)::

    final_layer.video_out.set_weight  [n * C * 4, hidden]   final_layer.video_out.set_bias  [n * C * 4]
    final_layer.audio_out.set_weight  [n * Ca, hidden]      final_layer.audio_out.set_bias  [n * Ca]

plus, optionally, the metadata ``pdd_num_steps`` (= n) and any ordinary LoRA tensors of the trunk. Block 0 of a
bank is a full head, blocks 1..n-1 are deltas from it (``runtime.model.h3.pdd_head_weights``); the sampler blends
them per step along its schedule exactly as for a checkpoint that carries the bank (core's ``FinalLayer``).

Applying the LoRA replaces both output heads with the bank (a "set": strength 0 leaves the model alone, any other
strength installs the bank as it is, as ComfyUI's set patches ignore the strength) and sets the model's
``head_bank`` to n; a bank without ``set_bias`` keeps the head's bias for block 0 and zero deltas. Removing the
LoRA puts the original heads and config back. One bank per stack; a stack that also merges into the heads is
refused (the bank would overwrite the merge).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from .key_forms import LoraError, LoraFile

HEAD_KEY = re.compile(r"^(?:model\.diffusion_model\.|diffusion_model\.|transformer\.)?"
                      r"final_layer\.(video_out|audio_out)\.(set_weight|set_bias)$")


@dataclass
class PddBank:
    """A bank read from a LoRA file: n heads; weights / biases fp32 in ComfyUI layout (None: bias not given)."""

    file: str
    n: int
    video_weight: torch.Tensor
    audio_weight: torch.Tensor
    video_bias: torch.Tensor | None
    audio_bias: torch.Tensor | None
    keys: tuple[str, ...]
    num_steps_metadata: int | None = None

    def report(self) -> dict:
        return {"file": self.file, "heads": self.n, "pdd_num_steps": self.num_steps_metadata, "keys": list(self.keys),
                "bias": "set_bias" if self.video_bias is not None else "the head's own, zero deltas"}


def split_bank(lf: LoraFile, cfg) -> tuple[PddBank | None, LoraFile]:
    """(the file's PDD bank or None, the file without the bank's tensors). Validates the bank against ``cfg``
    (hidden width, patch and audio channels, one n for both heads, ``pdd_num_steps``); LoraError otherwise."""
    parts = {}
    for k, t in lf.tensors.items():
        m = HEAD_KEY.match(k)
        if m:
            parts[(m[1], m[2])] = (k, t)
    if not parts:
        return None, lf
    name = lf.name
    for head in ("video_out", "audio_out"):
        if (head, "set_weight") not in parts:
            raise LoraError(f"{name}: a PDD head bank needs final_layer.video_out.set_weight and "
                            f"final_layer.audio_out.set_weight; {head}.set_weight is missing")
    rows = {"video_out": cfg.video_patch_dim, "audio_out": cfg.audio_channels}
    ns = {}
    for head, per in rows.items():
        k, w = parts[(head, "set_weight")]
        if w.dim() != 2 or w.shape[1] != cfg.hidden_size or w.shape[0] % per or w.shape[0] // per < 2:
            raise LoraError(f"{name}: {k} is {list(w.shape)}; a bank of n >= 2 heads for this model is "
                            f"[n * {per}, {cfg.hidden_size}]")
        ns[head] = w.shape[0] // per
        if (head, "set_bias") in parts:
            kb, b = parts[(head, "set_bias")]
            if tuple(b.shape) != (w.shape[0],):
                raise LoraError(f"{name}: {kb} is {list(b.shape)}; expected [{w.shape[0]}] (one per bank row)")
    if ns["video_out"] != ns["audio_out"]:
        raise LoraError(f"{name}: the video bank has {ns['video_out']} heads, the audio bank {ns['audio_out']}; "
                        "both heads share one schedule of n intervals")
    n = ns["video_out"]
    meta_n = lf.metadata.get("pdd_num_steps")
    if meta_n is not None:
        try:
            meta_n = int(meta_n)
        except ValueError:
            raise LoraError(f"{name}: metadata pdd_num_steps is {lf.metadata['pdd_num_steps']!r}; expected an "
                            "integer") from None
        if meta_n != n:
            raise LoraError(f"{name}: metadata pdd_num_steps is {meta_n} but the banks hold {n} heads")

    def get(head, what):
        kt = parts.get((head, what))
        return None if kt is None else kt[1].float()

    bank = PddBank(lf.path, n, get("video_out", "set_weight"), get("audio_out", "set_weight"),
                   get("video_out", "set_bias"), get("audio_out", "set_bias"),
                   tuple(sorted(k for k, _ in parts.values())), meta_n)
    if bank.video_bias is None or bank.audio_bias is None:
        if (bank.video_bias is None) != (bank.audio_bias is None):
            raise LoraError(f"{name}: set_bias is given for one head only; give both or neither")
    rest = {k: t for k, t in lf.tensors.items() if not HEAD_KEY.match(k)}
    return bank, LoraFile(lf.path, rest, lf.metadata)


@dataclass
class BankOriginal:
    """What installing a bank replaced: the two head modules and the model's (and load plan's) config."""

    video_out: nn.Module
    audio_out: nn.Module
    model_cfg: object
    plan_cfg: object | None


def _bank_head(orig: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> nn.Linear:
    out = weight.shape[0]
    head = nn.Linear(weight.shape[1], out, bias=True, dtype=torch.float32, device=orig.weight.device)
    head.requires_grad_(False)
    head.weight.copy_(weight.to(head.weight.device))
    if bias is None:  # block 0: the head's own bias; blocks 1.. are deltas: zero
        per = out // n
        ob = orig.bias.detach().float().to(head.bias.device)
        base = ob[:per] if ob.numel() >= per else ob
        bias = torch.cat([base, torch.zeros(out - per, device=head.bias.device)])
    head.bias.copy_(bias.to(head.bias.device))
    return head


def install_bank(rt, bank: PddBank) -> BankOriginal:
    """Replace the model's heads with ``bank`` (module docstring); returns what restores them."""
    model = rt.model
    fl = model.final_layer
    plan = getattr(rt, "plan", None)
    orig = BankOriginal(fl.video_out, fl.audio_out, model.cfg, getattr(plan, "config", None))
    fl.video_out = _bank_head(orig.video_out, bank.video_weight, bank.video_bias, bank.n)
    fl.audio_out = _bank_head(orig.audio_out, bank.audio_weight, bank.audio_bias, bank.n)
    model.cfg = replace(model.cfg, head_bank=bank.n)
    if plan is not None and getattr(plan, "config", None) is not None:
        plan.config = replace(plan.config, head_bank=bank.n)
    return orig


def restore_bank(rt, orig: BankOriginal) -> None:
    """Put back the heads and config ``install_bank`` replaced."""
    model = rt.model
    model.final_layer.video_out, model.final_layer.audio_out = orig.video_out, orig.audio_out
    model.cfg = orig.model_cfg
    plan = getattr(rt, "plan", None)
    if plan is not None and orig.plan_cfg is not None:
        plan.config = orig.plan_cfg
