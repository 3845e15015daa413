"""Launch configurations for the SGMV kernel: a small cached function of the problem size.

The kernels are bound by memory, not arithmetic: what matters is enough programs in
flight to hide DRAM latency, with each adapter's weights read from DRAM once. The shrink
splits the input width into ``k_splits`` chunks and the expand cuts the output columns
into spans until a launch has about ``PROGRAMS_PER_SM`` programs per multiprocessor (at
decode, spans of at most ``MAX_DECODE_SPAN`` columns); a prefill step has enough row blocks
on its own and is hardly split.

On Hopper and later the expand is launched as a programmatic dependent of the shrink
(PDL). At decode the shrink lets it launch at once, and is itself a dependent of the base
GEMM before it: each reads its step metadata, rows, scales (and the expand its first tile
of B) while the kernel before it finishes, then waits (``griddepcontrol.wait``) for the
data that kernel writes. At prefill the shrink lets the expand launch only once all its
programs are past their loops, and is launched plainly. ``LORAPLEX_PDL=0`` in the
environment launches them all plainly.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from .batch import DECODE_BLOCK_M

# Programs wanted per multiprocessor: enough loads in flight to cover DRAM latency.
PROGRAMS_PER_SM = 4
# At decode an expand program streams at most this many output columns of B. Measured on
# an H200 (bench/results/kernels_h200_decode_sweep.json, 64 tokens): gate/up with 32
# adapters 23.1 us with spans of 1024 columns against 26.2 with 1920. Cutting spans finer
# everywhere (twice the programs) lost up to 40% where blocks hold many rows: each span's
# program re-reads its rows' split-K partials (kernels_h200_expand_x2_vs_prev.json).
MAX_DECODE_SPAN = 1024
# The decode expand takes 256 columns a step where its grid holds at most this many programs
# per multiprocessor; more, and it takes 128 below rank 64, 64 at 64 and up (make_config).
WIDE_STEP_PROGRAMS_PER_SM = 6
# At prefill the expand adds into y with reductions from this rank up (below it, it reads y).
PREFILL_ADD_IN_MEMORY_RANK = 64
# Multiprocessor count assumed where there is no CUDA device (the Triton interpreter).
_INTERPRETER_SMS = 4


@dataclass(frozen=True)
class SGMVConfig:
    k_splits: int  # shrink programs per row block, each over a chunk of the input width
    block_k: int  # input columns per inner step of the shrink
    span: int  # output columns per expand program (a multiple of block_n)
    block_n: int  # output columns per inner step of the expand
    num_warps: int
    num_stages: int
    pdl: bool = False  # the expand is a programmatic dependent of the shrink (Hopper and later)
    pdl_early: bool = True  # with pdl: the expand may launch at the shrink's start, and the shrink
    # is a dependent of the kernel before it (decode); else the expand launches in the shrink's tail
    add_in_memory: bool = False  # the expand adds into y with reductions (red.add), not load + store


# The shrink splits the input width no finer than this many columns per program.
MIN_K_CHUNK = 256


@functools.lru_cache(maxsize=None)
def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA devices of compute capability 9.0 and later,
    unless ``LORAPLEX_PDL=0``."""
    if os.environ.get("LORAPLEX_PDL", "1") == "0":
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def make_config(
    num_blocks: int,
    in_features: int,
    output_slices: tuple[int, ...],
    rank: int,
    itemsize: int,
    sms: int,
    programs_per_sm: int = PROGRAMS_PER_SM,
    block_n: int | None = None,
    block_k: int | None = None,
    k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    block_m: int = DECODE_BLOCK_M,
    device_pdl: bool = False,
    pdl: bool | None = None,
    add_in_memory: bool | None = None,
) -> SGMVConfig:
    """A configuration from the problem size; the keyword arguments override the defaults."""
    wanted = programs_per_sm * sms
    decode = block_m <= DECODE_BLOCK_M
    block_nr = max(16, triton.next_power_of_2(len(output_slices) * rank))
    # Keep the [BLOCK_K, n*R] tile of A near 16 KB, but BLOCK_K 64 at least in 16-bit dtypes
    # (of the Llama-3-8B layers at ranks up to 64, only q/k/v's 3 x 64 came under it): measured
    # on an H200 (kernels_h200_qkv_r64*), 32 -> 64 took q/k/v rank 64 decode from 13.6 to 11.7
    # us at one token and 222.3 to 175.6 at 256 tokens of one adapter each, prefill from 93.6
    # to 84.1 us.
    block_k = block_k or max(64 if itemsize <= 2 else 16, min(128, 16384 // (block_nr * itemsize)))
    if not k_splits:
        k_splits = max(1, min(triton.cdiv(wanted, num_blocks), triton.cdiv(in_features, MIN_K_CHUNK)))
        if not decode:
            # Prefill: a power of two, so the chunks are even and the grid a whole number of
            # waves. Measured on an H200 (kernels_h200_prefill_split.json): q/k/v, 4096
            # tokens, one adapter: the shrink in 19.1 us with 4 splits against 24.0 with 5.
            k_splits = 1 << (k_splits.bit_length() - 1)
    if not block_n and decode:
        # At decode the expand walks its spans in steps of 256 columns, unless that grid
        # holds more than WIDE_STEP_PROGRAMS_PER_SM programs per multiprocessor. Measured on
        # an H200 against the steps before (128 columns below rank 64, 64 at 64), each rule in
        # one run: rank 64 (kernels_h200_r64_block_n*.json) 256 everywhere was faster on 76 of
        # 96 cases (down at 64 tokens of one adapter 17.6 -> 13.2 us, gate/up at 128 tokens
        # with 8 adapters 31.3 -> 25.9), but 1.07x-1.13x slower on gate/up's grids of 952
        # programs and more, 1.03x on q/k/v's 816, while o's 544 and q/k/v's 680 gained; with
        # this rule 0.74x-1.04x (geomean 0.92x). Ranks 8 and 16
        # (kernels_h200_r8_r16_block_n_*.json): this rule 0.87x-1.08x (geomean 0.97x, 3 of 192
        # cases slower by more than 2%), 256 everywhere 0.88x-1.05x (12 slower, gate/up's
        # large grids again).
        wide = _expand_span(num_blocks, output_slices, 256, wanted, decode)
        if num_blocks * sum(triton.cdiv(w, wide) for w in output_slices) <= WIDE_STEP_PROGRAMS_PER_SM * sms:
            block_n = 256
    block_n = block_n or (128 if rank < 64 else 64)
    span = _expand_span(num_blocks, output_slices, block_n, wanted, decode)
    # Measured on an H200: PDL with the expand launched at the shrink's start saves ~1 us a
    # call at decode, and costs up to 21% at prefill (gate/up 4096 tokens: 173 vs 143 us),
    # where the expand's early programs hold SM resources the shrink's last wave wants. At
    # prefill the expand launches once the shrink's programs are past their loops.
    pdl_early = decode
    if pdl is None:
        pdl = device_pdl
    if add_in_memory is None:
        # Measured on an H200 (bench/results/kernels_h200_variants.json): at decode, where a
        # block's rows are few, reductions in memory beat reading y (gate/up, 64 tokens, 32
        # adapters: 24.6 vs 28.1 us); at prefill, where y is dense, reading it one tile ahead
        # is faster (q/k/v, 4096 tokens: 48.2 vs 60.6 us), except at rank 64, where the
        # reductions win again: kernels_h200_prefill_align.json, q/k/v one adapter 92.2 vs
        # 101.8 us, o 43.5 vs 48.5, down 70.6 vs 77.4; kernels_h200_prefill_one_launch.json,
        # 7 of 8 rank-64 cases faster, gate/up 8 adapters 1.4% slower. At rank 32 it is mixed
        # (q/k/v and down faster, gate/up up to 1.26x slower), so the line stays at 64.
        add_in_memory = decode or rank >= PREFILL_ADD_IN_MEMORY_RANK
    return SGMVConfig(k_splits=k_splits, block_k=block_k, span=span, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages, pdl=pdl, pdl_early=pdl_early, add_in_memory=add_in_memory)


def _expand_span(num_blocks: int, output_slices: tuple[int, ...], block_n: int, wanted: int, decode: bool) -> int:
    """Output columns per expand program: the slices cut until the grid has about ``wanted``
    programs, a multiple of ``block_n`` and no wider than the widest slice."""
    column_tiles = sum(triton.cdiv(w, block_n) for w in output_slices)
    spans = max(len(output_slices), min(column_tiles, triton.cdiv(wanted, num_blocks)))
    if decode:
        spans = max(spans, triton.cdiv(sum(output_slices), MAX_DECODE_SPAN))
    else:
        # Prefill: a power of two, as for the K splits. One adapter's 4096 rows make 129
        # blocks, 4.09 programs per SM asked 5 spans, and gate/up's 5 spans of 5,760 columns
        # cut its slices mid-span. Measured on an H200 (kernels_h200_prefill_spans.json, one
        # adapter): gate/up 167.5 -> 141.1 us at rank 16 and 189.5 -> 146.0 at rank 32, o and
        # down at rank 32 1.17x and 1.10x faster; 8 adapters (136 blocks) had 4 already.
        spans = max(len(output_slices), 1 << (spans.bit_length() - 1))
    span = triton.cdiv(triton.cdiv(sum(output_slices), spans), block_n) * block_n
    return max(block_n, min(span, triton.cdiv(max(output_slices), block_n) * block_n))


_cached_config = functools.lru_cache(maxsize=1024)(make_config)


def sgmv_config(
    num_blocks: int,
    block_m: int,
    in_features: int,
    output_slices: tuple[int, ...],
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SGMVConfig:
    """The launch configuration for one call shape (cached)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _cached_config(num_blocks, in_features, tuple(output_slices), rank, itemsize, multiprocessors(device),
                          block_m=block_m, device_pdl=supports_pdl(device))
