"""The package's structure: no import cycles, no hidden ones, runtime/ never imports ComfyUI, short functions.
(The default tiny run's determinism and accuracy: tests/runtime/sampling/test_determinism.py.)"""

import ast
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "nodes", "cli", "comfy_client")
# who may import whom (folders of this package): the runtime stands alone, the ComfyUI adapter (nodes/) and the
# command line (cli/) sit on it, and the ComfyUI HTTP client (comfy_client/) stands alone beside cli/, which calls it
MAY_IMPORT = {"runtime": {"runtime"}, "nodes": {"nodes", "runtime"}, "cli": {"cli", "runtime", "comfy_client"},
              "comfy_client": {"comfy_client"}}

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported module of this package, imported inside a function?) for every import in ``path``."""
    me = _module_name(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level:
            base = pkg[:len(pkg) - (n.level - 1)] + (n.module.split(".") if n.module else [])
            cands = [".".join(base + [a.name]) for a in n.names] + [".".join(base)]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("h3_blackwell."):
            base = n.module.split(".")[1:]
            cands = [".".join(base + [a.name]) for a in n.names] + [".".join(base)]
        elif isinstance(n, ast.Import):
            cands = [a.name.removeprefix("h3_blackwell.") for a in n.names if a.name.startswith("h3_blackwell.")]
        else:
            continue
        for c in cands:
            if c in modules:
                out.append((c, id(n) in local))
                break
    return out


def _graph():
    files = [p for d in PACKAGES for p in (ROOT / d).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(1000, 10 * len(edges)))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_counting_function_local_imports():
    """A function-local import does not hide a cycle: every import counts."""
    g = _graph()
    assert len(g) > 30, "the package walk found too few modules"
    cycles = _cycles({m: {t for t, _ in imps if t != m} for m, imps in g.items()})
    assert cycles == [], f"import cycles: {cycles}"


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a two-module cycle and a three-module one are reported, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_runtime_never_imports_comfyui():
    for p in (ROOT / "runtime").rglob("*.py"):
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
            bad = [x for x in names if x.split(".")[0] in ("comfy", "folder_paths", "comfy_extras", "nodes")]
            assert not bad, f"{p.relative_to(ROOT)} imports {bad}: runtime/ never imports ComfyUI"


# Functions in runtime/, cli/ and nodes/ are at most MAX_FUNCTION_LINES long (issues 14, 36), counted from the `def`
# line to the last line without the docstring: a docstring states the contract, and the rule must not push contracts
# out.
MAX_FUNCTION_LINES = 80
# The only exceptions allowed: Triton kernels (decorated @triton.jit, whose bodies cannot call Python helpers
# and where a split costs a launch or a register round trip), each listed as "path::name" with why. None is
# that long today.
LONG_TRITON_KERNELS: dict[str, str] = {}


def _function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    doc = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        doc = body[0].end_lineno - body[0].lineno + 1
    return fn.end_lineno - fn.lineno + 1 - doc


def _is_triton_jit(fn) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in fn.decorator_list)


def test_no_function_longer_than_80_lines():
    long, kernels = [], {}
    for d in ("runtime", "cli", "nodes"):
        for p in sorted((ROOT / d).rglob("*.py")):
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{p.relative_to(ROOT)}::{n.name}"
                    kernels[where] = _is_triton_jit(n)
                    if _function_lines(n) > MAX_FUNCTION_LINES and where not in LONG_TRITON_KERNELS:
                        long.append(f"{where} ({_function_lines(n)} lines)")
    not_kernels = [w for w in LONG_TRITON_KERNELS if not kernels.get(w)]
    assert not not_kernels, f"the allow-list holds Triton kernels only; these are not @triton.jit: {not_kernels}"
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (docstring not counted): {long}; split them into "
                      "named steps")


# Functions in runtime/, cli/ and nodes/ take at most MAX_PARAMETERS parameters (issue 36): self/cls not counted,
# *args and **kwargs counted as one each; Triton kernels (@triton.jit) are excluded (their launch wrappers are not).
# More settings travel as one value (a dataclass), not as a long keyword list.
MAX_PARAMETERS = 8


def _parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len([n for n in names if n not in ("self", "cls")])


def _too_many_parameters(tree: ast.AST, where: str) -> list[str]:
    return [f"{where}:{n.lineno} {n.name} ({_parameter_count(n)} parameters)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_jit(n)
            and _parameter_count(n) > MAX_PARAMETERS]


def test_parameter_checker_counts_what_the_rule_counts():
    """The checker itself: self/cls free, keyword-only, *args and **kwargs count; a Triton kernel is excluded."""
    src = ("def ok(self, a, b, c, d, e, f, g, h): pass\n"
           "def bad(a, b, c, d, e, f, g, *, h, **kw): pass\n"
           "class C:\n    @classmethod\n    def m(cls, a, b, c, d, e, f, g, h, *rest): pass\n"
           "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h, i, j): pass\n")
    found = _too_many_parameters(ast.parse(src), "x.py")
    assert found == ["x.py:2 bad (9 parameters)", "x.py:5 m (9 parameters)"], found


def test_no_function_takes_more_than_8_parameters():
    many = []
    for d in ("runtime", "cli", "nodes"):
        for p in sorted((ROOT / d).rglob("*.py")):
            many += _too_many_parameters(ast.parse(p.read_text()), str(p.relative_to(ROOT)))
    assert not many, (f"functions with more than {MAX_PARAMETERS} parameters (self/cls not counted): {many}; pass "
                      "related settings as one dataclass value")


def test_options_defined_once_with_ignored_seed_names():
    """Seed names that change nothing here are accepted with the reason and kept out of `configuration`;
    the precision option's earlier half-names map onto it and refuse a contradiction."""
    from h3_blackwell.runtime.options import CHOICES, IGNORED_ENV, RuntimeOptions

    env = {"H3_SAGE_QKV_LAYOUT": "contiguous", "H3_NVFP4_SCALE_BACKEND": "vortex", "H3_ATTENTION": "sdpa"}
    o = RuntimeOptions.from_env(env)
    assert set(o.ignored) == {"H3_SAGE_QKV_LAYOUT", "H3_NVFP4_SCALE_BACKEND"}
    cfg = o.as_env()
    assert not set(cfg) & set(IGNORED_ENV) and cfg["H3_ATTENTION"] == "sdpa"
    assert RuntimeOptions().precision == CHOICES["precision"][0] == "fast"
    assert RuntimeOptions.from_env({"H3_FP8_ACCUM": "fp32"}).precision == "exact"
    assert RuntimeOptions.from_env({"H3_SILU": "exact", "H3_FP8_ACCUM": "fp32"}).precision == "exact"
    with pytest.raises(ValueError, match="different precisions"):
        RuntimeOptions.from_env({"H3_SILU": "exact", "H3_FP8_ACCUM": "fast"})
    with pytest.raises(ValueError, match="precision"):
        RuntimeOptions(precision="medium")


