"""ComfyUI core's block-sparse methods on the packed H3 sequence (``BlockSparseAttention``, core's
``comfy_extras/nodes_sparse_attention.py``): sinks, VSA's cube tiling, the rotary table the chunked kernel takes,
and the eager reference of comfy-kitchen's ``sol_attn`` with every selection it has. LOSSY by design.

What one sparse call computes (per head, on 64-row blocks; :func:`sol_reference`):

- block summaries over the LIVE rows of each block (``block_len``: VSA's zero-padded tiles): mean key ``kc``,
  summed values ``vc``, mean query ``c``; the block score ``m_ij = c_i . (kc_j - mean_j kc_j) * scale * log2 e``.
- selection: ``sol-attn``: ``m_ij > tau * sqrt(sum_d c_id^2 var_j(kc_jd) (scale log2 e)^2 + 1e-6)``; ``sla`` /
  ``vsa``: the top ``keep`` blocks of each query block (sink blocks neither count nor compete;
  ``max(1, round(ratio * n'))`` clamped to ``[0, n' - 1]``, ties at the boundary kept). Forced exact: the
  diagonal +-1, the sink key blocks ``sink``, the dense query blocks ``sink_q``.
- every row attends the exact blocks' live tokens (logits ``q . (k - mean kc)``) and, with ``tail`` (sol-attn,
  sla), one pooled term per other block (logit ``m_ij``, weight = its live rows, value ``vc_j / rows``), one
  base-2 softmax. VSA (``tail=False``) drops the pooled terms and, with ``coarse_gate``, adds
  ``gate * softmax(c kc^T * scale) (vc / rows)`` per block (VSA's coarse branch).

The kernel's int8 arithmetic and ``token_aug`` extra tokens are not modelled (the reference is exact fp32 over the
same selection, as comfy-kitchen's own eager reference). The chunked kernel also carries the pooled statistics
``(kmean, vscale)`` of each block from one sparse call to the next (its int8 scales); :func:`pooled_stats` is
that statistic's definition here (fp32 ``[H, 128]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import H3Error

__all__ = ["BLOCK", "PRODUCER_CHUNK", "VSA_CUBE", "KernelArgs", "VsaPlan", "core_sinks", "vsa_plan", "rope_freqs",
           "pad_rows", "sol_reference", "pooled_stats"]

BLOCK = 64                 # the kernels' block length (rows)
PRODUCER_CHUNK = 4096      # rows per qkv chunk fed to the chunked producer (core's)
VSA_CUBE = (4, 4, 4)       # VSA's video tile: 4 latent frames x 4 x 4 patches = 64 rows
_LOG2E = 1.4426950408889634
_VSCALE_MARGIN = 1.1       # comfy-kitchen's clip headroom on last step's V absmax


@dataclass(frozen=True)
class KernelArgs:
    """What one sparse call hands the kernel besides q/k/v: tau (sol-attn), topk_ratio (> 0: top-k), the sink
    key blocks and dense query blocks (half-open), tail (pooled terms on), token_aug (kernel only),
    block_len (int32 [n/64] live rows per tile, VSA) and coarse_gate ([T, H, D], VSA with to_gate_compress)."""

    tau: float
    topk_ratio: float = 0.0
    sink: tuple[int, int] = (0, 0)
    sink_q: tuple[int, int] = (0, 0)
    tail: bool = True
    token_aug: int = 0
    block_len: Optional[torch.Tensor] = None
    coarse_gate: Optional[torch.Tensor] = None

    def kernel_kwargs(self) -> dict:
        """The keyword arguments of comfy-kitchen's ``sol_attn`` / ``sol_attn_chunked`` (core's call)."""
        out = dict(tau=self.tau, topk_ratio=self.topk_ratio, token_aug=self.token_aug,
                   sink_blocks=list(self.sink), sink_q=list(self.sink_q))
        if not self.tail:
            out["tail"] = False
        if self.block_len is not None:
            out["block_len"] = self.block_len
        if self.coarse_gate is not None:
            out["coarse_gate"] = self.coarse_gate
        return out


def core_sinks(segments: Sequence[tuple[int, int, str]], seq_len: int, mode: str
               ) -> tuple[tuple[int, int], tuple[int, int]]:
    """core's ``sinks``: (exact-KV key blocks, dense query blocks) of a packed layout of ``seq_len`` rows.

    exact_kv: key blocks ``[0, ceil(v0 / 64))`` (every row before the target video); exact_kv_and_rows: also the
    query blocks ``[floor(a0 / 64), ceil(v0 / 64))`` (a0: the target audio's start; all prefix blocks without
    audio); off, no layout for these rows, no video or ``v0 == 0``: none."""
    none = ((0, 0), (0, 0))
    if mode == "off" or not segments or segments[-1][1] != seq_len:
        return none
    video = next(((a, b) for a, b, kind in segments if kind == "video"), None)
    if video is None or video[0] <= 0:
        return none
    blocks = (0, -(-video[0] // BLOCK))
    if mode != "exact_kv_and_rows":
        return blocks, (0, 0)
    audio = next(((a, b) for a, b, kind in segments if kind == "audio"), None)
    if audio is None:
        return blocks, blocks
    return blocks, (audio[0] // BLOCK, blocks[1])


@dataclass(frozen=True)
class VsaPlan:
    """VSA's padded tile order of one layout: ``src`` [n] int64 (padded row -> source row, -1 = pad), ``inv``
    [S] int64 (source row -> padded row), ``n`` padded rows, ``n_prefix`` prefix tiles (every non-video segment
    in its own zero-padded 64-row tiles), ``block_len`` int32 [n / 64] live rows at the front of each tile."""

    n: int
    n_prefix: int
    src: torch.Tensor
    inv: torch.Tensor
    block_len: torch.Tensor

    @property
    def live(self) -> torch.Tensor:
        return self.src >= 0


def vsa_plan(segments: Sequence[tuple[int, int, str]], grid: tuple[int, int, int], device) -> VsaPlan:
    """core's VSA tiling: non-video segments padded separately to 64-row tiles, in order; the target video
    (rows in t, h, w order over ``grid`` = (T, H/2, W/2)) padded up to multiples of 4 per axis and cut into 4x4x4
    cubes (cube order t, h, w; within a cube t, h, w), live rows first in each cube."""
    seq_len = segments[-1][1]
    tiles, n_prefix = [], 0
    for a, b, kind in segments:
        n = b - a
        if kind != "video":
            m = -(-n // BLOCK)
            seg = torch.full((m * BLOCK,), -1, dtype=torch.int64, device=device)
            seg[:n] = torch.arange(a, b, device=device)
            tiles.append(seg.view(m, BLOCK))
            n_prefix += m
            continue
        if grid[0] * grid[1] * grid[2] != n:
            raise H3Error(f"VSA: the video segment has {n} rows but the latent grid {tuple(grid)} (T, H/2, W/2) "
                          f"has {grid[0] * grid[1] * grid[2]}; the layout and the latent shape disagree")
        pt, ph, pw = (-(-g // c) * c for g, c in zip(grid, VSA_CUBE))
        padded = torch.full((pt, ph, pw), -1, dtype=torch.int64, device=device)
        padded[:grid[0], :grid[1], :grid[2]] = torch.arange(a, b, device=device).view(*grid)
        ct, ch, cw = VSA_CUBE
        cubes = (padded.view(pt // ct, ct, ph // ch, ch, pw // cw, cw).permute(0, 2, 4, 1, 3, 5)
                 .reshape(-1, BLOCK))
        order = torch.argsort((cubes < 0).to(torch.int8), dim=1, stable=True)
        tiles.append(torch.gather(cubes, 1, order))
    tiles = torch.cat(tiles)
    src = tiles.reshape(-1)
    live = src >= 0
    inv = torch.empty(seq_len, dtype=torch.int64, device=device)
    inv[src[live]] = torch.nonzero(live).flatten()
    return VsaPlan(int(src.numel()), n_prefix, src, inv, (tiles >= 0).sum(1).to(torch.int32))


def pad_rows(x: torch.Tensor, plan: VsaPlan) -> torch.Tensor:
    """[S, C] rows -> [n, C] in the plan's padded order, padded rows zero (what core feeds qkv_proj and
    to_gate_compress; both have no bias, so projecting zero rows gives zero rows)."""
    return x[plan.src.clamp_min(0)] * plan.live.unsqueeze(1).to(x.dtype)


def rope_freqs(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half RoPE tables cos/sin [S, R] (angles duplicated over the halves) -> core's rotation table
    ``[1, S, 1, R/2, 2, 2]`` fp32 of ``[[c, -s], [s, c]]`` (what ``sol_attn_chunked`` takes as rope_freqs)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, :half].float(), sin[:, :half].float()
    rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)   # [S, R/2, 2, 2]
    return rot.unsqueeze(0).unsqueeze(2).contiguous()


# ---------------------------------------------------------------------------------------------
# the eager reference (fp32), memory O(query_blocks * 64 * T * H)
# ---------------------------------------------------------------------------------------------

def _lengths(t: int, n: int, block_len: Optional[torch.Tensor], device) -> torch.Tensor:
    """Live rows per block as fp32 [n]: block_len clamped to [1, rows in the block], else 64 (ragged last)."""
    tail = t - (n - 1) * BLOCK
    if block_len is None:
        out = torch.full((n,), float(BLOCK), device=device)
    else:
        out = block_len.to(device=device, dtype=torch.float32).clamp(1, BLOCK).clone()
    out[-1] = out[-1].clamp(max=float(tail))
    return out


def _pooled(x: torch.Tensor, n: int, live: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [n, H, D]: sums over the live rows of each 64-row block."""
    t = x.shape[0]
    x = x * live.view(t, 1, 1)
    if n * BLOCK > t:
        x = torch.cat([x, x.new_zeros(n * BLOCK - t, *x.shape[1:])])
    return x.view(n, BLOCK, *x.shape[1:]).sum(1)


