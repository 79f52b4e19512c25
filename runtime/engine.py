"""load_model: plan, stream, bind. A resident H3 model with its BlockOps, ready for ``sample``.

1. ``plan.make_plan``: every backend choice from the device, the options and the checkpoint header (no
   tensor read yet); printed by the callers and copied into every report.
2. ``io.load.stream_load``: one pass over the tensors into a model built on the meta device; block
   linears become NVFP4 as they arrive.
3. FC2's guarded dispatcher is prepared (its extension built) only where the plan says FC2 takes NVFP4 bytes,
   then ``ops.block.build_ops`` binds the block operations the plan chose.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import H3Error
from .io.load import StateDictSource, stream_load
from .model.config import H3Config
from .model.h3 import H3Model
from .model.tiny import tiny_state_dict
from .ops import fp8_producers, quant_kernels
from .ops.attention import bind_attention
from .ops.block import build_ops
from .ops.sparse_attention import SparseStepAttention, bind_sparse
from .options import RuntimeOptions
from .plan import LoadPlan, make_plan


@dataclass
class H3Runtime:
    """A loaded model that stays resident across runs.

    plan: the LoadPlan it was loaded with; ops: the BlockOps every evaluation runs; backends: {op: {"choice",
    "reason"}} (the plan's choices plus what prepare found), copied into every report.
    """

    model: H3Model
    plan: LoadPlan
    ops: object
    backends: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    fc2: object | None = None  # the guarded FC2 dispatcher, where FC2 takes NVFP4 bytes on CUDA
    sparse: SparseStepAttention | None = None  # the sparse attention bound in ops (attention=sparse): the sampler
    #                                            sets its per-run routing and per-step schedule switch

    @property
    def config(self) -> H3Config:
        return self.plan.config

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def options(self) -> RuntimeOptions:
        return self.plan.options

    @property
    def source(self) -> str:
        return self.plan.source

    @source.setter
    def source(self, value: str) -> None:  # where LoRA merges read source weights from (runtime.lora)
        self.plan.source = value

    def describe(self) -> str:
        lines = self.plan.describe().splitlines()
        extra = {k: v for k, v in self.backends.items() if k not in self.plan.report()}
        lines += [f"  {op:<12} {b['choice']:<14} {b['reason']}" for op, b in extra.items()]
        return "\n".join(lines)


def apply_tile_table(path: str | Path) -> dict:
    """Install the producer tile table at ``path`` (written by bench/producers_h200.py --tiles-out) ->
    {"choice", "reason"}. Tiles change speed only. A missing or malformed file raises H3Error naming it."""
    try:
        table = json.loads(Path(path).read_text())
        if not isinstance(table, dict):
            raise ValueError(f"expected a JSON object, found {type(table).__name__}")
        installed = fp8_producers.set_tile_table(table)
        fp8 = quant_kernels.set_fp8_tiles(table.get("to_fp8_rowwise"))
    except (OSError, ValueError) as e:
        raise H3Error(f"producer tile table {path}: {e}; write one with bench/producers_h200.py --tiles-out, "
                      "or unset H3_PRODUCER_TILES for the built-in tiles") from e
    if fp8:
        installed["to_fp8_rowwise"] = list(fp8)
    return {"choice": str(path), "reason": f"measured on {table.get('device', '?')}: {installed}"}


def _prepare_fc2(plan: LoadPlan) -> tuple[object | None, dict | None]:
    """The guarded FC2 dispatcher, prepared before any capture, only where the plan applies it."""
    if not plan.fc2_lt:
        return None, None
    from .fc2.dispatcher import Fc2Dispatcher  # builds/loads the C++ extension: only where FC2 applies

    fc2 = Fc2Dispatcher(plan.options)
    prep = fc2.prepare(plan.device)
    reason = prep.get("reason") or "prepared: " + ", ".join(
        f"{k}: {v.get('status', v) if isinstance(v, dict) else v}" for k, v in prep.get("entries", {}).items())
    return fc2, {"choice": plan.choices["fc2_lt"].choice, "reason": reason}


def _bind_sparse(plan: LoadPlan) -> SparseStepAttention | None:
    """attention=sparse: the kernel plus the plan's dense backend for the dense steps, bound once."""
    if plan.attention != "sparse":
        return None
    cfg, o = plan.config, plan.options
    dense = bind_attention(plan.dense_attention, cfg.num_heads, cfg.head_dim, v_handling=plan.v_handling)
    return bind_sparse(plan.device, plan.dtype, cfg.num_heads, cfg.head_dim, dense, plan.dense_attention,
                       tau=o.sparse_tau, extra_tokens=o.sparse_extra_tokens, start_percent=o.sparse_start,
                       min_tokens=o.sparse_min_tokens)


def load_model(path: str | Path | None = None, options: RuntimeOptions | None = None, tiny_seed: int = 0,
               progress: Callable[[int, int, str], None] | None = None) -> H3Runtime:
    """Load an H3 DiT (or the embedded tiny model when ``path`` is None, or an in-memory tensor source, see
    ``plan.make_plan``): plan, stream, bind (module docstring). Raises CheckpointError with the problem named
    for bad files."""
    options = options or RuntimeOptions.from_env()
    t0 = time.perf_counter()
    plan = make_plan(path, options, tiny_seed)
    backends = plan.report()
    if options.producer_tiles:
        backends["producer_tiles"] = apply_tile_table(options.producer_tiles)
    model = H3Model(plan.config, plan.dtype, device="meta")
    src = plan.checkpoint if path is not None else StateDictSource(
        tiny_state_dict(plan.config, tiny_seed, plan.dtype), plan.source, plan.config)
    stream_load(model, src, plan, progress)
    model.eval().requires_grad_(False)
    fc2, fc2_report = _prepare_fc2(plan)
    if fc2_report is not None:
        backends["fc2_lt"] = fc2_report
    sparse = _bind_sparse(plan)
    rt = H3Runtime(model, plan, build_ops(plan, fc2, attention=sparse), backends, fc2=fc2, sparse=sparse)
    rt.load_seconds = time.perf_counter() - t0
    return rt
