"""Build and load the cuBLASLt extension (``csrc/fc2_nvfp4_lt.cpp``).

The extension is pure host C++ (it only calls cuBLASLt and the CUDA runtime API), so it is compiled
with the host compiler through ``torch.utils.cpp_extension.load`` and ninja; nvcc is never needed.
It needs three things that torch's own wheel does not ship:

- CUDA 13 headers: ``cuda_runtime_api.h`` (+ ``crt/``), ``nv/target`` (CCCL) and ``cublasLt.h``;
- ``libcublasLt.so.13`` and ``libcudart.so.13`` to link against.

They are looked up, in this order, in explicit arguments, the ``nvidia/cu13`` tree of the NVIDIA
wheels on ``sys.path`` (what a cu130 torch already depends on, and what the ``cuda-headers``
optional-dependency group installs for CI), ``torch.utils.cpp_extension.CUDA_HOME`` and
``/usr/local/cuda``. A libcublasLt already mapped into this process wins over any other copy, so the
extension links the very library torch uses.

Builds are cached per torch version, CUDA version, header versions, Python version and source hash
under ``RuntimeOptions.cache_dir/ext/<tag>``. Every failure (no headers, no ninja, a compile error, an
import error) ends in an :class:`ExtStatus` with ``ok=False`` and a reason a person can act on; this
module never raises for them. A compile failure is remembered on disk (``FAILED.json`` beside the
build) so later starts do not pay for a rebuild that will fail again; ``force=True`` retries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence


EXT_NAME = "h3_fc2_lt"
SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "fc2_nvfp4_lt.cpp"

# header file -> what it is, for the error message
_REQUIRED_HEADERS = {
    "cublasLt.h": "cuBLASLt (pip: nvidia-cublas)",
    "cuda_runtime_api.h": "CUDA runtime (pip: nvidia-cuda-runtime)",
    "crt/host_defines.h": "CUDA C runtime headers (pip: nvidia-cuda-crt)",
    "nv/target": "CCCL (pip: nvidia-cuda-cccl)",
}

INSTALL_HINT = (
    "install the CUDA 13 headers and libraries with `pip install -e '.[cuda-headers]'` "
    "(nvidia-cublas, nvidia-cuda-runtime, nvidia-cuda-crt, nvidia-cuda-cccl), or point CUDA_HOME at a "
    "CUDA 13 toolkit that has cuBLAS"
)


class ExtensionUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; ``str(e)`` says why and what to do."""


@dataclass(frozen=True)
class CudaPaths:
    """Where the CUDA headers and libraries for the build come from."""

    include_dirs: tuple[str, ...]
    cublaslt_lib: str
    cudart_lib: str
    cuda_header: int  # CUDART_VERSION of cuda_runtime_api.h, e.g. 13000
    cublas_header: int  # CUBLAS_VERSION of cublas_api.h, e.g. 130100
    cublaslt_already_loaded: bool  # the lib was taken from this process's memory map

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ExtStatus:
    """Outcome of :func:`load`. ``module`` is the imported extension when ``ok``."""

    ok: bool
    module: Any = None
    reason: str | None = None
    tag: str | None = None
    build_dir: str | None = None
    seconds: float = 0.0
    built_now: bool = False
    paths: CudaPaths | None = None
    build_info: dict[str, Any] | None = field(default=None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "tag": self.tag,
            "build_dir": self.build_dir,
            "seconds": round(self.seconds, 3),
            "built_now": self.built_now,
            "paths": self.paths.as_dict() if self.paths else None,
            "build_info": self.build_info,
        }


# ----------------------------------------------------------------------------------------------
# discovery


def _nvidia_roots() -> list[Path]:
    """``.../site-packages/nvidia`` directories on sys.path (a namespace package, maybe several)."""
    roots: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    for p in sys.path:
        cand = Path(p) / "nvidia"
        if cand.is_dir() and cand not in roots:
            roots.append(cand)
    return roots


def _cuda_home() -> Path | None:
    try:
        from torch.utils.cpp_extension import CUDA_HOME  # torch reads CUDA_HOME/CUDA_PATH/nvcc itself
    except Exception:  # noqa: BLE001 - any import problem just means "no toolkit known"
        return None
    return Path(CUDA_HOME) if CUDA_HOME else None


