"""What block streaming measured per evaluation (``BlockStreamer``): the copies into its slots and the compute
stream's waits for them, summarized once after the run's final synchronization."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StepStats:
    copies: list = field(default_factory=list)  # (start event, end event, bytes) on CUDA; (seconds, bytes) on CPU
    stalls: list = field(default_factory=list)  # (start event, end event) on the compute stream


def summarize(steps: list[StepStats], cuda: bool) -> dict:
    """Per evaluation: bytes copied, copy time, exposed (stalled) time and the hidden rest; their medians. CUDA:
    event times (call after the events completed); CPU: the synchronous copies' host seconds, all exposed."""
    per_step = []
    for st in steps:
        if cuda:
            copy_ms, exposed = (sum(c[0].elapsed_time(c[1]) for c in x) for x in (st.copies, st.stalls))
        else:
            copy_ms = exposed = 1e3 * sum(t for t, _ in st.copies)
        per_step.append({"bytes_copied": sum(c[-1] for c in st.copies), "copy_ms": copy_ms, "exposed_ms": exposed,
                         "hidden_ms": max(0.0, copy_ms - exposed)})

    def median(key):
        return statistics.median(p[key] for p in per_step) if per_step else None

    return {"evaluations": len(per_step), "bytes_copied_per_step": median("bytes_copied"),
            "copy_ms_per_step": median("copy_ms"), "copy_exposed_ms_per_step": median("exposed_ms"),
            "copy_hidden_ms_per_step": median("hidden_ms"), "per_step": per_step,
            "timing": ("CUDA events: copies on the copy stream, stalls where the compute stream waited for a "
                       "copy (medians over the evaluations)") if cuda else
                      "cpu emulation: synchronous host copies, all exposed (perf_counter)"}
