"""Fused SGMV LoRA kernel: shrink (x A^T) and expand (v B^T) of every output slice in one launch.

One program takes one block of rows that share a slot (from ``LoRABatch``) and one span of
output columns inside one slice. It computes the block's shrink for that slice over the full
input width, keeps the [rows, rank] result in registers, then walks its span of columns
adding ``scaling * v @ B^T`` into y. No intermediate goes through device memory, and one
launch covers every slice of a fused projection (q/k/v, gate/up).

Programs of one row block and different spans are adjacent in the launch order (the span
index is grid axis 0), so the block's rows of x come from DRAM once and from L2 after;
the span width is chosen so the launch has a few programs per multiprocessor even for a
single decode token (see ``configs.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .configs import SGMVConfig, sgmv_config

MAX_SLICES = 3


@triton.jit
def _sgmv_kernel(
    # pointers
    y_ptr,  # [T, N0+N1+N2], updated in place
    x_ptr,  # [T, K]
    a_ptr,  # [S, n*RANK, K]
    b_ptr,  # [S, N0+N1+N2, RANK]
    scaling_ptr,  # float32 [S, n] (stride 0 along n when one scale per slot)
    ranks_ptr,  # int32 [S] (unused unless HAS_RANKS)
    sorted_tokens_ptr,  # int32 [T]
    block_slot_ptr,  # int32 [B]
    block_start_ptr,  # int32 [B]
    block_len_ptr,  # int32 [B]
    # sizes
    K,
    N0,
    N1,
    N2,  # slice widths; 0 for absent slices
    SPAN,  # output columns per program
    RANK,  # rows per slice in lora_a (the buffers' max rank)
    # strides (the last dimension of every tensor is contiguous)
    stride_xt,
    stride_yt,
    stride_as,
    stride_ar,
    stride_bs,
    stride_bn,
    stride_scale_s,
    stride_scale_n,
    # meta-parameters
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for block b, span j:                       # grid (spans, blocks)
            s = block_slot[b]; skip if s == -1
            i, cols = slice and columns of span j
            rows = sorted_tokens[block_start[b] : block_start[b] + block_len[b]]
            v = x[rows] @ lora_a[s, i*RANK : i*RANK + ranks[s]].T * scaling[s, i]
            y[rows, cols] += v @ lora_b[s, cols, :ranks[s]].T
    """
    pid_span = tl.program_id(0)
    pid_block = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_block)
    if slot < 0:
        return
    slot = slot.to(tl.int64)

    # Which slice this span is in, and its columns [col_lo, col_hi) inside the slice.
    spans0 = tl.cdiv(N0, SPAN)
    spans01 = spans0 + tl.cdiv(N1, SPAN)
    in1 = pid_span >= spans0
    in2 = pid_span >= spans01
    slice_idx = in1.to(tl.int32) + in2.to(tl.int32)
    width = tl.where(in2, N2, tl.where(in1, N1, N0))
    slice_col = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
    col_lo = (pid_span - tl.where(in2, spans01, tl.where(in1, spans0, 0))) * SPAN
    col_hi = tl.minimum(col_lo + SPAN, width)

    # The block's rows.
    start = tl.load(block_start_ptr + pid_block)
    num_rows = tl.load(block_len_ptr + pid_block)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_rows
    rows = tl.load(sorted_tokens_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)

    # The slot's rank: rank rows past it are never read.
    rank = RANK
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), RANK)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank

    # Shrink: v[m, r] = sum_k x[rows[m], k] * A[slot, slice*RANK + r, k].
    x_rows = x_ptr + rows[:, None] * stride_xt
    a_rows = a_ptr + slot * stride_as + (slice_idx * RANK + offs_r)[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xb = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ab = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xb, ab, acc, input_precision=DOT_PRECISION)
    scale = tl.load(scaling_ptr + slot * stride_scale_s + slice_idx * stride_scale_n)
    v = (acc * scale).to(y_ptr.dtype.element_ty)

    # Expand: y[rows, slice_col + n] += v @ B[slot, slice_col + n, :rank].T over the span.
    b_cols = b_ptr + slot * stride_bs + slice_col * stride_bn
    y_rows = y_ptr + rows[:, None] * stride_yt + slice_col
    for n0 in range(col_lo, col_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_hi
        bb = tl.load(b_cols + offs_n[None, :] * stride_bn + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(v, bb, input_precision=DOT_PRECISION)
        y_mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = y_rows + offs_n[None, :]
        yv = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def sgmv_add(
    y: torch.Tensor,  # [T, out]: updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None,  # int32 [S]
    output_slices: tuple[int, ...],  # (o_0, .., o_{n-1}), sum == out
    config: SGMVConfig | None = None,
) -> None:
    """Launch the fused SGMV kernel. Inputs are checked by ``add_lora``; this only launches."""
    num_slices = len(output_slices)
    if num_slices > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices in one launch, got {num_slices}")
    widths = tuple(output_slices) + (0,) * (MAX_SLICES - num_slices)
    rank = lora_b.shape[2]
    if config is None:
        config = sgmv_config(
            num_blocks=batch.num_blocks,
            in_features=x.shape[1],
            output_slices=tuple(output_slices),
            rank=rank,
            dtype=x.dtype,
            device=x.device,
        )
    num_spans = sum(triton.cdiv(w, config.span) for w in output_slices)
    if scaling.dim() == 1:
        stride_scale_s, stride_scale_n = scaling.stride(0), 0
    else:
        stride_scale_s, stride_scale_n = scaling.stride(0), scaling.stride(1)

    grid = (num_spans, batch.num_blocks)
    _sgmv_kernel[grid](
        y,
        x,
        lora_a,
        lora_b,
        scaling,
        ranks if ranks is not None else batch.slot_counts,  # any int32 [S]; not read
        batch.sorted_tokens,
        batch.block_slot,
        batch.block_start,
        batch.block_len,
        x.shape[1],
        *widths,
        config.span,
        rank,
        x.stride(0),
        y.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        stride_scale_s,
        stride_scale_n,
        HAS_RANKS=ranks is not None,
        BLOCK_M=batch.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