def _topk_count(n: int, ratio: float) -> int:
    return max(0, min(n - 1, max(1, round(ratio * n))))


def _selection(m: torch.Tensor, cen: torch.Tensor, kcc: torch.Tensor, args: KernelArgs, log2s: float) -> torch.Tensor:
    """[H, nq, nk] bool: the key blocks each query block attends exactly (module docstring)."""
    h, n, _ = m.shape
    s0, s1 = args.sink
    if args.topk_ratio:
        ranked = m.clone()
        ranked[..., s0:s1] = float("-inf")
        kk = _topk_count(n - max(0, min(s1, n) - min(s0, n)), args.topk_ratio)
        exact = ranked >= ranked.topk(kk, dim=-1).values[..., -1:] if kk else torch.zeros_like(m, dtype=torch.bool)
    else:
        var = (cen.pow(2) * kcc.pow(2).mean(0, keepdim=True)).sum(-1)     # [n, H]
        thr = args.tau * torch.sqrt(var * log2s * log2s + 1e-6)
        exact = m > thr.t().unsqueeze(-1)
    idx = torch.arange(n, device=m.device)
    exact |= ((idx.view(1, -1) - idx.view(-1, 1)).abs() <= 1)
    exact |= ((idx >= s0) & (idx < s1)).view(1, 1, n)
    exact |= ((idx >= args.sink_q[0]) & (idx < args.sink_q[1])).view(1, n, 1)
    return exact


