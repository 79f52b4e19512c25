"""The progress line on stderr: ``label [####......] done/total  elapsed 0:12  ETA 0:31``, from the first update on.

On a terminal (or with ``force``) one line is redrawn in place; the module knows whether that line is still
open, so a message printed after it (an interruption, an error) starts on a line of its own. Elsewhere (a log
file, a pipe) each update that is due is a line of its own: the first at once, then one per tenth of the work
or per ``LOG_EVERY_S`` seconds, whichever comes first, and the last.
"""

from __future__ import annotations

import sys
import time

LOG_EVERY_S = 10.0
_open_line = False  # a bar was drawn in place and its line not yet ended


def end_line() -> None:
    """End a progress line left open (before printing anything else on stderr)."""
    global _open_line
    if _open_line:
        sys.stderr.write("\n")
        sys.stderr.flush()
        _open_line = False


def clock(seconds: float) -> str:
    """0:07, 1:05, 1:02:03."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def line(label: str, done: int, total: int, elapsed: float, width: int = 30) -> str:
    """One progress line (total <= 0: not known, no bar); the ETA assumes the remaining items take as long as the
    finished ones on average."""
    if total <= 0:
        return f"{label} {done}  elapsed {clock(elapsed)}"
    fill = int(width * min(done, total) / total)
    text = f"{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}  elapsed {clock(elapsed)}"
    if 0 < done < total:
        text += f"  ETA {clock(elapsed / done * (total - done))}"
    return text


class Progress:
    """``progress(done, total)``: the work's progress on stderr (see the module docstring). ``force``: redraw one
    line in place even when stderr is not a terminal."""

    def __init__(self, label: str, force: bool = False):
        self.label, self.t0 = label, time.perf_counter()
        self.in_place = force or sys.stderr.isatty()
        self._last_t, self._last_done, self._width = None, 0, 0

    def _due(self, done: int, total: int, now: float) -> bool:
        if self.in_place or self._last_t is None or 0 < total <= done:
            return True
        return now - self._last_t >= LOG_EVERY_S or (total > 0 and (done - self._last_done) * 10 >= total)

    def __call__(self, done: int, total: int):
        global _open_line
        now = time.perf_counter()
        if not self._due(done, total, now):
            return
        self._last_t, self._last_done = now, done
        text = line(self.label, done, total, now - self.t0)
        if self.in_place:
            self._width = max(self._width, len(text))
            sys.stderr.write("\r" + text.ljust(self._width))  # spaces over what a longer earlier line left
            _open_line = True
            if 0 < total <= done:
                end_line()
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
