"""Per-step batch metadata for the SGMV kernels: built once per forward step, read by every layer.

A step's rows (tokens) each name a GPU adapter slot, or -1 for the base model alone. The
kernels want rows grouped by slot (so that one program reads one adapter's weights once for
many rows) and cut into blocks of at most ``block_m`` rows of one slot. ``LoRABatch.build``
does that grouping on the device with sort/scan ops only: no host synchronisation, so the
step that builds it can be captured in a CUDA graph.

Worked example, 7 tokens, 3 slots, block_m = 2::

    token_slots   = [ 1, -1,  1,  0,  1,  2, -1]
    sorted_tokens = [ 3,  0,  2,  4,  5,  1,  6]   # slot 0 | slot 1 x3 | slot 2 | base rows last
    slot_counts   = [ 1,  3,  1]
    block_slot    = [ 0,  1,  1,  2, -1, -1]        # blocks: {3}, {0, 2}, {4}, {5}; -1 = no block
    block_rows    = [[3, -1], [0, 2], [4, -1], [5, -1], [-1, -1], [-1, -1]]   # -1 padded

The kernels read a block's slot and its rows in one round trip to memory.

The grid (the number of blocks, here 6) is fixed per shape, so that a CUDA graph can replay
it: ``max_blocks`` bounds the blocks of any assignment of T rows to the slots. A caller that
knows more, such as an engine that knows how many distinct adapters its running rows use,
passes ``max_adapters``: the grid shrinks to that many adapters' blocks, and the launch
configuration spreads each block's work over more programs (``configs.make_config``).

Rows with slot -1 belong to no block: they cost the kernels nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows per block: small for decode (each request's row is its own segment, so a larger
# block would mostly compute padding), larger for prefill (long segments share weights).
# 32 rather than 64 for prefill: measured faster on every Llama-3-8B layer on an H200
# (bench/results/kernels_h200_v1.json, sweep of 4096-token prefill: q/k/v 51 vs 60 us).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 32
PREFILL_MIN_TOKENS = 512


def default_block_m(num_tokens: int) -> int:
    """Rows per block for a step of ``num_tokens`` rows."""
    return PREFILL_BLOCK_M if num_tokens >= PREFILL_MIN_TOKENS else DECODE_BLOCK_M


def max_blocks(num_tokens: int, num_adapters: int, block_m: int) -> int:
    """An upper bound on the blocks of any assignment of ``num_tokens`` rows to at most
    ``num_adapters`` distinct slots: the grid size, fixed per shape.

    sum_s ceil(c_s / m) <= floor(T / m) + (number of non-empty slots), over counts c_s
    summing to at most T.
    """
    return max(1, num_tokens // block_m + min(num_adapters, num_tokens))


def step_grids(max_tokens: int, max_adapters: int) -> dict[tuple[int, int], int]:
    """Every grid (block_m, blocks) that a step of 1..``max_tokens`` rows with at most
    ``max_adapters`` distinct adapters launches, each with the fewest rows that launch it.

    The launch configuration is a function of the grid (configs.make_config), so these steps
    between them compile every kernel variant such steps can: what a server's warm-up runs.
    The blocks change only where ``rows // block_m`` or ``min(max_adapters, rows)`` does, so
    the walk jumps from one such row count to the next.
    """
    grids: dict[tuple[int, int], int] = {}
    rows = 1
    while rows <= max_tokens:
        block_m = default_block_m(rows)
        grids.setdefault((block_m, max_blocks(rows, max_adapters, block_m)), rows)
        rows = rows + 1 if rows < max_adapters else (rows // block_m + 1) * block_m
    return grids


def slot_counts(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int64 [S]: rows of each slot in ``slots`` (int64 [T], negative = base only).

    bincount would read max(slots) on the host; a scatter into a fixed size does not. Base
    rows count in a bucket of their own before slot 0, so a slot at or past ``num_slots``
    indexes past the buckets: an error (on a GPU, a device-side assert, as no host check is
    possible there), never a row silently counted as a base row.
    """
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, torch.where(slots < 0, 0, slots + 1), torch.ones_like(slots))
    return counts[1:]