def test_plan_reads_no_tensor_and_orders_its_choices(tmp_path, monkeypatch):
    """The load plan is made from the header alone (no tensor read) and resolves gemm -> act_format -> FC2
    -> attention -> V handling; FC2 is 'not applicable' with W4A8 and off on the CPU."""
    from h3_blackwell.runtime.io import checkpoint as ck
    from h3_blackwell.runtime.model.tiny import save_tiny
    from h3_blackwell.runtime.options import RuntimeOptions
    from h3_blackwell.runtime.plan import make_plan

    path = save_tiny(tmp_path / "t.safetensors", seed=1)
    monkeypatch.setattr(ck, "_read_raw", lambda *a, **k: (_ for _ in ()).throw(AssertionError("tensor read")))
    plan = make_plan(path, RuntimeOptions(device="cpu", gemm="fp8"))
    assert list(plan.choices)[:5] == ["gemm", "act_format", "fc2_lt", "attention", "v_handling"]
    assert plan.gemm == "fp8" and plan.act_format == "fp8"
    assert plan.choices["fc2_lt"].choice.startswith("not applicable")
    plan = make_plan(path, RuntimeOptions(device="cpu"))
    assert plan.act_format == "nvfp4" and plan.choices["fc2_lt"].choice == "off"
    dense = make_plan(path, RuntimeOptions(device="cpu", quantize=False))
    assert dense.gemm == "dense" and dense.act_format == "dense"


