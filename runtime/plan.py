"""LoadPlan: what a load will do, resolved from the device, the options and the checkpoint header before
any tensor is read.

Order of resolution (each step can depend only on the ones before it):

1. device and compute dtype;
2. the GEMM backend of the block linears (``quantize`` off: dense linears at the compute dtype);
3. the activation format: fp8 (W4A8) where the block linears run the fp8 GEMM backend, NVFP4 elsewhere;
4. FC2's guarded cuBLASLt path, only where FC2 takes NVFP4 bytes (NVFP4 activations on CUDA);
5. the attention backend (``sparse``: also the dense backend of its dense steps), and 6. the V handling of
   Sage2's sm_90 kernel (for the dense backend);
7. precision and AdaLN placement; 8. the producers' tile table, where one is given.

Every step is a ``Choice`` (what will run, and why a faster one was not taken). ``describe()`` is what the
CLI and the loader node print; ``report()`` is the report's ``backends`` block.

The plan decides, everything else binds: below ``cli/`` and ``nodes/`` this module and ``options.py`` are the
only readers of ``RuntimeOptions``. The load (``runtime.load``), the block ops (``ops.block_ops.build_ops``), the
FC2 dispatcher and the sampler take the plan's choices and settings (the properties below) and bind them into
callables once (``ops.registry.bind``); nothing re-derives a choice per layer or per call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError
from .io.checkpoint import Checkpoint, open_checkpoint
from .model.config import QUANT_LINEARS, TINY, H3Config
from .ops.producer_tiles import BUILTIN as BUILTIN_TILES, ProducerTiles
from .ops.registry import capability_table, resolve
from .ops.sage import capability
from .options import RuntimeOptions, SparseSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FC2_NOT_APPLICABLE = "not applicable (act_format fp8)"
ADALN_FROM_FILE = "rows per run from the file"
ADALN_ON_DEVICE = "on the device"  # the memory plan found room for them beside every block (budget.plan_memory)


@dataclass(frozen=True)
class Choice:
    choice: str
    reason: str

    def as_dict(self) -> dict:
        return {"choice": self.choice, "reason": self.reason}


@dataclass
class LoadPlan:
    """Every backend choice of one load. ``checkpoint`` is None for the embedded tiny model."""

    options: RuntimeOptions
    device: torch.device
    dtype: torch.dtype
    config: H3Config
    source: str
    checkpoint: object | None  # a Checkpoint, an in-memory source, or None (embedded tiny)
    choices: dict[str, Choice] = field(default_factory=dict)
    stored_nvfp4: tuple[str, ...] = ()  # block linears stored as NVFP4 (adopted as they are)
    capabilities: dict = field(default_factory=dict)  # ops.registry.capability_table on this device
    memory: object | None = None  # runtime.budget.MemoryPlan: resident vs streamed blocks, chunking (load_model)
    tiles: ProducerTiles = BUILTIN_TILES  # the producers' tile table (choice "producer_tiles" when one is given)
    scratch: object | None = None  # the GEMM scratch every block linear of this load shares (gemm_backends.Scratch;
    #                                set by the load, reused by a control tower loaded onto this plan)
    towers: weakref.WeakSet = field(default_factory=weakref.WeakSet, init=False, compare=False, repr=False)
    # ^ the Fun ControlNet towers loaded onto this plan and still alive (io.control.load_control): a run that
    #   leaves one out plans its budget around the device bytes it holds (H3Runtime.fit_memory). Not copied by
    #   dataclasses.replace, not pickled (a plan elsewhere has loaded no tower there)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "towers"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.towers = weakref.WeakSet()

    @property
    def quantize(self) -> bool:
        return self.options.quantize

    @property
    def gemm(self) -> str:
        return self.choices["gemm"].choice

    @property
    def act_format(self) -> str:
        return self.choices["act_format"].choice

    @property
    def attention(self) -> str:
        return self.choices["attention"].choice

    @property
    def dense_attention(self) -> str:
        """The dense backend: the attention choice, or the one the sparse backend's dense steps run."""
        return self.choices.get("attention_dense", self.choices["attention"]).choice

    @property
    def v_handling(self) -> str:
        return self.choices["v_handling"].choice

    @property
    def fc2_lt(self) -> bool:
        return self.choices["fc2_lt"].choice in ("dispatcher", "strict")

    @property
    def fc2_strict(self) -> bool:
        """The guarded FC2 path raises instead of falling back (choice "strict")."""
        return self.choices["fc2_lt"].choice == "strict"

    @property
    def adaln_on_host(self) -> bool:
        """Full-form AdaLN off the device: in host memory, or left in the checkpoint file (``adaln_from_file``)."""
        return self.choices["adaln"].choice in ("rows per run", ADALN_FROM_FILE)

    @property
    def adaln_from_file(self) -> bool:
        """The memory plan left the full-form AdaLN weights in the checkpoint file: each run reads them block by
        block to compute its modulation rows (``runtime.io.adaln_file``), so host memory never holds them all."""
        return self.choices["adaln"].choice == ADALN_FROM_FILE

    @property
    def act_scale(self) -> str:
        """NVFP4 activations' global scale policy: dynamic | calibrated."""
        return self.choices["act_scale"].choice

    @property
    def fp8_fast_accum(self) -> bool:
        """W4A8 GEMMs with Hopper's fast fp8 accumulation (precision fast)."""
        return self.choices["precision"].choice == "fast"

    @property
    def silu(self) -> str:
        """The W4A8 SwiGLU producer's silu: fast (hardware exp2) | exact (precision)."""
        return "fast" if self.choices["precision"].choice == "fast" else "exact"

    def linear_choices(self) -> dict:
        """What every NVFP4 block linear is built with (``ops.linear.Nvfp4Linear`` keywords): the GEMM backend
        and its reason, the act_scale policy, the output dtype and the fp8 expansion's tiles."""
        return {"backend": self.gemm, "reason": self.choices["gemm"].reason, "act_scale": self.act_scale,
                "out_dtype": self.dtype, "fp8_tiles": self.tiles.to_fp8_rowwise}

    @property
    def cache_dir(self) -> str:
        """Where the FC2 extension build and its tables live."""
        return self.options.cache_dir

    def sparse_settings(self) -> SparseSettings:
        """attention=sparse: the settings ``ops.sparse_attention.bind_sparse`` takes."""
        return self.options.sparse_settings()

    @property
    def vram_budget(self) -> str:
        """The device-memory budget asked for ("" none, "auto" or GB; runtime.budget parses it)."""
        return self.options.vram_budget

    @property
    def host_budget(self) -> str:
        """The host memory the model may keep ("auto" or GB; runtime.budget parses it)."""
        return self.options.host_budget

    @property
    def load_behind(self) -> str:
        """Whether the load's pass may run behind the first step: auto | on | off (``load.load_behind_choice``)."""
        return self.options.load_behind

    @property
    def first_block_cache(self) -> float | None:
        """The First-Block Cache threshold a run uses when it gives none (None: off)."""
        return self.options.first_block_cache

    def configuration(self) -> dict[str, str]:
        """The report's ``configuration`` block: every ``H3_*`` option this runtime acts on, as strings."""
        return self.options.as_env()

    def report(self) -> dict:
        out = {k: c.as_dict() for k, c in self.choices.items()}
        if self.options.ignored:
            out["ignored_options"] = {"choice": ", ".join(sorted(self.options.ignored)),
                                      "reason": "; ".join(f"{k}: {v}" for k, v in sorted(self.options.ignored.items()))}
        return out

    def describe(self) -> str:
        c = self.config
        lines = [f"H3 model {self.source}: {c.num_layers} blocks, hidden {c.hidden_size}, "
                 f"{self.device} {str(self.dtype).replace('torch.', '')}"]
        for op, ch in self.report().items():
            lines.append(f"  {op:<12} {ch['choice']:<14} {ch['reason']}")
        return "\n".join(lines)


