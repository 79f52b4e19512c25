"""The LOSSY speed options of one sampling run (``LossySettings``): sparse attention's per-run routing and
per-step schedule switch, and the First-Block Cache. The model call (``runtime.sampling.model_call``) installs
them once per run: the sparse backend bound at load (an ops-level attention) gets the run's routing, and the
cache is installed on each plan of the run (``RunPlan.step_cache``), so neither travels through the calls.

- sparse attention (``attention=sparse`` at load, runtime.ops.sparse_attention): the routing comes from the run's
  packed layout, the dense/sparse switch from each step's model sigma and the video shift; ``tau`` may be set per
  run (the sampler node's widget), default the load options' ``sparse_tau``.
- First-Block Cache (runtime.sampling.step_cache): threshold per run, default the options' ``first_block_cache``
  (None = off).

Neither works with sequence parallelism yet (a rank sees its rows only); that is refused before any work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..errors import H3Error
from ..options import LossySettings, SparseSettings
from .step_cache import FirstBlockCache


def tower_ops(rt):
    """The BlockOps a Fun ControlNet tower runs with on ``rt``: None (the base's own) unless the base attends
    sparse, then the base's ops with its dense attention (core runs the tower dense)."""
    return None if rt.sparse is None else rt.ops.with_attention(rt.sparse.dense)


@dataclass
class LossyRun:
    """sparse: the runtime's SparseStepAttention or None; cache: a FirstBlockCache or None; settings: this run's sparse settings."""

    sparse: object | None
    cache: FirstBlockCache | None
    settings: Optional[SparseSettings] = None  # this run's sparse settings (None: the load's)
    cache_runs: list = field(default_factory=list)
    step: int = 0  # the run's current step (the model call's index in the run): the cache's step

    @classmethod
    def for_run(cls, rt, settings: LossySettings, parallel) -> Optional["LossyRun"]:
        """The context of one sampling run, or None when no lossy option is on."""
        sparse_tau = settings.sparse_tau
        threshold = rt.plan.first_block_cache if settings.first_block_cache is None else settings.first_block_cache
        given = "sparse settings" if settings.sparse is not None else f"sparse_tau={sparse_tau}"
        if (sparse_tau is not None or settings.sparse is not None) and rt.sparse is None:
            raise H3Error(f"{given} were given but the model was loaded with attention={rt.plan.attention}; load "
                          "it with attention=sparse (the sparse kernels are bound at load), or drop them")
        if rt.sparse is None and threshold is None:
            return None
        if parallel is not None:
            raise H3Error("sparse attention and the First-Block Cache do not run under sequence parallelism yet; "
                          "load with another attention backend and leave first_block_cache off, or run on one GPU")
        run = settings.sparse
        if run is None and sparse_tau is not None:
            run = dataclasses.replace(rt.sparse.settings, tau=float(sparse_tau))
        return cls(rt.sparse, None if threshold is None else FirstBlockCache(threshold), run)

    def begin_run(self, plan, shift_video: float) -> None:
        if self.sparse is not None:
            self.sparse.begin_run(plan.layout.segments, plan.layout.token_grid, shift_video, self.settings)
        if self.cache is not None:
            self.cache.reset()

    def branch(self, key, plan) -> None:
        """The next evaluation is conditioning ``key``'s (the run's first: 0), on ``plan``: sparse attention
        carries its statistics per conditioning (``SparseStepAttention.begin_branch``). The First-Block Cache
        follows one conditioning: a second one is refused (its cached residual would mix the branches)."""
        if key != 0 and self.cache is not None:
            raise H3Error("the First-Block Cache follows one conditioning per sampling run (expected: every "
                          "evaluation with the run's first conditioning; found: a second one, as CFG > 1 with a "
                          "negative prompt or a changed conditioning brings). Sample with cfg 1 (BasicGuider), or "
                          "leave first_block_cache off for CFG runs (sparse attention alone runs with CFG: it keeps "
                          "its statistics per conditioning, as core does)")
        if self.sparse is not None:
            self.sparse.begin_branch(key, plan.layout.segments, plan.layout.token_grid)

    def install(self, plan) -> None:
        """Install the cache on a plan of this run (its blocks then consult it at every step)."""
        if self.cache is not None:
            plan.step_cache = self

    def run(self, i: int, x, first, rest):
        """The installed cache's hook (``RunPlan.step_cache``): the plan's step ``i`` is counted as the run's."""
        return self.cache.run(self.step, x, first, rest)

    def begin_step(self, i: int, model_sigma: float) -> None:
        self.step = i
        if self.sparse is not None:
            self.sparse.begin_step(i, model_sigma)

    def end_run(self, measured: bool) -> None:
        if self.sparse is not None:
            self.sparse.end_run()
        if self.cache is not None and measured:
            self.cache_runs.append(self.cache.summary())

    def report(self) -> dict:
        """The report's ``sparse_attention`` / ``first_block_cache`` blocks (only for what was on)."""
        out = {}
        if self.sparse is not None:
            out["sparse_attention"] = self.sparse.summary()
        if self.cache is not None:
            last = self.cache_runs[-1] if self.cache_runs else self.cache.summary()
            out["first_block_cache"] = {"lossy": True, "threshold": self.cache.threshold,
                                        "reused_steps": last["reused_steps"], "rel_l1": last["rel_l1"],
                                        "reused_steps_per_measured_run": [r["reused_steps"] for r in self.cache_runs],
                                        "rule": "skip blocks 1.. and add their cached residual when the first "
                                                "block's residual change differs from the last computed step's "
                                                "by relative L1 < threshold"}
        return out
