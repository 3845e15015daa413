"""SGMV expand: y[:, slice] += scaling * v_slice @ B_slice^T, for every slice in one launch.

One program takes one row block and one span of output columns inside one slice. It adds
up the shrink's partial planes for its rows and its slice's rank columns once, scales and
rounds them to y's dtype (as PEFT's lora_B sees them), then walks its span of columns.
Spans of one row block are adjacent in launch order (span index = grid axis 0), so the
block's partial sums come from L2 after the first read.

Two ways to walk the span, chosen by the batch (configs.make_config):

- decode (few rows a block, a span of one to a few tiles): B's first tile is read before
  the wait on the shrink (with PDL it loads while the shrink runs), and each tile is added
  into y with a fire-and-forget reduction (``red.global.add``), so no step waits on a read
  of y;
- prefill (dense rows, long spans): read-modify-write of y, each y tile read one step
  ahead, B's tiles pipelined by the compiler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .block_rows import alignment, load_block_rows, rank_strides, slot_rank

MAX_SLICES = 3


@triton.jit
def _expand_kernel(
    # pointers
    y_ptr,  # [T, N0+N1+N2]: updated in place
    partial_ptr,  # float32 [k_splits, T, n*RANK]
    b_ptr,  # [S, N0+N1+N2, RANK]
    scaling_ptr,  # float32 [S, n] (stride 0 along n when one scale per slot)
    ranks_ptr,  # int32 [S] or [S, n] (read only when HAS_RANKS; strides stride_rank, stride_rank_n)
    block_slot_ptr,  # int32 [B]
    block_rows_ptr,  # int32 [B, BLOCK_M]
    # sizes
    N0,
    N1,
    N2,  # slice widths; 0 for absent slices
    SPAN,  # output columns per program
    RANK: tl.constexpr,  # rank columns per slot in lora_b; constexpr, so masks on it come in whole vectors
    # strides (last dimensions contiguous)
    stride_yt,
    stride_pk,
    stride_pt,
    stride_bs,
    stride_bn,
    stride_scale_s,
    stride_scale_n,
    stride_rank,
    stride_rank_n,  # 0: one rank per slot for every slice
    # meta-parameters
    HAS_RANKS: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the shrink
    ADD_IN_MEMORY: tl.constexpr,  # y += delta as a reduction in memory, not a load and a store
    K_SPLITS: tl.constexpr,  # partial planes to add up
    B_ALIGN: tl.constexpr,  # a power of two that divides stride_bn (so B's rows load as vectors)
    P_ALIGN: tl.constexpr,  # a power of two that divides stride_pt
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for block b, span j:                       # grid (spans, blocks)
            i, cols = slice and columns of span j
            s = block_slot[b]; r = ranks[s, i] (ranks[s]: [S]); skip if s == -1 or r == 0
            rows = block_rows[b] without its -1 padding
            v = partial[:, rows, i*RANK : i*RANK + r].sum(0) * scaling[s, i]
            y[rows, cols] += v @ lora_b[s, cols, :r].T
    """
    pid_span = tl.program_id(0)
    pid_block = tl.program_id(1)
    # The block's slot and rows are loaded before the exit test: both loads in flight at once.
    slot = tl.load(block_slot_ptr + pid_block)
    rows, m_mask = load_block_rows(block_rows_ptr, pid_block, BLOCK_M)
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

    rank = slot_rank(ranks_ptr + slice_idx * stride_rank_n, slot, stride_rank, RANK, HAS_RANKS)
    if rank <= 0:
        return  # no weights in this slice (a projection the adapter does not target): y stays as it is
    offs_r = tl.arange(0, BLOCK_R)
    # Loads are masked to whole 32-byte sectors of the slot's rank (so they vectorise and
    # bytes a sector past the rank are never read); columns past the rank are zeroed in
    # registers, since the buffers' padding may hold anything.
    r_mask = offs_r < rank
    r_load = (offs_r < RANK) & ((offs_r // 16) < tl.cdiv(rank, 16))
    scale = tl.load(scaling_ptr + slot * stride_scale_s + slice_idx * stride_scale_n)
    b_cols = b_ptr + slot * stride_bs + slice_col * stride_bn
    if ADD_IN_MEMORY:
        # Decode: a span is a tile or a few. B is a weight, not the shrink's output, so its
        # first tile is read before the wait, then each next tile one step ahead.
        b_next = _load_b_tile(b_cols, col_lo + tl.arange(0, BLOCK_N), col_hi, offs_r, r_load, r_mask, stride_bn,
                              B_ALIGN)
    if USE_PDL:
        # Above: step metadata and weights only. The partials and y are the shrink's (and
        # the base GEMM's before it) to finish.
        tl.extra.cuda.gdc_wait()

    # v = the shrink's partial planes added up, for this slice's rank columns. The planes
    # are read in one unrolled burst: every load is in flight before the first add.
    v_rows = tl.multiple_of(rows * stride_pt, P_ALIGN)
    v_ptrs = partial_ptr + v_rows[:, None] + (slice_idx * RANK + offs_r)[None, :]
    v_mask = m_mask[:, None] & r_load[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in tl.static_range(K_SPLITS):
        acc += tl.load(v_ptrs + k * stride_pk, mask=v_mask, other=0.0)
    acc = tl.where(r_mask[None, :], acc, 0.0)
    v = (acc * scale).to(y_ptr.dtype.element_ty)

    y_rows = y_ptr + rows[:, None] * stride_yt + slice_col
    if ADD_IN_MEMORY:
        for n0 in range(col_lo, col_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            bb = b_next
            b_next = _load_b_tile(b_cols, offs_n + BLOCK_N, col_hi, offs_r, r_load, r_mask, stride_bn, B_ALIGN)
            delta = tl.dot(v, bb, input_precision=DOT_PRECISION)
            # A fire-and-forget reduction: the loop never waits on a read of y. Each element
            # has one writer, so the result is deterministic: y + delta rounded to y's dtype
            # first, as PEFT adds lora_B's output.
            y_mask = m_mask[:, None] & (offs_n < col_hi)[None, :]
            tl.atomic_add(y_rows + offs_n[None, :], delta.to(y_ptr.dtype.element_ty), mask=y_mask, sem="relaxed")
    else:
        # Prefill: y is dense. Read-modify-write, each y tile read one step ahead so its read
        # is in flight while the tile before it is added and stored; B's tiles are pipelined
        # by the compiler (num_stages).
        offs_n = col_lo + tl.arange(0, BLOCK_N)
        y_next = tl.load(y_rows + offs_n[None, :], mask=m_mask[:, None] & (offs_n < col_hi)[None, :], other=0.0)
        for n0 in range(col_lo, col_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            y_mask = m_mask[:, None] & (offs_n < col_hi)[None, :]
            y_ptrs = y_rows + offs_n[None, :]
            yv = y_next
            y_next = tl.load(y_ptrs + BLOCK_N, mask=m_mask[:, None] & (offs_n + BLOCK_N < col_hi)[None, :], other=0.0)
            bb = _load_b_tile(b_cols, offs_n, col_hi, offs_r, r_load, r_mask, stride_bn, B_ALIGN)
            delta = tl.dot(v, bb, input_precision=DOT_PRECISION)
            tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _load_b_tile(b_cols, offs_n, col_hi, offs_r, r_load, r_mask, stride_bn, B_ALIGN: tl.constexpr):
    """B^T tile [BLOCK_R, BLOCK_N] of columns offs_n (< col_hi), zero past the slot's rank."""
    # Without the hint a row stride that is not a multiple of 16 (rank 8) reads B one
    # element at a time.
    b_offs = tl.multiple_of(offs_n * stride_bn, B_ALIGN)
    bb = tl.load(b_cols + b_offs[None, :] + offs_r[:, None], mask=r_load[:, None] & (offs_n < col_hi)[None, :],
                 other=0.0)
    return tl.where(r_mask[:, None], bb, 0.0)


def sgmv_expand(
    y: torch.Tensor,  # [T, out]: updated in place
    partial: torch.Tensor,  # float32 [k_splits, T, n*R]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None,  # int32 [S] or [S, n]
    output_slices: tuple[int, ...],
    span: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 3,
    pdl: bool = False,
    add_in_memory: bool = False,
) -> None:
    """Adds the expanded LoRA term into y."""
    if len(output_slices) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices in one launch, got {len(output_slices)}")
    widths = tuple(output_slices) + (0,) * (MAX_SLICES - len(output_slices))
    rank = lora_b.shape[2]
    num_spans = sum(triton.cdiv(w, span) for w in output_slices)
    stride_scale_n = 0 if scaling.dim() == 1 else scaling.stride(1)
    grid = (num_spans, batch.num_blocks)
    _expand_kernel[grid](
        y,
        partial,
        lora_b,
        scaling,
        ranks if ranks is not None else batch.slot_counts,  # any int32 [S]; not read
        batch.block_slot,
        batch.block_rows,
        *widths,
        span,
        rank,
        y.stride(0),
        partial.stride(0),
        partial.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        scaling.stride(0),
        stride_scale_n,
        *rank_strides(ranks),
        HAS_RANKS=ranks is not None,
        USE_PDL=pdl,
        ADD_IN_MEMORY=add_in_memory,
        K_SPLITS=partial.shape[0],
        B_ALIGN=alignment(lora_b.stride(1)),
        P_ALIGN=alignment(partial.stride(1)),
        BLOCK_M=batch.block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
