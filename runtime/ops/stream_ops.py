"""StreamOps: the BlockOps wrapper that binds each streamed block's linears to its device slot while the block
computes (``runtime.ops.streaming.BlockStreamer``: the streamed bytes, the slots, the copy stream), and carries the
memory plan's FFN row chunking (``ffn_chunk_rows``, read by ``DiTBlock.forward``)."""

from __future__ import annotations

from .streaming import BlockStreamer
from .wrapper import OpsWrapper


class StreamOps(OpsWrapper):
    """BlockOps = ``inner`` (any BlockOps) whose blocks' streamed linears are bound to their device slot while
    the block computes (``BlockStreamer.enter`` / ``leave``); ``ffn_chunk_rows``: the FFN row chunk of the
    memory plan (None: unchunked). Every other BlockOps member is the inner ops' (``ops.wrapper.OpsWrapper``)."""

    OWN = ("inner", "streamer", "chunk_rows")

    def __init__(self, inner, streamer: BlockStreamer | None, ffn_chunk_rows: int | None = None):
        super().__init__(inner, streamer=streamer, chunk_rows=ffn_chunk_rows)

    @property
    def ffn_chunk_rows(self) -> int | None:
        return self.chunk_rows

    def set_ffn_chunk_rows(self, rows: int | None) -> None:
        self.chunk_rows = rows

    def _enter(self, i, blk, starts_block: bool = False) -> None:
        st = self.streamer
        if st is not None and isinstance(i, int) and 0 <= i < len(st.blocks) and st.blocks[i] is blk:
            st.enter(i, starts_block)

    def with_attention(self, fn) -> "StreamOps":
        return StreamOps(self.inner.with_attention(fn), self.streamer, self.ffn_chunk_rows)

    def qkv(self, i, blk, x, shift, scale, segs):
        self._enter(i, blk, starts_block=True)
        return self.inner.qkv(i, blk, x, shift, scale, segs)

    def out_proj(self, i, blk, o):
        self._enter(i, blk)
        return self.inner.out_proj(i, blk, o)

    def fc1(self, i, blk, x, shift, scale, segs):
        self._enter(i, blk)
        return self.inner.fc1(i, blk, x, shift, scale, segs)

    def fc2(self, i, blk, h, lora_active: bool = False):
        self._enter(i, blk)
        y = self.inner.fc2(i, blk, h, lora_active=lora_active)
        if self.streamer is not None and isinstance(i, int):
            self.streamer.leave(i)
        return y
