"""The jobs users run (issue 37), one definition each for every bench: canonical, turbo8, clip10s, turbo8_sparse.

A ``Job`` is sizes, steps, conditioning and the attention / LoRA it runs with; ``bench/user_jobs.py`` runs each
resident and under hard device-memory caps, on our stack and on ComfyUI core's. ``CAPS_GB``: None = resident.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SEED = 440420
TEXT_TOKENS = 100
CAPS_GB = (None, 16, 8)
# The released turbo LoRA's rank: ../shared/docs names lightx2v's file (h3-comfyui-facts.md §9, §11.4), not
# its rank, and we found it in no public source. The other widely used turbo LoRA's card
# (larryvrh/MiniMax-H3-Turbo-Lora, mirrored with its card at nyxia/H3-Loras) states rank 64, 16 on AdaLN.
# Every row records this (``lora_rank_source``).
TURBO_LORA_RANK = 64
TURBO_LORA_RANK_SOURCE = ("rank 64 on the block linears, as the public card of larryvrh/MiniMax-H3-Turbo-Lora's "
                          "mirror (nyxia/H3-Loras) states (it has 16 on AdaLN; ours keeps 64 there, the larger "
                          "cost); no public source we found gives the rank of lightx2v's 8-step file; "
                          "--lora-rank overrides")


@dataclass(frozen=True)
class SparseJob:
    """ComfyUI core's "Model Sparse Attention" node at its defaults (h3-comfyui-facts.md §11.2)."""

    method: str = "sol-attn"
    tau: float = 1.3
    start_percent: float = 0.2
    min_tokens: int = 12288
    extra_tokens: int = 256
    sinks: str = "exact_kv_and_rows"


@dataclass(frozen=True)
class Job:
    """One user job: fl2va when ``keyframes`` names pixel frames (first = 0, last = -1) else t2va."""

    name: str
    width: int = 1344
    height: int = 768
    frames: int = 124
    steps: int = 8
    keyframes: tuple[int, ...] = ()
    lora_rank: int | None = None  # a turbo LoRA of this rank on the stack (None: none)
    lora_mode: str = "merge"  # our default LoRA mode (runtime.lora.spec.LoraSpec)
    sparse: SparseJob | None = None
    sampler: str = "res_multistep"
    seed: int = SEED
    text_tokens: int = TEXT_TOKENS

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "width", "height", "frames", "steps", "sampler", "seed",
                                           "text_tokens", "lora_mode")}
        d.update(keyframes=list(self.keyframes), lora_rank=self.lora_rank,
                 sparse=None if self.sparse is None else vars(self.sparse).copy())
        return d


def canonical_job() -> Job:
    """The canonical job: t2va 1344x768, 124 frames, 12 steps, no LoRA."""
    return Job("canonical", steps=12)


def turbo8_job(rank: int = TURBO_LORA_RANK) -> Job:
    """fl2va 1344x768, 124 frames, first and last keyframes, 8 steps, a turbo LoRA of the released rank."""
    return Job("turbo8", keyframes=(0, -1), lora_rank=rank)


def clip10s_job(rank: int = TURBO_LORA_RANK) -> Job:
    """turbo8 at 243 frames (the 17k+5 grid: 10 s at 24 fps, 73,486 packed rows)."""
    return replace(turbo8_job(rank), name="clip10s", frames=243)


def turbo8_sparse_job(rank: int = TURBO_LORA_RANK) -> Job:
    """turbo8 with core's sparse-attention node at its defaults."""
    return replace(turbo8_job(rank), name="turbo8_sparse", sparse=SparseJob())


JOBS = {"turbo8": turbo8_job, "clip10s": clip10s_job, "turbo8_sparse": turbo8_sparse_job, "canonical": canonical_job}
USER_JOBS = ("turbo8", "clip10s", "turbo8_sparse")


def tiny(job: Job) -> Job:
    """The same job shrunk for the embedded tiny model on the CPU (--tiny): 128x96, 22 frames (39 with clip10s's
    longer clip), 2 steps, rank 4; sparse thresholds lowered so its few rows take the sparse path."""
    frames = 39 if job.frames > 124 else 22
    sparse = None if job.sparse is None else replace(job.sparse, min_tokens=0, extra_tokens=0)
    return replace(job, width=128, height=96, frames=frames, steps=2, text_tokens=16,
                   lora_rank=None if job.lora_rank is None else 4, sparse=sparse)
