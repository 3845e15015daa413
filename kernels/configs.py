"""Launch configurations for the SGMV kernel: a small cached function of the problem size.

The kernel is bound by memory, not arithmetic: what matters is enough programs in flight
to hide DRAM latency, with each adapter's weights read from DRAM about once. The span of
output columns per program sets the grid's width: narrow spans give a single decode token
many programs (each re-reads its slice of A, from L2), wide spans keep prefill from
recomputing its shrink more than it must.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

# Programs wanted per multiprocessor: enough loads in flight to cover DRAM latency.
PROGRAMS_PER_SM = 4
# Multiprocessor count assumed where there is no CUDA device (the Triton interpreter).
_INTERPRETER_SMS = 4


@dataclass(frozen=True)
class SGMVConfig:
    block_n: int  # output columns per inner step of the expand
    block_k: int  # input columns per inner step of the shrink
    span: int  # output columns per program (a multiple of block_n)
    num_warps: int
    num_stages: int


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
    num_warps: int = 4,
    num_stages: int = 3,
) -> SGMVConfig:
    """A configuration from the problem size; the keyword arguments override the defaults."""
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = block_n or (64 if block_r >= 64 else 128)
    # Keep the [BLOCK_K, BLOCK_R] tile of A near 16 KB.
    block_k = block_k or max(32, min(256, triton.next_power_of_2(in_features), 16384 // (block_r * itemsize)))
    column_tiles = sum(triton.cdiv(w, block_n) for w in output_slices)
    wanted_spans = triton.cdiv(programs_per_sm * sms, num_blocks)
    spans = max(len(output_slices), min(column_tiles, wanted_spans))
    span = triton.cdiv(triton.cdiv(sum(output_slices), spans), block_n) * block_n
    span = max(block_n, min(span, triton.cdiv(max(output_slices), block_n) * block_n))
    return SGMVConfig(block_n=block_n, block_k=block_k, span=span, num_warps=num_warps, num_stages=num_stages)


_cached_config = functools.lru_cache(maxsize=1024)(make_config)


def sgmv_config(
    num_blocks: int,
    in_features: int,
    output_slices: tuple[int, ...],
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SGMVConfig:
    """The launch configuration for one call shape (cached)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _cached_config(num_blocks, in_features, tuple(output_slices), rank, itemsize, multiprocessors(device))
