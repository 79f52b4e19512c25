"""What MODEL patch nodes record on core's ModelPatcher, read for the H3 MODEL (``core_model``).

- **LoRAs** (``LoraLoaderModelOnly``, ``LoraLoader``): core records ``model.patches[key] = [(strength_patch, adapter,
  strength_model, offset, function), ...]`` per weight name (``diffusion_model.blocks.3.attn.qkv_proj.weight``),
  meaning to merge them into its own weights when the model loads. The H3 MODEL has no weights in core's format:
  ``lora_specs`` turns the records into LoRA files of this pack's key forms (the LoRA factors as core read them,
  written once per distinct set to a temporary folder) that the runtime's LoRA machinery applies (merge into the
  resident weights, NVFP4 re-quantized, or the side path; the FC2 guard sees side paths). The n-th record of every
  weight with the same strength forms one LoRA (chained loader nodes stack in order). Low-rank (``LoRAAdapter``)
  and full ``diff`` records are taken; anything else (LoHa, LoKr, OFT, DoRA, offsets, weight functions, model
  merges, ``strength_model != 1``) is refused by name.
- **Core's Fun ControlNet** (``MiniMaxH3FunControlNetApply``): it records a diffusion-model wrapper of a
  ``MiniMaxH3FunControlPatch`` and one ``MiniMaxH3FunControlBlockPatch`` per injection layer in
  ``patches_replace["dit"][("double_block", L)]``. ``fun_control_patch`` recognises exactly that and hands the
  patch to the H3 MODEL, which runs core's tower weights as this pack's tower (``core_model``); core's wrapper
  still runs around the call (it prepares core's own hint latent), and the block patches, which only core's
  model code calls, are not called. Two Fun ControlNets on one MODEL, or a Fun block patch chained onto
  another pack's, are refused.
- **Core's Model Sparse Attention** (``BlockSparseAttention``): it records an ``optimized_attention_override``
  closure over its ``SparseAttnPatch`` (tau, topk_ratio, vsa, the sigma window frozen at apply, min_tokens,
  dense_blocks, sink_conditioning, extra_tokens) and, on an H3 diffusion model, one block patch per block.
  ``core_sparse_patch`` recognises exactly that; its settings (``core_sparse_settings``) become the run's sparse
  settings in this pack's runtime (the closures, which only core's model code calls, are not called: the
  node is neither ignored nor applied twice). Applied before core's Fun ControlNet, the two compose (the Fun
  block patch chains the sparse one; the tower stays dense); applied after it, core's mainline node replaces the
  Fun block patches and core would drop the control silently: refused, saying to apply it first.
- **Refusals**: a patch that would change what the network computes and that the runtime cannot honour
  (``patches_replace`` entries, ``patches``, an attention override, a diffusion-model wrapper, object patches
  other than ``model_sampling``, weight hooks, a ControlNet) raises ONE H3NodeError naming the entry, where it
  comes from and what to use instead. Nothing is silently ignored.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch

from ..runtime import SparseSettings
from ._common import node_error, optional_comfy_module

TITLE = "H3 MODEL"
LORA_MODE = "merge"  # core merges LoRAs into its weights; the runtime merges too (NVFP4 layers re-quantized)
PREFIX = "diffusion_model."

# object patches core's own H3 nodes make and the runtime follows (MiniMaxH3SigmaShift patches model_sampling)
ALLOWED_OBJECT_PATCHES = ("model_sampling",)

_files: dict = {}  # content signature -> (temporary LoRA file, the records it came from: keeps their ids unique)
_MAX_FILES = 16
_tmp: dict = {"dir": None}


def _refuse(what: str, todo: str):
    raise node_error(TITLE, f"{what} cannot run on the H3 MODEL from H3 NVFP4 Model Loader (this pack's fast "
                            f"stack has no such hook), and it is never dropped silently. {todo}")


_CORE_ROUTE = ("Load the same checkpoint with core's UNETLoader for that graph, or remove the node that adds it "
               "before the sampler")


FUN_PATCH, FUN_BLOCK = "MiniMaxH3FunControlPatch", "MiniMaxH3FunControlBlockPatch"  # core's class names
SPARSE_PATCH, SPARSE_NODE = "SparseAttnPatch", "Model Sparse Attention (BlockSparseAttention)"


def _closure_value(fn, name: str):
    """The value the closure ``fn`` holds under the free variable ``name``, or None."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for var, cell in zip(getattr(code, "co_freevars", ()), cells):
        if var == name:
            try:
                return cell.cell_contents
            except ValueError:
                return None
    return None


