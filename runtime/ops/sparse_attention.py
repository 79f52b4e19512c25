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

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..errors import H3Error
from .sparse_routing import (BLOCK, DEFAULT_EXTRA_TOKENS, DEFAULT_MIN_TOKENS, DEFAULT_START_PERCENT, DEFAULT_TAU,
                             SparseRouting, SparseSchedule, routing_for_segments)

__all__ = [
    "SparseUnavailable",
    "SolAttention",
    "SparseStepAttention",
    "bind_sparse",
    "choose_sparse",
    "reference_kernel",
    "sparse_check",
    "sol_attention_reference",
    "sol_unavailable_reason",
    "stride_rules_hold",
]

HEAD_DIM = 128                # the only head_dim the fused kernel takes
_LOG2E = 1.4426950408889634
# the fused kernel's dense query rows vs sol_attention_reference on random N(0,1) bf16 q/k/v
PROBE_TOLERANCE = (0.1, "int8 q and k inside the kernel (comfy-kitchen: 'expect cos ~0.999', i.e. rel-L2 up to "
                        "~0.045); a broken kernel gives ~1")


class SparseUnavailable(H3Error):
    """The sparse backend cannot run here (no comfy-kitchen, no kernel for this GPU, wrong dtype/shape)."""


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------

def _block_sums(x: torch.Tensor, n: int) -> torch.Tensor:
    """[T, H, D] -> [n, H, D]: sums over 64-row blocks (the last one ragged)."""
    t = x.shape[0]
    pad = n * BLOCK - t
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.view(n, BLOCK, *x.shape[1:]).sum(1)


def _block_stats(q, k, v, n, rows_per_block, log2s):
    """Block summaries of fp32 [T, H, D] inputs: centroids, centred pooled keys, summed values, k_mu, thr/tau."""
    lens = rows_per_block.view(n, 1, 1)
    kc = _block_sums(k, n) / lens
    k_mu = kc.mean(0, keepdim=True)                              # mean over blocks (not over tokens)
    kcc = kc - k_mu
    cen = _block_sums(q, n) / lens
    var = (cen.pow(2) * kcc.pow(2).mean(0, keepdim=True)).sum(-1)   # [n, H]
    spread = torch.sqrt(var * log2s * log2s + 1e-6)
    return cen, kcc, _block_sums(v, n), k_mu, spread