def _candidate_include_roots(extra: Iterable[str] | None) -> list[Path]:
    roots = [Path(p) for p in (extra or [])]
    for nv in _nvidia_roots():
        roots.append(nv / "cu13" / "include")
    home = _cuda_home()
    if home is not None:
        roots += [home / "include"] + [home / "targets" / t / "include" for t in ("x86_64-linux", "sbsa-linux")]
    roots.append(Path("/usr/local/cuda/include"))
    # CUDA 13 toolkits may keep CCCL (nv/target) only under include/cccl, which nvcc adds by itself
    roots += [r / "cccl" for r in list(roots)]
    out: list[Path] = []
    for r in roots:
        if r.is_dir() and r not in out:
            out.append(r)
    return out


def _candidate_lib_dirs(extra: Iterable[str] | None) -> list[Path]:
    dirs = [Path(p) for p in (extra or [])]
    for nv in _nvidia_roots():
        dirs.append(nv / "cu13" / "lib")
    home = _cuda_home()
    if home is not None:
        dirs += [home / "lib64", home / "lib"] + [home / "targets" / t / "lib" for t in ("x86_64-linux", "sbsa-linux")]
    dirs += [Path("/usr/local/cuda/lib64")]
    out: list[Path] = []
    for d in dirs:
        if d.is_dir() and d not in out:
            out.append(d)
    return out