def sol_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: KernelArgs, *,
                  scale: Optional[float] = None, query_blocks: int = 16) -> torch.Tensor:
    """comfy-kitchen's ``sol_attn`` semantics (module docstring) in fp32 for ``[T, H, D]`` q, k, v of any strides
    -> ``[T, H, D]`` fp32 (rows of padded tiles: unspecified, as the kernel's)."""
    t, h, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise H3Error(f"q, k, v must be [T, H, D] alike; found {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n = -(-t // BLOCK)
    scale = d ** -0.5 if scale is None else float(scale)
    log2s = scale * _LOG2E
    qf, kf, vf = q.float(), k.float(), v.float()
    rows = _lengths(t, n, args.block_len, q.device)
    key_block = torch.arange(t, device=q.device) // BLOCK
    live = (torch.arange(t, device=q.device) % BLOCK) < rows[key_block]
    kc = _pooled(kf, n, live) / rows.view(n, 1, 1)
    k_mu = kc.mean(0, keepdim=True)
    kcc = kc - k_mu
    cen = _pooled(qf, n, live) / rows.view(n, 1, 1)
    vsum = _pooled(vf, n, live)
    m = torch.einsum("ihd,jhd->hij", cen, kcc) * log2s                   # [H, nq, nk]
    exact = _selection(m, cen, kcc, args, log2s)
    kh, vh, vc = (kf - k_mu).permute(1, 2, 0), vf.permute(1, 0, 2), vsum.permute(1, 0, 2)
    out = torch.empty(t, h, d, device=q.device)
    for i0 in range(0, n, query_blocks):
        i1 = min(n, i0 + query_blocks)
        r0, r1 = i0 * BLOCK, min(i1 * BLOCK, t)
        qb = torch.arange(r0, r1, device=q.device) // BLOCK - i0
        ex_rows = exact[:, i0:i1][:, qb]                                  # [H, r, n]
        s_tok = torch.matmul(qf[r0:r1].permute(1, 0, 2), kh) * log2s       # [H, r, T]
        s_tok = s_tok.masked_fill(~(ex_rows[..., key_block] & live), float("-inf"))
        s_blk = m[:, i0:i1][:, qb].masked_fill(ex_rows | (not args.tail), float("-inf"))
        top = torch.maximum(s_tok.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True))
        p_tok, p_blk = torch.exp2(s_tok - top), torch.exp2(s_blk - top)
        num = torch.matmul(p_tok, vh) + torch.matmul(p_blk, vc)
        den = p_tok.sum(-1) + (p_blk * rows).sum(-1)
        out[r0:r1] = (num / den.clamp_min(1e-30).unsqueeze(-1)).permute(1, 0, 2)
    if args.coarse_gate is not None:
        s = torch.einsum("ihd,jhd->hij", cen, kc) * scale
        oc = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vsum / rows.view(n, 1, 1))   # [n, H, D]
        out += args.coarse_gate.float() * oc[key_block]
    return out


def pooled_stats(k: torch.Tensor, v: torch.Tensor, block_len: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics the chunked kernel carries to a block's next sparse call, from its post-RoPE k and v
    [T, H, D]: (kmean: mean k over the live rows, vscale: max |v| over the live rows / 127 * 1.1, at least
    1e-8), both fp32 [H, D]."""
    t = k.shape[0]
    n = -(-t // BLOCK)
    rows = _lengths(t, n, block_len, k.device)
    live = ((torch.arange(t, device=k.device) % BLOCK) < rows[torch.arange(t, device=k.device) // BLOCK])
    kmean = (k.float() * live.view(t, 1, 1)).sum(0) / live.sum()
    vamax = (v.float().abs() * live.view(t, 1, 1)).amax(0)
    return kmean, (vamax / 127.0 * _VSCALE_MARGIN).clamp_min(1e-8)
