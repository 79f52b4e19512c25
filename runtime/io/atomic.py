"""Atomic outputs: every file is written under a unique temporary name in its target folder, then renamed.

- :func:`write_file`: ``writer(tmp)`` then one ``os.replace`` onto the path. Two writers to one path each
  install their own complete file (the last rename wins); neither can rename the other's bytes, and nothing
  is left behind on an error or an interruption (SIGINT / SIGTERM unwind through here).
- :func:`write_dir`: several files written into a unique temporary folder inside the output folder, then
  moved in while holding an exclusive lock (``flock``) on that folder, so two runs into one folder never
  mix their files: the last run's set wins whole (a file of an earlier set that this set does not write, such
  as a preview, is removed with the same lock when the caller names it).
- Installing (the renames) is never cut in two by SIGINT / SIGTERM / SIGHUP: a signal that arrives then is held
  back until the output is whole, then delivered; the exception it raises carries ``written`` (the path that
  was installed), so a caller can say so instead of "nothing was written".
- :func:`save_tensors`: safetensors bytes written with Python's file I/O, so a full disk is an ``OSError``.

A write that fails for lack of space (ENOSPC, EDQUOT, EFBIG) raises :class:`OutputError` naming the file.

Temporary names carry the writer's process id (``.NAME.PID.XXXXXXXX.partial``, ``.h3-tmp-PID-XXXXXXXX``). A
writer killed outright (SIGKILL, a power cut) cannot remove its temporary file, which for a quantized
checkpoint is gigabytes; the next write to the same target removes the temporaries of writers that no longer
run on this host (a process id that is alive, or that cannot be checked, is left alone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from ..errors import H3Error

_NO_SPACE = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


class OutputError(H3Error):
    """An output that could not be written (no space left, a file size limit); nothing was left behind."""


def _os_errno(e: BaseException) -> int | None:
    """The OS error number of ``e``: an OSError's, or the ``(os error N)`` that safetensors' writer (Rust) puts in
    its message."""
    if isinstance(e, OSError):
        return e.errno
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return int(m.group(1)) if m else None


def no_space(e: BaseException, path: str | os.PathLike) -> OutputError | None:
    """The OutputError naming ``path`` when ``e`` is a full disk (or quota / file size limit), else None."""
    if _os_errno(e) not in _NO_SPACE:
        return None
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
    return OutputError(f"{path}: the disk is full or a size limit was reached while writing it ({why}); nothing "
                       "was written; free space or choose another location")


@contextlib.contextmanager
def no_space_is_a_refusal(path: str | os.PathLike) -> Iterator[None]:
    """Turn a full disk (or quota / file size limit) while writing ``path`` into an OutputError naming it."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - an OSError, or safetensors' own writer error carrying one
        full = no_space(e, path)
        if full is None:
            raise
        raise full from None


def refuse_replacing_inputs(outputs: Iterable[str | os.PathLike],
                            inputs: Mapping[str, Iterable[str | os.PathLike | None]]) -> None:
    """OutputError when an output would replace a file the same command reads. ``outputs``: the paths the writers
    rename onto (a final symbolic link is replaced, not written through: resolve it first where writing resolves
    it); ``inputs``: {what the files are (``--model``, ...): their paths (None entries are skipped)}."""
    read = {os.path.realpath(p): (what, p) for what, paths in inputs.items() for p in paths if p is not None}
    for out in map(Path, outputs):
        hit = read.get(os.path.join(os.path.realpath(out.parent), out.name))
        if hit is not None:
            raise OutputError(f"output {out} is the {hit[0]} file {hit[1]}, which this command reads; writing the "
                              "output would replace it; choose another output path")


def _dead(pid_text: str) -> bool:
    """True when ``pid_text`` is the id of a process that no longer runs here (never our own)."""
    if not pid_text.isdigit() or os.name != "posix":
        return False
    pid = int(pid_text)
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive under another user, or not checkable: leave it
        return False
    return False


