"""A one-line progress bar on stderr that knows whether its line is still open, so a message printed after
it (an interruption, an error) starts on a line of its own."""

from __future__ import annotations

import sys
import time

_open_line = False  # a bar was drawn and its line not yet ended


def end_line() -> None:
    """End a progress line left open (before printing anything else on stderr)."""
    global _open_line
    if _open_line:
        sys.stderr.write("\n")
        sys.stderr.flush()
        _open_line = False


class Progress:
    """``progress(done, total)``: redraws ``label [###...] done/total seconds`` in place. Drawn when stderr is
    a terminal, when forced, or once the work has run 5 s."""

    def __init__(self, label: str, force: bool = False):
        self.label, self.t0 = label, time.perf_counter()
        self.enabled = force or sys.stderr.isatty()

    def __call__(self, done: int, total: int):
        global _open_line
        if not self.enabled and time.perf_counter() - self.t0 < 5.0:
            return
        w = 30
        fill = int(w * done / max(total, 1))
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (w - fill)}] {done}/{total} {el:6.1f}s")
        _open_line = True
        if done == total:
            end_line()
        sys.stderr.flush()
