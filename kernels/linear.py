"""``lora_linear``: a decode step's base matmul and its rows' LoRA terms in one GEMM.

``y = x @ W.T`` followed by ``add_lora`` is two passes over y and, at decode, a chain of
short launches whose fixed cost is most of the LoRA term (kernels_h200_notes.md). Here the
expand is the GEMM's epilogue instead:

1. the shrink (``sgmv_shrink``, one plane: each row block's programs walk the whole input
   width) computes v = x @ A^T per row; it runs beside the GEMM's main loop, which does not
   need it;
2. one program per (row tile, column tile, K split) streams its tile of W; the program that
   finishes a tile (the last K split to arrive) adds the tile's LoRA term,
   ``sum over the step's adapters of onehot(rows of the adapter) * v @ B[cols]^T``, as a
   few small dense dots over the step's distinct adapters, and writes y once.

On Hopper and later the GEMM is a programmatic dependent of the shrink: the shrink lets it
launch at once, and only the epilogue waits for v. Each adapter's B is read once per
column tile, so once in all; A once per row block, as in ``add_lora``.

Rounding follows PEFT's bf16/fp16 forward: the base output and the LoRA output are each
rounded to y's dtype, then added and rounded again; v is scaled and rounded before B, as
``add_lora`` does.

Split K: several programs share a tile; each stores its float32 partial tile in a
workspace and counts itself in the tile's counter; the last one to count adds the partials
in split order (so the result does not depend on which finished last), resets the counter
and runs the epilogue. Counters are zero between calls, so calls that share a workspace
must not run at the same time (one stream, as an engine's step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .batch import LoRABatch
from .block_rows import alignment, rank_strides
from .configs import multiprocessors, sgmv_config, supports_pdl
from .shrink import sgmv_shrink

MAX_SLICES = 3


@dataclass(frozen=True)
class LinearConfig:
    block_m: int  # rows per tile (a power of two >= 16)
    block_n: int  # columns per tile; divides every output slice
    block_k: int  # input columns per step of the main loop
    splits: int  # K splits per tile (1: no workspace)
    num_warps: int = 4
    num_stages: int = 4
    adapters_per_step: int = 4  # distinct adapters per step of the epilogue
    shrink_splits: int = 0  # the shrink's K splits (0: as add_lora picks them)
    pdl: bool = False


@triton.jit
def _linear_kernel(
    y_ptr,  # [T, N] out
    x_ptr,  # [T, K]
    w_ptr,  # [N, K]
    partial_ptr,  # float32 [K_SPLITS, T, n*RANK]: the shrink's planes
    b_ptr,  # [S, N, RANK]
    scaling_ptr,  # float32 [S, n] (stride 0 along n when one scale per slot)
    ranks_ptr,  # int32 [S] or [S, n] (read only when HAS_RANKS)
    token_slots_ptr,  # int32 [T]
    block_slot_ptr,  # int32 [B]: blocks of one slot are adjacent (LoRABatch)
    ws_ptr,  # float32 [PARTS, T, N] (read only when PARTS > 1)
    count_ptr,  # int32 [row tiles * column tiles], zero between calls (PARTS > 1)
    M,
    N,
    K,
    K_CHUNK,
    N0,
    N1,  # slice widths (N2 = N - N0 - N1)
    NUM_BLOCKS,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_pk,
    stride_pt,
    stride_bs,
    stride_bn,
    stride_scale_s,
    stride_scale_n,
    stride_rank,
    stride_rank_n,
    RANK: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    USE_PDL: tl.constexpr,
    SPLITS: tl.constexpr,  # K splits of the base GEMM
    K_SPLITS: tl.constexpr,  # the shrink's planes
    EVEN_K: tl.constexpr,  # every K split is a whole number of BLOCK_K steps
    B_ALIGN: tl.constexpr,
    P_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= RANK, a power of two >= 16
    ADAPTERS: tl.constexpr,  # distinct adapters per step of a LoRA program
    DOT_PRECISION: tl.constexpr,
):
    """Semantics::

        for row tile m, column tile n:          # grid (row tiles, column tiles, SPLITS + HAS_LORA)
            base = x[m] @ W[n].T                 (float32; programs 0..SPLITS-1 each one K chunk)
            lora = 0                             (program SPLITS, after the shrink:)
            for each distinct slot s of the step (block_slot), i = slice of tile n:
                r = ranks[s, i]; rows = rows of m with token_slots == s
                v = partial[:, rows, i*RANK : i*RANK + r].sum(0)
                lora[rows] += round(v * scaling[s, i]) @ B[s, n, :r].T
            y[m, n] = round(round(base) + round(lora))    (the last program of the tile)
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

    lora_program = False
    if HAS_LORA:
        lora_program = pid_k == SPLITS
    if lora_program:
        # Scheduled after every GEMM program of the grid (the last grid axis), so the shrink
        # has long finished by the time it waits.
        acc = _lora_tile(partial_ptr, b_ptr, scaling_ptr, ranks_ptr, token_slots_ptr, block_slot_ptr, offs_m, m_mask,
                         offs_n, n_mask, pid_n * BLOCK_N, N0, N1, NUM_BLOCKS, stride_pk, stride_pt, stride_bs,
                         stride_bn, stride_scale_s, stride_scale_n, stride_rank, stride_rank_n, y_ptr.dtype.element_ty,
                         RANK, HAS_RANKS, USE_PDL, K_SPLITS, B_ALIGN, P_ALIGN, BLOCK_M, BLOCK_N, BLOCK_R, ADAPTERS,
                         DOT_PRECISION)
    else:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_k * K_CHUNK
        k_hi = tl.minimum(k_lo + K_CHUNK, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xb = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                wb = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < k_hi
                xb = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                wb = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(xb, wb, acc, input_precision=DOT_PRECISION)

    tile_mask = m_mask[:, None] & n_mask[None, :]
    if SPLITS + HAS_LORA > 1:
        ws_tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_tile, acc, mask=tile_mask)
        # Every thread's store is done before the count (release); the last to count sees
        # every part of the tile (acquire) and reads them from L2, past L1.
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived != SPLITS + HAS_LORA - 1:
            return
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(ws_ptr + s * M * N + ws_tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_LORA:
            lora = tl.load(ws_ptr + SPLITS * M * N + ws_tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            out = (out.to(tl.float32) + lora.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(counter, 0)
    else:
        out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=tile_mask)


@triton.jit
def _lora_tile(partial_ptr, b_ptr, scaling_ptr, ranks_ptr, token_slots_ptr, block_slot_ptr, offs_m, m_mask, offs_n,
               n_mask, n_lo, N0, N1, NUM_BLOCKS, stride_pk, stride_pt, stride_bs, stride_bn, stride_scale_s,
               stride_scale_n, stride_rank, stride_rank_n, out_dtype: tl.constexpr, RANK: tl.constexpr,
               HAS_RANKS: tl.constexpr, USE_PDL: tl.constexpr, K_SPLITS: tl.constexpr, B_ALIGN: tl.constexpr,
               P_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
               ADAPTERS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The LoRA term [BLOCK_M, BLOCK_N] (float32) of a tile, ADAPTERS distinct slots a step:
    a dense dot of v, kept only in the rows of each step's slots, by their B."""
    # The tile's slice: tiles never straddle slices (BLOCK_N divides every width).
    in1 = n_lo >= N0
    in2 = n_lo >= N0 + N1
    slice_idx = in1.to(tl.int32) + in2.to(tl.int32)
    row_slot = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)
    offs_j = tl.arange(0, ADAPTERS * BLOCK_R)
    r = offs_j % BLOCK_R
    v_rows = tl.multiple_of(offs_m * stride_pt, P_ALIGN)
    b_offs = tl.multiple_of(offs_n * stride_bn, B_ALIGN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the planes are the shrink's
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Not pipelined through shared memory: the GEMM's stages already hold it.
    for b0 in tl.range(0, NUM_BLOCKS, ADAPTERS, num_stages=1):
        blk = b0 + offs_j // BLOCK_R
        slot = tl.load(block_slot_ptr + blk, mask=blk < NUM_BLOCKS, other=-1)
        before = tl.load(block_slot_ptr + blk - 1, mask=(blk > 0) & (blk < NUM_BLOCKS), other=-1)
        valid = (slot >= 0) & (slot != before)  # one step per distinct slot: its first block
        s64 = tl.maximum(slot, 0).to(tl.int64)
        rank = RANK
        if HAS_RANKS:
            rank = tl.minimum(tl.load(ranks_ptr + s64 * stride_rank + slice_idx * stride_rank_n, mask=valid, other=0),
                              RANK)
        valid = valid & (r < rank)
        scale = tl.load(scaling_ptr + s64 * stride_scale_s + slice_idx * stride_scale_n, mask=valid, other=0.0)
        mine = m_mask[:, None] & valid[None, :] & (row_slot[:, None] == slot[None, :])
        v_ptrs = partial_ptr + v_rows[:, None] + (slice_idx * RANK + r)[None, :]
        v = tl.zeros((BLOCK_M, ADAPTERS * BLOCK_R), dtype=tl.float32)
        for k in tl.static_range(K_SPLITS):
            v += tl.load(v_ptrs + k * stride_pk, mask=mine, other=0.0)
        vt = (v * scale[None, :]).to(out_dtype)
        bt = tl.load(b_ptr + s64[:, None] * stride_bs + b_offs[None, :] + r[:, None],
                     mask=valid[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(vt, bt, acc, input_precision=DOT_PRECISION)
    return acc


def _divides_slices(block_n: int, slices: tuple[int, ...]) -> bool:
    return all(w % block_n == 0 for w in slices)


@functools.lru_cache(maxsize=1024)
def make_linear_config(num_tokens: int, in_features: int, output_slices: tuple[int, ...], sms: int,
                       device_pdl: bool = False) -> LinearConfig:
    """The default configuration of one call shape."""
    block_m = max(16, min(64, triton.next_power_of_2(num_tokens)))
    block_n = 64
    while block_n > 16 and not _divides_slices(block_n, output_slices):
        block_n //= 2
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(sum(output_slices), block_n)
    splits = 1
    while 10 * tiles * splits < 7 * sms and in_features // (splits * 2) >= 512:
        splits *= 2
    return LinearConfig(block_m=block_m, block_n=block_n, block_k=128, splits=splits,
                        num_stages=5 if block_m >= 64 else 3, pdl=device_pdl)


def linear_config(x: torch.Tensor, output_slices: tuple[int, ...]) -> LinearConfig:
    return make_linear_config(x.shape[0], x.shape[1], tuple(output_slices), multiprocessors(x.device),
                              supports_pdl(x.device))


class _Workspace:
    """Split-K partial tiles and tile counters, kept per device and grown on demand.

    A CUDA graph that captures a call keeps using the buffers it captured; they are never
    freed or replaced while one is alive, only grown into new ones for larger calls.
    """

    def __init__(self):
        self.partials: dict[torch.device, torch.Tensor] = {}
        self.counters: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, partial_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.partials.get(device)
        if p is None or p.numel() < partial_elems:
            p = torch.empty(max(partial_elems, 1 << 20), dtype=torch.float32, device=device)
            self.partials[device] = p
        c = self.counters.get(device)
        if c is None or c.numel() < tiles:
            c = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
            self.counters[device] = c
        return p, c


_WORKSPACE = _Workspace()


def lora_linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    lora_a: torch.Tensor | None = None,  # [S, n*R, in]
    lora_b: torch.Tensor | None = None,  # [S, out, R]
    scaling: torch.Tensor | None = None,  # float32 [S] or [S, n]
    batch: LoRABatch | None = None,
    ranks: torch.Tensor | None = None,  # int32 [S] or [S, n]
    output_slices: tuple[int, ...] | None = None,
    config: LinearConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` plus each row's LoRA term (as ``add_lora`` adds it), in one GEMM.

    Without ``lora_a`` it is the plain GEMM. CUDA tensors, or CPU under ``TRITON_INTERPRET=1``.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, in] and weight [out, in], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous along their last dimension")
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    slices = tuple(output_slices) if output_slices is not None else (out_features,)
    if sum(slices) != out_features or len(slices) > MAX_SLICES:
        raise ValueError(f"output_slices {slices} must be at most {MAX_SLICES} and sum to {out_features}")
    config = config or linear_config(x, slices)
    if not _divides_slices(config.block_n, slices):
        raise ValueError(f"block_n {config.block_n} must divide every output slice {slices}")
    y = out if out is not None else torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    has_lora = lora_a is not None
    use_pdl = has_lora and config.pdl
    if has_lora:
        if batch is None or scaling is None or lora_b is None:
            raise ValueError("lora_a needs lora_b, scaling and batch")
        rank = lora_b.shape[2]
        sgmv = sgmv_config(batch.num_blocks, batch.block_m, in_features, slices, rank, x.dtype, x.device)
        # The shrink lets the GEMM launch at once (PDL): only the LoRA programs wait for it.
        partial = sgmv_shrink(x, lora_a, batch, ranks, rank, config.shrink_splits or sgmv.k_splits, sgmv.block_k,
                              sgmv.num_warps, sgmv.num_stages, trigger=1 if use_pdl else 0)
        lora_args = (partial, lora_b, scaling, ranks if ranks is not None else batch.token_slots, batch.token_slots,
                     batch.block_slot)
        strides = (partial.stride(0), partial.stride(1), lora_b.stride(0), lora_b.stride(1), scaling.stride(0),
                   0 if scaling.dim() == 1 else scaling.stride(1), *rank_strides(ranks))
        k_planes, num_blocks = partial.shape[0], batch.num_blocks
        b_align, p_align = alignment(lora_b.stride(1)), alignment(partial.stride(1))
    else:
        rank, k_planes, num_blocks, b_align, p_align = 16, 1, 0, 16, 16
        lora_args = (x,) * 6  # not read
        strides = (0,) * 8
    row_tiles = triton.cdiv(num_tokens, config.block_m)
    col_tiles = triton.cdiv(out_features, config.block_n)
    k_chunk = triton.cdiv(triton.cdiv(in_features, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(in_features, k_chunk)
    parts = splits + has_lora
    if parts > 1:
        ws, counters = _WORKSPACE.get(x.device, parts * num_tokens * out_features, row_tiles * col_tiles)
    else:
        ws, counters = y, y  # not read
    _linear_kernel[(row_tiles, col_tiles, parts)](
        y, x, weight, *lora_args, ws, counters,
        num_tokens, out_features, in_features, k_chunk, slices[0], slices[1] if len(slices) > 1 else 0, num_blocks,
        x.stride(0), weight.stride(0), y.stride(0), *strides,
        RANK=rank,
        HAS_LORA=has_lora,
        HAS_RANKS=ranks is not None,
        USE_PDL=use_pdl,
        SPLITS=splits,
        K_SPLITS=k_planes,
        EVEN_K=in_features % k_chunk == 0,
        B_ALIGN=b_align,
        P_ALIGN=p_align,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        ADAPTERS=config.adapters_per_step,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return y