def _sparse_owner(fn):
    """The SparseAttnPatch a core sparse closure (its attention override or an H3 block patch) was made for."""
    patch = _closure_value(fn, "patch")
    return patch if type(patch).__name__ == SPARSE_PATCH else None


def core_sparse_patch(options: dict):
    """Core's Model Sparse Attention recorded in ``transformer_options`` -> its SparseAttnPatch, or None. Refuses
    an override it put on top of another pack's (core would fall back to that one on dense calls)."""
    options = options or {}
    override = options.get("optimized_attention_override")
    patch = _sparse_owner(override) if override is not None else None
    dit = (options.get("patches_replace") or {}).get("dit") or {}
    for entry in dit.values():
        owner = _sparse_owner(entry) or _sparse_owner(getattr(entry, "previous", None))
        if owner is not None and patch is None:
            patch = owner
        if owner is not None and owner is not patch:
            _refuse(f"two {SPARSE_NODE} nodes on one MODEL", "Apply one Model Sparse Attention node.")
    if patch is not None and _closure_value(override, "previous") is not None:
        _refuse(f"{SPARSE_NODE} on top of another attention override", "Remove the other attention node.")
    return patch


def core_sparse_settings(options: dict):
    """The runtime's SparseSettings of core's Model Sparse Attention in ``options`` (its values as the node froze
    them: the sigma window, VSA's extra_tokens 0), or None."""
    p = core_sparse_patch(options)
    if p is None:
        return None
    method = "vsa" if p.vsa else ("sla" if p.topk_ratio > 0 else "sol-attn")
    keep = float(p.topk_ratio) * 100.0 if p.topk_ratio > 0 else SparseSettings.keep_percent
    try:
        return SparseSettings(method, float(p.tau), keep, dense_blocks=tuple(sorted(int(b) for b in p.dense_blocks)),
                              min_tokens=int(p.min_tokens), extra_tokens=int(p.extra_tokens),
                              sinks=str(p.sink_conditioning), sigma_start=float(p.sigma_start),
                              sigma_end=float(p.sigma_end)).check()
    except ValueError as e:
        raise node_error(TITLE, f"{SPARSE_NODE}: {e}") from e


def _is_sparse_entry(group, entry, patch) -> bool:
    return patch is not None and group == "dit" and _sparse_owner(entry) is patch


def _fun_owner(fn):
    """The MiniMaxH3FunControlPatch a wrapper function is a bound method of, or None."""
    owner = getattr(fn, "__self__", None)
    return owner if type(owner).__name__ == FUN_PATCH else None


