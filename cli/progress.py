"""The progress line on stderr: ``label [####......] done/total  elapsed 0:12  ETA 0:31``, from the first update on.

On a terminal (or with ``force``) one line is redrawn in place; the module knows whether that line is still
open, so a message printed after it (an interruption, an error) starts on a line of its own. Elsewhere (a log
file, a pipe) each update that is due is a line of its own: the first at once, then one per tenth of the work
or per ``LOG_EVERY_S`` seconds, whichever comes first, and the last. A step slower than ``SLOW_STEP_S`` shows its
blocks too (the runtime calls ``Progress.block`` after each), and a run whose first block says it will take an hour
or more is a warning.
"""

from __future__ import annotations

import sys
import time

LOG_EVERY_S = 10.0
SLOW_STEP_S = 5.0       # a step running longer than this shows its blocks (Progress.block)
WARN_AFTER_S = 3600.0   # a run estimated to take this long or longer is a warning
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
    line in place even when stderr is not a terminal. ``steps`` / ``runs``: the sampling's steps per run and its
    runs (warmup included), for :meth:`block`'s estimate (0: not known, no estimate)."""

    def __init__(self, label: str, force: bool = False, steps: int = 0, runs: int = 1):
        self.label, self.t0 = label, time.perf_counter()
        self.in_place = force or sys.stderr.isatty()
        self._last_t, self._last_done, self._width = None, 0, 0
        self.steps, self.runs = steps, runs
        self._step_t0, self._first_block_end, self._warned = self.t0, self.t0, False

    def _due(self, done: int, total: int, now: float) -> bool:
        if self.in_place or self._last_t is None or 0 < total <= done:
            return True
        return now - self._last_t >= LOG_EVERY_S or (total > 0 and (done - self._last_done) * 10 >= total)

    def _emit(self, text: str, last: bool) -> None:
        global _open_line
        if self.in_place:
            self._width = max(self._width, len(text))
            sys.stderr.write("\r" + text.ljust(self._width))  # spaces over what a longer earlier line left
            _open_line = True
            if last:
                end_line()
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def __call__(self, done: int, total: int):
        now = time.perf_counter()
        self._step_t0 = now
        if not self._due(done, total, now):
            return
        self._last_t, self._last_done = now, done
        self._emit(line(self.label, done, total, now - self.t0), 0 < total <= done)

    def block(self, step: int, done: int, total: int):
        """After block ``done`` of ``total`` in step ``step`` (0-based): a step slower than SLOW_STEP_S shows its
        blocks with the step's and the run's ETA. The run's time is estimated from the first step's second block
        (the first block's clock also holds the run's set-up), and an estimate of WARN_AFTER_S or more is a warning
        (once)."""
        now = time.perf_counter()
        elapsed = now - self._step_t0
        if step == 0 and done == 1:
            self._first_block_end = now  # the second block's time is the first that is a block's alone
        elif step == 0 and done == 2 and self.steps and not self._warned:
            self._warned = True
            self._warn(now - self._first_block_end, total)
        if elapsed < SLOW_STEP_S or (not self.in_place and self._last_t is not None
                                     and now - self._last_t < LOG_EVERY_S and done < total):
            return
        self._last_t = now
        name = f"{self.label} step {step + 1}" + (f"/{self.steps}" if self.steps else "") + " blocks"
        text = line(name, done, total, elapsed)
        if self.steps and 0 < done:
            per_step = elapsed / done * total
            text += f"  run ETA {clock(per_step - elapsed + per_step * (self.steps - step - 1))}"
        self._emit(text, False)

    def _warn(self, block_s: float, blocks: int) -> None:
        estimate = block_s * blocks * self.steps * self.runs
        if estimate < WARN_AFTER_S:
            return
        end_line()
        sys.stderr.write(f"warning: at this pace the run takes about {clock(estimate)} (one block took "
                         f"{block_s:.1f} s; {blocks} blocks x {self.steps} steps x {self.runs} run(s)); "
                         "Ctrl-C stops it, and fewer pixels, frames or steps shorten it\n")
        sys.stderr.flush()