@dataclass(frozen=True)
class LoRABatch:
    """Token -> slot grouping of one forward step (all tensors int32, on the step's device)."""

    token_slots: torch.Tensor  # [T]: slot of each row, -1 = base only
    sorted_tokens: torch.Tensor  # [T]: row indices grouped by slot, ascending slots, -1 rows last
    slot_counts: torch.Tensor  # [S]: rows per slot
    block_slot: torch.Tensor  # [B]: slot of each block of rows, -1 past the last block
    block_rows: torch.Tensor  # [B, block_m]: the block's row indices, -1 padded
    num_slots: int  # S
    block_m: int  # rows per block at most

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_blocks(self) -> int:
        """Blocks in the grid (an upper bound; blocks past the real ones have slot -1)."""
        return self.block_slot.shape[0]

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int, block_m: int | None = None,
              max_adapters: int | None = None) -> "LoRABatch":
        """Group ``token_slots`` (int32 [T], -1 = no adapter) into blocks of one slot each.

        ``max_adapters``: an upper bound on the distinct slots in ``token_slots``, known to the
        caller (default: ``num_slots``). It sizes the grid, so it is a contract: rows of
        adapters past it would fall outside the grid. Device ops only (sort, scatter, scan,
        searchsorted): no host synchronisation, so on a GPU neither the bound nor slots past
        ``num_slots`` can be checked here; on the CPU both are.
        """
        if token_slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D [num_tokens], got shape {tuple(token_slots.shape)}")
        if token_slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token_slots must be int32, got {token_slots.dtype}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_adapters is not None and max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1 (a step without adapters needs no batch), "
                             f"got {max_adapters}")
        if block_m is not None and block_m < 0:
            raise ValueError(f"block_m must be >= 1 (or 0 or None for the default), got {block_m}")
        if token_slots.device.type == "cpu" and token_slots.numel():
            if int(token_slots.max()) >= num_slots:
                raise ValueError(f"token_slots names slot {int(token_slots.max())}, past the {num_slots} slots")
            if max_adapters is not None and (distinct := token_slots[token_slots >= 0].unique().numel()) > max_adapters:
                raise ValueError(f"token_slots use {distinct} distinct slots, more than max_adapters={max_adapters}: "
                                 "the grid would leave some rows out")
        num_tokens = token_slots.shape[0]
        block_m = block_m or default_block_m(num_tokens)
        device = token_slots.device
        slots = token_slots.to(torch.int64)

        # Base-only rows sort after every slot: key S.
        key = torch.where(slots < 0, torch.full_like(slots, num_slots), slots)
        sorted_tokens = torch.sort(key, stable=True).indices

        counts = slot_counts(slots, num_slots)
        starts = torch.cumsum(counts, 0) - counts  # [S] first sorted position of each slot
        blocks = (counts + block_m - 1) // block_m  # [S] blocks of each slot
        blocks_end = torch.cumsum(blocks, 0)  # [S] one past each slot's last block

        adapters = num_slots if max_adapters is None else min(max_adapters, num_slots)
        block_ids = torch.arange(max_blocks(num_tokens, adapters, block_m), device=device)
        block_slot = torch.searchsorted(blocks_end, block_ids, right=True)  # [B] in 0..S
        valid = block_slot < num_slots
        s = block_slot.clamp(max=num_slots - 1)
        index_in_slot = block_ids - (blocks_end[s] - blocks[s])
        block_start = starts[s] + index_in_slot * block_m
        block_len = (counts[s] - index_in_slot * block_m).clamp(min=0, max=block_m)

        block_start = torch.where(valid, block_start, 0)
        block_len = torch.where(valid, block_len, 0)
        offs = torch.arange(block_m, device=device)
        in_block = offs[None, :] < block_len[:, None]
        if num_tokens:
            positions = (block_start[:, None] + offs[None, :]).clamp(max=num_tokens - 1)
            block_rows = torch.where(in_block, sorted_tokens[positions], -1)
        else:
            block_rows = torch.full(in_block.shape, -1, dtype=torch.int64, device=device)

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.int32).contiguous()

        return cls(
            token_slots=i32(slots),
            sorted_tokens=i32(sorted_tokens),
            slot_counts=i32(counts),
            block_slot=i32(torch.where(valid, block_slot, -1)),
            block_rows=i32(block_rows),
            num_slots=num_slots,
            block_m=block_m,
        )