def fun_control_patch(options: dict):
    """Core's Fun ControlNet recorded in ``transformer_options`` (module docstring) -> its
    ``MiniMaxH3FunControlPatch`` (the tower ``model_patch.model``, the VAE, control video, mask, source video,
    strength, sigma window and fades), or None. Refuses two of them, and block patches that do not match the
    tower's injection layers or chain onto another patch."""
    options = options or {}
    wrappers = (options.get("wrappers") or {}).get("diffusion_model") or {}
    owners = {id(o): o for fns in wrappers.values() for o in map(_fun_owner, fns or ()) if o is not None}
    if not owners:
        return None
    if len(owners) > 1:
        _refuse(f"{len(owners)} Fun ControlNets (MiniMaxH3FunControlNetApply applied more than once)",
                "Apply one Fun ControlNet to the H3 MODEL (the pack runs one tower per sampling run), or use core's "
                "UNETLoader model for stacked controls.")
    patch = next(iter(owners.values()))
    layers = tuple(int(x) for x in patch.model_patch.model.injection_layers)
    dit = (options.get("patches_replace") or {}).get("dit") or {}
    for layer in layers:
        entry = dit.get(("double_block", layer))
        if _sparse_owner(entry) is not None:
            _refuse(f"{SPARSE_NODE} was applied after MiniMaxH3FunControlNetApply: core's sparse node replaces the "
                    f"Fun ControlNet's block patches (block {layer}), so the control would be dropped silently",
                    "Apply Model Sparse Attention before the Fun ControlNet (the control tower runs dense either way).")
        if type(entry).__name__ != FUN_BLOCK or entry.control_patch is not patch:
            _refuse(f"the Fun ControlNet's block {layer} has no matching patches_replace['dit'][('double_block', "
                    f"{layer})] entry (found {type(entry).__name__})", _CORE_ROUTE + ".")
        if entry.previous is not None and _sparse_owner(entry.previous) is None:
            _refuse(f"the Fun ControlNet's block {layer} patch chains onto another block patch "
                    f"({type(entry.previous).__name__})", _CORE_ROUTE + ".")
    return patch


def _is_fun_entry(group, entry, patch) -> bool:
    return (patch is not None and group == "dit" and type(entry).__name__ == FUN_BLOCK
            and getattr(entry, "control_patch", None) is patch)


def check_transformer_options(options: dict):
    """Refuse what in ``transformer_options`` (as core hands it to the diffusion model) would change the
    network and cannot be honoured. Keys core itself sets per call (sigmas, sample_sigmas, shifts, uuids, ...)
    and callbacks pass, and so does core's Fun ControlNet, which the H3 MODEL runs: returns its patch
    (``fun_control_patch``), or None."""
    options = options or {}
    fun = fun_control_patch(options)
    sparse = core_sparse_patch(options)
    replace = options.get("patches_replace") or {}
    for group, entries in replace.items():
        for key, entry in (entries or {}).items():
            if _is_fun_entry(group, entry, fun) or _is_sparse_entry(group, entry, sparse):
                continue
            _refuse(f"a block replacement patches_replace[{group!r}][{key!r}] (added by a MODEL patch node such as "
                    "another pack's block patch)", _CORE_ROUTE + ".")
    for name, fns in (options.get("patches") or {}).items():
        if fns:
            _refuse(f"a model patch patches[{name!r}] (added by a MODEL patch node, e.g. an attention or block "
                    "patch)", _CORE_ROUTE + ".")
    if options.get("optimized_attention_override") is not None and sparse is None:
        _refuse("an attention override (optimized_attention_override, set by an attention node of another pack)",
                "The loader's attention widget picks this pack's attention backends (sage2, sdpa, sparse, ...); "
                "remove the override node, or use core's UNETLoader for it.")
    wrappers = (options.get("wrappers") or {}).get("diffusion_model") or {}
    for key, fns in wrappers.items():
        fns = [f for f in (fns or ()) if _fun_owner(f) is None]
        if fns:
            _refuse(f"a diffusion-model wrapper ({key or 'unnamed'}: {_names(fns)}; e.g. EasyCache or another "
                    "pack's cache)",
                    "Use the loader's first_block_cache / attention=sparse for speed, or core's UNETLoader for that "
                    "node.")
    return fun


def _names(fns) -> str:
    return ", ".join(getattr(f, "__qualname__", type(f).__name__) for f in fns)


