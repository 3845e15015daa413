"""SGMV shrink and expand in one launch, for decode: each program computes its own rows' v.

The two-launch path (shrink.py, then expand.py) splits the input width over many shrink
programs and hands their partial sums to the expand through memory: at decode, where a
step moves a few megabytes, most of its time is the second launch and that handoff.

Here one program takes one row block and one span of output columns in one slice, as the
expand does. It first computes its rows' v for its slice alone, over the whole input width
(its slice's rank rows of A: a [RANK, K] strip), then walks its span of B and adds into y.
The spans of one block each read the block's x rows and their slice's A again, from L2
after the first: at decode those are a few hundred kilobytes, against the cost of a
launch. No workspace, no second grid, no handoff.

``configs.make_config`` picks this kernel where it was measured faster (decode, narrow
inputs); the semantics are those of the two-launch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .block_rows import alignment, load_block_rows, slot_rank
from .expand import MAX_SLICES, add_span_in_memory, load_b_tile, span_columns


@triton.jit
def _shrink_expand_kernel(
    # pointers
    y_ptr,  # [T, N0+N1+N2]: updated in place
    x_ptr,  # [T, K]
    a_ptr,  # [S, n*RANK, K]
    b_ptr,  # [S, N0+N1+N2, RANK]
    scaling_ptr,  # float32 [S, n] (stride 0 along n when one scale per slot)
    ranks_ptr,  # int32 [S] (read only when HAS_RANKS; element stride stride_rank)
    block_slot_ptr,  # int32 [B]
    block_rows_ptr,  # int32 [B, BLOCK_M]
    # sizes
    K,
    N0,
    N1,
    N2,  # slice widths; 0 for absent slices
    SPAN,  # output columns per program
    RANK: tl.constexpr,  # rank rows per slice in lora_a, rank columns in lora_b
    # strides (last dimensions contiguous)
    stride_yt,
    stride_xt,
    stride_as,
    stride_ar,
    stride_bs,
    stride_bn,
    stride_scale_s,
    stride_scale_n,
    stride_rank,
    # meta-parameters
    HAS_RANKS: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the kernel before (the base GEMM)
    B_ALIGN: tl.constexpr,  # a power of two that divides stride_bn
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for block b, span j:                       # grid (spans, blocks)
            s = block_slot[b]; skip if s == -1 or ranks[s] == 0
            i, cols = slice and columns of span j
            rows = block_rows[b] without its -1 padding
            v = x[rows] @ lora_a[s, i*RANK : i*RANK + ranks[s]].T * scaling[s, i]
            y[rows, cols] += v @ lora_b[s, cols, :ranks[s]].T
    """
    pid_span = tl.program_id(0)
    pid_block = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_block)
    rows, m_mask = load_block_rows(block_rows_ptr, pid_block, BLOCK_M)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    slice_idx, slice_col, col_lo, col_hi = span_columns(pid_span, N0, N1, N2, SPAN)
    rank = slot_rank(ranks_ptr, slot, stride_rank, RANK, HAS_RANKS)
    if rank <= 0:
        return  # no weights in this group: y stays as it is, bit for bit
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    r_load = (offs_r < RANK) & ((offs_r // 16) < tl.cdiv(rank, 16))
    scale = tl.load(scaling_ptr + slot * stride_scale_s + slice_idx * stride_scale_n)
    b_cols = b_ptr + slot * stride_bs + slice_col * stride_bn
    # B is a weight: its first tile is read before the wait, while the kernel before runs.
    b_next = load_b_tile(b_cols, col_lo + tl.arange(0, BLOCK_N), col_hi, offs_r, r_load, r_mask, stride_bn, B_ALIGN)
    if USE_PDL:
        # x and y are the kernel before's to finish.
        tl.extra.cuda.gdc_wait()

    # v for this slice: the slot's rank rows of A (rows past the rank are never read).
    x_rows = x_ptr + rows[:, None] * stride_xt
    a_rows = a_ptr + slot * stride_as + (slice_idx * RANK + offs_r)[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xb = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ab = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xb, ab, acc, input_precision=DOT_PRECISION)
    # Scaled and rounded to y's dtype, as the two-launch path (and PEFT's lora_B) sees v.
    v = (acc * scale).to(y_ptr.dtype.element_ty)

    y_rows = y_ptr + rows[:, None] * stride_yt + slice_col
    add_span_in_memory(y_rows, v, b_cols, b_next, col_lo, col_hi, m_mask, offs_r, r_load, r_mask, stride_bn, B_ALIGN,
                       BLOCK_N, DOT_PRECISION)


def sgmv_shrink_expand(
    y: torch.Tensor,  # [T, out]: updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None,  # int32 [S]
    output_slices: tuple[int, ...],
    span: int,
    block_k: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 3,
    pdl: bool = False,
) -> None:
    """Adds the LoRA term into y in one launch (grid: spans x row blocks)."""
    if len(output_slices) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices in one launch, got {len(output_slices)}")
    widths = tuple(output_slices) + (0,) * (MAX_SLICES - len(output_slices))
    rank = lora_b.shape[2]
    num_spans = sum(triton.cdiv(w, span) for w in output_slices)
    grid = (num_spans, batch.num_blocks)
    _shrink_expand_kernel[grid](
        y,
        x,
        lora_a,
        lora_b,
        scaling,
        ranks if ranks is not None else batch.slot_counts,  # any int32 [S]; not read
        batch.block_slot,
        batch.block_rows,
        x.shape[1],
        *widths,
        span,
        rank,
        y.stride(0),
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        scaling.stride(0),
        0 if scaling.dim() == 1 else scaling.stride(1),
        ranks.stride(0) if ranks is not None else 0,
        HAS_RANKS=ranks is not None,
        USE_PDL=pdl,
        B_ALIGN=alignment(lora_b.stride(1)),
        BLOCK_M=batch.block_m,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
