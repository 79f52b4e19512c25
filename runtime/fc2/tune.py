"""The FC2 tuner behind ``h3-blackwell tune-fc2`` (its command line: ``cli/tune_fc2.py``): find a pinned
cuBLASLt configuration for FC2 on this GPU.

What it does, for one role / shape / dtype (bf16 or fp8 on Hopper, NVFP4 on Blackwell):

1. builds synthetic operands of the exact shape (random data, padding rows zero as the producer
   writes them) and the reference output: torch's own GEMM for that dtype, which is the path the
   fallback takes (``F.linear`` for bf16, ``torch._scaled_mm`` for fp8 and NVFP4);
2. enumerates candidate configurations: the heuristic's results first (split-K forced to 1), then every
   (algo id, tile, stages, CTA swizzle, custom option) the algorithm capabilities list. AlgoGetIds does
   not filter by device, so every candidate must pass AlgoCheck for the exact shape and workspace;
3. runs each legal candidate into a NaN-filled buffer and keeps those whose output is byte-identical to
   the reference, then re-checks the fastest on more seeds and for run-to-run determinism;
4. times the best exact candidates, the heuristic's own choice and the reference in alternating order
   (ABC/CBA ...), CUDA events, p50 over rounds;
5. writes a table entry (``table.ENTRY_SCHEMA``) with all that as evidence. By default it lands in
   ``cache_dir/fc2_lt/table/``, where ``Fc2Table.default`` picks it up.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..io.atomic import write_file
from . import ext
from .guard import Fc2Environment
from .table import AlgoSpec, ENTRY_SCHEMA, Fc2Entry, KINDS, ROLE_FC2, table_dir
from .operands import DEFAULT_SCALE_MODE, REFERENCE_NAME, compare_bytes, reference_gemm, synthetic_operands

CANONICAL = {"m_logical": 37810, "m_padded": 37824, "n": 5376, "k": 14336}


def candidate_configs(caps: Mapping[str, Any], cluster_ids: Sequence[int] = (0,)) -> Iterator[dict[str, int]]:
    """Every split-K-1 / reduction-NONE configuration the capabilities of one algorithm id allow."""
    if int(caps.get("init_status", 0)) != 0:
        return
    tiles = list(caps.get("tiles") or [0])
    stages = list(caps.get("stages") or [0])
    swizzles = [0, 1] if int(caps.get("swizzle_support", 0)) else [0]
    customs = range(max(0, int(caps.get("custom_option_max", 0))) + 1)
    for tile in tiles:
        for st in stages:
            for sw in swizzles:
                for cu in customs:
                    for cl in cluster_ids:
                        yield {"id": int(caps["id"]), "tile": int(tile), "stages": int(st), "splitk": 1,
                               "reduction": 0, "swizzle": sw, "custom": cu, "cluster": int(cl), "inner_shape": 0}


def pinnable(config: Mapping[str, Any]) -> dict[str, int]:
    """A heuristic result turned into a pinned candidate: split-K 1, reduction NONE, the rest kept."""
    c = {k: int(config.get(k, 0)) for k in ("id", "tile", "stages", "swizzle", "custom", "cluster", "inner_shape")}
    c.update(splitk=1, reduction=0)
    return c


def config_key(c: Mapping[str, Any]) -> tuple:
    return tuple(int(c.get(k, 0)) for k in ("id", "tile", "stages", "splitk", "reduction", "swizzle", "custom",
                                            "cluster", "inner_shape"))


def unique(configs: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, int]]:
    seen: set[tuple] = set()
    for c in configs:
        k = config_key(c)
        if k not in seen:
            seen.add(k)
            yield dict(c)


def round_robin(iterables: Iterable[Iterable[Any]]) -> Iterator[Any]:
    """a1 b1 c1 a2 b2 ... : spreads a time-limited sweep fairly over algorithm ids."""
    its = [iter(i) for i in iterables]
    while its:
        alive = []
        for it in its:
            try:
                yield next(it)
                alive.append(it)
            except StopIteration:
                pass
        its = alive


def alternating_order(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Round r runs the contenders forward when r is even and reversed when odd (AB/BA ...)."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def summarize_ms(samples: Sequence[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50": round(statistics.median(s), 4), "min": round(s[0], 4), "max": round(s[-1], 4),
            "mean": round(statistics.fmean(s), 4), "n": len(s)}


def entry_name(device_name: str, role: str, dtype: str, m_logical: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return f"{slug}-{role}-{dtype}-m{m_logical}"


# ----------------------------------------------------------------------------------------------
# the sweep


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """One call's time: CUDA events on the current stream (host clock for a CPU plan module in tests)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end))


