"""K and V of every row held once, in SageAttention2's sm_90 operand form, for attention over query-row chunks.

The query-row chunks of ``DiTBlock._attend_in_row_chunks`` keep K and V of all S rows while each chunk's Q
attends over them. Kept at the compute dtype ([S, 2*H*D] bf16), every chunk's call then quantizes all of K
and V again into Sage2's operands (int8 K, fp8 V: another 1 byte per element of each). ``SageKV`` keeps only
those operands, built once per block call, so the bf16 copy and the per-call copies are both gone:

- pass 1 (``observe``, chunk by chunk): the fp32 sum of K per (head, channel), for K's mean (Sage2's
  ``smooth_k``), and V's absolute maximum per (head, channel), for V's per-channel fp8 scale;
- ``seal``: K's mean at K's dtype (the fp32 sum / S), V's scales (``fp8_producers.e4m3_scales``);
- pass 2 (``store``, chunks starting on 128-row boundaries): K - mean quantized to int8 per head and 128-row
  block, V to e4m3 at its scale in the kernel's layout (``[1, D, H, roundup(S, 128)]``, each 16 tokens in
  ``SAGE_V_PERM`` order, zero past S) by ``fp8_producers.sage_v_codes``, row by row: V's codes are the ones
  ``fp8_producers.sage_v_fp8`` makes of all of V;
- ``attend`` (pass 3): a chunk's Q, quantized per 16-row warp, over the held operands.

Not row-exact against the unchunked Sage2 call: the library takes K's mean with one bf16 ``mean`` over all
rows; here it comes from fp32 chunk sums, so an element of the mean may round to the neighbouring bf16 value
and K's int8 codes follow. Subtracting any per-channel constant from K leaves softmax(QK^T) unchanged, so the
difference is the quantization's rounding only (the GPU test gives its rel-L2).

Kernels (``SageKVKernels``): ``sm90`` calls SageAttention2's own quantizers (``sageattention._fused``) and its
sm_90 kernel, which takes fewer query rows than key rows; ``emulated`` is the plain PyTorch reference of the
same three quantizations and a dequantized fp32 attention (the CPU tests, and the GPU test's reference).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch

from .fp8_producers import SAGE_V_ROWS, e4m3_scales, sage_v_codes, sage_v_token_order

K_BLOCK = 128   # K's rows per int8 scale (the sm_90 kernel's BLKK)
Q_BLOCK = 64    # Q's rows per kernel block (BLKQ) ...
Q_WARP = 16     # ... and per int8 scale (WARPQ)
INT8_MAX = 127.0


def _per_rows_int8(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, H, D] -> (int8 codes [m, H, D], fp32 scales [H, ceil(m / rows)]): per head and block of ``rows``
    rows, scale = max(amax |x| / 127, 1e-8), code = round(x / scale)."""
    m, h, d = x.shape
    blocks = -(-m // rows)
    xp = torch.zeros(blocks * rows, h, d, dtype=torch.float32, device=x.device)
    xp[:m] = x.float()
    xb = xp.view(blocks, rows, h, d)
    scale = (xb.abs().amax(dim=(1, 3)) / INT8_MAX).clamp_min(1e-8)              # [blocks, H]
    codes = torch.round(xb / scale[:, None, :, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.view(-1, h, d)[:m], scale.t().contiguous()


@dataclasses.dataclass(frozen=True)
class SageKVKernels:
    """The three quantizers and the attention of a ``SageKV``, bound once.

    quant_k(k [1, m, H, D] view, mean [1, H, D] at k's dtype) -> (int8 [1, m, H, D], fp32 [1, H, ceil(m/128)]);
    attend(q [1, m, H, D] view, kv: SageKV) -> o [1, m, H, D] at q's dtype."""

    name: str
    quant_k: Callable
    attend: Callable


def _emulated_quant_k(k: torch.Tensor, mean: torch.Tensor):
    codes, scale = _per_rows_int8(k[0].float() - mean[0].float(), K_BLOCK)
    return codes.unsqueeze(0), scale.unsqueeze(0)


def _emulated_attend(q: torch.Tensor, kv: "SageKV") -> torch.Tensor:
    """The reference: the operands dequantized (q per 16-row warp as the kernel quantizes it, K and V as held),
    then fp32 attention."""
    s = kv.rows
    qc, qs = _per_rows_int8(q[0].float(), Q_WARP)
    qd = qc.float() * qs.t().repeat_interleave(Q_WARP, 0)[: qc.shape[0], :, None]
    kd = kv.k_codes[0].float() * kv.k_scale[0].t().repeat_interleave(K_BLOCK, 0)[:s, :, None]
    held = kv.v_codes[0].float().permute(2, 1, 0)                              # [Sp, H, D], the kernel's order
    vd = torch.empty_like(held)
    vd[sage_v_token_order(held.shape[0], q.device)] = held
    vd = vd[:s] * kv.v_scale[0][None]
    att = torch.einsum("qhd,khd->hqk", qd, kd) * kv.scale
    return torch.einsum("hqk,khd->qhd", att.softmax(-1), vd).unsqueeze(0).to(q.dtype)


EMULATED = SageKVKernels("emulated", _emulated_quant_k, _emulated_attend)


def sm90_attention(kernel, q_ops, k_ops, v_ops, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """SageAttention2's sm_90 kernel (``sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf``) in our
    one configuration (NHD, non-causal, per-warp q scales, no lse) over the (codes, scales) pairs of q [1, m, H, D]
    (int8, per warp), k (int8, per 128-row block) and v (e4m3 [1, D, H, roundup(S, 128)], per channel)
    -> o [1, m, H, D] at ``out_dtype``."""
    (qc, qs), (kc, ks), (vc, vs) = q_ops, k_ops, v_ops
    o = torch.empty(qc.shape, dtype=out_dtype, device=qc.device)
    # (q, k, v, o, q_scale, k_scale, v_scale, layout NHD=0, causal=0, per_warp=2, sm_scale, lse=0)
    kernel(qc, kc, vc, o, qs, ks, vs, 0, 0, 2, scale, 0)
    return o


def sm90_kernels(sage_module) -> SageKVKernels:
    """SageAttention2's quantizers (``sageattention._fused``) and sm_90 kernel; AttributeError names what the
    installed build lacks."""
    fused = importlib.import_module(sage_module.__name__ + "._fused")
    kernel = sage_module.core.sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf
    for name in ("quant_per_block_int8_fuse_sub_mean_cuda", "quant_per_warp_int8_cuda"):
        getattr(fused, name)

    def quant_k(k, mean):
        m, h = k.shape[1], k.shape[2]
        codes = torch.empty(k.shape, dtype=torch.int8, device=k.device)
        scale = torch.empty(1, h, -(-m // K_BLOCK), dtype=torch.float32, device=k.device)
        fused.quant_per_block_int8_fuse_sub_mean_cuda(k, mean, codes, scale, K_BLOCK, 0)   # 0: NHD
        return codes, scale

    def attend(q, kv):
        m, h = q.shape[1], q.shape[2]
        qc = torch.empty(q.shape, dtype=torch.int8, device=q.device)
        qs = torch.empty(1, h, -(-m // Q_BLOCK) * (Q_BLOCK // Q_WARP), dtype=torch.float32, device=q.device)
        fused.quant_per_warp_int8_cuda(q, qc, qs, Q_BLOCK, Q_WARP, 0)
        return sm90_attention(kernel, (qc, qs), (kv.k_codes, kv.k_scale), (kv.v_codes, kv.v_scale), kv.scale,
                              q.dtype)
    return SageKVKernels("sm90", quant_k, attend)


class SageKV:
    """K and V of ``rows`` rows for ``heads`` heads of ``head_dim`` (64 or 128 on the sm_90 kernels; any on the
    emulated ones) as Sage2's sm_90 operands (module docstring): ``observe`` every row once, ``seal``, ``store``
    every row once (chunks starting on 128-row boundaries), then ``attend`` any query rows. k, v, q: [m, H*D]
    views (unit stride in D) at the compute dtype; ``attend`` returns [m, H*D] at q's dtype."""

    def __init__(self, rows: int, heads: int, head_dim: int, dtype: torch.dtype, device, kernels: SageKVKernels,
                 scale: float):
        if kernels.name == "sm90" and head_dim not in (64, 128):
            raise ValueError(f"SageKV: head_dim must be 64 or 128 (Sage2's sm_90 kernel); found {head_dim}")
        self.rows, self.heads, self.head_dim, self.dtype, self.scale, self.kernels = \
            rows, heads, head_dim, dtype, scale, kernels
        f32 = dict(dtype=torch.float32, device=device)
        self.k_sum = torch.zeros(heads, head_dim, **f32)
        self.v_amax = torch.zeros(heads, head_dim, **f32)
        self.k_codes = torch.empty(1, rows, heads, head_dim, dtype=torch.int8, device=device)
        self.k_scale = torch.empty(1, heads, -(-rows // K_BLOCK), **f32)
        self.v_codes = torch.zeros(1, head_dim, heads, -(-rows // SAGE_V_ROWS) * SAGE_V_ROWS,
                                   dtype=torch.float8_e4m3fn, device=device)
        self.mean = self.v_scale = self.v_inv = None

    STORE_TEMP_BYTES = 7  # per element of a stored chunk's K or V: V's fp32 copy, its e4m3 codes and their
    #                       permuted copy, K's int8 codes (then copied in)

    @staticmethod
    def nbytes(rows: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
        """What one holds on the device: int8 K and its scales, fp8 V padded to 128 rows and its scales, the
        statistics and K's mean."""
        hd = heads * head_dim
        return rows * hd + 4 * heads * -(-rows // K_BLOCK) + hd * (-(-rows // SAGE_V_ROWS) * SAGE_V_ROWS) \
            + hd * (4 * 4 + dtype_bytes)

    def _nhd(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(1, (self.heads, self.head_dim)).unsqueeze(0)

    passes = ("observe", "store")  # the block's passes over the rows before ``attend`` (``seal`` after observe)

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_sum += self._nhd(k)[0].sum(0, dtype=torch.float32)
        torch.maximum(self.v_amax, self._nhd(v)[0].abs().amax(0).float(), out=self.v_amax)

    def seal(self) -> None:
        self.mean = (self.k_sum / self.rows).to(self.dtype).unsqueeze(0)        # [1, H, D]
        sc, self.v_inv = e4m3_scales(self.v_amax)
        self.v_scale = sc.unsqueeze(0).contiguous()                             # [1, H, D]

    def store(self, a: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.mean is None:
            raise RuntimeError("SageKV.store before seal: observe every row, then seal")
        if a % K_BLOCK:
            raise ValueError(f"SageKV.store: chunks must start on {K_BLOCK}-row boundaries; found row {a}")
        m = k.shape[0]
        codes, scale = self.kernels.quant_k(self._nhd(k), self.mean)
        self.k_codes[:, a:a + m] = codes
        self.k_scale[:, :, a // K_BLOCK:a // K_BLOCK + scale.shape[2]] = scale
        vc = sage_v_codes(self._nhd(v)[0], self.v_inv)
        self.v_codes[0, :, :, a:a + vc.shape[2]] = vc

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        return self.kernels.attend(self._nhd(q), self).reshape(q.shape[0], -1)


__all__ = ["EMULATED", "K_BLOCK", "SageKV", "SageKVKernels", "sm90_attention", "sm90_kernels"]