def sol_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routing: SparseRouting, *,
                            scale: Optional[float] = None, query_blocks: int = 16) -> torch.Tensor:
    """Sol-Attn (token_aug = 0) in fp32 for ``[S, H, D]`` (or ``[1, S, H, D]``) q, k, v of any strides.

    Returns ``[S, H*D]`` fp32, head-major columns. ``query_blocks`` query blocks are computed at a time
    (memory ``O(query_blocks * 64 * S * H)``). The algorithm is the module docstring's.
    """
    if q.dim() == 4:
        q, k, v = q[0], k[0], v[0]
    t, h, d = q.shape
    if k.shape != q.shape or v.shape != q.shape or t != routing.seq_len:
        raise H3Error(f"q, k, v must be [S, H, D] alike with S = routing.seq_len = {routing.seq_len}; found "
                      f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n = routing.n_blocks
    scale = d ** -0.5 if scale is None else float(scale)
    log2s = scale * _LOG2E
    qf, kf, vf = q.float(), k.float(), v.float()
    rows = torch.full((n,), float(BLOCK), device=q.device)
    rows[-1] = float(t - (n - 1) * BLOCK)
    cen, kcc, vsum, k_mu, spread = _block_stats(qf, kf, vf, n, rows, log2s)
    m = torch.einsum("ihd,jhd->hij", cen, kcc) * log2s              # [H, nq, nk] block scores
    exact = (m > (routing.tau * spread).t().unsqueeze(-1)) | routing.forced_exact().to(q.device)
    kh = (kf - k_mu).permute(1, 2, 0)                              # [H, D, T]: k - k_mu
    vh = vf.permute(1, 0, 2)                                         # [H, T, D]
    vc = vsum.permute(1, 0, 2)                                       # [H, n, D]
    out = torch.empty(t, h, d, device=q.device)
    key_block = torch.arange(t, device=q.device) // BLOCK
    for i0 in range(0, n, query_blocks):
        i1 = min(n, i0 + query_blocks)
        r0, r1 = i0 * BLOCK, min(i1 * BLOCK, t)
        qb = torch.arange(r0, r1, device=q.device) // BLOCK - i0     # query block of each row, local
        ex_rows = exact[:, i0:i1][:, qb]                             # [H, r, n]
        s_tok = torch.matmul(qf[r0:r1].permute(1, 0, 2), kh) * log2s  # [H, r, T]
        s_tok = s_tok.masked_fill(~ex_rows[..., key_block], float("-inf"))
        s_blk = m[:, i0:i1][:, qb].masked_fill(ex_rows, float("-inf"))  # [H, r, n]
        top = torch.maximum(s_tok.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True))
        p_tok, p_blk = torch.exp2(s_tok - top), torch.exp2(s_blk - top)
        num = torch.matmul(p_tok, vh) + torch.matmul(p_blk, vc)
        den = p_tok.sum(-1) + (p_blk * rows).sum(-1)
        out[r0:r1] = (num / den.unsqueeze(-1)).permute(1, 0, 2)
    return out.reshape(t, h * d)


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
class SparseStepAttention:
    """``attention(qkv [S, 3*H*D]) -> [S, H*D]`` for the block stack: ``kernel`` with the run's routing on the
    steps the schedule makes sparse, ``dense`` on the others. LOSSY on sparse steps. Bound once per load.

    Per run: ``begin_run(segments, shift_video, tau)`` builds the routing from the packed layout and the schedule
    from the video shift; per step: ``begin_step(i, sigma)`` with the MODEL sigma decides sparse or dense (the
    context the sampler sets; nothing is re-derived per call). ``summary()`` is the report's block.
    """

    kernel: Any                   # SolAttention or reference_kernel: (qkv, heads, head_dim, routing) -> [S, H*D]
    dense: Any                    # the dense backend, bound: qkv -> [S, H*D]
    heads: int
    head_dim: int
    tau: float = DEFAULT_TAU
    token_aug: int = DEFAULT_EXTRA_TOKENS
    start_percent: float = DEFAULT_START_PERCENT
    min_tokens: int = DEFAULT_MIN_TOKENS
    kernel_name: str = ""
    dense_name: str = ""
    routing: Optional[SparseRouting] = None
    schedule: Optional[SparseSchedule] = None
    sparse_now: bool = False
    steps: list = field(default_factory=list)
    calls: dict = field(default_factory=lambda: {"sparse": 0, "dense": 0})

    def begin_run(self, segments: Sequence[tuple[int, int, str]], shift_video: float,
                  tau: Optional[float] = None) -> None:
        """Routing and schedule of one sampling run (``tau``: this run's, default the bound one)."""
        self.routing = routing_for_segments(segments, tau=self.tau if tau is None else float(tau),
                                            token_aug=self.token_aug)
        self.schedule = SparseSchedule(float(shift_video), self.start_percent, 1.0, self.min_tokens)
        self.steps = []
        self.calls = {"sparse": 0, "dense": 0}
        self.sparse_now = False

    def begin_step(self, step: int, sigma: float) -> None:
        if self.routing is None:
            raise H3Error("sparse attention: begin_run(segments, shift) must come before begin_step (no routing yet)")
        reason = self.schedule.dense_reason(sigma, self.routing.seq_len)
        self.sparse_now = reason is None
        self.steps.append({"step": step, "sigma": float(sigma), "sparse": self.sparse_now,
                           **({} if reason is None else {"dense_because": reason})})

    def end_run(self) -> None:
        """Back to dense until the next begin_run (a forward outside a sampling run stays exact-path dense)."""
        self.sparse_now = False

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        if self.sparse_now and qkv.shape[0] == self.routing.seq_len:
            self.calls["sparse"] += 1
            return self.kernel(qkv, self.heads, self.head_dim, self.routing)
        self.calls["dense"] += 1
        return self.dense(qkv)

    def summary(self) -> dict:
        """Report fields: what ran, the routing, the schedule switch, which steps were sparse, calls, copies."""
        r, sch = self.routing, self.schedule
        out = {"lossy": True, "kernel": self.kernel_name, "dense_backend": self.dense_name,
               "tau": self.tau if r is None else r.tau, "extra_tokens": self.token_aug,
               "start_percent": self.start_percent, "min_tokens": self.min_tokens,
               "sparse_steps": [s["step"] for s in self.steps if s["sparse"]],
               "dense_steps": [s["step"] for s in self.steps if not s["sparse"]], "calls": dict(self.calls)}
        if sch is not None:
            out["sparse_at_or_below_sigma"] = sch.sigma_start
        if r is not None:
            out.update(sink_blocks=list(r.sink_blocks), dense_query_blocks=list(r.dense_q_blocks),
                       sink_rows=list(r.sink_rows()), dense_query_rows=list(r.dense_rows()))
        copies = getattr(self.kernel, "copies", None)
        if copies is not None:
            out["qkv_copies"] = dict(copies)
        return out


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


@dataclass(frozen=True)
class SparseSettings:
    """What the load binds the sparse backend with (the plan's ``sparse_settings``): the routing threshold
    ``tau``, the extra tokens per routed block, the dense fraction of the schedule and the fewest rows that go
    sparse."""

    tau: float = DEFAULT_TAU
    extra_tokens: int = DEFAULT_EXTRA_TOKENS
    start_percent: float = DEFAULT_START_PERCENT
    min_tokens: int = DEFAULT_MIN_TOKENS


def bind_sparse(device: torch.device | str, dtype: torch.dtype, heads: int, head_dim: int, dense, dense_name: str,
                settings: SparseSettings = SparseSettings()) -> SparseStepAttention:
    """The sparse backend bound once at load: comfy-kitchen's kernel on CUDA (reference on the CPU) plus the
    bound ``dense`` backend for the dense steps."""
    device = torch.device(device)
    if device.type == "cpu":
        kernel, name = reference_kernel, "fp32 reference (sol_attention_reference)"
    else:
        kernel = SolAttention.resolve(device, head_dim, dtype)
        name = f"comfy-kitchen {kernel.version} sol_attn"
    return SparseStepAttention(kernel, dense, heads, head_dim, tau=float(settings.tau),
                               token_aug=int(settings.extra_tokens), start_percent=float(settings.start_percent),
                               min_tokens=int(settings.min_tokens), kernel_name=name,
                               dense_name=dense_name)