def _stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class TuneError(RuntimeError):
    pass


class TuneCrash(TuneError):
    """The tuner's subprocess died (a signal such as SIGSEGV inside cuBLASLt) or ended without a result."""

    def __init__(self, message: str, returncode: int | None, log_tail: str):
        super().__init__(message)
        self.returncode = returncode
        self.log_tail = log_tail


@dataclass(frozen=True)
class TuneProblem:
    """The GEMM one sweep tunes: operand ``dtype`` (``KINDS``), ``m_logical`` rows padded to ``m_padded``, N x K
    weights, the ``role`` it is tuned for; ``workspace_limit`` bounds the pinned candidates (0: zero-workspace
    configurations only, like the seed's entry); ``scale_mode`` None: the dtype's default."""

    dtype: str
    m_logical: int
    m_padded: int
    n: int
    k: int
    role: str = ROLE_FC2
    workspace_limit: int = 0
    scale_mode: str | None = None


@dataclass(frozen=True)
class TuneSweep:
    """How far one sweep goes: at most ``max_candidates`` executed, the ``top`` exact ones checked over ``seeds``
    seeds and timed over ``rounds`` alternating rounds; ``check_seconds`` / ``run_seconds`` bound the AlgoCheck
    and execution stages; ``heuristic_workspace``: the unpinned baseline's workspace (a typical 32 MiB)."""

    max_candidates: int = 300
    top: int = 6
    heuristic_workspace: int = 32 << 20  # the baseline the finalists are timed against
    rounds: int = 20
    seeds: int = 3
    check_seconds: float = 90.0
    run_seconds: float = 120.0


def tune_subprocess(problem: TuneProblem, sweep: TuneSweep = TuneSweep(), *, cache_dir: str, device: str = "cuda",
                    timeout: float | None = None, log_path: str | None = None, trace: bool = True,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """:func:`tune` in a child process (:func:`_child_main`), so that a crash inside cuBLASLt is
    reported as a :class:`TuneCrash` naming the signal instead of killing the caller.

    Returns ``{"entry": <entry JSON or None>, "evidence": {...}}`` like :func:`tune`. The child runs with
    ``-X faulthandler`` and, with ``trace``, ``H3_FC2_LT_TRACE=1`` (every cublasLtMatmul argument on stderr);
    its stderr goes to ``log_path`` (default: a temporary file) and its tail into errors.
    """
    with tempfile.TemporaryDirectory(prefix="tune-fc2-") as td:
        evidence = Path(td) / "result.json"
        log = Path(log_path) if log_path else Path(td) / "stderr.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        kw = {"problem": asdict(problem), "sweep": asdict(sweep), "device": str(device), "cache_dir": str(cache_dir),
              "command": "tune_subprocess"}
        args = [json.dumps(kw), str(evidence)]
        code = ("import sys; from h3_blackwell.runtime.fc2.tune import _child_main; "
                "sys.exit(_child_main(sys.argv[1:]))")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        if trace:
            env["H3_FC2_LT_TRACE"] = "1"
        pr = problem
        say(f"tune-fc2 subprocess: {pr.dtype} M={pr.m_logical}/{pr.m_padded} N={pr.n} K={pr.k} workspace "
            f"{pr.workspace_limit} (log {log})")
        t0 = time.perf_counter()
        with open(log, "w") as errf:
            try:
                proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args], stdout=subprocess.PIPE,
                                      stderr=errf, text=True, env=env, timeout=timeout)
                rc: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        text = log.read_text(errors="replace")
        tail = text[-6000:]
        for line in text.splitlines()[-40:]:
            say(f"  | {line}")
        secs = time.perf_counter() - t0
        if rc is None:
            raise TuneCrash(f"tune-fc2 subprocess timed out after {timeout} s", None, tail)
        if rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            last = [ln for ln in text.splitlines() if ln.startswith("[h3_fc2_lt] run ")][-1:]
            raise TuneCrash(f"tune-fc2 subprocess killed by {sig} after {secs:.1f} s"
                            + (f"; last cuBLASLt call: {last[0]}" if last else ""), rc, tail)
        if rc in (0, 1) and evidence.is_file():
            return json.loads(evidence.read_text())
        raise TuneCrash(f"tune-fc2 subprocess exited with status {rc} and no result: "
                        + (text.strip().splitlines() or ["(no output)"])[-1], rc, tail)


