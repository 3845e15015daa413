"""``lora_linear``: a decode step's base matmul with its rows' LoRA terms, the shrink hidden
under the GEMM.

After a cuBLAS GEMM, ``add_lora`` is a chain of two short launches (kernels_h200_notes.md):
the shrink cannot start before the GEMM ends, though it needs only x. Here the base GEMM is
our own (``_gemm_kernel``, a split-K Triton GEMM that matches cuBLAS at decode sizes, see
bench/results/linear_h200_notes.md), so the three launches can overlap on Hopper and later
through programmatic dependent launch (PDL):

1. the shrink (``sgmv_shrink``) computes v = x @ A^T into its float32 planes, and lets the
   GEMM launch at once;
2. the GEMM writes y = x @ W^T, running beside the shrink (it does not need v); it lets the
   expand launch at once, and its last programs wait for the shrink before they end, so the
   GEMM's end means the shrink's end too;
3. the expand (``sgmv_expand``) reads its first tiles of B while the GEMM runs, waits for the
   GEMM, then adds v @ B^T into y, as ``add_lora`` does.

Without PDL (older GPUs, the interpreter, ``LORAPLEX_PDL=0``) the three run one after the
other, with the same bits. The result is that of ``y = gemm(x, W); add_lora(y, ...)``, up to
the order in which the shrink adds its K splits (``GemmConfig.shrink_splits``; with 0, the
same bits).

Split K: several programs share a tile of y; each stores its float32 partial tile in a
workspace and counts itself in the tile's counter; the last one to count adds the partials
in split order (so the result does not depend on which finished last), resets the counter
and writes y. Counters are zero between calls, so calls that share a workspace must not run
at the same time (one stream, as an engine's step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .add_lora import _check
from .batch import LoRABatch
from .block_rows import rank_strides
from .configs import multiprocessors, sgmv_config, supports_pdl
from .expand import sgmv_expand
from .shrink import sgmv_shrink


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per tile (a power of two >= 16)
    block_n: int  # columns per tile
    block_k: int  # input columns per step of the main loop
    splits: int  # K splits per tile (1: no workspace)
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False  # launched between a shrink and an expand, overlapping both (Hopper and later)
    # The shrink's K splits in lora_linear (0: as add_lora picks them, up to 16 at decode).
    # Measured on an H200 (linear_h200_overlap.json): 4 beats add_lora's choice in 27 of 28
    # cases (down, 64 rows, 32 adapters: 50.7 vs 53.2 us): fewer shrink programs leave room
    # for the GEMM's beside them.
    shrink_splits: int = 4
    # lora_linear: the expand's work done in the GEMM's epilogue (where every output slice is a
    # whole number of tiles), so the LoRA term is two launches, not three; each tile adds
    # v @ B^T over the step's adapters `lora_k` rank columns (lora_k // 16 adapters at rank 16)
    # per dot.
    fuse_expand: bool = True
    lora_k: int = 128


@triton.jit(do_not_specialize=["M"])  # one compile for every row count of a tile size
def _gemm_kernel(
    y_ptr,  # [T, N] out
    x_ptr,  # [T, K]
    w_ptr,  # [N, K]
    ws_ptr,  # float32 [SPLITS, T, N] (read only when SPLITS > 1)
    count_ptr,  # int32 [row tiles * column tiles], zero between calls (SPLITS > 1)
    # the LoRA term (read only when LORA): the shrink's planes, B, scales, ranks, the batch
    partial_ptr,  # float32 [P_SPLITS, T, n*RANK]
    b_ptr,  # [S, N, RANK]
    scaling_ptr,  # float32 [S, n]
    ranks_ptr,  # int32 [S, n] (read only when HAS_RANKS)
    token_slots_ptr,  # int32 [T]
    block_slot_ptr,  # int32 [NUM_BLOCKS]
    M,
    N,
    K,
    K_CHUNK,  # input columns per split (a multiple of BLOCK_K)
    NUM_BLOCKS,
    N0,
    N1,  # the first two output slices' widths (N1 = 0: one slice; N - N0 - N1: the third)
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
    PDL: tl.constexpr,  # a dependent of the shrink before it (and, without LORA, the expand after it is ours)
    LORA: tl.constexpr,  # add each row's LoRA term (the expand's work) before storing y
    HAS_RANKS: tl.constexpr,
    P_SPLITS: tl.constexpr,  # the shrink's partial planes
    RANK: tl.constexpr,  # rank columns per slice in the buffers
    BLOCK_R: tl.constexpr,  # RANK rounded up to a power of two >= 16
    LORA_G: tl.constexpr,  # row blocks of the batch per dot of the LoRA term
    SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr,  # every K split is a whole number of BLOCK_K steps
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[m, n] = round(x[m] @ W[n].T) per (row tile m, column tile n); grid (row tiles,
    column tiles, SPLITS), each split one K chunk, the last split of a tile to finish adding
    them up in split order. With LORA, that last split then adds each row's LoRA term
    (``_lora_term``) as the expand would: y = round(round(x @ W^T) + round(delta))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if PDL and not LORA:
        # The expand may launch now: it reads its weights, then waits for this grid's end.
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

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
    if SPLITS > 1:
        plane = M.to(tl.int64) * N  # a split's partial tiles: [T, N] float32
        ws_tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * plane + ws_tile, acc, mask=tile_mask)
        # Every thread's store is done before the count (release); the last to count sees
        # every split's tile (acquire) and reads them from L2, past L1.
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived != SPLITS - 1:
            return
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(ws_ptr + s * plane + ws_tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
        tl.store(counter, 0)
    out = acc.to(y_ptr.dtype.element_ty)
    if LORA:
        if PDL:
            tl.extra.cuda.gdc_wait()  # the shrink's planes are complete
        delta = _lora_term(partial_ptr, b_ptr, scaling_ptr, ranks_ptr, token_slots_ptr, block_slot_ptr,
                           offs_m, m_mask, offs_n, n_mask, pid_n * BLOCK_N, NUM_BLOCKS, N0, N1,
                           stride_pk, stride_pt, stride_bs, stride_bn, stride_scale_s, stride_scale_n,
                           stride_rank, stride_rank_n, HAS_RANKS, P_SPLITS, RANK, BLOCK_R, LORA_G, BLOCK_M,
                           BLOCK_N, DOT_PRECISION)
        # As the expand adds it: lora_B's output rounded to y's dtype, then added and rounded.
        out = (out.to(tl.float32) + delta.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=tile_mask)
    if PDL and not LORA:
        # This grid ends only after the shrink has: the expand, which waits for this grid,
        # then reads complete planes. The shrink is short and started first, so this wait
        # is normally over at once.
        tl.extra.cuda.gdc_wait()


@triton.jit
def _lora_term(partial_ptr, b_ptr, scaling_ptr, ranks_ptr, token_slots_ptr, block_slot_ptr,
               offs_m, m_mask, offs_n, n_mask, col0, NUM_BLOCKS, N0, N1,
               stride_pk, stride_pt, stride_bs, stride_bn, stride_scale_s, stride_scale_n, stride_rank, stride_rank_n,
               HAS_RANKS: tl.constexpr, P_SPLITS: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
               LORA_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: each row's v @ B^T for the tile's columns (all in one output
    slice), as the expand computes it, v = the shrink's planes added up, scaled and rounded to
    B's dtype. Semantics::

        i = slice of the tile's columns
        for each row t with slot s = token_slots[t] >= 0 and r = ranks[s, i] > 0:
            delta[t] = round(scaling[s, i] * partial[:, t, i*RANK : i*RANK + r].sum(0)) @ b[s, cols, :r].T

    The batch's row blocks are walked LORA_G at a time (a slot's first block stands for all
    of its rows): their B tiles are stacked along the dot's K axis, [LORA_G * BLOCK_R,
    BLOCK_N], and each row's v is placed in its own slot's rank columns, zero elsewhere, so
    one dot adds the LoRA terms of LORA_G adapters at once.
    """
    slice_idx = (col0 >= N0).to(tl.int32) + ((N1 > 0) & (col0 >= N0 + N1)).to(tl.int32)
    row_slot = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)
    LK: tl.constexpr = LORA_G * BLOCK_R
    offs_lk = tl.arange(0, LK)
    lk_block = offs_lk // BLOCK_R
    lk_r = offs_lk % BLOCK_R
    # v of every row for this slice's rank columns, repeated LORA_G times along the K axis.
    # Rows of slot -1 and columns past a slot's rank hold what the shrink did not write:
    # dropped below by tl.where, never multiplied in.
    v_ptrs = partial_ptr + offs_m.to(tl.int64)[:, None] * stride_pt + (slice_idx * RANK + lk_r)[None, :]
    v_mask = m_mask[:, None] & (lk_r < RANK)[None, :]
    v = tl.zeros((BLOCK_M, LK), dtype=tl.float32)
    for k in tl.static_range(P_SPLITS):
        v += tl.load(v_ptrs + k * stride_pk, mask=v_mask, other=0.0)
    n64 = offs_n.to(tl.int64)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, NUM_BLOCKS, LORA_G):
        blk = c + lk_block
        in_grid = blk < NUM_BLOCKS
        slot = tl.load(block_slot_ptr + blk, mask=in_grid, other=-1)
        prev = tl.load(block_slot_ptr + blk - 1, mask=in_grid & (blk > 0), other=-1)
        live = (slot >= 0) & (slot != prev)  # the slot's first block (blocks of a slot are adjacent)
        slot64 = tl.maximum(slot, 0).to(tl.int64)
        rank = RANK
        if HAS_RANKS:
            rank = tl.minimum(tl.load(ranks_ptr + slot64 * stride_rank + slice_idx * stride_rank_n, mask=live,
                                      other=0), RANK)
        keep = live & (lk_r < rank)
        # Loads in whole 16-element groups of the rank (so they vectorise); past the rank zeroed.
        b_load = live & (lk_r < RANK) & ((lk_r // 16) < (rank + 15) // 16)
        bt = tl.load(b_ptr + slot64[:, None] * stride_bs + n64[None, :] * stride_bn + lk_r[:, None],
                     mask=b_load[:, None] & n_mask[None, :], other=0.0)
        bt = tl.where(keep[:, None], bt, 0.0)
        scale = tl.load(scaling_ptr + slot64 * stride_scale_s + slice_idx * stride_scale_n, mask=live, other=0.0)
        vk = tl.where((row_slot[:, None] == slot[None, :]) & keep[None, :], v * scale[None, :], 0.0)
        delta += tl.dot(vk.to(bt.dtype), bt, input_precision=DOT_PRECISION)
    return delta


@functools.lru_cache(maxsize=1024)
def make_gemm_config(num_tokens: int, in_features: int, out_features: int, sms: int, itemsize: int = 2,
                     device_pdl: bool = False) -> GemmConfig:
    """The default configuration of one call shape. Chosen by the sweep of
    bench/results/linear_h200_lora_programs.json (Llama-3-8B layers, 1 to 64 rows): tiles of
    64 columns, K split until the tiles fill the GPU (1.5 programs a multiprocessor at up to
    16 rows, 0.7 at more), 5 stages where the tiles are fewer than the multiprocessors. Steps of
    128 input columns in 16-bit types, 64 in float32 (so 5 stages stay in shared memory)."""
    block_m = max(16, min(64, triton.next_power_of_2(num_tokens)))
    block_n = 64
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(out_features, block_n)
    fill = 15 if block_m <= 16 else 7  # tenths of a program per multiprocessor
    splits = 1
    while 10 * tiles * splits < fill * sms and in_features // (splits * 2) >= 512:
        splits *= 2
    stages = 5 if block_m >= 64 and tiles < sms else 3
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=256 // itemsize, splits=splits, num_stages=stages,
                      pdl=device_pdl)


def fuses_expand(config: GemmConfig, output_slices: tuple[int, ...]) -> bool:
    """Whether ``lora_linear`` adds the LoRA term in the GEMM's epilogue: asked for, and every
    column tile inside one output slice (at most three slices, as the expand takes)."""
    return (config.fuse_expand and len(output_slices) <= 3
            and all(width % config.block_n == 0 for width in output_slices))


def gemm_config(num_tokens: int, weight: torch.Tensor) -> GemmConfig:
    """The default configuration of `x @ weight.T` for `num_tokens` rows of x."""
    return make_gemm_config(num_tokens, weight.shape[1], weight.shape[0], multiprocessors(weight.device),
                            weight.element_size(), supports_pdl(weight.device))


class _Workspace:
    """Split-K partial tiles and tile counters, kept per device and grown on demand.

    A CUDA graph that captures a call keeps using the buffers it captured: they are never
    freed while this module lives, only joined by larger ones for larger calls.
    """

    def __init__(self):
        self.partials: dict[torch.device, list[torch.Tensor]] = {}
        self.counters: dict[torch.device, list[torch.Tensor]] = {}

    @staticmethod
    def _fit(pool: dict, device: torch.device, numel: int, make) -> torch.Tensor:
        held = pool.setdefault(device, [])
        if not held or held[-1].numel() < numel:
            held.append(make(numel))
        return held[-1]

    def get(self, device: torch.device, partial_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        partials = self._fit(self.partials, device, partial_elems,
                             lambda n: torch.empty(max(n, 1 << 20), dtype=torch.float32, device=device))
        counters = self._fit(self.counters, device, tiles,
                             lambda n: torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        return partials, counters


_WORKSPACE = _Workspace()


def gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, config: GemmConfig | None = None,
         pdl: bool = False) -> torch.Tensor:
    """``x @ weight.T`` (a decode-sized GEMM; CUDA, or CPU under ``TRITON_INTERPRET=1``).

    ``pdl``: launched as a programmatic dependent of the kernel before it, letting the one
    after it launch at once (``lora_linear`` only)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, in] and weight [out, in], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous along their last dimension")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight is {weight.dtype} but x is {x.dtype}")
    num_tokens = x.shape[0]
    out_features = weight.shape[0]
    config = config or gemm_config(num_tokens, weight)
    y = out if out is not None else torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if tuple(y.shape) != (num_tokens, out_features) or y.dtype != x.dtype or (out_features > 1 and y.stride(-1) != 1):
        raise ValueError(f"out must be {x.dtype} [{num_tokens}, {out_features}], contiguous along its last "
                         f"dimension; got {y.dtype} {tuple(y.shape)} with strides {y.stride()}")
    if num_tokens:
        _launch_gemm(x, weight, y, config, pdl)
    return y


@dataclass(frozen=True)
class _LoRATerm:
    """What the GEMM's epilogue reads to add the LoRA term (``_lora_term``)."""

    partial: torch.Tensor  # float32 [P, T, n*R]: the shrink's planes
    lora_b: torch.Tensor  # [S, out, R]
    scaling: torch.Tensor  # float32 [S] or [S, n]
    ranks: torch.Tensor | None  # int32 [S] or [S, n]
    batch: LoRABatch
    slices: tuple[int, ...]


def _launch_gemm(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, config: GemmConfig, pdl: bool,
                 lora: _LoRATerm | None = None) -> None:
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    row_tiles = triton.cdiv(num_tokens, config.block_m)
    col_tiles = triton.cdiv(out_features, config.block_n)
    k_chunk = triton.cdiv(triton.cdiv(in_features, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(in_features, k_chunk)
    if splits > 1:
        ws, counters = _WORKSPACE.get(x.device, splits * num_tokens * out_features, row_tiles * col_tiles)
    else:
        ws, counters = y, y  # not read
    if lora is not None:
        rank = lora.lora_b.shape[2]
        block_r = max(16, triton.next_power_of_2(rank))
        widths = lora.slices + (0,) * (2 - min(2, len(lora.slices)))
        lora_args = (lora.partial, lora.lora_b, lora.scaling,
                     lora.ranks if lora.ranks is not None else lora.batch.slot_counts,  # not read without ranks
                     lora.batch.token_slots, lora.batch.block_slot)
        lora_sizes = (lora.batch.num_blocks, widths[0], widths[1])
        lora_strides = (lora.partial.stride(0), lora.partial.stride(1), lora.lora_b.stride(0), lora.lora_b.stride(1),
                        lora.scaling.stride(0), 0 if lora.scaling.dim() == 1 else lora.scaling.stride(1),
                        *rank_strides(lora.ranks))
        lora_meta = dict(LORA=True, HAS_RANKS=lora.ranks is not None, P_SPLITS=lora.partial.shape[0], RANK=rank,
                         BLOCK_R=block_r, LORA_G=max(1, config.lora_k // block_r))
    else:
        lora_args = (y,) * 6  # not read
        lora_sizes = (0, out_features, 0)
        lora_strides = (0,) * 8
        lora_meta = dict(LORA=False, HAS_RANKS=False, P_SPLITS=1, RANK=16, BLOCK_R=16, LORA_G=1)
    _gemm_kernel[(row_tiles, col_tiles, splits)](
        y, x, weight, ws, counters, *lora_args,
        num_tokens, out_features, in_features, k_chunk, *lora_sizes,
        x.stride(0), weight.stride(0), y.stride(0), *lora_strides,
        PDL=pdl,
        **lora_meta,
        SPLITS=splits,
        EVEN_K=in_features % k_chunk == 0,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )


def lora_linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None = None,  # int32 [S] or [S, n]
    output_slices: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` plus each row's LoRA term: ``y = gemm(x, weight); add_lora(y, x, ...)``
    with the arguments of ``add_lora`` (its shrink's K cut per ``config.shrink_splits``), the
    shrink overlapping the GEMM.
    CUDA tensors, or CPU under ``TRITON_INTERPRET=1``; no host synchronisation."""
    y = out if out is not None else torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    slices = _check(y, x, lora_a, lora_b, scaling, batch, ranks, output_slices)
    if batch.block_m < 16 or batch.block_m & (batch.block_m - 1):
        raise ValueError(f"the Triton path needs block_m a power of two >= 16, the batch has {batch.block_m}")
    config = config or gemm_config(x.shape[0], weight)
    if x.shape[0] == 0:
        return y
    rank = lora_b.shape[2]
    sgmv = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)
    partial = sgmv_shrink(x, lora_a, batch, ranks, rank, config.shrink_splits or sgmv.k_splits, sgmv.block_k,
                          sgmv.num_warps, sgmv.num_stages, trigger=1 if config.pdl else 0)
    if fuses_expand(config, slices):
        _launch_gemm(x, weight, y, config, config.pdl, _LoRATerm(partial, lora_b, scaling, ranks, batch, slices))
        return y
    _launch_gemm(x, weight, y, config, config.pdl)
    sgmv_expand(y, partial, lora_b, scaling, batch, ranks, slices, sgmv.span, sgmv.block_n, sgmv.num_warps,
                sgmv.num_stages, pdl=config.pdl, add_in_memory=True)
    return y
