"""Shrink and expand in one launch: each row block handed from its shrink programs to its
expand programs through a counter, not through the end of a grid.

With two launches the expand starts only after the shrink's last program ends, so every
call pays a second launch, and the shrink's ramp and tail leave memory bandwidth unused.
Here one grid holds the shrink's (block, split) programs first and the expand's (block,
span) programs after them. A shrink program stores its partial plane and adds one to its
block's counter (release); an expand program reads its weights, spins until the counter
shows all K_SPLITS planes (acquire), then adds them up and walks its span as the expand
kernel does. The block's last expand program sets the counter back to zero, so the
counters (``LoRABatch.block_done``) are zero between calls and a CUDA graph can replay.

Why the spin cannot deadlock: programs start in grid order, so every shrink program is
running or done before the first expand program starts, and a spinning program waits only
on programs that hold their multiprocessor until they finish. The Triton interpreter runs
programs one after another in grid order, so there the counters are full before any expand
program looks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .block_rows import alignment, load_block_rows
from .expand import MAX_SLICES, expand_span
from .shrink import shrink_split


@triton.jit
def _handoff_kernel(
    # pointers
    y_ptr,  # [T, N0+N1+N2]: updated in place
    partial_ptr,  # float32 [K_SPLITS, T, NR]: workspace
    x_ptr,  # [T, K]
    a_ptr,  # [S, NR, K]
    b_ptr,  # [S, N0+N1+N2, RANK]
    scaling_ptr,  # float32 [S, n]
    ranks_ptr,  # int32 [S] (read only when HAS_RANKS)
    block_slot_ptr,  # int32 [B]
    block_rows_ptr,  # int32 [B, BLOCK_M]
    done_ptr,  # int32 [B]: planes published per block; zero between calls
    # sizes
    NUM_BLOCKS,
    NUM_SPANS,
    K,
    K_CHUNK,
    N0,
    N1,
    N2,
    SPAN,
    RANK: tl.constexpr,
    NR: tl.constexpr,
    # strides
    stride_pk,
    stride_pt,
    stride_xt,
    stride_as,
    stride_ar,
    stride_yt,
    stride_bs,
    stride_bn,
    stride_scale_s,
    stride_scale_n,
    # meta-parameters
    HAS_RANKS: tl.constexpr,
    WAIT_BEFORE: tl.constexpr,  # launched as a programmatic dependent of the kernel before (x, y)
    ADD_IN_MEMORY: tl.constexpr,
    K_SPLITS: tl.constexpr,
    P_ALIGN: tl.constexpr,
    B_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_NR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics: the shrink kernel's loop over (block, split), then the expand kernel's
    over (block, span), in one grid of K_SPLITS * B + NUM_SPANS * B programs."""
    pid = tl.program_id(0)
    shrink_programs = K_SPLITS * NUM_BLOCKS
    if pid < shrink_programs:
        pid_block = pid // K_SPLITS
        slot = tl.load(block_slot_ptr + pid_block)
        rows, m_mask = load_block_rows(block_rows_ptr, pid_block, BLOCK_M)
        if slot >= 0:
            shrink_split(partial_ptr, x_ptr, a_ptr, ranks_ptr, slot.to(tl.int64), rows, m_mask, pid % K_SPLITS, K,
                         K_CHUNK, RANK, NR, stride_pk, stride_pt, stride_xt, stride_as, stride_ar, HAS_RANKS, WAIT_BEFORE, 0,
                         P_ALIGN, BLOCK_M, BLOCK_K, BLOCK_NR, DOT_PRECISION)
            # Every thread's stores are issued before one thread publishes them (the release
            # covers what happened before it in the block, through the barrier).
            tl.debug_barrier()
            tl.atomic_add(done_ptr + pid_block, 1, sem="release")
    else:
        pid_block = (pid - shrink_programs) // NUM_SPANS
        slot = tl.load(block_slot_ptr + pid_block)
        rows, m_mask = load_block_rows(block_rows_ptr, pid_block, BLOCK_M)
        if WAIT_BEFORE:
            tl.extra.cuda.gdc_wait()  # y is the kernel before's output too
        if slot >= 0:
            expand_span(y_ptr, partial_ptr, b_ptr, scaling_ptr, ranks_ptr, slot.to(tl.int64), rows, m_mask,
                        (pid - shrink_programs) % NUM_SPANS, N0, N1, N2, SPAN, RANK, stride_yt, stride_pk, stride_pt,
                        stride_bs, stride_bn, stride_scale_s, stride_scale_n, HAS_RANKS, 2, done_ptr + pid_block,
                        ADD_IN_MEMORY, K_SPLITS, B_ALIGN, P_ALIGN, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)


def sgmv_handoff(
    y: torch.Tensor,  # [T, out]: updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None,  # int32 [S]
    output_slices: tuple[int, ...],
    k_splits: int,
    block_k: int,
    span: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 3,
    add_in_memory: bool = False,
    wait_before: bool = False,
) -> None:
    """Adds the LoRA term into y with one launch (the shrink's and the expand's programs)."""
    if len(output_slices) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} output slices in one launch, got {len(output_slices)}")
    num_tokens, in_features = x.shape
    nr, rank = lora_a.shape[1], lora_b.shape[2]
    k_chunk = triton.cdiv(triton.cdiv(in_features, k_splits), block_k) * block_k
    k_splits = triton.cdiv(in_features, k_chunk)
    partial = torch.empty((k_splits, num_tokens, nr), dtype=torch.float32, device=x.device)
    widths = tuple(output_slices) + (0,) * (MAX_SLICES - len(output_slices))
    num_spans = sum(triton.cdiv(w, span) for w in output_slices)
    num_blocks = batch.num_blocks
    stride_scale_n = 0 if scaling.dim() == 1 else scaling.stride(1)
    grid = ((k_splits + num_spans) * num_blocks,)
    _handoff_kernel[grid](
        y,
        partial,
        x,
        lora_a,
        lora_b,
        scaling,
        ranks if ranks is not None else batch.slot_counts,  # any int32 [S]; not read
        batch.block_slot,
        batch.block_rows,
        batch.block_done,
        num_blocks,
        num_spans,
        in_features,
        k_chunk,
        *widths,
        span,
        rank,
        nr,
        partial.stride(0),
        partial.stride(1),
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        y.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        scaling.stride(0),
        stride_scale_n,
        HAS_RANKS=ranks is not None,
        WAIT_BEFORE=wait_before,
        ADD_IN_MEMORY=add_in_memory,
        K_SPLITS=k_splits,
        P_ALIGN=alignment(partial.stride(1)),
        B_ALIGN=alignment(lora_b.stride(1)),
        BLOCK_M=batch.block_m,
        BLOCK_K=block_k,
        BLOCK_NR=max(16, triton.next_power_of_2(nr)),
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if wait_before else {}),
    )