class _Bench:
    """The state one sweep shares between its steps: the plan module's Problem, the operands of the current seed
    and their reference output, the output buffer and the pinned candidates' workspace."""

    def __init__(self, mod: Any, problem: TuneProblem, device: torch.device, say: Callable[[str], None]):
        p = problem
        self.dtype, self.m_logical, self.m_padded, self.n, self.k = p.dtype, p.m_logical, p.m_padded, p.n, p.k
        self.device, self.scale_mode, self.say = device, p.scale_mode or DEFAULT_SCALE_MODE[p.dtype], say
        self.pointer_mode = "device" if p.dtype == "nvfp4" else "host"
        self.prob = mod.Problem(p.dtype, p.m_padded, p.n, p.k, self.pointer_mode, self.scale_mode)
        self.new_seed(0)
        self.out = torch.empty((p.m_padded, p.n), dtype=torch.bfloat16, device=device)
        ws = p.workspace_limit
        self.ws_buf = torch.empty(ws, dtype=torch.uint8, device=device) if ws else None

    def new_seed(self, seed: int) -> None:
        """Synthetic operands of ``seed`` and their reference output (the previous ones are freed first)."""
        self.ops = self.ref = None
        self.ops = synthetic_operands(self.dtype, self.m_logical, self.m_padded, self.n, self.k, self.device,
                                      seed=seed, scale_mode=self.scale_mode)
        self.ref = reference_gemm(self.ops, self.dtype, self.scale_mode)
        _sync(self.device)

    def run_plan(self, plan, dst: torch.Tensor | None = None, ws: torch.Tensor | None = None) -> int:
        """The plan's cublasStatus_t on the current operands into ``dst`` (default: ``out``); -1 when the
        extension refuses the operands (a ValueError)."""
        o = self.ops
        try:
            return plan.run(o.x, o.w, self.out if dst is None else dst, o.x_scale, o.w_scale,
                            o.alpha if self.pointer_mode == "device" else None, 1.0,
                            ws if ws is not None else self.ws_buf, _stream_handle(self.device))
        except ValueError as e:
            self.say(f"  operands refused by a plan: {e}")
            return -1

    def run_fresh(self, plan, ws: torch.Tensor | None = None) -> tuple[int, dict[str, Any]]:
        """Run ``plan`` into a NaN-filled ``out``; (status, byte comparison with the reference)."""
        self.out.fill_(float("nan"))
        st = self.run_plan(plan, ws=ws)
        _sync(self.device)
        return st, compare_bytes(self.out, self.ref)


def _heuristic_baseline(bench: _Bench, heuristic_workspace: int) -> tuple[Any, torch.Tensor | None, dict[str, Any]]:
    """The heuristic's own (unpinned) first choice with ``heuristic_workspace`` bytes: the timing baseline.
    Returns (plan, its workspace buffer or None, its evidence)."""
    plan = bench.prob.heuristic_plan(0, heuristic_workspace, False)
    info = dict(plan.info())
    ws = None
    if plan.ok and plan.workspace_required:
        ws = torch.empty(int(plan.workspace_required), dtype=torch.uint8, device=bench.device)
    heur = {"ok": plan.ok, "config": info.get("config"), "stage": info["stage"], "message": info["message"],
            "workspace_limit": heuristic_workspace, "workspace_required": info["workspace_required"]}
    if plan.ok:
        st, cmp = bench.run_fresh(plan, ws)
        heur.update(status=st, **{f"vs_reference_{k}": v for k, v in cmp.items()})
    bench.say(f"  heuristic choice: {heur.get('config') or heur['message']}")
    return plan, ws, heur


