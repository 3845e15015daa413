"""SGMV shrink: v = x @ A^T for every row block and every output slice at once, split over K.

Decode is bound by latency, not bytes: a single program walking all of K issues one short
chain of loads after another. Here the input width is cut into ``k_splits`` chunks, one
program per (chunk, row block), so a step's loads are all in flight at once. Each program
writes its partial sums to its own plane of a float32 workspace; the expand kernel adds
the planes as it reads them, so there are no atomics and no zeroing pass, and the result
does not depend on the order programs run in.

All slices' rank rows are computed together (A is [n*R, K] per slot), so a row block's x
is read from memory once whatever the number of slices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .block_rows import alignment, load_block_rows, rank_strides


@triton.jit
def _shrink_kernel(
    # pointers
    partial_ptr,  # float32 [k_splits, T, n*RANK]: out
    x_ptr,  # [T, K]
    a_ptr,  # [S, n*RANK, K]
    ranks_ptr,  # int32 [S] or [S, n] (read only when HAS_RANKS; strides stride_rank, stride_rank_n)
    block_slot_ptr,  # int32 [B]
    block_rows_ptr,  # int32 [B, BLOCK_M]
    # sizes
    K,
    K_CHUNK,  # input columns per split (a multiple of BLOCK_K)
    RANK: tl.constexpr,  # rank rows per slice in lora_a
    NR: tl.constexpr,  # n * RANK: rank rows of all slices
    # strides (last dimensions contiguous)
    stride_pk,
    stride_pt,
    stride_xt,
    stride_as,
    stride_ar,
    stride_rank,
    stride_rank_n,  # 0: one rank per slot for every slice
    # meta-parameters
    HAS_RANKS: tl.constexpr,
    WAIT_BEFORE: tl.constexpr,  # launched as a programmatic dependent of the kernel before
    TRIGGER: tl.constexpr,  # lets the expand launch (PDL): 0 never, 1 at the start, 2 after the loop
    P_ALIGN: tl.constexpr,  # a power of two that divides stride_pt (so the stores are vectors)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_NR: tl.constexpr,  # >= NR, a power of two >= 16
    DOT_PRECISION: tl.constexpr,
):
    """Semantics, as the plain loop it computes::

        for block b, split c:                       # grid (k_splits, blocks)
            s = block_slot[b]; skip if s == -1 or every slice's rank is 0
            rows = block_rows[b] without its -1 padding
            ks = c*K_CHUNK : (c+1)*K_CHUNK
            j = rank rows of every slice i with (j % RANK) < ranks[s, i]   (ranks[s] for all i: [S])
            partial[c, rows, j] = x[rows, ks] @ lora_a[s, j, ks].T
    """
    pid_k = tl.program_id(0)
    pid_block = tl.program_id(1)
    # The block's slot and rows are loaded before the exit test: both loads in flight at once.
    slot = tl.load(block_slot_ptr + pid_block)
    rows, m_mask = load_block_rows(block_rows_ptr, pid_block, BLOCK_M)
    if slot < 0:
        return
    slot = slot.to(tl.int64)

    # Rank rows inside their slice's rank; rows past it are never read.
    offs_j = tl.arange(0, BLOCK_NR)
    j_mask = offs_j < NR
    if HAS_RANKS:
        # Each row j reads its slice's rank (a few distinct addresses, one round trip).
        rank_j = tl.load(ranks_ptr + slot * stride_rank + (offs_j // RANK) * stride_rank_n, mask=j_mask, other=0)
        rank_j = tl.minimum(rank_j, RANK)
        if tl.max(rank_j, axis=0) <= 0:
            return  # no weights in this group (an adapter that targets q and v only, at gate/up)
        j_mask = j_mask & ((offs_j % RANK) < rank_j)
    if TRIGGER == 1:
        # Decode: the expand may launch at once; its programs read their metadata and first
        # tile of B while this grid runs.
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT_BEFORE:
        # Everything above reads step metadata and weights, written long before; x is the
        # kernel before's output, so wait for it here.
        tl.extra.cuda.gdc_wait()

    x_rows = x_ptr + rows[:, None] * stride_xt
    a_rows = a_ptr + slot * stride_as + offs_j[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_NR), dtype=tl.float32)
    k_lo = pid_k * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xb = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ab = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & j_mask[None, :], other=0.0)
        acc = tl.dot(xb, ab, acc, input_precision=DOT_PRECISION)
    if TRIGGER == 2:
        # Prefill: the expand launches once every program is past its loop, in the last
        # wave's tail, so its programs never take a place a program of this grid waits for.
        tl.extra.cuda.gdc_launch_dependents()

    out_rows = tl.multiple_of(rows * stride_pt, P_ALIGN)
    out = partial_ptr + pid_k * stride_pk + out_rows[:, None] + offs_j[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & (offs_j < NR)[None, :])


def sgmv_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    batch: LoRABatch,
    ranks: torch.Tensor | None,  # int32 [S] or [S, n]
    rank: int,  # R
    k_splits: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 3,
    wait_before: bool = False,
    trigger: int = 0,
) -> torch.Tensor:
    """Returns float32 partial sums [k_splits, T, n*R]: sum over axis 0 is x @ A^T per row.

    With programmatic dependent launch (Hopper and later): ``wait_before`` launches this
    grid as a dependent of the kernel before it, ``trigger`` lets the expand launched after
    it as a dependent start early (1: at once, 2: once every program is past its loop).

    Only rows of adapter blocks are written; rows of slot -1 are left as they were.
    """
    num_tokens, in_features = x.shape
    nr = lora_a.shape[1]
    k_chunk = triton.cdiv(triton.cdiv(in_features, k_splits), block_k) * block_k
    k_splits = triton.cdiv(in_features, k_chunk)
    # Planes start on 64-byte boundaries whatever the rows: Triton compiles a variant per
    # divisibility of an integer argument by 16, and T * n*R (rank 8, an odd T) would make
    # the plane stride one, i.e. a new compile for a new prefill length.
    plane = triton.cdiv(num_tokens * nr, 16) * 16
    partial = torch.empty(k_splits * plane, dtype=torch.float32, device=x.device).as_strided(
        (k_splits, num_tokens, nr), (plane, nr, 1))
    grid = (k_splits, batch.num_blocks)
    _shrink_kernel[grid](
        partial,
        x,
        lora_a,
        ranks if ranks is not None else batch.slot_counts,  # any int32 [S]; not read
        batch.block_slot,
        batch.block_rows,
        in_features,
        k_chunk,
        rank,
        nr,
        partial.stride(0),
        partial.stride(1),
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        *rank_strides(ranks),
        HAS_RANKS=ranks is not None,
        WAIT_BEFORE=wait_before,
        TRIGGER=trigger,
        P_ALIGN=alignment(partial.stride(1)),
        BLOCK_M=batch.block_m,
        BLOCK_K=block_k,
        BLOCK_NR=max(16, triton.next_power_of_2(nr)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if wait_before else {}),
    )
    return partial