def check_patcher(patcher):
    """Refuse object patches and weight hooks recorded on the ModelPatcher (LoRA patches are read by
    ``lora_specs``, transformer options by ``check_transformer_options``) -> core's Fun ControlNet patch of the
    run, or None."""
    for name in getattr(patcher, "object_patches", {}) or {}:
        if name not in ALLOWED_OBJECT_PATCHES:
            _refuse(f"an object patch of {name!r} (ModelPatcher.add_object_patch, from a MODEL patch node)",
                    _CORE_ROUTE + ".")
    if getattr(patcher, "hook_patches", None):
        _refuse("weight hooks (CreateHookLora / hooks on the conditioning)",
                "Use LoraLoaderModelOnly on the MODEL instead, or core's UNETLoader for hooks.")
    for k, fn in (getattr(patcher, "weight_wrapper_patches", {}) or {}).items():
        if fn:
            _refuse(f"a weight wrapper on {k!r} (ModelPatcher.add_weight_wrapper)", _CORE_ROUTE + ".")
    return check_transformer_options(patcher_transformer_options(patcher))


def patcher_transformer_options(patcher) -> dict:
    """The transformer options a sampling run with ``patcher`` hands the model: its ``model_options``' with the
    patcher's own wrapper table merged in (``ModelPatcher.add_wrapper_with_key`` keeps wrappers there)."""
    to = dict((getattr(patcher, "model_options", {}) or {}).get("transformer_options", {}) or {})
    merged = {k: {kk: list(vv or ()) for kk, vv in (v or {}).items()} for k, v in (to.get("wrappers") or {}).items()}
    for kind, keyed in (getattr(patcher, "wrappers", None) or {}).items():
        for key, fns in (keyed or {}).items():
            merged.setdefault(kind, {}).setdefault(key, []).extend(fns or ())
    if merged:
        to["wrappers"] = merged
    return to


def fun_patch_models(options: dict) -> list:
    """The ``model_patch`` objects of core's Fun ControlNet block patches in ``options`` (what core would load onto
    the device beside the model; the H3 MODEL runs its own copy of the tower instead)."""
    out = []
    for entries in (options.get("patches_replace") or {}).values():
        for entry in (entries or {}).values():
            if type(entry).__name__ == FUN_BLOCK:
                mp = getattr(getattr(entry, "control_patch", None), "model_patch", None)
                if mp is not None and all(mp is not m for m in out):
                    out.append(mp)
    return out


# ---------------------------------------------------------------------------------------------
# LoRA records -> LoRA files of this pack's key forms
# ---------------------------------------------------------------------------------------------

def _lora_adapter_class():
    mod = optional_comfy_module("comfy.weight_adapter")
    return getattr(mod, "LoRAAdapter", None) if mod is not None else None


def _entry_tensors(key: str, entry, lora_cls) -> dict[str, torch.Tensor]:
    """One record of ``model.patches[key]`` -> its tensors under this pack's key forms (module + suffix)."""
    strength, adapter, strength_model, offset, function = (tuple(entry) + (None,) * 5)[:5]
    if not key.startswith(PREFIX) or not key.endswith((".weight", ".bias")):
        _refuse(f"a patch of {key!r} (core patches weights named diffusion_model.<module>.weight/.bias)",
                "Remove the node that adds it.")
    module, param = key[len(PREFIX):].rsplit(".", 1)
    where = f"the patch of {key} (strength {strength})"
    if strength_model not in (None, 1.0):
        _refuse(f"{where} scales the model weight by strength_model={strength_model} (a model merge)",
                "Merge checkpoints offline, or use core's UNETLoader for merges.")
    if offset is not None:
        _refuse(f"{where} updates a slice {offset} of the weight", "Convert the LoRA to whole-module keys "
                "(ComfyUI names such as blocks.N.attn.qkv_proj) or use H3 LoRA on the H3_MODEL output.")
    if function is not None:
        _refuse(f"{where} carries a weight function", _CORE_ROUTE + ".")
    if lora_cls is not None and isinstance(adapter, lora_cls):
        up, down, alpha, mid, dora, reshape = (tuple(adapter.weights) + (None,) * 6)[:6]
        if mid is not None or dora is not None or reshape is not None:
            kind = "DoRA" if dora is not None else ("a LoCon mid weight" if mid is not None else "a reshape")
            _refuse(f"{where} is a LoRA with {kind}", "Use a plain low-rank LoRA (lora_up/lora_down).")
        if param != "weight":
            _refuse(f"{where} is a low-rank update of a bias", "Use a LoRA whose bias updates are .diff_b tensors.")
        out = {f"{module}.lora_up.weight": up, f"{module}.lora_down.weight": down}
        if alpha is not None:
            out[f"{module}.alpha"] = torch.tensor(float(alpha))
        return out
    if isinstance(adapter, tuple) and (len(adapter) == 1 or (len(adapter) == 2 and adapter[0] == "diff")):
        diff = adapter[0] if len(adapter) == 1 else adapter[1][0]
        if isinstance(diff, torch.Tensor):
            return {f"{module}.{'diff' if param == 'weight' else 'diff_b'}": diff}
    kind = getattr(adapter, "name", None) or (adapter[0] if isinstance(adapter, tuple) and adapter
                                              and isinstance(adapter[0], str) else type(adapter).__name__)
    _refuse(f"{where} is of kind {kind!r} (LoHa / LoKr / OFT / GLoRA adapters, 'set' patches and model merges "
            "have no form in this pack's LoRA machinery, which takes low-rank LoRAs and full diffs)",
            "Convert the adapter to a plain LoRA, or use core's UNETLoader for it.")


