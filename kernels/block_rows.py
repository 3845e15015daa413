"""Device helpers the SGMV kernels share: a row block's rows, and a slot's rank."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_block_rows(sorted_tokens_ptr, block_start_ptr, block_len_ptr, pid_block, BLOCK_M: tl.constexpr):
    """Row indices [BLOCK_M] (int64) of block `pid_block` and the mask of the real ones."""
    start = tl.load(block_start_ptr + pid_block)
    num_rows = tl.load(block_len_ptr + pid_block)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_rows
    rows = tl.load(sorted_tokens_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def slot_rank(ranks_ptr, slot, RANK, HAS_RANKS: tl.constexpr):
    """The slot's rank, capped by the buffers' RANK (RANK itself without a ranks tensor)."""
    rank = RANK
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), RANK)
    return rank