def _candidates(bench: _Bench, workspace_limit: int) -> tuple[list[int], Iterator[dict[str, int]]]:
    """(algo ids, every candidate configuration once): the library's own picks first (split-K forced to 1),
    then every id's space, interleaved."""
    prob = bench.prob
    try:
        heur_list = list(prob.heuristic(64, workspace_limit, True)) + list(prob.heuristic(64, workspace_limit, False))
    except RuntimeError as e:
        heur_list = []
        bench.say(f"  heuristic list unavailable: {e}")
    ids = list(prob.algo_ids(1024))
    caps = {i: dict(prob.algo_caps(i)) for i in ids}

    def all_candidates() -> Iterator[dict[str, int]]:
        for r in heur_list:
            if r.get("config"):
                yield pinnable(r["config"])
        yield from round_robin(candidate_configs(caps[i]) for i in ids)

    return ids, unique(all_candidates())


def _legal_plans(bench: _Bench, candidates: Iterable[dict[str, int]], workspace_limit: int,
                 check_seconds: float) -> dict[str, Any]:
    """AlgoCheck every candidate (within ``check_seconds``) for the exact shape and ``workspace_limit``.
    Returns {"legal": [(config, plan)], "refused": {stage: count}, "checked", "truncated",
    "ws_needed": the least workspace among configurations refused only for their workspace, or None}."""
    legal: list[tuple[dict, Any]] = []
    refused: dict[str, int] = {}
    ws_needed: int | None = None
    checked = 0
    truncated = False
    t0 = time.perf_counter()
    for cfg in candidates:
        if time.perf_counter() - t0 > check_seconds:
            truncated = True
            break
        checked += 1
        plan = bench.prob.pinned_plan(cfg, workspace_limit)
        if plan.ok:
            legal.append((cfg, plan))
        else:
            pinfo = plan.info()
            stage, need = pinfo["stage"], int(pinfo.get("workspace_required") or 0)
            refused[stage] = refused.get(stage, 0) + 1
            if stage == "workspace" and need > 0:
                ws_needed = need if ws_needed is None else min(ws_needed, need)
    return {"legal": legal, "refused": refused, "checked": checked, "truncated": truncated, "ws_needed": ws_needed}


def _exact_on_first_seed(bench: _Bench, legal: list[tuple[dict, Any]], max_candidates: int,
                         run_seconds: float) -> tuple[list[dict[str, Any]], bool]:
    """Run the first ``max_candidates`` legal plans (within ``run_seconds``) on the current seed; each result
    records its status, whether its bytes equal the reference and, when they do, a rough time.
    Returns (results, truncated)."""
    results: list[dict[str, Any]] = []
    truncated = len(legal) > max_candidates
    t0 = time.perf_counter()
    for cfg, plan in legal[:max_candidates]:
        if time.perf_counter() - t0 > run_seconds:
            truncated = True
            break
        st, cmp = bench.run_fresh(plan)
        if st != 0:
            results.append({"config": cfg, "status": st, "exact": False})
            continue
        ms = _time_ms(lambda: bench.run_plan(plan), bench.device) if cmp["equal"] else None
        results.append({"config": cfg, "status": 0, "exact": cmp["equal"], "mismatched": cmp["mismatched"],
                        "rough_ms": ms, "plan": plan})
    return results, truncated