def _define(path: Path, name: str) -> int | None:
    m = re.search(rf"#define\s+{name}\s+(\d+)", path.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def _header_versions(include_dirs: Sequence[str]) -> tuple[int, int]:
    cuda = cublas = None
    for d in include_dirs:
        p = Path(d)
        if cuda is None and (p / "cuda_runtime_api.h").is_file():
            cuda = _define(p / "cuda_runtime_api.h", "CUDART_VERSION")
        if cublas is None and (p / "cublas_api.h").is_file():
            major = _define(p / "cublas_api.h", "CUBLAS_VER_MAJOR")
            minor = _define(p / "cublas_api.h", "CUBLAS_VER_MINOR")
            patch = _define(p / "cublas_api.h", "CUBLAS_VER_PATCH")
            if major is not None and minor is not None and patch is not None:
                cublas = major * 10000 + minor * 100 + patch
    if cuda is None or cublas is None:
        raise ExtensionUnavailable(
            f"could not read CUDART_VERSION / CUBLAS_VERSION from {list(include_dirs)}; {INSTALL_HINT}"
        )
    return cuda, cublas


def mapped_libraries(stem: str) -> list[str]:
    """Paths of shared objects named ``stem*`` mapped into this process (Linux ``/proc/self/maps``).

    Two different paths for libcublasLt mean two copies side by side (e.g. conda + the wheel):
    the one torch uses and the one an extension was linked against may then differ.
    """
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    seen: list[str] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and os.path.basename(parts[-1]).startswith(stem) and parts[-1] not in seen:
            seen.append(parts[-1])
    return seen


def _find_lib(stem: str, major: int, lib_dirs: Sequence[Path]) -> tuple[str, bool]:
    soname = f"{stem}.so.{major}"
    for path in mapped_libraries(stem + ".so"):
        if os.path.basename(path).startswith(soname):
            return path, True
    for d in lib_dirs:
        for name in (soname, f"{stem}.so"):
            cand = d / name
            if cand.exists():
                return str(cand), False
    raise ExtensionUnavailable(
        f"{soname} not found (looked in the process memory map and {[str(d) for d in lib_dirs]}); {INSTALL_HINT}"
    )


def find_cuda(include_dirs: Iterable[str] | None = None, lib_dirs: Iterable[str] | None = None) -> CudaPaths:
    """Locate the CUDA 13 headers and libraries; raises :class:`ExtensionUnavailable` with the reason."""
    roots = _candidate_include_roots(include_dirs)
    chosen: list[str] = []
    missing: list[str] = []
    for header, what in _REQUIRED_HEADERS.items():
        hit = next((r for r in roots if (r / header).exists()), None)
        if hit is None:
            missing.append(f"{header} ({what})")
        elif str(hit) not in chosen:
            chosen.append(str(hit))
    if missing:
        raise ExtensionUnavailable(
            f"CUDA headers missing: {', '.join(missing)}; searched {[str(r) for r in roots] or 'nothing'}; "
            f"{INSTALL_HINT}"
        )
    cuda_hdr, cublas_hdr = _header_versions(chosen)
    if cuda_hdr < 12080 or cublas_hdr < 120800:
        raise ExtensionUnavailable(
            f"headers are CUDA {cuda_hdr} / cuBLAS {cublas_hdr}; block-scaled NVFP4 (CUDA_R_4F_E2M1, VEC16_UE4M3) "
            f"needs CUDA >= 12.8; {INSTALL_HINT}"
        )
    dirs = _candidate_lib_dirs(lib_dirs)
    lt, lt_loaded = _find_lib("libcublasLt", cublas_hdr // 10000, dirs)
    rt, _ = _find_lib("libcudart", cuda_hdr // 1000, dirs)
    return CudaPaths(tuple(chosen), lt, rt, cuda_hdr, cublas_hdr, lt_loaded)


# ----------------------------------------------------------------------------------------------
# build + load


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build_tag(paths: CudaPaths) -> str:
    import torch

    raw = (
        f"torch{torch.__version__}-cuda{torch.version.cuda or 'none'}-hdr{paths.cuda_header}"
        f"-cublas{paths.cublas_header}-py{sys.version_info[0]}{sys.version_info[1]}-{source_hash()[:12]}"
    )
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


_LOADED: dict[str, ExtStatus] = {}


def _failure(reason: str, t0: float, **kw: Any) -> ExtStatus:
    return ExtStatus(ok=False, reason=reason, seconds=time.perf_counter() - t0, **kw)


def _earlier_failure(build_dir: Path, t0: float, **kw: Any) -> ExtStatus | None:
    """The failure remembered in ``build_dir/FAILED.json`` from an earlier build of this exact tag, or None."""
    failed_marker = build_dir / "FAILED.json"
    if not failed_marker.is_file():
        return None
    try:
        prior = json.loads(failed_marker.read_text())
        why = prior.get("reason", "unknown")
    except (OSError, ValueError):
        why = "unreadable marker"
    return _failure(
        f"an earlier build of this exact configuration failed ({why}); log: {build_dir / 'build-error.log'}; "
        f"delete {failed_marker} or pass force=True to retry",
        t0,
        build_dir=str(build_dir),
        **kw,
    )


def _compile_failure(e: Exception, build_dir: Path, t0: float, **kw: Any) -> ExtStatus:
    """A compiler, linker or import error as a status: the full text goes to ``build-error.log``, the first
    diagnostic into the reason; a compile error is remembered in ``FAILED.json``."""
    text = f"{type(e).__name__}: {e}"
    log = build_dir / "build-error.log"
    try:
        log.write_text(text)
    except OSError:
        pass
    lines = text.splitlines()
    # the compiler's or linker's own diagnostic, not ninja's echo of the command line
    first = next((ln.strip() for ln in lines if "error:" in ln or "undefined reference" in ln),
                 lines[0] if lines else "unknown error")
    compile_failed = "Error building extension" in text
    if compile_failed:
        try:
            (build_dir / "FAILED.json").write_text(json.dumps({"reason": first[:500], "time": time.time()}))
        except OSError:
            pass
    kind = "build" if compile_failed else "load"
    return _failure(f"extension {kind} failed: {first[:500]} (full log: {log}); the FC2 Lt path falls back",
                    t0, build_dir=str(build_dir), **kw)


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir`` while torch builds or loads there (a no-op without flock).

    torch's own lock is a plain file (``build_dir/lock``): a build killed outright (SIGKILL, the OOM killer) leaves
    it behind, and every later build then waits for it forever. The kernel releases a flock when its holder dies,
    however it dies; while this process holds it no other build of this runtime can be in ``build_dir``, so a
    torch lock found then is stale and is removed (only where the flock is real)."""
    from ..io.atomic import folder_lock  # imported here: this module is read before torch is needed

    with folder_lock(build_dir) as held:
        if held:
            (build_dir / "lock").unlink(missing_ok=True)
        yield


def _compile(cpp_ext: Any, paths: CudaPaths, build_dir: Path, verbose: bool) -> Any:
    """``torch.utils.cpp_extension.load`` of the source against ``paths`` (host compiler, no nvcc), with the
    libraries' directories as rpath. Raises whatever the compiler, linker or import raises."""
    lib_dirs_used = sorted({os.path.dirname(paths.cublaslt_lib), os.path.dirname(paths.cudart_lib)})
    ldflags = [paths.cublaslt_lib, paths.cudart_lib] + [f"-Wl,-rpath,{d}" for d in lib_dirs_used]
    return cpp_ext.load(
        name=EXT_NAME,
        sources=[str(SOURCE)],
        extra_cflags=["-O2"],
        extra_include_paths=list(paths.include_dirs),
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        with_cuda=False,
        verbose=verbose,
    )


def _locate(include_dirs: Iterable[str] | None, lib_dirs: Iterable[str] | None,
            t0: float) -> tuple[CudaPaths, str] | ExtStatus:
    """(CUDA paths, build tag), or the failure that stops the build before it starts."""
    if not SOURCE.is_file():
        return _failure(f"extension source {SOURCE} is missing from the installed package", t0)
    try:
        paths = find_cuda(include_dirs, lib_dirs)
    except ExtensionUnavailable as e:
        return _failure(str(e), t0)
    try:
        return paths, build_tag(paths)
    except Exception as e:  # noqa: BLE001 - torch import problems end up here
        return _failure(f"cannot compute the build tag: {type(e).__name__}: {e}", t0, paths=paths)


def load(
    cache_dir: str | Path,
    *,
    include_dirs: Iterable[str] | None = None,
    lib_dirs: Iterable[str] | None = None,
    force: bool = False,
    verbose: bool = False,
) -> ExtStatus:
    """Build (if needed) and import the extension. Never raises for an environment problem.

    ``cache_dir`` (the plan's ``cache_dir``) holds the builds under ``ext/<tag>``. Returns the same
    :class:`ExtStatus` for the same build tag within one process.
    """
    t0 = time.perf_counter()
    located = _locate(include_dirs, lib_dirs, t0)
    if isinstance(located, ExtStatus):
        return located
    paths, tag = located
    if tag in _LOADED and not force:
        return _LOADED[tag]
    build_dir = Path(cache_dir).expanduser() / "ext" / tag
    where = dict(tag=tag, paths=paths)
    earlier = None if force else _earlier_failure(build_dir, t0, **where)
    if earlier is not None:
        return earlier
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _failure(f"cannot create the build directory {build_dir}: {e}", t0, **where)
    try:
        import torch.utils.cpp_extension as cpp_ext

        cpp_ext.verify_ninja_availability()
    except Exception as e:  # noqa: BLE001
        return _failure(
            f"ninja is required to build the extension ({e}); `pip install ninja` or install the ninja-build package",
            t0, build_dir=str(build_dir), **where)
    try:
        with _build_lock(build_dir):
            so_existed = any(build_dir.glob(f"{EXT_NAME}*.so"))
            module = _compile(cpp_ext, paths, build_dir, verbose)
    except Exception as e:  # noqa: BLE001 - compiler, linker and import errors all land here
        return _compile_failure(e, build_dir, t0, **where)
    try:
        info = dict(module.build_info())
    except Exception as e:  # noqa: BLE001
        return _failure(f"extension loaded but build_info() failed: {type(e).__name__}: {e}", t0,
                        build_dir=str(build_dir), **where)
    info["cublaslt_mapped"] = mapped_libraries("libcublasLt.so")
    status = ExtStatus(ok=True, module=module, tag=tag, build_dir=str(build_dir), seconds=time.perf_counter() - t0,
                       built_now=not so_existed, paths=paths, build_info=info)
    _LOADED[tag] = status
    return status


def require(cache_dir: str | Path, **kw: Any) -> Any:
    """:func:`load` for callers that cannot continue without the extension (the tuner, benchmarks)."""
    st = load(cache_dir, **kw)
    if not st.ok:
        raise ExtensionUnavailable(st.reason or "extension unavailable")
    return st.module
