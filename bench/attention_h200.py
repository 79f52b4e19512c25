#!/usr/bin/env python3
"""Attention backends and the fused norm+RoPE / gate+add kernels at the canonical shape, one GPU, one run.

    python3 bench/attention_h200.py [--out bench/results/attention-h200.json]

Writes ``{"S", "heads", "head_dim", "device", "backends": {"sage2": {"ms", "tflops", "rel_l2", ...},
"sdpa_cudnn": ..., "sdpa_flash": ..., "sage1": ...}, "norm_rope": ..., "gate_add": ..., "copy_bandwidth":
..., "versions": ..., "command": ...}``. Every backend reads q, k, v as strided NHD views of one
``[S, 3*H*D]`` bf16 buffer, through the function a load binds (``bind_attention``; Sage2 with the V handling
the plan picks). A backend that is missing or fails is recorded with its reason.

* ms: median of ``--iters`` timed calls (CUDA events) after ``--warmup`` calls; tflops = 4*S^2*D*H / time.
* rel_l2: against the fp32 reference (IEEE fp32, no TF32) on ``--ref-rows`` evenly spaced query rows
  (all keys); inputs are N(0,1), the worst case for the quantized kernels (see TOLERANCE).
  rel_l2_space_time: the same on q/k whose video rows carry space-time locality (tests/fixtures/structured_qkv:
  H3's canonical segments, as a trained video DiT's attention looks), at the canonical S only.
* candidates that are not registered backends (rows ``variant_*``): FA3 fp8 with ONE per-tensor scale for each
  of q, k, v and no smoothing (the interface's plain use), and SageAttention2's library wrapper with per-thread
  q/k quantization. They show what the registered choices gain.
* copies: CUDA kernels with "copy" in their name during one call (torch profiler) and the peak-memory
  delta of one call, in q-thirds (a copy of q, k and v would add 3).
* norm_rope: GB/s = bytes the kernel must move (read + write the q and k thirds, read cos and sin) / time,
  next to the device copy bandwidth measured in the same run on the same number of bytes.

* sparse (``--backends ... sparse``): comfy-kitchen's sol_attn through runtime.ops.sparse_attention at the
  canonical routing, rows ``sparse_tau{tau}`` (core's 256 extra tokens) and ``sparse_tau{tau}_extra{n}``, each
  timed and compared with exact attention on random AND space-time-local q/k (bench/_sparse_bench.py). LOSSY.
  ``--merge`` adds the measured rows to an existing --out file instead of rewriting it.

SageAttention2 comes from the environment (scripts/device_build_sage2.sh); sageattention 1.0.6 from
``--sage1`` (default: the newest .whl/sageattention-1.*.whl of this checkout).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _h3bench import bench_copy, err_text, time_ms, versions, write_json  # noqa: E402  (also makes the checkout importable as h3_blackwell)

from _sparse_bench import CANONICAL_GRID, bench_sparse, canonical_segments, local_qkv  # noqa: E402
from h3_blackwell.runtime.ops import attention as A  # noqa: E402
from h3_blackwell.runtime.ops import sage as S  # noqa: E402
from h3_blackwell.runtime.ops import flash_attention as FA  # noqa: E402
from h3_blackwell.runtime.ops import elementwise as E  # noqa: E402
from h3_blackwell.runtime.ops import reference as R  # noqa: E402




def copy_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "copy" in e.name.lower()]


def peak_delta(fn, dev) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = fn()
    torch.cuda.synchronize()
    d = torch.cuda.max_memory_allocated(dev) - base
    del out
    return d


def attention_versions() -> dict:
    """The shared versions, plus cuDNN and the SageAttention builds this bench can load."""
    mod, ver = S.sage2_module()
    mod1, src = S.sage1_module()
    return versions(cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                    sageattention2=ver if mod is not None else f"absent: {ver}",
                    sageattention1=src if mod1 is not None else f"absent: {src}")


def _variants(dev, h, d) -> dict:
    """Candidate kernels that are not registered backends: name -> fn(qkv) -> [S, H*D] (module docstring)."""
    out = {}
    mod, why = FA.fa3_module()
    if mod is not None and FA.fa3_check("fa3_fp8", dev, d, torch.bfloat16)[0]:
        def fa3_per_tensor(qkv):
            q, k, v = A.qkv_views(qkv, h, d)
            ops, ds = [], []
            for t in (q, k, v):
                sc = (t.abs().amax().float() / 448).clamp_min(1e-30)
                ops.append((t.float() / sc).clamp(-448, 448).to(torch.float8_e4m3fn))
                ds.append(sc.reshape(1, 1).expand(1, h).contiguous())
            o = mod.flash_attn_func(*ops, causal=False, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
            return (o[0] if isinstance(o, tuple) else o).reshape(qkv.shape[0], -1)
        out["variant_fa3_fp8_per_tensor_unsmoothed"] = fa3_per_tensor
    smod, _ = S.sage2_module()
    if smod is not None and hasattr(smod, S.SAGE2_SM90_FN) and torch.cuda.get_device_capability(dev) == (9, 0):
        fn = getattr(smod, S.SAGE2_SM90_FN)

        def sage2_per_thread(qkv):
            q, k, v = A.qkv_views(qkv, h, d)
            return fn(q, k, v, tensor_layout="NHD", is_causal=False, qk_quant_gran="per_thread",
                      pv_accum_dtype="fp32+fp32", smooth_k=True).reshape(qkv.shape[0], -1)
        out["variant_sage2_library_per_thread"] = sage2_per_thread
    return out


def bench_attention(args, dev, qkv, ref, rows, before, structured=None) -> dict:
    s, h, d = args.seq, args.heads, args.head_dim
    flops = A.attention_flops(s, h, d)
    third = s * h * d * qkv.element_size()
    out = {}
    variants = _variants(dev, h, d)
    for b in list(args.backends) + list(variants):
        if b in variants:
            fn, rec = variants[b], {"available": True, "what": "bench-only candidate (module docstring)"}
        else:
            ok, why = A._available(b, dev, d, qkv.dtype, probe=False)
            if not ok:
                out[b] = {"available": False, "reason": why}
                print(f"{b:12s} unavailable: {why}", flush=True)
                continue
            v_handling = S.v_handling_status("fused", dev, d)[0] if b == "sage2" else "none"
            rec = {"available": True, "what": why, "v_handling": v_handling}
        try:
            if b not in variants:
                fn = A.bind_attention(b, d, device=dev, v_handling=v_handling)
            call = lambda: fn(qkv)  # noqa: E731
            t = time_ms(call, args.iters, args.warmup)
            o = call()
            torch.cuda.synchronize()
            rec.update(ms=round(t["median"], 3), ms_min=round(t["min"], 3), ms_all=t["all"],
                       tflops=round(flops / (t["median"] * 1e-3) / 1e12, 1),
                       rel_l2=round(A.rel_l2(o[rows].float(), ref), 5),
                       tolerance=A.TOLERANCE[b][0] if b in A.TOLERANCE else None,
                       qkv_buffer_untouched=bool(torch.equal(qkv, before)))
            del o
            if structured is not None:
                sqkv, sref = structured
                rec["rel_l2_space_time"] = round(A.rel_l2(fn(sqkv)[rows].float(), sref), 5)
            ck = copy_kernels(call)
            strided = peak_delta(call, dev)
            rec["copies"] = {
                "copy_kernels_in_one_call": ck,
                "peak_delta_mib": round(strided / 2**20, 1),
                "qkv_third_mib": round(third / 2**20, 1),
                "peak_delta_thirds": round(strided / third, 2),
            }
            print(f"{b:12s} {rec['ms']:8.2f} ms {rec['tflops']:6.1f} TFLOP/s rel_l2 {rec['rel_l2']:.4f} st {rec.get('rel_l2_space_time', -1):.4f} "
                  f"copy kernels {len(ck)} peak {rec['copies']['peak_delta_mib']} MiB", flush=True)
        except Exception as e:
            rec["error"] = err_text(e)
            rec["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
            print(f"{b:12s} FAILED {rec['error']}", flush=True)
        out[b] = rec
        torch.cuda.empty_cache()
    return out



def bench_norm_rope(args, dev) -> dict:
    s, h, d, r = args.seq, args.heads, args.head_dim, args.rope_dim
    g = torch.Generator(device=dev).manual_seed(7)
    qkv = (torch.randn(s, 3 * h * d, generator=g, device=dev) * 3 + 0.5).to(torch.bfloat16)
    qw = torch.rand(d, generator=g, device=dev) + 0.5
    kw = torch.rand(d, generator=g, device=dev) + 0.5
    ang = torch.rand(s, r // 2, generator=g, device=dev) * 50
    ang = torch.cat([ang, ang], 1)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    ref = R.norm_rope_qkv_reference(qkv, qw, kw, cos, sin, 1e-5, r)
    work = qkv.clone()
    E.norm_rope_(work, qw, kw, cos, sin, 1e-5, r)
    diff = (work.float() - ref.float()).abs()
    fi = torch.finfo(torch.bfloat16)
    ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(fi.tiny)))) * fi.eps
    check = {"within_1ulp_plus_1e-6": bool((diff <= ulp + 1e-6).all()),
             "fraction_differs": float((work != ref).float().mean()), "max_abs_diff": float(diff.max())}
    del ref, diff, ulp
    qk_bytes = 2 * s * h * d * qkv.element_size()
    moved = 2 * qk_bytes + 2 * s * r * 4  # read + write q and k thirds, read cos and sin
    configs = []
    for bs, hpp, nw in [(32, 2, 4), (16, 1, 4), (16, 2, 4), (32, 4, 4), (32, 8, 4), (64, 2, 8), (64, 4, 8), (8, 2, 2),
                        (4, 2, 1), (4, 4, 2), (8, 1, 1), (8, 4, 2), (8, 2, 4), (16, 2, 2)]:
        try:
            t = time_ms(lambda: E.norm_rope_(work, qw, kw, cos, sin, 1e-5, r,
                                             launch=E.NormRopeLaunch(bs, hpp, nw)), args.iters * 2, args.warmup)
            configs.append({"block_s": bs, "heads_per_program": hpp, "num_warps": nw, "ms": round(t["median"], 4),
                            "GBps": round(moved / (t["median"] * 1e-3) / 1e9, 1)})
        except Exception as e:
            configs.append({"block_s": bs, "heads_per_program": hpp, "num_warps": nw, "error": err_text(e)})
    ok = [c for c in configs if "GBps" in c]
    best = max(ok, key=lambda c: c["GBps"]) if ok else None
    # the same bytes moved by a plain device copy, and by a copy out of the strided q|k columns
    plain = bench_copy(dev, qk_bytes, args.iters * 2, args.warmup)
    dst = torch.empty(s, 2 * h * d, dtype=qkv.dtype, device=dev)
    t = time_ms(lambda: dst.copy_(qkv[:, : 2 * h * d]), args.iters * 2, args.warmup)
    strided = {"ms": round(t["median"], 4), "GBps_read_plus_write": round(2 * qk_bytes / (t["median"] * 1e-3) / 1e9, 1)}
    res = {"shape": {"S": s, "heads": h, "head_dim": d, "rope_dim": r, "dtype": "bfloat16"},
           "bytes_moved": moved, "configs": configs, "best": best, "vs_reference": check,
           "copy_same_bytes": plain, "copy_strided_qk_columns": strided}
    if best:
        res["fraction_of_copy_bandwidth"] = round(best["GBps"] / plain["GBps_read_plus_write"], 3)
    return res


def bench_gate_add(args, dev) -> dict:
    s, hidden = args.seq, args.hidden
    segs = [(0, 37296, 0), (37296, 37710, 1), (37710, 37810, 2)] if s == 37810 else [(0, s, 0)]
    g = torch.Generator(device=dev).manual_seed(8)
    x = torch.randn(s, hidden, generator=g, device=dev).to(torch.bfloat16)
    y = (torch.randn(s, hidden, generator=g, device=dev) * 2).to(torch.bfloat16)
    gate = (torch.randn(len(segs), hidden, generator=g, device=dev) * 0.5).float()
    ref = R.gate_add_reference(x, y, gate, segs)
    x1 = x.clone()
    E.gate_add_(x1, y, gate, segs)
    exact = bool(torch.equal(x1, ref))
    del ref, x1
    moved = 3 * s * hidden * x.element_size()
    t = time_ms(lambda: E.gate_add_(x, y, gate, segs), args.iters * 2, args.warmup)
    return {"shape": {"S": s, "hidden": hidden, "segments": segs, "x": "bfloat16", "gate": "float32"},
            "exact_vs_reference": exact, "ms": round(t["median"], 4),
            "GBps": round(moved / (t["median"] * 1e-3) / 1e9, 1), "bytes_moved": moved}


def merge_rows(result: dict, out: str) -> int:
    """--merge: this run's backend rows into the existing file, with this run's command, date and versions
    recorded beside them (``merged_runs``); every other key of the file stays as it was."""
    path = Path(out)
    old = json.loads(path.read_text()) if path.exists() else {}
    old.setdefault("backends", {}).update(result["backends"])
    old.setdefault("merged_runs", []).append({k: result[k] for k in ("command", "date_utc", "device", "versions")}
                                             | {"rows": sorted(result["backends"])})
    print(f"merged {len(result['backends'])} rows into {write_json(old, path)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=37810)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-dim", type=int, default=96)
    p.add_argument("--hidden", type=int, default=5376)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ref-rows", type=int, default=512)
    p.add_argument("--backends", nargs="*", default=["sage2", "fa3_fp8", "fa3", "sdpa_cudnn", "sdpa_flash", "sage1"],
                   help="attention backends to time; none (a bare --backends) times only norm+RoPE and gate+add")
    p.add_argument("--sage1", default=None, help="sageattention 1.x wheel or folder (default: .whl/sageattention-1.*.whl)")
    p.add_argument("--sparse-taus", nargs="*", type=float, default=[1.0, 1.3, 1.6, 2.0],
                   help="tau values of the sparse rows (with 'sparse' in --backends)")
    p.add_argument("--sparse-extra-tokens", nargs="*", type=int, default=[256, 0],
                   help="comfy-kitchen token_aug values of the sparse rows (256 = core's default)")
    p.add_argument("--merge", action="store_true",
                   help="update only the rows this run measures in an existing --out file (keep the others)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention-h200.json"))
    args = p.parse_args(argv)
    sparse = "sparse" in (args.backends or [])
    args.backends = [b for b in (args.backends or []) if b != "sparse"]

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    sage1_path = args.sage1 or (sorted(glob.glob(str(ROOT / ".whl" / "sageattention-1.*.whl"))) or [None])[-1]
    sage1_note = None
    if sage1_path:
        try:
            S.use_sage1_from(sage1_path)
        except Exception as e:
            sage1_note = f"could not load {sage1_path}: {err_text(e)}"

    props = torch.cuda.get_device_properties(dev)
    cc = torch.cuda.get_device_capability(dev)
    s, h, d = args.seq, args.heads, args.head_dim
    result = {
        "S": s, "heads": h, "head_dim": d,
        "device": f"{props.name} (sm_{cc[0]}{cc[1]}, {props.multi_processor_count} SMs, "
                  f"{props.total_memory / 2**30:.0f} GiB)",
        "dtype": "bfloat16",
        "layout": "q, k, v as strided NHD views of one [S, 3*H*D] buffer (H3_SAGE_QKV_LAYOUT=strided_nhd)",
        "tflops_counted_as": "4*S*S*head_dim*heads / median time",
        "command": shlex.join([os.path.basename(sys.executable)] + sys.argv),
        "cwd": os.getcwd(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": attention_versions(),
    }
    if sage1_note:
        result["sage1_note"] = sage1_note
    print(json.dumps({k: result[k] for k in ("device", "versions")}, indent=1), flush=True)

    try:
        name, why = A.choose_attention_backend(dev, head_dim=d)
        result["auto_choice"] = {"backend": name, "reason": why}
    except Exception as e:
        result["auto_choice"] = {"error": err_text(e)}

    result["backends"] = {}
    if args.backends:
        g = torch.Generator(device=dev).manual_seed(440420)
        qkv = torch.randn(s, 3 * h * d, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
        before = qkv.clone()
        rows = torch.linspace(0, s - 1, min(args.ref_rows, s), device=dev).round().long().unique()
        ref = A.exact_attention_reference(*A.qkv_views(qkv, h, d), rows=rows)
        result["reference"] = {"rows": int(rows.numel()), "math": "fp32 IEEE (no TF32), all keys"}
        structured = None
        if s == canonical_segments()[-1][1]:
            sqkv = local_qkv(canonical_segments(), CANONICAL_GRID, h, d, dev, seed=0)
            structured = (sqkv, A.exact_attention_reference(*A.qkv_views(sqkv, h, d), rows=rows))
            result["reference"]["space_time"] = "tests/fixtures/structured_qkv.local_qkv(seed=0), same rows"
        result["backends"] = bench_attention(args, dev, qkv, ref, rows, before, structured)
        structured = None
        del qkv, before, ref
        torch.cuda.empty_cache()
    if sparse:
        result["backends"].update(bench_sparse(dev, h, d, args.sparse_taus, args.sparse_extra_tokens, args.iters,
                                               args.warmup, args.ref_rows, time_ms))
        torch.cuda.empty_cache()
    if args.merge:
        return merge_rows(result, args.out)
    for name, fn in (("norm_rope", bench_norm_rope), ("gate_add", bench_gate_add)):
        try:
            result[name] = fn(args, dev)
            print(f"{name}: {json.dumps(result[name].get('best') or {k: result[name][k] for k in ('ms', 'GBps')})}",
                  flush=True)
        except Exception as e:
            result[name] = {"error": err_text(e), "traceback_tail": traceback.format_exc().splitlines()[-6:]}
            print(f"{name} FAILED {result[name]['error']}", flush=True)
        torch.cuda.empty_cache()
    try:
        result["copy_bandwidth"] = bench_copy(dev, 1 << 31, args.iters * 2, args.warmup)
    except Exception as e:
        result["copy_bandwidth"] = {"error": err_text(e)}

    print(f"wrote {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