def test_every_registered_backend_available_here_matches_its_reference():
    """The registry is the one table of backends: every one its capability check accepts on this device runs
    and matches its reference on random data (never zeros), each bound as a load binds it (registry.bind). Attention:
    fp32, the summation order alone differs (1e-5). GEMMs: NVFP4 operands; tolerances are the load-time probe's
    (ops.gemm_backends.PROBE_TOL: the fp8 path
    rounds the operands to e4m3 rowwise), 1e-5 for the exact emulation, 1e-2 for bf16 (the dequantized
    operands rounded to bf16, 2^-8 each). Sparse attention is lossy by design
    and has its own tests (tests/runtime/ops/test_sparse_attention.py)."""
    from h3_blackwell.runtime.ops import gemm_backends, nvfp4
    from h3_blackwell.runtime.ops.attention import exact_attention_reference, qkv_views
    from h3_blackwell.runtime.ops.registry import REGISTRY, bind, capability_table

    dev = torch.device("cpu")
    table = {op: {r["backend"]: r for r in rows} for op, rows in capability_table(dev).items()}
    assert set(table) == set(REGISTRY) and all(len(table[op]) == len(REGISTRY[op]) for op in REGISTRY)
    g = torch.Generator().manual_seed(0)
    heads, hd, s = 3, 32, 70
    qkv = torch.randn(s, 3 * heads * hd, generator=g)
    ref = exact_attention_reference(*qkv_views(qkv, heads, hd))
    ran = []
    for b in REGISTRY["attention"]:
        if not table["attention"][b.name]["available"] or b.name == "sparse":
            continue
        out = bind("attention", b.name, head_dim=hd, device=dev)(qkv)
        assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-5, b.name
        ran.append(b.name)
    a = nvfp4.quantize(torch.randn(48, 64, generator=g))
    w = nvfp4.quantize(torch.randn(40, 64, generator=g))
    scratch = gemm_backends.Scratch()
    gref = bind("gemm", "reference")(a, w, torch.float32, scratch).double()
    for b in REGISTRY["gemm"]:
        if not table["gemm"][b.name]["available"] or b.name == "reference":
            continue
        got = bind("gemm", b.name)(a, w, torch.float32, scratch).double()
        tol = gemm_backends.PROBE_TOL.get(b.name, 1e-5 if b.name == "emulated" else 1e-2)
        assert float((got - gref).norm() / gref.norm()) < tol, b.name
        ran.append(b.name)
    assert {"reference", "sdpa", "emulated", "fp8"} <= set(ran), ran


def test_report_carries_the_registry_capability_table():
    """Every registered backend appears in the load plan's capability table and in the report, with a reason."""
    from h3_blackwell.runtime import RuntimeOptions, load_model
    from fixtures.sampling import sample
    from h3_blackwell.runtime.ops.registry import REGISTRY

    rt = load_model(None, RuntimeOptions(device="cpu", dtype="float32"))
    rep = sample(rt, torch.randn(1, 5, rt.config.text_dim), None, torch.zeros(1, 24, 2, 4, 4),
                 torch.zeros(1, 32, 2, 4), seed=1, steps=1).report
    for op, backends in REGISTRY.items():
        rows = {r["backend"]: r for r in rep["capabilities"][op]}
        assert set(rows) == {b.name for b in backends}, op
        assert all(r["reason"] for r in rows.values()), op
    assert rows["reference"]["available"] is True


# ---------------------------------------------------------------------------------------------
# layers: cli/ and nodes/ see the runtime only through its public names; no folder imports one that imports it
# ---------------------------------------------------------------------------------------------

