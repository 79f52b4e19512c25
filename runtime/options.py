"""RuntimeOptions: every choice defined once (its values and its default), and the one place that reads
configuration.

Node widgets, CLI flags and the seed's ``H3_*`` environment variables all land here; nothing else in the
runtime reads ``os.environ``. Precedence: explicit keyword > environment variable > default. The plan
(``runtime.plan``) turns these requests into what will really run on the device, with the reasons.

Seed variables that name choices this runtime does not have (the seed's own producer family and fusion
switches, the QKV layout whose winner is built in) are accepted and listed in ``ignored`` with the reason;
they never appear in a report's ``configuration``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

# choice -> its values (the first is the default)
CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto",),  # or cpu / cuda / cuda:N (checked by the plan)
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "attention": ("auto", "sage2", "fa3_fp8", "fa3", "sage3", "fa4", "sage1", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
                  "reference", "sparse"),
    "gemm": ("auto", "native", "emulated", "fp8", "bf16", "reference"),
    "act_format": ("auto", "nvfp4", "fp8"),
    "act_scale": ("dynamic", "calibrated"),
    "precision": ("fast", "exact"),
    "load_behind": ("auto", "on", "off"),
}

# ComfyUI core's sparse attention defaults (its H3 node's widgets): the RuntimeOptions defaults, the CLI's and
# the nodes' defaults and the sparse backend's own
SPARSE_TAU = 1.3               # routing threshold
SPARSE_START = 0.2             # dense before this fraction of the timestep range
SPARSE_EXTRA_TOKENS = 256      # exact extra tokens per 64-row query block (comfy-kitchen's token_aug)
SPARSE_EXTRA_TOKENS_CHOICES = (0, 64, 128, 192, 256)
SPARSE_MIN_TOKENS = 12288      # shorter sequences stay dense
SPARSE_METHODS = ("sol-attn", "sla", "vsa")   # core's "method" choices: tau threshold, SLA top-k, VSA cubes + gate
SPARSE_KEEP_PERCENT = 10.0     # sla / vsa: percent of key blocks each query block keeps (FastH3 trained at 10)
SPARSE_END = 1.0               # sparse until this fraction of the timestep range
SPARSE_SINKS = ("exact_kv_and_rows", "exact_kv", "off")  # core's sink_conditioning (the first is its default)

# the user-facing FC2 switch (CLI --fc2, the loader's fc2_lt widget) -> (fc2_lt, fc2_lt_strict); the first is the
# default
FC2_MODES: dict[str, tuple[bool, bool]] = {"on": (True, False), "off": (False, False), "strict": (True, True)}

# CPU threads (``cpu_threads`` auto): an activation of fewer elements than this (packed rows x model width) makes
# each op too short to share: a pool of several threads then waits on its slowest member at every op, and one
# other busy process on the machine stalls them all (the tiny model's job: 0.2 s/step on one thread, 2.6 s on two
# beside a busy loop). Such work runs on one thread; bigger work on the cores that are free.
SMALL_CPU_WORK = 1 << 21

# field -> (environment variable, kind)
_ENV = {
    "attention": ("H3_ATTENTION", str),
    "gemm": ("H3_GEMM", str),
    "act_format": ("H3_ACT_FORMAT", str),
    "act_scale": ("H3_NVFP4_ACT_SCALE", str),
    "precision": ("H3_PRECISION", str),
    "quantize": ("H3_NVFP4", "bool"),
    "fc2_lt": ("H3_NVFP4_FC2_LT_SPLITK1", "bool"),
    "fc2_lt_strict": ("H3_NVFP4_FC2_LT_STRICT", "bool"),
    "adaln_cache": ("H3_ADALN_CACHE", "bool"),
    "producer_tiles": ("H3_PRODUCER_TILES", str),
    "cache_dir": ("H3_CACHE_DIR", str),
    "vram_budget": ("H3_VRAM_BUDGET", str),
    "host_budget": ("H3_HOST_BUDGET", str),
    "load_behind": ("H3_LOAD_BEHIND", str),
}

# seed / earlier names this runtime accepts but does not act on -> why
IGNORED_ENV = {
    "H3_NVFP4_SCALE_BACKEND": "the seed's producer family; this runtime has one fused producer family",
    "H3_NVFP4_SCALE_VERSION": "the seed's producer version; this runtime has one fused producer family",
    "H3_FUSED_ELEMENTWISE": "norm+RoPE and gate/add always run fused on CUDA (the references on the CPU)",
    "H3_NVFP4_MODULATE_FUSION": "RMSNorm+modulate+quantize always runs as one producer",
    "H3_NVFP4_SWIGLU_FUSION": "SwiGLU+quantize always runs as one producer",
    "H3_SAGE_QKV_LAYOUT": "attention always reads strided views of the QKV buffer (no copies)",
    "H3_SAGE_V_PAD": "V's handling is automatic: fused fp8 operands where Sage2's sm_90 stages exist, "
                     "the library wrapper elsewhere",
    "H3_QK_OPERANDS": "removed on 2026-12-01: q written by the norm+RoPE kernel measured slower on the H200 "
                      "(bench/NOTES.md); SageAttention2 quantizes q and k itself",
}

# earlier names of the precision option's two halves: value -> the precision it means
_PRECISION_ALIASES = {"H3_FP8_ACCUM": {"fast": "fast", "fp32": "exact"}, "H3_SILU": {"fast": "fast", "exact": "exact"}}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{name}={v!r}: expected 1/0, true/false, yes/no or on/off")


def _precision_from_aliases(env: Mapping[str, str]) -> str | None:
    """H3_FP8_ACCUM / H3_SILU (earlier names of the two halves of ``precision``) -> precision, or None."""
    got = {}
    for var, values in _PRECISION_ALIASES.items():
        if var in env:
            v = env[var].strip().lower()
            if v not in values:
                raise ValueError(f"{var}={env[var]!r}: expected one of {', '.join(values)} "
                                 "(or set H3_PRECISION=fast|exact)")
            got[var] = values[v]
    if len(set(got.values())) > 1:
        raise ValueError(f"{' and '.join(f'{k}={env[k]}' for k in got)} ask for different precisions; "
                         "set H3_PRECISION=fast or H3_PRECISION=exact instead")
    return next(iter(got.values()), None)



_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?:gb?)?\s*$", re.IGNORECASE)


def vram_budget_bytes(value, name: str = "vram_budget") -> int | None:
    """The one parser of ``vram_budget``: ``auto`` (or None) -> None; a number of GB (``8``, ``7.5``, ``12GB``,
    ``12 g``; 1 GB = 1e9 bytes) -> bytes. ValueError for anything else (zero, negative, not finite, not a
    number); ``runtime.budget.parse_vram_budget`` raises it as a BudgetError."""
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() == "auto":
        return None
    m = _BUDGET.match(text)
    v = float(m.group(1)) if m else float("nan")
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"option {name}={value!r}: expected auto or a positive number of GB (e.g. 8 or 7.5; "
                         "1 GB = 1e9 bytes)")
    return round(v * 1e9)  # the nearest byte: a value printed from a byte count (repr(n / 1e9)) reads back as n

def parse_dense_blocks(text: str) -> tuple[int, ...]:
    """core's dense_blocks text: '0, 1, 47-49' -> (0, 1, 47, 48, 49) (sorted; ranges either way round)."""
    blocks = set()
    for part in re.findall(r"\d+\s*-\s*\d+|\d+", text or ""):
        if "-" in part:
            a, b = (int(x) for x in part.split("-"))
            blocks.update(range(min(a, b), max(a, b) + 1))
        else:
            blocks.add(int(part))
    return tuple(sorted(blocks))