def _robust_finalists(bench: _Bench, finalists: list[dict[str, Any]],
                      seed_list: list[int]) -> tuple[list[dict[str, Any]], dict[str, bool]]:
    """Keep the finalists that stay byte-identical on every further seed (a failure is recorded as
    ``failed_seed``) and give the same bytes on two runs. The bench is left on the last seed's operands.
    Returns (finalists, {str(config_key): deterministic})."""
    for s in seed_list[1:]:
        if not finalists:
            break
        bench.new_seed(s)
        keep = []
        for r in finalists:
            bench.out.fill_(float("nan"))
            bench.run_plan(r["plan"])
            if compare_bytes(bench.out, bench.ref)["equal"]:
                keep.append(r)
            else:
                r["failed_seed"] = s
        finalists = keep
    deterministic = {}
    for r in finalists:
        a = torch.empty_like(bench.out)
        bench.run_plan(r["plan"])
        bench.run_plan(r["plan"], a)
        deterministic[str(config_key(r["config"]))] = bool(torch.equal(bench.out.view(torch.int16),
                                                                       a.view(torch.int16)))
        del a
    return [r for r in finalists if deterministic[str(config_key(r["config"]))]], deterministic


def _alternating_timing(bench: _Bench, finalists: list[dict[str, Any]], heur_plan: Any, heur_ws: torch.Tensor | None,
                        heur: Mapping[str, Any], rounds: int) -> dict[str, dict[str, float]]:
    """p50/min/max/mean per contender (``pinned<i>``, ``heuristic`` when it ran, ``reference``), timed in
    alternating order after one warm-up call each."""
    contenders: dict[str, Callable[[], Any]] = {}
    for i, r in enumerate(finalists):
        contenders[f"pinned{i}"] = (lambda p=r["plan"]: bench.run_plan(p))
    if heur_plan.ok and heur.get("status") == 0:
        contenders["heuristic"] = lambda: bench.run_plan(heur_plan, ws=heur_ws)
    contenders["reference"] = lambda: reference_gemm(bench.ops, bench.dtype, bench.scale_mode)
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up
        fn()
    _sync(bench.device)
    for order in alternating_order(list(contenders), rounds):
        for name in order:
            samples[name].append(_time_ms(contenders[name], bench.device))
    return {name: summarize_ms(v) for name, v in samples.items()}


