"""Training-free sparse attention (Sol-Attn, comfy-kitchen's ``sol_attn``) over the packed H3 sequence. LOSSY.

What it computes (per head, on 64-row blocks of the packed sequence; :func:`sol_attention_reference`):

- key block ``j`` is summarised by its mean key ``kc_j`` (centred by the mean over blocks ``k_mu``) and the
  SUM of its values ``vc_j``; query block ``i`` by its mean query ``c_i``.
- block score ``m_ij = c_i . (kc_j - k_mu) * scale * log2(e)``; threshold
  ``thr_i = tau * sqrt(sum_d c_id^2 * var_j(kc_jd) * (scale * log2 e)^2 + 1e-6)``.
- key block ``j`` is EXACT for query block ``i`` when ``m_ij > thr_i``, ``|i - j| <= 1``, ``j`` is a sink
  block, or ``i`` is a dense query block. Every row of query block ``i`` then attends the exact blocks'
  tokens (logits ``q_t . (k - k_mu)``) and one pooled term per other block (logit ``m_ij``, weight = the
  block's row count, value ``vc_j / rows``), all in one base-2 softmax.

Which blocks are sinks and dense, and which steps run sparse: ``ops.sparse_routing``.

The fused kernel is comfy-kitchen's ``sol_attn`` (an OPTIONAL dependency, imported lazily): CUDA sm_80+
(sm_90 included), bf16/fp16, head_dim 128. It reads q, k, v as ``[1, S, H, 128]`` strided views of the
packed qkv buffer when its stride rules hold (last dim contiguous, 16-byte aligned base, strides of the
other dims multiples of 8 elements); otherwise the views are copied and :class:`SolAttention` counts the
copies. Its int8 internals and its ``token_aug`` extra tokens are not modelled by the reference (the
reference is the ``token_aug = 0`` algorithm in fp32).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..errors import H3Error
from ..options import SparseSettings
from .reference import modulated, qk_norm_rope
from .sparse_methods import (PRODUCER_CHUNK, KernelArgs, VsaPlan, core_sinks, pad_rows, pooled_stats, rope_freqs,
                             sol_reference, vsa_plan)
from .sparse_routing import BLOCK, DEFAULT_EXTRA_TOKENS, SparseRouting, percent_to_sigma, routing_for_segments

__all__ = [
    "SparseUnavailable",
    "SolAttention",
    "SparseBlockCall",
    "SparseSettings",
    "SparseStepAttention",
    "bind_sparse",
    "choose_sparse",
    "reference_kernel",
    "sparse_check",
    "sol_attention_reference",
    "sol_unavailable_reason",
    "stride_rules_hold",
]

log = logging.getLogger("h3_blackwell")
HEAD_DIM = 128                # the only head_dim the fused kernel takes
# the fused kernel's dense query rows vs sol_attention_reference on random N(0,1) bf16 q/k/v
PROBE_TOLERANCE = (0.1, "int8 q and k inside the kernel (comfy-kitchen: 'expect cos ~0.999', i.e. rel-L2 up to "
                        "~0.045); a broken kernel gives ~1")


class SparseUnavailable(H3Error):
    """The sparse backend cannot run here (no comfy-kitchen, no kernel for this GPU, wrong dtype/shape)."""


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------

def sol_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routing: SparseRouting, *,
                            scale: Optional[float] = None, query_blocks: int = 16) -> torch.Tensor:
    """Sol-Attn (token_aug = 0) in fp32 for ``[S, H, D]`` (or ``[1, S, H, D]``) q, k, v of any strides, with the
    routing's tau, sinks and dense query rows (``sparse_methods.sol_reference``). Returns ``[S, H*D]`` fp32."""
    if q.dim() == 4:
        q, k, v = q[0], k[0], v[0]
    t, h, d = q.shape
    if k.shape != q.shape or v.shape != q.shape or t != routing.seq_len:
        raise H3Error(f"q, k, v must be [S, H, D] alike with S = routing.seq_len = {routing.seq_len}; found "
                      f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    args = KernelArgs(routing.tau, sink=routing.sink_blocks, sink_q=routing.dense_q_blocks)
    return sol_reference(q, k, v, args, scale=scale, query_blocks=query_blocks).reshape(t, h * d)


# ---------------------------------------------------------------------------------------------
# the fused kernel (comfy-kitchen, optional)
# ---------------------------------------------------------------------------------------------

def _kitchen() -> tuple[Any, str]:
    """(comfy_kitchen module, version) or (None, why not). Imported lazily: an optional dependency."""
    try:
        ck = importlib.import_module("comfy_kitchen")
    except Exception as e:  # ImportError, or a compiled extension that fails to load
        return None, (f"comfy-kitchen is not installed ({type(e).__name__}: {e}); install it "
                      f"(pip install comfy-kitchen>=0.2.40) to use attention=sparse")
    try:
        ver = importlib.metadata.version("comfy-kitchen")
    except Exception:
        ver = getattr(ck, "__version__", "unknown")
    if not hasattr(ck, "sol_attn") or not hasattr(ck, "sol_attn_is_available"):
        return None, f"comfy-kitchen {ver} has no sol_attn; install comfy-kitchen>=0.2.40"
    return ck, ver


def sol_unavailable_reason(device: torch.device | str, head_dim: int = HEAD_DIM,
                           dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """Why comfy-kitchen's fused ``sol_attn`` cannot run for these settings, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"sparse attention needs a CUDA GPU (comfy-kitchen's sol_attn kernel); the device is {device}"
    if head_dim != HEAD_DIM:
        return f"sol_attn takes head_dim {HEAD_DIM}; this model has head_dim {head_dim}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"sol_attn takes bfloat16 or float16 q/k/v; the compute dtype is {dtype} (use --dtype bfloat16)"
    ck, info = _kitchen()
    if ck is None:
        return info
    if not ck.sol_attn_is_available(device):
        cap = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
        return (f"comfy-kitchen {info} has no compiled sol_attn kernel for this GPU (compute capability {cap}; "
                f"the kernel needs sm_80 or newer and comfy-kitchen's CUDA extension)")
    return None


def stride_rules_hold(x: torch.Tensor) -> bool:
    """comfy-kitchen's sol_attn input rules for a ``[B, T, H, D]`` tensor: unit last stride, 16-byte aligned base,
    and every other dim of size > 1 with a stride that is a multiple of 8 elements."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        return False
    return all(x.shape[i] <= 1 or x.stride(i) % 8 == 0 for i in range(x.dim() - 1))


@dataclass
class SolAttention:
    """comfy-kitchen's fused ``sol_attn`` bound at load (``resolve``), fed from the packed qkv buffer.

    ``__call__(qkv [S, 3*H*D], heads, head_dim, routing) -> [S, H*D]`` in qkv's dtype. ``copies`` counts the
    q/k/v views that had to be copied because they broke the kernel's stride rules (calls, bytes).
    """

    ck: Any
    version: str
    copies: dict = field(default_factory=lambda: {"tensors": 0, "bytes": 0})

    @classmethod
    def resolve(cls, device: torch.device | str, head_dim: int = HEAD_DIM,
                dtype: torch.dtype = torch.bfloat16) -> "SolAttention":
        """The bound kernel, or SparseUnavailable with the reason (what is missing and what to do)."""
        reason = sol_unavailable_reason(device, head_dim, dtype)
        if reason is not None:
            raise SparseUnavailable(f"attention=sparse is not available: {reason}")
        ck, ver = _kitchen()
        return cls(ck, ver)

    def probe(self, device: torch.device | str, heads: int = 2, token_aug: int = DEFAULT_EXTRA_TOKENS,
              seq_len: int = 1024) -> dict:
        """One small call on ``device`` (the load-time check; raises SparseUnavailable when the kernel fails):
        every row finite, and the dense query rows (no routing involved) within PROBE_TOLERANCE of the fp32
        reference, at ``token_aug`` and at 0. Returns {"dense_rows_rel_l2": ...}."""
        g = torch.Generator(device=device).manual_seed(0)
        qkv = torch.randn(seq_len, 3 * heads * HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
        segs = [(0, 100, "text"), (100, 300, "audio"), (300, seq_len, "video")]
        try:
            out = self(qkv, heads, HEAD_DIM, routing_for_segments(segs, token_aug=token_aug))
            exact = routing_for_segments(segs, token_aug=0)
            out0 = self(qkv, heads, HEAD_DIM, exact)
        except Exception as e:
            raise SparseUnavailable(f"comfy-kitchen {self.version} sol_attn failed its load-time probe on {device}: "
                                    f"{type(e).__name__}: {e}") from e
        ref = sol_attention_reference(*qkv.unflatten(1, (3, heads, HEAD_DIM)).unbind(1), exact)
        a, b = exact.dense_rows()
        rel = max(float((o[a:b].double() - ref[a:b].double()).norm() / ref[a:b].double().norm()) for o in (out, out0))
        finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(out0).all())
        if not finite or not rel < PROBE_TOLERANCE[0]:
            raise SparseUnavailable(f"comfy-kitchen {self.version} sol_attn failed its load-time probe on {device}: "
                                    f"finite={finite}, dense-row rel-L2 {rel:.3g} against the fp32 reference "
                                    f"(allowed {PROBE_TOLERANCE[0]}: {PROBE_TOLERANCE[1]})")
        return {"dense_rows_rel_l2": rel, "seq_len": seq_len, "heads": heads, "token_aug": token_aug}

    def _operand(self, x: torch.Tensor) -> torch.Tensor:
        if stride_rules_hold(x):
            return x
        self.copies["tensors"] += 1
        self.copies["bytes"] += x.numel() * x.element_size()
        return x.contiguous()

    def __call__(self, qkv: torch.Tensor, heads: int, head_dim: int, routing: SparseRouting,
                 scale: Optional[float] = None) -> torch.Tensor:
        s = qkv.shape[0]
        if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * head_dim or s != routing.seq_len:
            raise H3Error(f"qkv must be [S, 3*H*D] = [{routing.seq_len}, {3 * heads * head_dim}]; found "
                          f"{tuple(qkv.shape)}")
        q, k, v = (self._operand(t.unsqueeze(0)) for t in qkv.unflatten(1, (3, heads, head_dim)).unbind(1))
        out = self.ck.sol_attn(q, k, v, tau=routing.tau, scale=scale, sink_blocks=list(routing.sink_blocks),
                               sink_q=list(routing.dense_q_blocks), token_aug=routing.token_aug)
        return out.view(s, heads * head_dim)

    def chunked(self, produce, n: int, heads: int, freqs: torch.Tensor, norm_weights, state, args: KernelArgs,
                eps: float):
        """comfy-kitchen's chunked producer, called as core's H3 block path calls it: ``produce()`` yields the
        pre-norm qkv chunks ([<=4096, 3*H*128] bf16) of ``n`` rows; the kernel applies q/k RMSNorm (``norm_weights``,
        ``eps``) and RoPE (``freqs`` [1, n, 1, 48, 2, 2]). ``state``: this block's (kmean, vscale) from its last
        sparse call, or None (cold). -> (out [1, n, H, 128] bf16, the next state)."""
        km, vs = (None, None) if state is None else state
        out, km, vs = self.ck.sol_attn_chunked(produce, n, heads, freqs, norm_weights, kmean=km, vscale=vs,
                                               rope_eps=eps, **args.kernel_kwargs())
        return out, (km, vs)


# ---------------------------------------------------------------------------------------------
# the step-aware backend the block stack calls
# ---------------------------------------------------------------------------------------------

def reference_kernel(qkv: torch.Tensor, heads: int, head_dim: int, routing: SparseRouting,
                     scale: Optional[float] = None) -> torch.Tensor:
    """The kernel's contract (``[S, 3*H*D]`` -> ``[S, H*D]`` in qkv's dtype) on :func:`sol_attention_reference`:
    the sparse backend on the CPU, where every op runs its reference."""
    q, k, v = qkv.unflatten(1, (3, heads, head_dim)).unbind(1)
    return sol_attention_reference(q, k, v, routing, scale=scale).to(qkv.dtype)


@dataclass
class SparseBlockCall:
    """One DiT block's inputs to the sparse path: its BlockOps (``ops.qkv`` produces the pre-norm qkv rows), index,
    the residual ``x`` [S, hidden], the attention modulation (shift, scale) and segments, the RoPE tables."""

    ops: Any
    index: int
    x: torch.Tensor
    shift: torch.Tensor
    scale: torch.Tensor
    segments: Any
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class SparseStepAttention:
    """Core's block-sparse attention (sol-attn, sla, vsa; ``SparseSettings``) for the block stack. LOSSY on its
    sparse calls. Bound once per load.

    Per run: ``begin_run(segments, grid, shift_video, settings)`` takes the packed layout (segments, the target
    video grid (T, H/2, W/2)), freezes the sigma window (the settings' frozen sigmas, else from the percents at
    the run's video shift) and clears the carried statistics; per step: ``begin_step(i, sigma)`` with the MODEL
    sigma; per block: ``takes(index, x)`` says whether the block runs sparse (window, min_tokens, dense_blocks,
    bf16 on CUDA as core), then ``block_attention(blk, call)`` -> [S, H*D]. Any other attention call
    (``__call__(qkv)``: dense blocks and steps, the tower, the refiner) runs ``dense``. ``kernel``: comfy-kitchen's
    kernels (SolAttention) or None (the eager reference, on the CPU). ``summary()`` is the report's block.
    """

    kernel: Any
    dense: Any
    heads: int
    head_dim: int
    settings: SparseSettings = SparseSettings()
    kernel_name: str = ""
    dense_name: str = ""
    run_settings: Optional[SparseSettings] = None
    segments: list = field(default_factory=list)
    grid: tuple = (0, 0, 0)
    window: tuple = (0.0, 0.0)
    sinks: tuple = ((0, 0), (0, 0))
    sparse_now: bool = False
    pooled: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    calls: dict = field(default_factory=lambda: {"sparse": 0, "dense": 0})
    notes: list = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.segments[-1][1] if self.segments else 0

    def begin_run(self, segments: Sequence[tuple[int, int, str]], grid: tuple[int, int, int], shift_video: float,
                  settings: Optional[SparseSettings] = None) -> None:
        s = (settings or self.settings).check()
        hi = percent_to_sigma(s.start_percent, shift_video) if s.sigma_start is None else float(s.sigma_start)
        lo = percent_to_sigma(s.end_percent, shift_video) if s.sigma_end is None else float(s.sigma_end)
        self.run_settings, self.segments, self.grid, self.window = s, list(segments), tuple(grid), (lo, hi)
        self.sinks = core_sinks(self.segments, self.seq_len, s.sinks)
        self.pooled, self.plans, self.steps, self.notes = {}, {}, [], []
        self.calls = {"sparse": 0, "dense": 0}
        self.sparse_now = False

    def begin_step(self, step: int, sigma: float) -> None:
        if self.run_settings is None:
            raise H3Error("sparse attention: begin_run(segments, grid, shift) must come before begin_step")
        lo, hi = self.window
        reason = None
        if sigma > hi or sigma < lo:
            reason = f"sigma {sigma:.6g} outside the sparse window [{lo:.6g}, {hi:.6g}]"
        elif self.seq_len < self.run_settings.min_tokens:
            reason = f"{self.seq_len} rows < min_tokens {self.run_settings.min_tokens}"
        self.sparse_now = reason is None
        self.steps.append({"step": step, "sigma": float(sigma), "sparse": self.sparse_now,
                           **({} if reason is None else {"dense_because": reason})})

    def end_run(self) -> None:
        """Back to dense until the next begin_run (a forward outside a sampling run stays dense)."""
        self.sparse_now = False

    def takes(self, index: int, x: torch.Tensor) -> bool:
        """Whether block ``index`` runs sparse on ``x`` [S, hidden] now (core's ``h3_eligible``)."""
        s = self.run_settings
        if not self.sparse_now or x.shape[0] != self.seq_len or index in s.dense_blocks:
            return False
        return x.device.type == "cpu" or x.dtype == torch.bfloat16

    def _plan(self, device) -> VsaPlan:
        key = str(device)
        if key not in self.plans:
            self.plans[key] = vsa_plan(self.segments, self.grid, device)
        return self.plans[key]

    def _inputs(self, blk, c: SparseBlockCall):
        """(produce, n, cos, sin, kernel args, VSA plan or None) of one block call (core's H3 block path):
        ``produce()`` yields the pre-norm qkv in 4096-row chunks, the GEMM shapes core's producer runs."""
        s, x, rows = self.run_settings, c.x, c.x.shape[0]
        if not s.vsa:
            def produce():
                for a in range(0, rows, PRODUCER_CHUNK):
                    b = min(rows, a + PRODUCER_CHUNK)
                    yield c.ops.qkv(c.index, blk, x[a:b], c.shift, c.scale, _clip(c.segments, a, b))

            args = KernelArgs(s.tau, s.topk_ratio, *self.sinks, token_aug=s.token_aug)
            return produce, rows, c.cos, c.sin, args, None
        plan = self._plan(x.device)
        gate_proj = blk.attn.to_gate_compress
        if gate_proj is None:
            self._note("VSA: the model has no to_gate_compress layers; running the fine stage without the coarse "
                       "branch")
        gate = None if gate_proj is None else x.new_empty(plan.n, self.heads * self.head_dim)
        src_host = plan.src.cpu()
        row_mod = torch.empty(rows, dtype=torch.int64)
        for a, b, r in c.segments:
            row_mod[a:b] = r

        def produce():  # core's order of work: the padded rows' chunks, pad rows zero in qkv and the gate
            for a in range(0, plan.n, PRODUCER_CHUNK):
                idx, live = plan.src[a:a + PRODUCER_CHUNK], plan.live[a:a + PRODUCER_CHUNK].unsqueeze(1)
                xc, segs = x[idx.clamp_min(0)], _runs(row_mod[src_host[a:a + PRODUCER_CHUNK].clamp_min(0)])
                if gate is not None:
                    hc = modulated(xc, blk.norm1, c.shift, c.scale, segs)
                    gate[a:a + xc.shape[0]] = gate_proj(torch.where(live, hc, torch.zeros_like(hc)))
                y = c.ops.qkv(c.index, blk, xc, c.shift, c.scale, segs)
                yield torch.where(live, y, torch.zeros_like(y))

        args = KernelArgs(s.tau, s.topk_ratio, (0, plan.n_prefix), (0, plan.n_prefix), tail=False,
                          block_len=plan.block_len,
                          coarse_gate=None if gate is None else gate.view(1, plan.n, self.heads, self.head_dim))
        return produce, plan.n, pad_rows(c.cos, plan), pad_rows(c.sin, plan), args, plan

    def block_attention(self, blk, c: SparseBlockCall) -> torch.Tensor:
        """The sparse attention of one block -> [S, H*D] in x's dtype (before out_proj)."""
        produce, n, cos, sin, args, plan = self._inputs(blk, c)
        key = (c.index, n)
        qw, kw = blk.attn.q_norm.weight, blk.attn.k_norm.weight
        eps = blk.attn.q_norm.eps
        if self.kernel is None:
            q, k, v = qk_norm_rope(torch.cat(list(produce())), qw, kw, cos, sin, self.heads, self.head_dim, eps)
            gate = None if args.coarse_gate is None else args.coarse_gate[0]
            out = sol_reference(q, k, v, dataclasses.replace(args, coarse_gate=gate))
            state = pooled_stats(k, v, args.block_len)
        else:
            out, state = self.kernel.chunked(produce, n, self.heads, rope_freqs(cos, sin), (qw, kw),
                                             self.pooled.get(key), args, eps)
        self.pooled[key] = state
        self.calls["sparse"] += 1
        out = out.reshape(n, self.heads * self.head_dim)
        return (out if plan is None else out[plan.inv]).to(c.x.dtype)

    def _note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)
            log.warning(message)

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        self.calls["dense"] += 1
        return self.dense(qkv)

    def summary(self) -> dict:
        """Report fields: what ran, the settings, the window, which steps were sparse, calls, copies, notes."""
        s = self.run_settings or self.settings
        (s0, s1), (q0, q1) = self.sinks
        out = {"lossy": True, "kernel": self.kernel_name, "dense_backend": self.dense_name, "method": s.method,
               "tau": s.tau, "keep_percent": s.keep_percent if s.method != "sol-attn" else None,
               "extra_tokens": s.token_aug, "start_percent": s.start_percent, "end_percent": s.end_percent,
               "min_tokens": s.min_tokens, "dense_blocks": list(s.dense_blocks), "sink_conditioning": s.sinks,
               "sparse_steps": [x["step"] for x in self.steps if x["sparse"]],
               "dense_steps": [x["step"] for x in self.steps if not x["sparse"]], "calls": dict(self.calls),
               "sparse_at_or_below_sigma": self.window[1], "sparse_at_or_above_sigma": self.window[0],
               "sink_blocks": [s0, s1], "dense_query_blocks": [q0, q1],
               "sink_rows": [s0 * BLOCK, min(s1 * BLOCK, self.seq_len)],
               "dense_query_rows": [q0 * BLOCK, min(q1 * BLOCK, self.seq_len)], "notes": list(self.notes)}
        copies = getattr(self.kernel, "copies", None)
        if copies is not None:
            out["qkv_copies"] = dict(copies)
        return out


def _runs(rows: torch.Tensor) -> list:
    """Per-row modulation rows [m] (host int64) -> segments [(start, stop, row)] of equal consecutive rows."""
    values, counts = torch.unique_consecutive(rows, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return [(e - n, e, int(v)) for v, n, e in zip(values.tolist(), counts.tolist(), ends)]


def _clip(segments, start: int, stop: int) -> list:
    """The modulation segments [(a, b, row)] overlapping rows [start, stop), re-based to the slice."""
    return [(max(a, start) - start, min(b, stop) - start, r) for a, b, r in segments if a < stop and b > start]


def sparse_check(device: torch.device | str, *, head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.bfloat16,
                 probe: bool = True, **_) -> tuple[bool, str]:
    """(available, reason) of the ``sparse`` attention backend: the fp32 reference on the CPU; on CUDA
    comfy-kitchen's sol_attn where installed, built for the GPU and (``probe``) passing its load-time probe."""
    device = torch.device(device)
    if device.type == "cpu":
        return True, "LOSSY sparse: the fp32 reference of Sol-Attn (CPU: every op runs its reference)"
    reason = sol_unavailable_reason(device, head_dim, dtype)
    if reason is not None:
        return False, reason
    try:
        sol = SolAttention.resolve(device, head_dim, dtype)
        rec = sol.probe(device) if probe else None
    except SparseUnavailable as e:
        return False, str(e)
    got = f"; probe: dense rows rel-L2 {rec['dense_rows_rel_l2']:.3g}" if rec else ""
    return True, f"LOSSY sparse: comfy-kitchen {sol.version} sol_attn (training-free, Sol-Attn){got}"


def choose_sparse(device: torch.device | str, *, head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.bfloat16,
                  probe: bool = True, **_) -> tuple[str, str]:
    """("sparse", reason), or SparseUnavailable saying why: a lossy backend is never swapped in or out silently."""
    ok, why = sparse_check(device, head_dim=head_dim, dtype=dtype, probe=probe)
    if not ok:
        raise SparseUnavailable(f"attention=sparse was requested but cannot run: {why}. Choose another attention "
                                f"backend (auto), or install comfy-kitchen>=0.2.40 on an sm_80+ GPU.")
    return "sparse", why


def bind_sparse(device: torch.device | str, dtype: torch.dtype, heads: int, head_dim: int, dense, dense_name: str,
                settings: SparseSettings = SparseSettings()) -> SparseStepAttention:
    """The sparse backend bound once at load: comfy-kitchen's kernels on CUDA (the eager reference on the CPU)
    plus the bound ``dense`` backend for every dense call."""
    device = torch.device(device)
    if device.type == "cpu":
        kernel, name = None, "fp32 reference (sparse_methods.sol_reference)"
    else:
        kernel = SolAttention.resolve(device, head_dim, dtype)
        name = f"comfy-kitchen {kernel.version} sol_attn_chunked"
    return SparseStepAttention(kernel, dense, heads, head_dim, settings.check(), kernel_name=name,
                               dense_name=dense_name)