def _runtime_reaches(path: Path, source: str | None = None) -> tuple[list[str], list[str]]:
    """(imports of a ``runtime`` submodule, names imported from ``h3_blackwell.runtime`` itself) in ``path``'s
    source, relative imports (``..runtime.x``) and function-local ones included. A name that is a submodule
    (``from ..runtime import sampling``) counts as a submodule import."""
    me = _module_name(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    subs, names = [], []
    for n in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(n, ast.ImportFrom):
            mod = ".".join(pkg[:len(pkg) - (n.level - 1)] + (n.module.split(".") if n.module else [])) if n.level \
                else (n.module or "").removeprefix("h3_blackwell.") if (n.module or "").startswith("h3_blackwell") \
                else None
            targets = [mod] if mod != "" else []
            if mod == "":  # `from .. import runtime` / `from h3_blackwell import runtime.x`
                targets = [a.name for a in n.names]
            for t in targets:
                if t is None or not (t == "runtime" or t.startswith("runtime.")):
                    continue
                if t != "runtime":
                    subs.append(t)
                    continue
                for a in n.names:
                    sub = ROOT / "runtime" / a.name
                    (subs if sub.is_dir() or sub.with_suffix(".py").exists() else names).append(
                        f"runtime.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() else a.name)
        elif isinstance(n, ast.Import):
            subs += [a.name.removeprefix("h3_blackwell.") for a in n.names
                     if a.name.startswith("h3_blackwell.runtime.")]
    return subs, names


def test_layer_checker_sees_every_form_of_submodule_import():
    """The checker itself: relative and absolute, module-level and function-local, a submodule imported as a
    name; the package's public names pass."""
    p = ROOT / "cli" / "commands.py"
    src = ("from ..runtime.io.header import read_header\n"
           "from ..runtime import sampling, run\n"
           "import h3_blackwell.runtime.plan\n"
           "from h3_blackwell.runtime.model import layout\n"
           "from h3_blackwell.runtime import make_job\n"
           "def f():\n    from ..runtime.errors import H3Error\n")
    subs, names = _runtime_reaches(p, src)
    assert subs == ["runtime.io.header", "runtime.sampling", "runtime.plan", "runtime.model", "runtime.errors"], subs
    assert names == ["run", "make_job"], names


def test_cli_and_nodes_import_only_the_runtime_package():
    """``cli/`` and ``nodes/`` reach the runtime through ``h3_blackwell.runtime`` itself, and only through names
    it lists in ``__all__`` (its public API, documented in the README)."""
    import h3_blackwell.runtime as rt

    bad, private = [], []
    for d in ("cli", "nodes"):
        for p in sorted((ROOT / d).rglob("*.py")):
            subs, names = _runtime_reaches(p)
            bad += [f"{p.relative_to(ROOT)}: {s}" for s in subs]
            private += [f"{p.relative_to(ROOT)}: {n}" for n in names if n not in rt.__all__]
    assert not bad, f"cli/ and nodes/ import runtime submodules (use h3_blackwell.runtime's public names): {bad}"
    assert not private, f"names imported from h3_blackwell.runtime that are not in its __all__: {private}"


def test_each_folder_imports_only_what_the_layers_allow():
    """runtime/ imports none of the others; nodes/ only the runtime; cli/ the runtime and the ComfyUI client;
    comfy_client/ nothing of this package (it is the standalone HTTP client that ``comfy-run`` calls)."""
    bad = [f"{m} imports {t}" for m, imps in _graph().items() for t, _ in imps
           if t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]]
    assert not bad, f"imports across the layers (allowed: {MAY_IMPORT}): {bad}"
    assert any(t.startswith("comfy_client") for t, _ in _graph()["cli.comfy_run"]), "cli/comfy_run.py calls the client"


def test_no_two_folders_import_each_other():
    """The import graph folded to folders two levels down (runtime/model/*.py -> runtime.model; cli/x.py stays
    cli.x), as ``import_cycles.py --depth 2`` folds it: no cycle, so every folder is one layer."""
    folded: dict[str, set[str]] = {}
    for m, imps in _graph().items():
        top = ".".join(m.split(".")[:2])
        folded.setdefault(top, set()).update(".".join(t.split(".")[:2]) for t, _ in imps)
    folded = {m: deps - {m} for m, deps in folded.items()}
    assert len(folded) > 20, "the fold found too few folders"
    assert _cycles(folded) == [], f"folders that import each other: {_cycles(folded)}"


def test_ops_files_are_at_most_400_lines():
    """runtime/ops/ holds one concern per file (issue 22): no file over 400 lines."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "runtime" / "ops").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files in runtime/ops over 400 lines: {long}"


def test_tests_never_import_bench():
    """Benches are scripts; tests do not depend on them (no bench/ on sys.path, no import of a bench module)."""
    bench_modules = {p.stem for p in (ROOT / "bench").glob("*.py")}
    bad = []
    for p in (ROOT / "tests").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
            bad += [f"{p.relative_to(ROOT)}: import {x}" for x in names
                    if x.split(".")[0] in bench_modules | {"bench"} or x.startswith("h3_blackwell.bench")]
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("sys.path.insert", "sys.path.append") \
                    and "bench" in ast.unparse(n):
                bad.append(f"{p.relative_to(ROOT)}: puts bench/ on sys.path")
    assert not bad, bad
