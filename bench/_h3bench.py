"""Shared pieces of the H200 benches: a random full-size H3 built through the runtime's own job (``open_model``
-> plan -> streaming load), and the map from kernel names to the seed profile's components."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import h3_blackwell.runtime  # noqa: F401
except ImportError:  # a plain checkout (the device copy): make the repo root the package
    pkg = types.ModuleType("h3_blackwell")
    pkg.__path__ = [str(ROOT)]
    sys.modules["h3_blackwell"] = pkg

from h3_blackwell.runtime import ModelSpec, RuntimeOptions, open_model  # noqa: E402
from h3_blackwell.runtime.model.config import FULL  # noqa: E402
from h3_blackwell.runtime.errors import describe  # noqa: E402
from h3_blackwell.runtime.model.h3 import H3Model  # noqa: E402

COMPONENTS = [
    # Sage2's own helper kernels (int8/fp8 quantization of q, k, v, V's pad and transpose) count as attention,
    # as the seed's "sage2" component did (5 launches per block)
    # FA3 fp8's operand producers (qkv_stats_kernel, qkv_fp8_kernel) likewise
    ("attention", ("attn", "sage", "fmha", "flash", "cudnn", "softmax", "quantint8", "meanscale",
                   "transposepad", "catarray", "qkv_stats", "qkv_fp8")),
    ("norm_and_rope", ("norm_rope",)),
    ("remaining_gate_add", ("gate_add",)),
    ("nvfp4_packing", ("_rms_modulate", "_rms_fp8", "_swiglu", "_quantize_kernel", "_quantize_fp8", "_fp8_rowwise",
                       "_dequant", "amax", "reduce_kernel")),
    ("nvfp4_gemms", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "_gemm_kernel", "matmul")),
    ("copies", ("copy", "memcpy", "cat", "pad")),
]


def is_annotation(name: str) -> bool:
    """Our record_function ranges (``h3.*``) also show up on the GPU timeline: not kernels."""
    return name.startswith("h3.")


def component(name: str) -> str:
    low = name.lower()
    for comp, keys in COMPONENTS:
        if any(k in low for k in keys):
            return comp
    return "other"


class RandomSource:
    """Random H3 weights of any config, made one tensor at a time on the device as the streaming load asks for
    them (so a full-size bench model goes through the real load path without a file): norms 1, other vectors
    N(0, 0.02), matrices N(0, 1/fan_in) (AdaLN x0.3). Each tensor has its own generator seed (seed, index)."""

    def __init__(self, cfg, seed: int, dtype: torch.dtype):
        with torch.device("meta"):
            m = H3Model(cfg, dtype)
        self._meta = m.state_dict()
        self._index = {k: i for i, k in enumerate(self._meta)}
        self.config, self.seed = cfg, seed
        self.name = f"random {'full-size' if cfg is FULL else 'tiny'} (seed {seed})"

    def keys(self):
        return list(self._meta)

    def shape(self, k):
        return tuple(self._meta[k].shape)

    def dtype(self, k):
        return self._meta[k].dtype

    def quant_format(self, layer):
        return None

    def tensor(self, k, device="cpu"):
        if torch.device(device).type == "cpu" and torch.cuda.is_available():
            return self.tensor(k, "cuda").cpu()  # made on the GPU: much faster than CPU normal_ at this size
        ref = self._meta[k]
        if k == "rope.inv_freq":
            c = self.config
            return (c.rope_theta ** (-torch.arange(c.rope_inv_freq_len, dtype=torch.float64)
                                     / c.rope_inv_freq_len)).float().to(device)
        g = torch.Generator(device=device).manual_seed(self.seed * 100003 + self._index[k])
        t = torch.empty(ref.shape, dtype=ref.dtype, device=device)
        if t.dim() == 1 and "norm" in k:
            return t.fill_(1.0)
        if t.dim() == 1:
            return t.normal_(0.0, 0.02, generator=g)
        return t.normal_(0.0, t.shape[1] ** -0.5 * (0.3 if "adaln" in k else 1.0), generator=g)


def model_spec(opts: RuntimeOptions, seed: int, cfg=FULL) -> ModelSpec:
    """What to load: random weights of ``cfg`` (``RandomSource``) with ``opts``, as the runtime's job takes it
    (``spec.load()`` here, or each rank's own load in a sequence-parallel ``run``)."""
    dt = torch.bfloat16 if torch.device(opts.device).type == "cuda" else torch.float32
    return open_model(RandomSource(cfg, seed, dt), opts)


def build(opts: RuntimeOptions, seed: int, cfg=FULL):
    """A resident runtime on random weights of ``cfg``, loaded through the real plan + streaming load."""
    return model_spec(opts, seed, cfg).load()


def time_ms(fn, iters: int, warmup: int) -> dict:
    """CUDA-event times of ``iters`` calls after ``warmup`` calls: {"median", "min", "all"} in ms."""
    import statistics

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = [a.elapsed_time(b) for a, b in ev]
    return {"median": statistics.median(ts), "min": min(ts), "all": [round(t, 4) for t in ts]}


def bench_copy(dev, nbytes: int, iters: int, warmup: int) -> dict:
    """Device copy bandwidth on ``nbytes`` (read + write), the reference the producers are compared to."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), iters, warmup)
    return {"bytes_copied": nbytes, "ms": round(t["median"], 4),
            "GBps_read_plus_write": round(2 * nbytes / (t["median"] * 1e-3) / 1e9, 1)}


def err_text(e: BaseException) -> str:
    """The error of a bench section that could not run, as recorded in its JSON."""
    return describe(e, 400)


def bench_command(argv=None) -> str:
    """How the bench ran, for its JSON: the ``H3_*`` environment (the runtime options it read), then python3, the
    script and ``argv`` (the arguments main() was given; default the command line's)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("H3_")]
    return " ".join([*env, "python3", *(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])])])


def versions(**extra) -> dict:
    """python, torch, CUDA, Triton, the driver and the git commit; ``extra`` keys after them."""
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception as e:
        v["triton"] = err_text(e)
    for key, cmd in (("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                     ("git_commit", ["git", "-C", str(ROOT), "rev-parse", "HEAD"])):
        try:
            v[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except Exception:
            v[key] = None
    try:  # the device gets a copy of the working tree whose .git may be older than the code: say so
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        v["git_tree_matches_commit"] = not dirty
    except Exception:
        v["git_tree_matches_commit"] = None
    v.update(extra)
    return v


def write_json(obj: dict, out: Path | str) -> Path:
    """The bench's result file (parent folders made; values json cannot encode written as str)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    return out
