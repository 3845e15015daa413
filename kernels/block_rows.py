"""Device helpers the SGMV kernels share: a row block's rows, and a slot's rank."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_block_rows(block_rows_ptr, pid_block, BLOCK_M: tl.constexpr):
    """Row indices [BLOCK_M] (int64; padding reads row 0) of block `pid_block`, and the mask
    of the real ones: one load, independent of the block's slot."""
    rows = tl.load(block_rows_ptr + pid_block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = rows >= 0
    return tl.maximum(rows, 0).to(tl.int64), m_mask


@triton.jit
def slot_rank(ranks_ptr, slot, RANK, HAS_RANKS: tl.constexpr):
    """The slot's rank, capped by the buffers' RANK (RANK itself without a ranks tensor)."""
    rank = RANK
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), RANK)
    return rank
