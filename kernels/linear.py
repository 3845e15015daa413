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

from .add_lora import SUPPORTED_DTYPES, _check, _check_triton, _overlaps, check_interpreter
from .batch import LoRABatch
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


@triton.jit(do_not_specialize=["M"])  # one compile for every row count of a tile size
def _gemm_kernel(
    y_ptr,  # [T, N] out
    x_ptr,  # [T, K]
    w_ptr,  # [N, K]
    ws_ptr,  # float32 [SPLITS, T, N] (read only when SPLITS > 1)
    count_ptr,  # int32 [row tiles * column tiles], zero between calls (SPLITS > 1)
    M,
    N,
    K,
    K_CHUNK,  # input columns per split (a multiple of BLOCK_K)
    stride_xm,
    stride_wn,
    stride_ym,
    PDL: tl.constexpr,  # a dependent of the shrink before it, and the expand after it is ours
    SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr,  # every K split is a whole number of BLOCK_K steps
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[m, n] = round(x[m] @ W[n].T) per (row tile m, column tile n); grid (row tiles,
    column tiles, SPLITS), each split one K chunk, the last split of a tile to finish adding
    them up in split order."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if PDL:
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
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=tile_mask)
    if PDL:
        # This grid ends only after the shrink has: the expand, which waits for this grid,
        # then reads complete planes. The shrink is short and started first, so this wait
        # is normally over at once.
        tl.extra.cuda.gdc_wait()


@functools.lru_cache(maxsize=1024)
def make_gemm_config(num_tokens: int, in_features: int, out_features: int, sms: int, itemsize: int = 2,
                     device_pdl: bool = False) -> GemmConfig:
    """The default configuration of one call shape. Chosen by the sweeps of
    bench/results/linear_h200_lora_programs.json (Llama-3-8B layers, 1, 16 and 64 rows) and
    linear_h200_grid.json (8, 17, 32 and 48 rows): tiles of 64 columns, K split until the
    tiles fill the GPU (1.5 programs a multiprocessor at up to 32 rows, 0.7 at more), 5 stages
    where 64-row tiles are fewer than the multiprocessors. Steps of 128 input columns in 16-bit
    types, 64 in float32 (so 5 stages stay in shared memory).

    At 17-32 rows the grid gives q/k/v 24.6 us, o 18.7, gate/up 69.9, down 42.4 (32 rows;
    cuBLAS 23.1, 19.5, 69.6, 42.7); 0.7 programs a multiprocessor there, as at 64-row tiles,
    gave 31.3, 22.0, 69.7 and 52.0.
    """
    block_m = max(16, min(64, triton.next_power_of_2(num_tokens)))
    block_n = 64
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(out_features, block_n)
    fill = 15 if block_m <= 32 else 7  # tenths of a program per multiprocessor
    splits = 1
    while 10 * tiles * splits < fill * sms and in_features // (splits * 2) >= 512:
        splits *= 2
    stages = 5 if block_m >= 64 and tiles < sms else 3
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=256 // itemsize, splits=splits, num_stages=stages,
                      pdl=device_pdl)


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


def _check_gemm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, in] and weight [out, in], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous along their last dimension")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight is {weight.dtype} but x is {x.dtype}")


def gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, config: GemmConfig | None = None,
         pdl: bool = False) -> torch.Tensor:
    """``x @ weight.T`` (a decode-sized GEMM; CUDA, or CPU under ``TRITON_INTERPRET=1``).

    ``pdl``: launched as a programmatic dependent of the kernel before it, letting the one
    after it launch at once (``lora_linear`` only)."""
    _check_gemm_inputs(x, weight)
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    config = config or gemm_config(num_tokens, weight)
    y = out if out is not None else torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if (tuple(y.shape) != (num_tokens, out_features) or y.dtype != x.dtype or (out_features > 1 and y.stride(-1) != 1)
            or (num_tokens > 1 and y.stride(0) < out_features)):
        raise ValueError(f"out must be {x.dtype} [{num_tokens}, {out_features}], contiguous along its last "
                         f"dimension, its rows not overlapping; got {y.dtype} {tuple(y.shape)} with strides "
                         f"{y.stride()}")
    for name, t in (("x", x), ("weight", weight)):
        if _overlaps(y, t):
            raise ValueError(f"out shares memory with {name}: its tiles are written while {name} is read")
    check_interpreter(x)
    if num_tokens == 0:
        return y
    if in_features == 0:
        return y.zero_()
    row_tiles = triton.cdiv(num_tokens, config.block_m)
    col_tiles = triton.cdiv(out_features, config.block_n)
    k_chunk = triton.cdiv(triton.cdiv(in_features, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(in_features, k_chunk)
    if splits > 1:
        ws, counters = _WORKSPACE.get(x.device, splits * num_tokens * out_features, row_tiles * col_tiles)
    else:
        ws, counters = y, y  # not read
    _gemm_kernel[(row_tiles, col_tiles, splits)](
        y, x, weight, ws, counters,
        num_tokens, out_features, in_features, k_chunk,
        x.stride(0), weight.stride(0), y.stride(0),
        PDL=pdl,
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
    return y


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
    _check_gemm_inputs(x, weight)  # before the shrink runs, and before the weight sizes y and the GEMM
    y = out if out is not None else torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    slices = _check(y, x, lora_a, lora_b, scaling, batch, ranks, output_slices)
    _check_triton(x, batch, slices)
    config = config or gemm_config(x.shape[0], weight)
    if x.numel() == 0:  # no rows, or no input columns: no LoRA term
        return gemm(x, weight, y, config)
    rank = lora_b.shape[2]
    sgmv = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)
    partial = sgmv_shrink(x, lora_a, batch, ranks, rank, config.shrink_splits or sgmv.k_splits, sgmv.block_k,
                          sgmv.num_warps, sgmv.num_stages, trigger=1 if config.pdl else 0)
    gemm(x, weight, y, config, pdl=config.pdl)
    sgmv_expand(y, partial, lora_b, scaling, batch, ranks, slices, sgmv.span, sgmv.block_n, sgmv.num_warps,
                sgmv.num_stages, pdl=config.pdl, add_in_memory=sgmv.add_in_memory)
    return y
