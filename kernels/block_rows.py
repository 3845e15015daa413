"""Helpers the SGMV kernels share: a row block's rows, a slot's rank, a stride's alignment."""

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
def slot_rank(ranks_ptr, slot, stride_rank, RANK, HAS_RANKS: tl.constexpr):
    """The slot's rank, capped by the buffers' RANK (RANK itself without a ranks tensor). 0:
    the slot's adapter has no weights here (it does not target this layer group)."""
    rank = RANK
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rank), RANK)
    return rank


def alignment(stride: int, cap: int = 16) -> int:
    """The largest power of two (at most ``cap``) that divides ``stride``: a launch-time
    promise to the compiler (``tl.multiple_of``) that rows start on vector boundaries.

    Triton finds divisibility by 16 itself; a stride of 8 or 24 (rank 8) it cannot see, and
    read such rows one element at a time. Measured on an H200 with the hint
    (kernels_h200_prefill_align.json, kernels_h200_decode_r8_align.json): rank-8 prefill
    1.07-1.23x faster, rank-8 decode 1.02x at the median and up to 1.34x (gate/up, many
    adapters)."""
    return min(cap, stride & -stride) if stride else cap


def rank_strides(ranks) -> tuple[int, int]:
    """(slot, slice) element strides of a ranks tensor, int32 [S] or [S, n]: a slice stride
    of 0 reads one rank for every slice; (0, 0) without one (the kernels read none)."""
    if ranks is None:
        return 0, 0
    return ranks.stride(0), ranks.stride(1) if ranks.dim() == 2 else 0
