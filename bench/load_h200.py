"""Device memory during a load: a bf16 checkpoint at H3 width, and the NVFP4 file `quantize` makes from it.

    python3 bench/load_h200.py [--blocks 8] [--dir /tmp/h3load] [--out bench/results/load-h200.json]

1. Writes a bf16 ComfyUI-named checkpoint of the full H3 width (hidden 5376, 56 x 128 heads, FFN 14336) with
   ``--blocks`` blocks, random weights made on the GPU one tensor at a time (bench/_h3bench.RandomSource).
2. Loads it with the defaults (plan -> streaming load: block linears quantized to NVFP4 as they arrive,
   full-form AdaLN weights into pinned host memory) and records torch.cuda.max_memory_allocated during the
   load (``peak_allocated_during_load_bytes``), memory_allocated after it (``resident_bytes_after_load``) and
   the largest tensor of the file (``largest_source_tensor_bytes``); the contract is
   peak <= resident + 2 x largest.
3. ``quantize`` (on the GPU) turns the file into NVFP4 comfy_quant; the same measurements for loading that.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import ROOT, RandomSource, versions, write_json  # noqa: E402

from h3_blackwell.runtime.load import load_model  # noqa: E402
from h3_blackwell.runtime.io.convert import quantize_checkpoint  # noqa: E402
from h3_blackwell.runtime.io.header import read_header  # noqa: E402
from h3_blackwell.runtime.model.config import FULL  # noqa: E402
from h3_blackwell.runtime.options import RuntimeOptions  # noqa: E402


def write_bf16(path: Path, blocks: int, seed: int = 0) -> dict:
    """The bf16 checkpoint (fp32 islands fp32, as the release), tensors made on the GPU and written one by one."""
    from safetensors.torch import save_file

    cfg = FULL.replace(num_layers=blocks)
    src = RandomSource(cfg, seed, torch.bfloat16)
    t0 = time.perf_counter()
    sd = {k: src.tensor(k, "cuda").cpu() for k in src.keys()}
    save_file(sd, str(path), metadata={"format": "pt"})
    del sd
    return {"seconds": time.perf_counter() - t0, "bytes": path.stat().st_size, "blocks": blocks}


def largest_tensor_bytes(path: Path) -> tuple[str, int]:
    h = read_header(path)
    name, info = max(h.tensors.items(), key=lambda kv: kv[1].offsets[1] - kv[1].offsets[0])
    return name, info.offsets[1] - info.offsets[0]


def measure_load(path: Path) -> dict:
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rt = load_model(path, RuntimeOptions.from_env(device="cuda"))
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    resident = torch.cuda.memory_allocated() - base
    name, largest = largest_tensor_bytes(path)
    out = {"path": str(path), "file_bytes": path.stat().st_size, "load_seconds": secs,
           "peak_allocated_during_load_bytes": peak, "resident_bytes_after_load": resident,
           "largest_source_tensor": name, "largest_source_tensor_bytes": largest,
           "peak_minus_resident_over_largest": (peak - resident) / largest,
           "within_contract": peak <= resident + 2 * largest,
           "backends": {k: v["choice"] for k, v in rt.backends.items()}}
    del rt
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/h3load")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "load-h200.json"))
    a = ap.parse_args(argv)
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    bf16, nvfp4 = d / "h3_bf16.safetensors", d / "h3_nvfp4.safetensors"
    res = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "versions": versions(),
           "device": torch.cuda.get_device_name(), "config": {"hidden": FULL.hidden_size, "heads": FULL.num_heads,
                                                              "ffn": FULL.ffn_hidden_size, "blocks": a.blocks},
           "weights": "random (bench/_h3bench.RandomSource); memory and time do not depend on the values"}
    res["write_bf16"] = write_bf16(bf16, a.blocks)
    print("bf16 written", res["write_bf16"], flush=True)
    res["bf16"] = measure_load(bf16)
    print("bf16 load", res["bf16"], flush=True)
    t0 = time.perf_counter()
    quantize_checkpoint(bf16, nvfp4, device="cuda")
    res["quantize_seconds"] = time.perf_counter() - t0
    res["nvfp4"] = measure_load(nvfp4)
    print("nvfp4 load", res["nvfp4"], flush=True)
    res["acceptance"] = {"bf16_peak_within_resident_plus_2x_largest": res["bf16"]["within_contract"],
                         "nvfp4_peak_within_resident_plus_2x_largest": res["nvfp4"]["within_contract"]}
    write_json(res, a.out)
    for p in (bf16, nvfp4):
        os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