@dataclass(frozen=True)
class SparseSettings:
    """ComfyUI core's "Model Sparse Attention" (``BlockSparseAttention``) settings, one value for a run.

    method: sol-attn (threshold ``tau``) | sla (SLA top-k: ``keep_percent`` of the key blocks) | vsa (top-k over
    4x4x4 video cubes plus the checkpoint's ``to_gate_compress`` coarse branch); start_percent / end_percent: the
    window of the schedule that runs sparse (``sigma_start`` / ``sigma_end``: that window frozen to sigmas when
    the settings were applied, as core's node does; None: from the percents and the run's video shift);
    dense_blocks: block indices that always run dense; min_tokens: shorter sequences stay dense; extra_tokens:
    comfy-kitchen's token_aug (VSA: 0, see ``token_aug``); sinks: core's sink_conditioning.
    """

    method: str = SPARSE_METHODS[0]
    tau: float = SPARSE_TAU
    keep_percent: float = SPARSE_KEEP_PERCENT
    start_percent: float = SPARSE_START
    end_percent: float = SPARSE_END
    dense_blocks: tuple[int, ...] = ()
    min_tokens: int = SPARSE_MIN_TOKENS
    extra_tokens: int = SPARSE_EXTRA_TOKENS
    sinks: str = SPARSE_SINKS[0]
    sigma_start: float | None = None
    sigma_end: float | None = None

    @property
    def vsa(self) -> bool:
        return self.method == "vsa"

    @property
    def topk_ratio(self) -> float:
        """The kernel's top-k fraction: 0 for sol-attn (tau threshold), keep_percent / 100 for sla and vsa."""
        return 0.0 if self.method == "sol-attn" else self.keep_percent / 100.0

    @property
    def token_aug(self) -> int:
        """The kernel's extra tokens: VSA forces 0 (its weights were trained against their own sparse pattern)."""
        return 0 if self.vsa else self.extra_tokens

    def check(self) -> "SparseSettings":
        """Every field in core's ranges, else ValueError naming it (what was expected, what was found)."""
        bad = None
        if self.method not in SPARSE_METHODS:
            bad = f"method={self.method!r}: expected one of {', '.join(SPARSE_METHODS)}"
        elif not (0.0 <= self.tau and math.isfinite(self.tau)):
            bad = f"tau={self.tau!r}: expected a finite number >= 0 (core: {SPARSE_TAU}, its widget 0..4)"
        elif not 0.5 <= self.keep_percent <= 95.0:
            bad = f"keep_percent={self.keep_percent!r}: expected 0.5..95 (core: {SPARSE_KEEP_PERCENT})"
        elif not (0.0 <= self.start_percent <= 1.0 and 0.0 <= self.end_percent <= 1.0):
            bad = f"start/end_percent={self.start_percent!r}/{self.end_percent!r}: expected fractions in [0, 1]"
        elif self.extra_tokens not in SPARSE_EXTRA_TOKENS_CHOICES:
            bad = (f"extra_tokens={self.extra_tokens!r}: expected one of "
                   f"{', '.join(map(str, SPARSE_EXTRA_TOKENS_CHOICES))}")
        elif self.sinks not in SPARSE_SINKS:
            bad = f"sinks={self.sinks!r}: expected one of {', '.join(SPARSE_SINKS)}"
        elif self.min_tokens < 0 or any(b < 0 for b in self.dense_blocks):
            bad = f"min_tokens={self.min_tokens!r} / dense_blocks={self.dense_blocks!r}: expected numbers >= 0"
        if bad:
            raise ValueError(f"sparse attention setting {bad}")
        return self

    def describe(self) -> str:
        """One line for plans and reports."""
        how = f"tau {self.tau}" if self.method == "sol-attn" else f"keep {self.keep_percent:g}%"
        return f"{self.method} ({how})"