def _tmp_dir() -> str:
    """The folder of this process's LoRA files: in ComfyUI's temp folder where ComfyUI runs (main.py empties it at
    every start and exit, so a server killed before its atexit handlers leaves nothing behind for long), else in
    the system's; removed at exit either way."""
    if _tmp["dir"] is None:
        fp = optional_comfy_module("folder_paths")
        base = getattr(fp, "get_temp_directory", lambda: None)()
        if base:
            os.makedirs(base, exist_ok=True)
        _tmp["dir"] = tempfile.mkdtemp(prefix="h3b-core-loras-", dir=base or None)
        atexit.register(shutil.rmtree, _tmp["dir"], True)
    return _tmp["dir"]


def lora_specs(patches: dict, mode: str = LORA_MODE) -> list[tuple[str, float, str]]:
    """``ModelPatcher.patches`` -> the runtime's LoRA stack ``[(file, strength, mode)]``: one file per stack
    position and strength (the n-th record of each weight), written once per distinct content and reused (the
    runtime then sees the same stack and does nothing). Raises H3NodeError for a record it cannot take."""
    if not patches:
        return []
    from safetensors.torch import save_file

    lora_cls = _lora_adapter_class()
    groups: dict[tuple[int, float], dict] = {}
    ident: dict[tuple[int, float], list] = {}  # (weight key, the record's adapter object) per LoRA
    keep: dict[tuple[int, float], list] = {}
    for key in sorted(patches):
        for j, entry in enumerate(patches[key]):
            strength = float(entry[0])
            tensors = _entry_tensors(key, entry, lora_cls)
            groups.setdefault((j, strength), {}).update(tensors)
            ident.setdefault((j, strength), []).append((key, id(entry[1])))
            keep.setdefault((j, strength), []).append(entry[1])
    specs = []
    for g in sorted(groups):
        sig = (g, tuple(ident[g]))  # core's records are immutable: the same objects hold the same LoRA
        hit = _files.get(sig)
        if hit is None:
            if len(_files) >= _MAX_FILES:
                old, _ = _files.pop(next(iter(_files)))
                os.remove(old)
            _tmp["count"] = _tmp.get("count", 0) + 1
            path = os.path.join(_tmp_dir(), f"core-lora-{_tmp['count']}-x{g[1]:g}.safetensors")
            save_file({k: t.detach().to("cpu").contiguous() for k, t in groups[g].items()}, path)
            hit = _files[sig] = (path, keep[g])  # held, so their ids stay theirs while cached
        specs.append((hit[0], g[1], mode))
    return specs
