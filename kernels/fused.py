"""SGMV shrink and expand in one program per row block: the prefill path.

At prefill a row block holds ``block_m`` rows of one adapter, and there are hundreds of
blocks, enough programs without splitting a block's work. So one program reads its rows
of x once over the whole input width (v = x @ A^T, every slice's rank rows at once), keeps
v on chip, and walks every output column of y, adding v_i @ B_i^T into slice i. One launch,
no float32 partials written and read back, no wait between two grids.

v keeps all slices' rank columns side by side ([BLOCK_M, n*RANK]); a tile of slice i reads
B_i into rows i*RANK.. of a [n*RANK, BLOCK_N] tile and leaves the other rows zero, so one
dot with v gives v_i @ B_i^T without cutting v apart in registers.

Decode keeps the two launches (shrink.py, expand.py): with a few rows per adapter there
are too few blocks to fill the device one program each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .block_rows import alignment, load_block_rows, slot_rank
from .expand import MAX_SLICES


@triton.jit
def _fused_kernel(
    # pointers
    y_ptr,  # [T, N0+N1+N2]: updated in place
    x_ptr,  # [T, K]
    a_ptr,  # [S, n*RANK, K]
    b_ptr,  # [S, N0+N1+N2, RANK]
    scaling_ptr,  # float32 [S, n] (stride 0 along n when one scale per slot)
    ranks_ptr,  # int32 [S] (read only when HAS_RANKS)
    block_slot_ptr,  # int32 [B]
    block_rows_ptr,  # int32 [B, BLOCK_M]
    # sizes
    K,
    N0,
    N1,
    N2,  # slice widths; 0 for absent slices
    RANK: tl.constexpr,  # rank rows per slice in lora_a, rank columns per slot in lora_b
    NR: tl.constexpr,  # n * RANK
    NUM_SLICES: tl.constexpr,
    # strides (last dimensions contiguous)
    stride_yt,
    stride_xt,
    stride_as,
    stride_ar,
    stride_bs,
    stride_bn,
    stride_scale_s,
    stride_scale_n,
    # meta-parameters
    HAS_RANKS: tl.constexpr,
    ADD_IN_MEMORY: tl.constexpr,  # y += delta as a reduction in memory, not a load and a store
    B_ALIGN: tl.constexpr,  # a power of two that divides stride_bn (so B's rows load as vectors)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NR: tl.constexpr,  # >= NR, a power of two >= 16
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for block b:                                # grid (blocks,)
            s = block_slot[b]; skip if s == -1
            rows = block_rows[b] without its -1 padding
            for slice i:
                v = x[rows] @ lora_a[s, i*RANK : i*RANK + ranks[s]].T * scaling[s, i]
                y[rows, slice i] += v @ lora_b[s, slice i, :ranks[s]].T
    """
    pid_block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid_block)
    rows, m_mask = load_block_rows(block_rows_ptr, pid_block, BLOCK_M)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    rank = slot_rank(ranks_ptr, slot, RANK, HAS_RANKS)

    # Shrink: v = x[rows] @ A^T over the whole input width, every slice's rank rows at once.
    offs_j = tl.arange(0, BLOCK_NR)
    j_slice = offs_j // RANK
    j_mask = (offs_j < NR) & ((offs_j % RANK) < rank)
    x_rows = x_ptr + rows[:, None] * stride_xt
    a_rows = a_ptr + slot * stride_as + offs_j[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_NR), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xb = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ab = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & j_mask[None, :], other=0.0)
        acc = tl.dot(xb, ab, acc, input_precision=DOT_PRECISION)
    # Each slice's columns scaled by its own scale and rounded to y's dtype, as PEFT's lora_B
    # sees its input; columns past the rank are exactly zero (A's rows there were not read).
    scale = tl.load(scaling_ptr + slot * stride_scale_s + j_slice * stride_scale_n, mask=offs_j < NR, other=0.0)
    v = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)

    # Expand, slice by slice: y[rows, slice i] += v @ Bt_i, Bt_i zero outside rows i*RANK...
    # B is read in whole 16-element sectors of the rank (so the loads vectorise) and zeroed
    # past the rank in registers, since the buffers' padding may hold anything.
    y_rows = y_ptr + rows[:, None] * stride_yt
    b_slot = b_ptr + slot * stride_bs
    col0 = 0
    for i in tl.static_range(NUM_SLICES):
        if i == 0:
            width = N0
        elif i == 1:
            width = N1
        else:
            width = N2
        r_in = offs_j - i * RANK  # rank column of B_i behind row j of the tile
        in_slice = (offs_j >= i * RANK) & (offs_j < (i + 1) * RANK)
        r_load = in_slice & ((r_in // 16) < tl.cdiv(rank, 16))
        r_keep = in_slice & (r_in < rank)
        b_cols = b_slot + col0 * stride_bn + r_in[:, None]
        y_cols = y_rows + col0
        if ADD_IN_MEMORY:
            for n0 in range(0, width, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < width
                bb = _load_bt(b_cols, offs_n, n_mask, r_load, r_keep, stride_bn, B_ALIGN)
                delta = tl.dot(v, bb, input_precision=DOT_PRECISION)
                tl.atomic_add(y_cols + offs_n[None, :], delta.to(y_ptr.dtype.element_ty),
                              mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")
        else:
            # Read-modify-write, each y tile read one step ahead so its read is in flight
            # while the tile before it is added and stored.
            offs_n = tl.arange(0, BLOCK_N)
            y_next = tl.load(y_cols + offs_n[None, :], mask=m_mask[:, None] & (offs_n < width)[None, :], other=0.0)
            for n0 in range(0, width, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < width
                y_ptrs = y_cols + offs_n[None, :]
                yv = y_next
                y_next = tl.load(y_ptrs + BLOCK_N, mask=m_mask[:, None] & (offs_n + BLOCK_N < width)[None, :],
                                 other=0.0)
                bb = _load_bt(b_cols, offs_n, n_mask, r_load, r_keep, stride_bn, B_ALIGN)
                delta = tl.dot(v, bb, input_precision=DOT_PRECISION)
                tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty),
                         mask=m_mask[:, None] & n_mask[None, :])
        col0 += width


@triton.jit
def _load_bt(b_cols, offs_n, n_mask, r_load, r_keep, stride_bn, B_ALIGN: tl.constexpr):
    """B_i^T tile [BLOCK_NR, BLOCK_N] of columns offs_n, in the slice's rows, zero elsewhere."""
    b_offs = tl.multiple_of(offs_n * stride_bn, B_ALIGN)
    bb = tl.load(b_cols + b_offs[None, :], mask=r_load[:, None] & n_mask[None, :], other=0.0)
    return tl.where(r_keep[:, None], bb, 0.0)


def sgmv_fused(
    y: torch.Tensor,  # [T, out]: updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None,  # int32 [S]
    output_slices: tuple[int, ...],
    block_k: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 3,
    add_in_memory: bool = False,
) -> None:
    """Adds the LoRA term into y in one launch: one program per row block."""
    if len(output_slices) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices in one launch, got {len(output_slices)}")
    widths = tuple(output_slices) + (0,) * (MAX_SLICES - len(output_slices))
    rank = lora_b.shape[2]
    nr = lora_a.shape[1]
    stride_scale_n = 0 if scaling.dim() == 1 else scaling.stride(1)
    _fused_kernel[(batch.num_blocks,)](
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
        rank,
        nr,
        len(output_slices),
        y.stride(0),
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        scaling.stride(0),
        stride_scale_n,
        HAS_RANKS=ranks is not None,
        ADD_IN_MEMORY=add_in_memory,
        B_ALIGN=alignment(lora_b.stride(1)),
        BLOCK_M=batch.block_m,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        BLOCK_NR=max(16, triton.next_power_of_2(nr)),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