def sweep_stale(folder: Path, prefix: str, rest: str) -> list[Path]:
    """Remove the entries of ``folder`` named ``prefix`` + a match of the regex ``rest`` whose first group (a
    process id) is dead (module docstring); returns what was removed. Never raises."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for e in entries:
        m = re.fullmatch(rest, e.name[len(prefix):]) if e.name.startswith(prefix) else None
        if m is None or not _dead(m.group(1)):
            continue
        with contextlib.suppress(OSError):
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e)
            else:
                e.unlink()
            removed.append(e)
    return removed


def temp_path(path: Path, suffix: str = ".partial") -> Path:
    """A new empty file with a unique hidden name beside ``path`` (``.NAME.PID.XXXXXXXX.partial``), after
    removing the temporaries dead writers left for ``path``; the caller renames it onto ``path`` or removes it.

    Its permissions are a new file's (0666 less the umask), as a plain write gives, not ``tempfile.mkstemp``'s
    0600: an output must stay readable to the other users a ComfyUI server or a shared model folder runs as."""
    sweep_stale(path.parent, f".{path.name}.", r"(\d+)\.[A-Za-z0-9_]+\.(?:partial|spool)")
    while True:
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    os.close(fd)
    return tmp


_DEFERRED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def _installing(target: Path | None) -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP back while an output is moved into place, then deliver the first one that
    came: its handler runs (when the output was installed, the exception a Python handler raises gets
    ``written = str(target)``) or, with the default action, the process ends as the signal ends it, only once the
    renames are over. A no-op off the main thread, where Python runs no signal handler, and for a signal the
    process ignores or that was handled outside Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []  # target None: a side file (a cache), never named as "written" in the interrupt line
    prev = {}
    for s in _DEFERRED:
        h = signal.getsignal(s)
        if h is None or h == signal.SIG_IGN:
            continue
        prev[s] = h
        signal.signal(s, lambda signum, frame: came.append(signum))
    whole = False
    try:
        yield
        whole = True
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        if came:
            _deliver(came[0], prev[came[0]], target if whole and target is not None else None)


def _deliver(signum: int, handler, written: Path | None) -> None:
    """Run ``handler`` for a signal held back by :func:`_installing` (SIG_DFL: raise the signal again)."""
    if not callable(handler):
        signal.raise_signal(signum)
        return
    try:
        handler(signum, None)
    except BaseException as e:
        if written is not None:
            e.written = str(written)
        raise


def write_file(path: str | os.PathLike, writer: Callable[[Path], None], output: bool = True) -> None:
    """``writer(tmp)`` beside ``path`` (its folder created), then one rename; nothing is left on failure.
    ``output``: the file is what the command was asked to write, so an interruption held back over its rename
    names it as written; False for a side file (a cache record) that the line must not name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    mode = stat.S_IMODE(tmp.stat().st_mode)  # a new file's (the umask's)
    try:
        with no_space_is_a_refusal(path):
            writer(tmp)
        os.chmod(tmp, mode)  # a writer may replace tmp with a 0600 file of its own (safetensors' save_file does)
        with _installing(path if output else None):
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def folder_lock(directory: Path) -> Iterator[bool]:
    """An exclusive advisory lock on ``directory`` itself (no lock file is left; the kernel releases it when its
    holder dies, however it dies); a no-op where the OS has no flock. Writers of one folder that hold it never
    interleave. Yields whether the lock is really held (False: no flock here)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _temp_folder(out_dir: Path) -> Path:
    """A new unique ``.h3-tmp-PID-XXXXXXXX`` folder inside ``out_dir`` (created as needed). Another run into the
    same folder that fails removes the folder when it made it and it is empty: made again, then."""
    for _ in range(100):
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(prefix=f".h3-tmp-{os.getpid()}-", dir=out_dir))
        except FileNotFoundError:  # removed between the two calls by that other run's cleanup
            continue
    raise OutputError(f"{out_dir}: the output folder kept disappearing while this run made its temporary folder "
                      "there (another program removes it); nothing was written; choose another output folder")


def write_dir(out_dir: str | os.PathLike, files: Mapping[str, Callable[[Path], None]],
              replaces: Iterable[str] = ()) -> None:
    """Write ``files`` ({name: writer(path)}) into ``out_dir`` as one set: each into a unique temporary folder
    inside ``out_dir``, then all moved in under the folder's lock. ``replaces``: names an earlier set may hold
    that this one does not write (an optional file, e.g. a preview): removed with the same lock, so the folder
    never shows an earlier run's file beside this run's. On failure nothing is moved, the temporary folder is
    removed, and ``out_dir`` too when this call created it and it is still empty."""
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep_stale(out_dir, ".h3-tmp-", r"(\d+)-[A-Za-z0-9_]+")
    moved = False
    tmp = None
    try:
        tmp = _temp_folder(out_dir)
        for name, writer in files.items():
            with no_space_is_a_refusal(out_dir / name):
                writer(tmp / name)
        stale = [n for n in replaces if n not in files]
        with folder_lock(out_dir):
            in_the_way = [n for n in files if (out_dir / n).is_dir() and not (out_dir / n).is_symlink()]
            if in_the_way:  # checked before the first rename: a set is installed whole or not at all
                raise OutputError(f"{out_dir / in_the_way[0]} is a directory, where this run writes the file "
                                  f"{in_the_way[0]}; nothing was written; move it away or choose another output "
                                  "folder")
            with _installing(out_dir):
                for name in files:
                    os.replace(tmp / name, out_dir / name)
                    moved = True
                for name in stale:  # an earlier set's file that this set has no counterpart of
                    p = out_dir / name
                    if p.is_symlink() or p.is_file():
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created and not moved:
            with contextlib.suppress(OSError):  # another run may be writing into it now
                out_dir.rmdir()


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, str] | None = None) -> None:
    """A safetensors file of ``tensors`` (CPU-contiguous copies made as needed) at ``path``, written with plain
    file I/O (errors are OSErrors, a full disk included)."""
    from safetensors.torch import save

    data = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                metadata=None if metadata is None else dict(metadata))
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
