"""The KV cache: one preallocated row per running sequence, allocated once at start.

    k[layer], v[layer]: [rows, kv_heads, max_len, head_dim]   (views of k_all, v_all: [layers, ...])

A sequence owns one row from admission to finish; its token at position p lives at
[row, :, p]. Decode runs the batch over rows 0..n-1 (n = highest busy row + 1, rounded up
to a bucket), so a decode step's batch row *is* its KV row: no gather, no copy, and the
attention reads `k[layer][:n, :, :kv_len]` as one strided view. Free rows inside that range
compute masked garbage that nobody reads, at position `kept[row]`: 0, or just past the
prefix the row keeps for prefix caching (prefix_cache.py). `alloc` hands out the lowest
free row to keep busy rows packed at the front; with prefix caching the prefix cache picks
the row (PrefixCache.victim), which keeps finished requests' rows while others are free.

This is the simplest cache that supports continuous batching and CUDA-graph decode; rows
share a prefix by copying it (`copy_prefix`: one token's K/V over all layers is 128 KB for
Llama-3-8B, where recomputing it is a prefill). A paged cache (block tables) would share
prefixes without the copy and waste less memory on short sequences, at the cost of an
attention kernel that reads through a block table.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, device: torch.device, dtype: torch.dtype):
        self.rows = rows
        self.max_len = max_len
        shape = (cfg.num_layers, rows, cfg.num_kv_heads, max_len, cfg.head_dim)
        # One tensor for all layers, so that a prefix moves in one op over every layer
        # (prefix_store.py); k[layer] and v[layer] are views of it.
        self.k_all = torch.zeros(shape, device=device, dtype=dtype)
        self.v_all = torch.zeros(shape, device=device, dtype=dtype)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))
        self._free = list(range(rows))  # a heap: lowest free row first
        self._busy: set[int] = set()
        # Per row, the tokens at its front that a free row keeps for prefix caching (written by
        # PrefixCache); a decode step writes a free row's garbage at that position.
        self.kept = np.zeros(rows, dtype=np.int64)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return 2 * self.k_all.numel() * self.k_all.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, row: int | None = None) -> int:
        """The lowest free row, or `row` (free) when given, now busy."""
        if not self._free:
            raise RuntimeError("no free KV row")
        if row is None:
            row = heapq.heappop(self._free)
        else:
            self._free.remove(row)  # ValueError if it is not free
            heapq.heapify(self._free)
        self._busy.add(row)
        return row

    @property
    def free_rows(self) -> list[int]:
        """The free rows (in no order)."""
        return list(self._free)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the K/V of positions 0..n-1 of row `src` into row `dst`, in every layer (queued
        on the current stream, so it runs after every write to `src` queued before it and
        before any queued after)."""
        for t in (self.k_all, self.v_all):
            t[:, dst, :, :n].copy_(t[:, src, :, :n])

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
