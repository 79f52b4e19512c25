"""The BlockOps interface: what ``DiTBlock.forward`` (runtime.model.block), the sampler, LoRA and sequence
parallelism may use of the ops bound at load (runtime.ops.block_ops describes the per-block steps).

``BlockOps`` is the typing.Protocol; ``OpsState`` holds the declared state every plain (unwrapped) BlockOps
starts from, so a capability is read as a declared attribute, never probed with ``getattr``. The wrappers
(``runtime.ops.wrapper.OpsWrapper``: LoRA side paths, block streaming) delegate every member explicitly."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

# qkv [S, 3*H*D] -> [S, H*D] in qkv's dtype (H = qkv.shape[1] // (3*D): any head count, e.g. a rank's heads)
AttentionFn = Callable[[torch.Tensor], torch.Tensor]
KV_FORMS = ("bf16", "sage")  # how query-row chunks hold K and V (runtime.ops.rows_kv)
# q [Sq, H*D], k, v [S, H*D] -> [Sq, H*D]: attention of a query-row chunk over all keys (runtime.ops.attention)
RowsAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class BlockOps(Protocol):
    """One DiT block's operations (shapes: runtime.ops.block_ops), plus the state a run reads.

    name: "reference" | "nvfp4" | "w4a8"; attends_exactly: exact reference attention (the oracle);
    base: the plain ops at the bottom of any wrapper chain (self for a plain one; tests and load-time
    binding write there, never through a wrapper); ffn_chunk_rows: the memory plan's FFN rows per chunk (None:
    all rows at once); attn_chunk_rows: its query rows per attention chunk (None: all); attn_kv_form: how those chunks
    hold K and V ("bf16" | "sage", ``runtime.ops.rows_kv``); fc2_dispatcher: the guarded FC2 path (None: the fallback GEMM); fc2_direct_calls: FC2
    GEMMs run without a dispatcher; act_scale: the activation-scale policy of NVFP4 activations (None: not
    NVFP4); takes_amax_reduce: its producers take a dynamic amax that ``set_amax_reduce`` can route; sparse: the
    block-sparse attention bound at load (attention=sparse; None otherwise and on every ``with_attention`` copy,
    whose attention is the one given)."""

    @property
    def name(self) -> str: ...
    @property
    def attends_exactly(self) -> bool: ...
    @property
    def base(self) -> "BlockOps": ...
    @property
    def ffn_chunk_rows(self) -> int | None: ...
    @property
    def attn_chunk_rows(self) -> int | None: ...
    @property
    def attn_kv_form(self) -> str: ...
    @property
    def fc2_dispatcher(self) -> Any: ...
    @property
    def fc2_direct_calls(self) -> int: ...
    @property
    def act_scale(self) -> str | None: ...
    @property
    def takes_amax_reduce(self) -> bool: ...
    @property
    def sparse(self) -> Any: ...

    def with_attention(self, fn: AttentionFn) -> "BlockOps": ...
    def set_ffn_chunk_rows(self, rows: int | None) -> None: ...
    def set_attn_chunk_rows(self, rows: int | None, kv_form: str = "bf16") -> None: ...
    def attention_rows(self, q, k, v) -> torch.Tensor: ...
    @property
    def sage_kv_kernels(self) -> Any: ...
    def set_amax_reduce(self, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None: ...
    def qkv(self, i, blk, x, shift, scale, segs) -> torch.Tensor: ...
    def norm_rope_(self, blk, qkv, cos, sin): ...
    def attention(self, qkv) -> torch.Tensor: ...
    def out_proj(self, i, blk, o) -> torch.Tensor: ...
    def gate_add_(self, x, y, gate, segs) -> torch.Tensor: ...
    def fc1(self, i, blk, x, shift, scale, segs) -> torch.Tensor: ...
    def fc2(self, i, blk, h, lora_active: bool = False) -> torch.Tensor: ...
    def status(self) -> dict: ...


class OpsState:
    """The declared state of a plain BlockOps (``ReferenceOps`` and the quantized ops derive from it); see
    ``BlockOps`` for each member. A subclass that has a capability says so by overriding the class attribute."""

    name = "plain"
    ffn_chunk_rows: int | None = None
    attn_chunk_rows: int | None = None
    attention_rows_fn: "RowsAttentionFn | None" = None  # bound by the load for the dense backend (None: no row form)
    attn_kv_form = "bf16"
    sage_kv_kernels: "SageKVKernels | None" = None  # bound by the load where Sage2's sm_90 stages run ("sage" form)
    fc2_dispatcher: Any = None
    fc2_direct_calls = 0
    act_scale: str | None = None
    takes_amax_reduce = False
    sparse: Any = None  # the block-sparse attention (ops.sparse_attention.SparseStepAttention) the blocks consult
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def base(self) -> "OpsState":
        return self

    def set_ffn_chunk_rows(self, rows: int | None) -> None:
        self.ffn_chunk_rows = rows

    def set_attn_chunk_rows(self, rows: int | None, kv_form: str = "bf16") -> None:
        """Query-row chunks of ``rows`` (None: unchunked) holding K and V in ``kv_form`` (``runtime.ops.rows_kv``);
        the "sage" form only where the load bound Sage2's sm_90 kernels (``sage_kv_kernels``)."""
        if kv_form not in KV_FORMS:
            raise ValueError(f"kv_form {kv_form!r}: expected one of {', '.join(KV_FORMS)}")
        if kv_form == "sage" and rows is not None and self.sage_kv_kernels is None:
            raise RuntimeError(f"{self.name} ops have no Sage2 sm_90 kernels bound for K and V in Sage's operands: "
                               "the memory plan must hold them at the compute dtype here")
        self.attn_chunk_rows, self.attn_kv_form = rows, kv_form

    def clear_row_forms(self) -> None:
        """No row form of the attention (a copy whose attention is another function): no query-row chunks."""
        self.attention_rows_fn = self.sage_kv_kernels = self.attn_chunk_rows = None
        self.attn_kv_form = "bf16"

    def attention_rows(self, q, k, v) -> torch.Tensor:
        """Attention of the query rows q [Sq, H*D] over all of k, v [S, H*D] -> [Sq, H*D] (the query-row chunks of
        ``DiTBlock.forward``), through the row form of the bound dense backend."""
        if self.attention_rows_fn is None:
            raise RuntimeError(f"{self.name} ops have no row form of their attention (a sparse or sequence-parallel "
                               "attention): the memory plan must not chunk attention over query rows here")
        return self.attention_rows_fn(q, k, v)

    def set_amax_reduce(self, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Route every dynamic amax through ``fn`` (sequence parallelism: the all-reduce over the ranks)."""
        if not self.takes_amax_reduce:
            raise TypeError(f"{self.name} ops take no dynamic amax (takes_amax_reduce is False); only the W4A4 "
                            "ops (nvfp4) route one: check takes_amax_reduce first")
        self.amax_reduce = fn


__all__ = ["AttentionFn", "BlockOps", "OpsState"]
