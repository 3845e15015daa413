"""The KV cache: one preallocated row per running sequence, allocated once at start.

    k[layer], v[layer]: [rows, kv_heads, max_len, head_dim]

A sequence owns one row from admission to finish; its token at position p lives at
[row, :, p]. Decode runs the batch over rows 0..n-1 (n = highest busy row + 1, rounded up
to a bucket), so a decode step's batch row *is* its KV row: no gather, no copy, and the
attention reads `k[layer][:n, :, :kv_len]` as one strided view. Free rows inside that range
compute masked garbage at position 0 that nobody reads. `alloc` hands out the lowest free
row to keep busy rows packed at the front.

This is the simplest cache that supports continuous batching and CUDA-graph decode; a paged
cache (block tables) would let rows share prefixes and waste less memory on short
sequences, at the cost of an attention kernel that reads through a block table.
"""

from __future__ import annotations

import heapq

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, device: torch.device, dtype: torch.dtype):
        self.rows = rows
        self.max_len = max_len
        shape = (rows, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self._free = list(range(rows))  # a heap: lowest free row first
        self._busy: set[int] = set()

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV row")
        row = heapq.heappop(self._free)
        self._busy.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._busy:
            raise ValueError(f"KV row {row} is not allocated")
        self._busy.remove(row)
        heapq.heappush(self._free, row)

    @property
    def busy(self) -> frozenset[int]:
        """The rows a sequence holds now."""
        return frozenset(self._busy)

    def span(self) -> int:
        """Rows a decode step must cover: one past the highest busy row (0 when idle)."""
        return max(self._busy) + 1 if self._busy else 0