def resolve_device(options: RuntimeOptions) -> torch.device:
    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(options.device)
    except RuntimeError:
        raise CheckpointError(f"device {options.device!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise CheckpointError(f"device {options.device!r}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device 'cuda' was requested but torch sees no CUDA device; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CheckpointError(f"device {options.device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def requested_device(options: RuntimeOptions) -> str:
    """The device the options name, before it is resolved or checked: auto, cpu, cuda or cuda:N."""
    return options.device


def weight_form(options: RuntimeOptions, cfg: H3Config) -> tuple[str, bool]:
    """Before a plan (the request's memory check): the block linears' form ("fp8": quantized, 1 byte a weight at
    most; "dense") and whether full-form AdaLN weights stay in host memory."""
    return ("fp8" if options.quantize else "dense"), bool(options.adaln_cache and not cfg.curve_form)


def memory_choices(options: RuntimeOptions, cfg: H3Config, device: torch.device) -> dict:
    """Before a plan (the request's memory check, ``budget.ModelMemory.for_options``): the block linears' form and
    AdaLN's place (``weight_form``), the attention the options name counted as the nearest kind the memory
    estimate knows (auto: sage2 on CUDA, the exact reference elsewhere, what the plan resolves there; the fused
    flash kernels, fa3 / fa4 / sage3, hold no score matrix, like sdpa), Sage2's V handling (its sm_90 stages on an
    sm_90 GPU only), and the vram_budget text."""
    form, adaln_on_host = weight_form(options, cfg)
    a = options.attention
    if a == "auto":
        a = "sage2" if device.type == "cuda" else "reference"
    elif not (a in ("sage2", "sage1", "sparse", "reference") or a.startswith("sdpa")):
        a = "sdpa"
    # Sage2's sm_90 stages (the fused V handling, and K and V held in Sage's operands) run on sm_90 only
    sm90 = torch.cuda.is_available() and capability(device) == (9, 0)
    return {"form": form, "adaln_on_host": adaln_on_host, "attention": a, "vram_budget": options.vram_budget,
            "host_budget": options.host_budget, "v_handling": "fused" if sm90 else "library",
            "sparse_method": options.sparse_settings().method if a == "sparse" else "",
            "sparse_token_aug": options.sparse_settings().token_aug if a == "sparse" else 0}


def resolve_dtype(options: RuntimeOptions, device: torch.device) -> torch.dtype:
    if options.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[options.dtype]


def _stored_nvfp4(ck) -> tuple[str, ...]:
    if not isinstance(ck, Checkpoint):
        return ()
    out = []
    for k in ck.keys():
        if k.endswith(".weight") and QUANT_LINEARS.match(k[:-7]):
            fmt = ck.quant_format(k[:-7])
            if fmt and fmt.get("format") == "nvfp4":
                out.append(k[:-7])
    return tuple(out)


def _gemm(options: RuntimeOptions, device: torch.device, dtype: torch.dtype, stored: tuple, cfg: H3Config) -> Choice:
    if not options.quantize:
        return Choice("dense", f"quantize off: dense linears at {str(dtype).replace('torch.', '')}")
    k_dims = sorted({cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.ffn_hidden_size})  # the block linears' K
    name, why = resolve("gemm", device, options.gemm, k_dims=k_dims)
    src = "NVFP4 as stored" if stored else "quantized to NVFP4 while streaming in"
    return Choice(name, f"{why}; block linears {src}")


def _act_format(options: RuntimeOptions, gemm: str) -> Choice:
    if gemm == "dense":
        return Choice("dense", "quantize off: activations stay at the compute dtype")
    fp8_ok = gemm == "fp8"
    if options.act_format == "fp8" and not fp8_ok:
        return Choice("nvfp4", f"requested fp8 unavailable: W4A8 needs the fp8 GEMM backend (block linears run "
                               f"{gemm}); using nvfp4")
    if options.act_format == "nvfp4" or not fp8_ok:
        why = "requested" if options.act_format == "nvfp4" else f"auto: the block linears run {gemm}"
        return Choice("nvfp4", f"nvfp4: NVFP4 activations (W4A4); {why}")
    prefix = "auto: " if options.act_format == "auto" else ""
    return Choice("fp8", prefix + "fp8 (W4A8): e4m3 activations, one fp32 scale per row (row amax / 448), written "
                                  "by the fused producers; NVFP4 weights expanded per layer to rowwise e4m3")


def _fc2(options: RuntimeOptions, device: torch.device, act_format: str) -> Choice:
    if act_format == "dense":
        return Choice("off", "quantize off: FC2 is a dense linear")
    if act_format == "fp8":
        return Choice(FC2_NOT_APPLICABLE, "the pinned cuBLASLt FC2 takes NVFP4 bytes; with e4m3 activations FC2 "
                                          "runs its layer directly (no dispatcher, no extension build)")
    if device.type != "cuda":
        return Choice("off", "cpu: no cuBLASLt; FC2 runs the fallback GEMM on the producer's bytes")
    if not options.fc2_lt:
        return Choice("off", "fc2_lt off: FC2 runs the fallback GEMM on the producer's bytes")
    mode = "strict" if options.fc2_lt_strict else "dispatcher"
    return Choice(mode, "guarded cuBLASLt FC2 (entries checked at prepare; fallback on the same bytes"
                        + (", strict: a refusal raises" if mode == "strict" else "") + ")")


def _precision(options: RuntimeOptions, device: torch.device, act_format: str) -> Choice:
    if act_format != "fp8":
        return Choice(options.precision, f"no effect: it acts on the W4A8 GEMMs and producers (act_format {act_format})")
    what = ("fast: Hopper's fast fp8 accumulation in the W4A8 GEMMs, hardware exp2 silu in the SwiGLU producer"
            if options.precision == "fast" else
            "exact: fp32 accumulation in the W4A8 GEMMs, the bit-exact silu in the SwiGLU producer")
    return Choice(options.precision, what + ("; CPU: the exact references either way" if device.type != "cuda" else ""))


def _adaln(options: RuntimeOptions, device: torch.device, cfg: H3Config) -> Choice:
    if cfg.curve_form:
        return Choice("resident", "curve form: the AdaLN tables are small")
    if options.adaln_cache and (device.type == "cuda" or options.host_budget != "auto"):
        return Choice("rows per run", "modulation rows precomputed per run; full-form AdaLN weights stream into "
                                      "pinned host memory, never onto the device")
    return Choice("resident", "adaln_cache off or not CUDA: AdaLN weights stay with the model")


def _sparse(options: RuntimeOptions, device: torch.device, cfg: H3Config, ch: dict) -> str:
    """attention=sparse: the dense backend of its dense steps and the sparse settings -> the dense backend."""
    dense, dense_why = resolve("attention", device, "auto", head_dim=cfg.head_dim,
                               dtype=resolve_dtype(options, device))
    ch["attention_dense"] = Choice(dense, "the sparse backend's dense steps (before sparse_start) and short "
                                          f"sequences: {dense_why}")
    s = options.sparse_settings()
    ch["sparse"] = Choice(s.describe(), (
        f"LOSSY: sparse from {s.start_percent:.0%} to {s.end_percent:.0%} of the schedule and from {s.min_tokens} "
        f"rows, {s.token_aug} extra tokens per query block, dense blocks {list(s.dense_blocks) or 'none'}, sinks "
        f"{s.sinks}"))
    return dense


def make_plan(path, options: RuntimeOptions, tiny_seed: int = 0) -> LoadPlan:
    """Resolve every choice of a load (module docstring) from the header alone; reads no tensor.

    path: a checkpoint path, None for the embedded tiny model, or an in-memory tensor source (an object with
    ``config``, ``name``, ``keys()``, ``shape()``, ``quant_format()`` and ``tensor()``, e.g. the benches'
    random full-size weights)."""
    device = resolve_device(options)
    dtype = resolve_dtype(options, device)
    if path is None:
        ck, cfg, source = None, TINY, f"embedded tiny (seed {tiny_seed})"
    elif hasattr(path, "tensor"):
        ck, cfg, source = path, path.config, path.name
    else:
        ck = open_checkpoint(path)
        cfg, source = ck.config, str(path)
    plan = LoadPlan(options, device, dtype, cfg, source, ck, stored_nvfp4=_stored_nvfp4(ck))
    ch = plan.choices
    ch["gemm"] = _gemm(options, device, dtype, plan.stored_nvfp4, cfg)
    ch["act_format"] = _act_format(options, ch["gemm"].choice)
    ch["fc2_lt"] = _fc2(options, device, ch["act_format"].choice)
    name, why = resolve("attention", device, options.attention, head_dim=cfg.head_dim, dtype=dtype)
    ch["attention"] = Choice(name, why)
    if name == "sparse":
        name = _sparse(options, device, cfg, ch)
    ch["v_handling"] = Choice(*resolve("v_handling", device, name, head_dim=cfg.head_dim))
    ch["precision"] = _precision(options, device, ch["act_format"].choice)
    ch["act_scale"] = Choice(options.act_scale, "NVFP4 activations' global scale: " + (
        "amax per call" if options.act_scale == "dynamic" else "the checkpoint's input_scale where present")
        if ch["act_format"].choice == "nvfp4" else f"no effect: act_format {ch['act_format'].choice}")
    ch["adaln"] = _adaln(options, device, cfg)
    if options.producer_tiles:
        plan.tiles = ProducerTiles.load(options.producer_tiles)
        ch["producer_tiles"] = Choice(plan.tiles.source, f"measured on {plan.tiles.device}: {plan.tiles.entries()}")
    plan.capabilities = capability_table(device, head_dim=cfg.head_dim)
    return plan
