"""comfy-kitchen's sparse attention kernels for the packed H3 sequence (an OPTIONAL dependency, imported lazily:
CUDA sm_80+, bf16, head_dim 128) and the ``sparse`` attention backend bound at load. LOSSY.

- ``SolAttention``: the kernels bound once. ``chunked`` is what the blocks run (core's H3 path: pre-norm qkv
  chunks into ``sol_attn_chunked``, q/k RMSNorm and RoPE inside, the pooled statistics carried per block);
  ``__call__`` feeds ``sol_attn`` strided q/k/v views of a normed qkv buffer (the load-time probe; views that
  break the kernel's stride rules are copied and counted).
- ``sol_attention_reference``: the tau selection with a routing's sinks (``ops.sparse_routing``) on the eager
  reference of every method (``ops.sparse_methods``: sol-attn, sla, vsa; the kernel's int8 arithmetic and
  ``token_aug`` not modelled).
- ``bind_sparse``: the step-aware backend (``ops.sparse_step.SparseStepAttention``) with the kernels on CUDA, the
  eager reference on the CPU; ``sparse_check`` / ``choose_sparse``: whether it can run here, and why not.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import H3Error
from ..options import SparseSettings
from .sparse_methods import KernelArgs, sol_reference
from .sparse_routing import DEFAULT_EXTRA_TOKENS, SparseRouting, routing_for_segments
from .sparse_step import SparseBlockCall, SparseStepAttention

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