@dataclass
class RuntimeOptions:
    """What the user asked for (the plan resolves it for the device and says why).

    device:     auto (CUDA if present, else CPU) | cpu | cuda | cuda:N
    dtype:      compute dtype of the block stack: auto (bfloat16 on CUDA, float32 on the CPU) | float32 |
                bfloat16 | float16
    attention:  auto (the fastest backend that passes its capability check and probe) or a backend name;
                fa3_fp8 = LOSSIER than sage2 on peaked (space-time) attention, opt-in (bench/NOTES.md);
                sage3 / fa4 = Blackwell entries, explicit only;
                sparse = LOSSY training-free sparse attention (comfy-kitchen's sol_attn on CUDA, its fp32
                reference on the CPU; refused with the reason where it cannot run), dense before
                ``sparse_start`` of the schedule and on the dense backend auto picks
    sparse_tau: sparse routing threshold (higher = sparser, faster, less accurate); ComfyUI core's default
    sparse_start: fraction of the schedule's timestep range that stays dense (core: 0.2 -> sparse from model
                sigma <= 0.9796 at video shift 12)
    sparse_extra_tokens: exact extra tokens per 64-row query block (comfy-kitchen token_aug: 0, 64, ..., 256;
                core's default 256)
    sparse_min_tokens: sequences shorter than this stay dense (core's min_tokens)
    sparse_method / sparse_keep_percent / sparse_end / sparse_dense_blocks / sparse_sinks: core's node's method
                (sol-attn | sla | vsa), keep percent (sla, vsa), end_percent, dense_blocks ("0, 1, 47-49") and
                sink_conditioning (``SparseSettings``)
    first_block_cache: LOSSY step reuse (First-Block Cache) threshold on the first block's relative L1 change;
                None = off; 0 = on but never reuses (exactly the uncached latents); peers use ~0.05-0.1
    gemm:       auto | native (Blackwell FP4) | fp8 (NVFP4 weights expanded to e4m3) | bf16 | emulated
                (exact NVFP4 products) | reference — the block linears' GEMM backend
    quantize:   True: block linears run as NVFP4 (quantized while streaming in, or adopted as stored);
                False: dense linears at the compute dtype (the reference stack)
    act_format: auto (fp8 where every block linear runs the fp8 GEMM backend, NVFP4 elsewhere) | nvfp4
                (W4A4) | fp8 (W4A8: e4m3 activations with one fp32 scale per row)
    act_scale:  NVFP4 activations' global scale: dynamic (amax per call) | calibrated (the checkpoint's
                input_scale where present)
    precision:  fast (W4A8 GEMMs with Hopper's fast fp8 accumulation, SwiGLU producer with the hardware exp2)
                | exact (fp32 accumulation, the bit-exact silu). Lossy trade, measured in bench/NOTES.md.
    fc2_lt / fc2_lt_strict: the guarded cuBLASLt FC2 path (only where FC2 takes NVFP4 bytes); strict
                raises instead of falling back
    adaln_cache: precompute modulation rows per run and keep full-form AdaLN weights in host memory (CUDA)
    producer_tiles: a measured tile table JSON for the producers (speed only; "" = built-in tiles)
    cache_dir:  where the FC2 extension build and its tables live
    vram_budget: device-memory budget of a run: auto (the free device memory less a margin) or a number of GB
                (1 GB = 1e9 bytes); blocks beyond it stream from pinned host memory (runtime.budget)
    host_budget: host memory the model may keep: auto (the available host memory) or a number of GB; where the
                streamed blocks and the full-form AdaLN weights do not fit it, AdaLN stays in the checkpoint file and
                each run reads it block by block (runtime.budget); an explicit value also keeps AdaLN off the model
                on the CPU (adaln_cache)
    load_behind: auto (on for a checkpoint file on CUDA) | on | off: the streaming load's pass runs on a worker
                thread behind the first step, each block used once its tensors are loaded and checked
                (``runtime.pending_load``); off: the load ends before ``load_model`` returns
    cpu_threads: torch's intra-op threads for a run on the CPU in a process of its own (the CLI; ComfyUI keeps its
                own): auto (see ``cpu_thread_count``) or a number; H3_CPU_THREADS, else OMP_NUM_THREADS
    ignored:    {variable: why} for accepted names that change nothing here (never reported as configuration)
    """

    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    gemm: str = "auto"
    quantize: bool = True
    act_format: str = "auto"
    act_scale: str = "dynamic"
    precision: str = "fast"
    fc2_lt: bool = True
    fc2_lt_strict: bool = False
    adaln_cache: bool = True
    producer_tiles: str = ""
    cache_dir: str = field(default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "h3_blackwell"))
    sparse_tau: float = SPARSE_TAU
    sparse_start: float = SPARSE_START
    sparse_extra_tokens: int = SPARSE_EXTRA_TOKENS
    sparse_min_tokens: int = SPARSE_MIN_TOKENS
    sparse_method: str = SPARSE_METHODS[0]
    sparse_keep_percent: float = SPARSE_KEEP_PERCENT
    sparse_end: float = SPARSE_END
    sparse_dense_blocks: str = ""
    sparse_sinks: str = SPARSE_SINKS[0]
    first_block_cache: float | None = None
    vram_budget: str = "auto"
    host_budget: str = "auto"
    load_behind: str = "auto"
    cpu_threads: str = "auto"
    ignored: dict = field(default_factory=dict)

    def __post_init__(self):
        for name, choices in CHOICES.items():
            v = getattr(self, name)
            if name == "device":
                continue
            if v not in choices:
                raise ValueError(f"option {name}={v!r}: expected one of {', '.join(choices)}")
        self._check_lossy()
        self._check_budget()
        if self.cpu_threads != "auto" and not (str(self.cpu_threads).isdigit() and int(self.cpu_threads) > 0):
            raise ValueError(f"option cpu_threads={self.cpu_threads!r}: expected auto or a positive whole number "
                             "(H3_CPU_THREADS, --cpu-threads)")

    def _check_budget(self):
        """vram_budget: auto or a positive number of GB (``vram_budget_bytes``, the one parser)."""
        vram_budget_bytes(self.vram_budget)
        vram_budget_bytes(self.host_budget, "host_budget")

    def _check_lossy(self):
        """The sparse attention and step-reuse numbers: finite and in range."""
        if not (0.0 <= self.sparse_tau < float("inf")):
            raise ValueError(f"option sparse_tau={self.sparse_tau!r}: expected a finite number >= 0 "
                             f"(core: {SPARSE_TAU})")
        if not 0.0 <= self.sparse_start <= 1.0:
            raise ValueError(f"option sparse_start={self.sparse_start!r}: expected a fraction in [0, 1] "
                             f"(core: {SPARSE_START})")
        if self.sparse_extra_tokens not in SPARSE_EXTRA_TOKENS_CHOICES:
            raise ValueError(f"option sparse_extra_tokens={self.sparse_extra_tokens!r}: expected one of "
                             f"{', '.join(map(str, SPARSE_EXTRA_TOKENS_CHOICES))} (core: {SPARSE_EXTRA_TOKENS})")
        if self.sparse_min_tokens < 0:
            raise ValueError(f"option sparse_min_tokens={self.sparse_min_tokens!r}: expected >= 0 "
                             f"(core: {SPARSE_MIN_TOKENS})")
        self.sparse_settings().check()
        fbc = self.first_block_cache
        if fbc is not None and not (0.0 <= fbc < float("inf")):
            raise ValueError(f"option first_block_cache={fbc!r}: expected None (off) or a finite number >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "RuntimeOptions":
        """Defaults <- ``H3_*`` environment variables <- explicit ``overrides`` (None values ignored). The override
        ``fc2`` (a key of FC2_MODES: on | off | strict) sets ``fc2_lt`` and ``fc2_lt_strict`` together."""
        env = os.environ if env is None else env
        fc2 = overrides.pop("fc2", None)
        if fc2 is not None:
            if fc2 not in FC2_MODES:
                raise ValueError(f"option fc2={fc2!r}: expected one of {', '.join(FC2_MODES)}")
            overrides = {"fc2_lt": FC2_MODES[fc2][0], "fc2_lt_strict": FC2_MODES[fc2][1], **overrides}
        kw: dict[str, Any] = {}
        alias = _precision_from_aliases(env)
        if alias is not None:
            kw["precision"] = alias
        for name, (var, kind) in _ENV.items():
            if var in env:
                kw[name] = _parse_bool(var, env[var]) if kind == "bool" else kind(env[var])
        threads = env.get("H3_CPU_THREADS") or env.get("OMP_NUM_THREADS")  # OMP's: what the user set for torch
        if threads:
            kw["cpu_threads"] = threads.strip().lower()
        kw["ignored"] = {var: why for var, why in IGNORED_ENV.items() if var in env}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def sparse_settings(self) -> "SparseSettings":
        """The sparse attention settings these options ask for (attention=sparse; a run may bring its own)."""
        return SparseSettings(self.sparse_method, self.sparse_tau, self.sparse_keep_percent, self.sparse_start,
                              self.sparse_end, parse_dense_blocks(self.sparse_dense_blocks), self.sparse_min_tokens,
                              self.sparse_extra_tokens, self.sparse_sinks)

    # the two halves of `precision`, as the stack takes them
    @property
    def fp8_fast_accum(self) -> bool:
        return self.precision == "fast"

    @property
    def silu(self) -> str:
        return "fast" if self.precision == "fast" else "exact"

    def as_env(self) -> dict[str, str]:
        """The seed-profile ``configuration`` block: every ``H3_*`` option this runtime acts on, as strings."""
        out = {}
        for name, (var, kind) in _ENV.items():
            v = getattr(self, name)
            out[var] = ("1" if v else "0") if kind == "bool" else str(v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _free_cores() -> int:
    """The cores this process may run on (its affinity) less the load average's busy ones, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = os.getloadavg()[0]
    except OSError:  # no load average here
        busy = 0.0
    return max(1, min(cores, cores - int(busy + 0.5)))


def cpu_thread_count(setting: str, rows: int, width: int, default: int, free: int | None = None) -> int:
    """torch's intra-op threads for a CPU run of ``rows`` packed rows of a model ``width`` wide.

    ``setting``: RuntimeOptions.cpu_threads (a number is taken as given); ``default``: torch's own count (its
    physical cores); ``free``: the cores free now (default: the affinity less the 1-minute load average).
    auto: 1 thread when one activation has fewer than SMALL_CPU_WORK elements, else the free cores, at most
    ``default``.
    """
    if setting != "auto":
        return int(setting)
    if rows * width < SMALL_CPU_WORK:
        return 1
    return max(1, min(default, _free_cores() if free is None else free))
# ---------------------------------------------------------------------------------------------
# one run's settings, passed whole from the request to the plan to the loop
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingSettings:
    """One sampling run: the noise seed, the step count (None: the model's default, for ``make_job``), core's
    sampler and scheduler names, partial denoise, the flow shifts (None: the model's), and the input latent's
    batch entry whose noise is drawn (core's ``batch_index`` [k])."""

    seed: int
    steps: int | None = None
    sampler: str = "res_multistep"
    scheduler: str = "simple"
    denoise: float = 1.0
    shift_video: float | None = None
    shift_audio: float | None = None
    batch_index: int = 0


@dataclass(frozen=True)
class LossySettings:
    """One run's LOSSY speed settings (None: the load options'): the sparse routing threshold (attention=sparse
    only), the First-Block Cache threshold, and ``sparse``: the whole sparse attention settings of this run
    (method, window, blocks, sinks; e.g. from core's Model Sparse Attention node), which replace the load's (and
    ``sparse_tau``). Installed once per run on the model call (``runtime.sampling.lossy``)."""

    sparse_tau: float | None = None
    first_block_cache: float | None = None
    sparse: SparseSettings | None = None


@dataclass(frozen=True)
class Measure:
    """How often a job samples: ``warmup`` unreported resident runs, then ``runs`` measured ones (the report
    gives their median and whether their latents are the same bytes)."""

    runs: int = 1
    warmup: int = 0


@dataclass(frozen=True)
class Preset:
    """What a distilled checkpoint was trained to run with (the CLI's ``--preset``; the FastH3 workflow): its step
    count, sampler, flow shifts and the sparse attention it was trained against (attention=sparse with these
    settings; None: dense)."""

    name: str
    steps: int
    sampler: str
    shift_video: float
    shift_audio: float
    sparse: SparseSettings | None = None


# FastH3 (FastVideo's 4-step DMD2 student of H3, trained with VSA at 0.9 sparsity on 64-row tiles): 4 steps on the
# uniform grid at the base shifts 12 / 3, core's vsa method at 10 % kept with the checkpoint's to_gate_compress;
# the rest of core's node defaults (start 0.2: the first step dense)
PRESETS: dict[str, Preset] = {
    "fasth3": Preset("fasth3", 4, "euler", 12.0, 3.0, SparseSettings("vsa", keep_percent=10.0)),
}