def _entry(env: Fc2Environment, bench: _Bench, role: str, winner_info: Mapping[str, Any], producer: str | None,
           evidence: dict[str, Any]) -> Fc2Entry:
    """The table entry that pins the winner's configuration for this environment and shape."""
    return Fc2Entry(
        name=entry_name(env.device_name, role, bench.dtype, bench.m_logical),
        role=role,
        cc=env.cc,  # type: ignore[arg-type]
        sm_count=int(env.sm_count or 0),
        device_name=env.device_name,
        cuda_header=(env.cuda_header // 1000, (env.cuda_header % 1000) // 10),
        cublas_header=(env.cublas_header // 10000, (env.cublas_header % 10000) // 100),
        cuda_runtime=int(env.cuda_runtime),
        cublaslt_runtime=int(env.cublaslt_runtime),
        dtype=bench.dtype,
        out_dtype="bf16",
        m_logical=bench.m_logical,
        m_padded=bench.m_padded,
        n=bench.n,
        k=bench.k,
        algo=AlgoSpec.from_dict(winner_info["config"]),
        workspace_bytes=int(winner_info["workspace_required"]),
        pointer_mode=bench.pointer_mode,
        scale_mode=bench.scale_mode,
        producer=producer,
        source="h3-blackwell tune-fc2",
        evidence=evidence,
    )


def _open_bench(problem: TuneProblem, cache_dir: str | Path | None, device: torch.device | str, module: Any,
                say: Callable[[str], None]) -> tuple[_Bench, Fc2Environment, dict[str, Any]]:
    """Check the arguments, select the device, load the plan module and build the seed-0 bench.
    Returns (bench, the plans' environment, the module's build info)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    p = problem
    if p.dtype not in KINDS:
        raise TuneError(f"dtype {p.dtype!r}; expected one of {KINDS}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if module is None and cache_dir is None:
        raise TuneError("tune needs cache_dir (where the extension builds) or a plan module")
    mod = module if module is not None else ext.require(cache_dir)
    info = dict(mod.build_info())
    env = Fc2Environment.from_build_info(info)
    if env.cc is None:
        raise TuneError(f"no device for the plans: {env.device_error}")
    say(f"tune-fc2: {env.device_name} sm_{env.cc[0]}{env.cc[1]} x{env.sm_count} SMs, cuBLASLt {env.cublaslt_runtime}, "
        f"{p.dtype} M={p.m_logical}/{p.m_padded} N={p.n} K={p.k}")
    return _Bench(mod, p, device, say), env, info


def tune(problem: TuneProblem, sweep: TuneSweep = TuneSweep(), *, cache_dir: str | Path | None = None,
         device: torch.device | str = "cuda", producer: str | None = None, command: str | None = None,
         say: Callable[[str], None] = print, module: Any = None) -> dict[str, Any]:
    """Sweep, verify and time ``problem`` as far as ``sweep`` says; returns ``{"entry": <entry JSON or None>,
    "evidence": {...}}``.

    The timing baseline is the heuristic's own first choice with ``sweep.heuristic_workspace``
    bytes available (what cuBLASLt picks unpinned with a typical 32 MiB workspace). ``module`` is the
    plan module (default: the compiled extension through ``ext.require``); tests pass a CPU stand-in
    with the same Problem/Plan interface.
    """
    t_start = time.perf_counter()
    bench, env, info = _open_bench(problem, cache_dir, device, module, say)
    dtype, m_padded, n, k, workspace_limit = problem.dtype, problem.m_padded, problem.n, problem.k, \
        problem.workspace_limit
    sw = sweep
    heur_plan, heur_ws, heur = _heuristic_baseline(bench, sw.heuristic_workspace)
    ids, candidates = _candidates(bench, workspace_limit)
    found = _legal_plans(bench, candidates, workspace_limit, sw.check_seconds)
    legal, refused, ws_needed = found["legal"], found["refused"], found["ws_needed"]
    say(f"  {len(ids)} algo ids, {found['checked']} configurations checked, {len(legal)} legal "
        f"({', '.join(f'{k} {v}' for k, v in sorted(refused.items())) or 'none refused'})")
    if not legal and ws_needed is not None:
        say(f"  every configuration that passed AlgoCheck needs workspace (at least {ws_needed} bytes) and the limit "
            f"is {workspace_limit}: run again with a workspace limit (--workspace-mb) of at least that")
    results, truncated_runs = _exact_on_first_seed(bench, legal, sw.max_candidates, sw.run_seconds)
    exact = sorted((r for r in results if r["exact"]), key=lambda r: r["rough_ms"])
    say(f"  {len(results)} executed, {len(exact)} byte-identical to the reference")
    seed_list = list(range(sw.seeds))
    finalists, deterministic = _robust_finalists(bench, exact[: max(sw.top, 1)], seed_list)
    timing = _alternating_timing(bench, finalists, heur_plan, heur_ws, heur, sw.rounds)
    flop = 2.0 * m_padded * n * k
    evidence: dict[str, Any] = {
        "tool": "h3-blackwell tune-fc2",
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "build_info": info,
        "problem": {"dtype": dtype, "role": problem.role, "m_logical": problem.m_logical, "m_padded": m_padded,
                    "n": n, "k": k,
                    "pointer_mode": bench.pointer_mode, "scale_mode": bench.scale_mode,
                    "workspace_limit": workspace_limit,
                    "padding_rows": "zero (as the producer writes them)", "compared_rows": "all m_padded rows"},
        "reference": REFERENCE_NAME[dtype],
        "heuristic": heur,
        "sweep": {"algo_ids": ids, "configurations_checked": found["checked"], "legal": len(legal),
                  "refused_by_stage": refused, "least_workspace_refused": ws_needed,
                  "executed": len(results), "exact_seed0": len(exact), "truncated_checks": found["truncated"],
                  "truncated_runs": truncated_runs, "max_candidates": sw.max_candidates},
        "seeds": seed_list,
        "finalists": [{"name": f"pinned{i}", "config": r["config"], "rough_ms": r["rough_ms"]}
                      for i, r in enumerate(finalists)],
        "rejected_on_seed": [{"config": r["config"], "seed": r["failed_seed"]} for r in exact if "failed_seed" in r],
        "deterministic": deterministic,
        "timing": {"order": "alternating (forward on even rounds, reversed on odd)", "rounds": sw.rounds,
                   "ms": timing, "tflops_p50": {name: round(flop / (t["p50"] * 1e-3) / 1e12, 2)
                                                for name, t in timing.items()}},
        "inexact_examples": [{"config": r["config"], "mismatched": r.get("mismatched"), "status": r["status"]}
                             for r in results if not r["exact"]][:10],
        "seconds": round(time.perf_counter() - t_start, 2),
    }
    if not finalists:
        say("  no configuration was byte-identical to the reference on every seed: no entry written")
        return {"entry": None, "evidence": evidence}
    return {"entry": _record_winner(bench, env, problem.role, producer, finalists, timing, evidence).to_json(),
            "evidence": evidence}


def _record_winner(bench: _Bench, env: Fc2Environment, role: str, producer: str | None,
                   finalists: list[dict[str, Any]], timing: Mapping[str, Mapping[str, float]],
                   evidence: dict[str, Any]) -> Fc2Entry:
    """The fastest finalist (p50): its evidence and speed-ups go into ``evidence``; returns its entry."""
    best_i = min(range(len(finalists)), key=lambda i: timing[f"pinned{i}"]["p50"])
    winner_name = f"pinned{best_i}"
    info_w = dict(finalists[best_i]["plan"].info())
    p50w = timing[winner_name]["p50"]
    evidence["winner"] = {"name": winner_name, "config": info_w["config"], "p50_ms": p50w,
                          "waves": info_w["waves"], "workspace_required": info_w["workspace_required"]}
    if "heuristic" in timing:
        evidence["speedup_vs_heuristic"] = round(timing["heuristic"]["p50"] / p50w, 4)
    evidence["speedup_vs_reference"] = round(timing["reference"]["p50"] / p50w, 4)
    entry = _entry(env, bench, role, info_w, producer, evidence)
    bench.say(f"  winner {info_w['config']} p50 {p50w:.3f} ms"
              + (f", heuristic {timing['heuristic']['p50']:.3f} ms" if "heuristic" in timing else "")
              + f", reference {timing['reference']['p50']:.3f} ms")
    return entry


# ----------------------------------------------------------------------------------------------
# the tuner's results and its child process (the command line itself is cli/tune_fc2.py)


def auto_dtype(device: torch.device | str) -> str:
    """The operand dtype ``--dtype auto`` means on ``device``: nvfp4 on compute capability >= 10, else bf16."""
    return "nvfp4" if torch.cuda.get_device_capability(torch.device(device))[0] >= 10 else "bf16"


def write_entry(entry: Mapping[str, Any], cache_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a tuned entry's JSON to ``out`` (default: ``<cache_dir>/fc2_lt/table/<name>.json``, where
    ``Fc2Table.default`` picks it up); returns the path written."""
    if entry.get("schema") != ENTRY_SCHEMA:
        raise TuneError(f"entry schema {entry.get('schema')!r}; expected {ENTRY_SCHEMA!r}")
    path = Path(out) if out else table_dir(cache_dir) / f"{entry['name']}.json"
    text = json.dumps(dict(entry), indent=1, default=str)
    write_file(path, lambda tmp: tmp.write_text(text))  # a unique temporary name, then one rename
    return path


def _child_main(argv: Sequence[str]) -> int:
    """The child of :func:`tune_subprocess`: ``argv`` = [tune's keyword arguments as JSON, result path]. Writes
    ``{"entry", "evidence"}`` to the result path; exit status 0 entry found, 1 none exact, 2 error."""
    kw, result = json.loads(argv[0]), Path(argv[1])
    if not torch.cuda.is_available():
        print("error: tune-fc2 needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    res = tune(TuneProblem(**kw.pop("problem")), TuneSweep(**kw.pop("sweep")), **kw,
               say=lambda s: print(s, file=sys.stderr))
    result.write_text(json.dumps(res, indent=1, default=str))
    return 0 if res["entry"] is not None else 1
