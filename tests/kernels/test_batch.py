"""LoRABatch.build: every adapter row in exactly one block of its own slot; base rows in none."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.batch import LoRABatch, max_blocks


def blocks_of(batch: LoRABatch) -> list[tuple[int, list[int]]]:
    """[(slot, rows)] of the real blocks, read back from the batch."""
    out = []
    for b in range(batch.num_blocks):
        slot, padded = int(batch.block_slot[b]), batch.block_rows[b].tolist()
        if slot < 0:
            assert padded == [-1] * batch.block_m
            continue
        rows = [r for r in padded if r >= 0]
        assert rows and padded == rows + [-1] * (batch.block_m - len(rows))
        out.append((slot, rows))
    # The real blocks, in order, are the adapter rows of sorted_tokens, in order.
    adapter_rows = int((batch.token_slots >= 0).sum())
    assert [r for _, rows in out for r in rows] == batch.sorted_tokens[:adapter_rows].tolist()
    return out


def test_worked_example_of_the_docstring():
    batch = LoRABatch.build(torch.tensor([1, -1, 1, 0, 1, 2, -1], dtype=torch.int32), 3, block_m=2)
    assert batch.sorted_tokens.tolist() == [3, 0, 2, 4, 5, 1, 6]
    assert batch.slot_counts.tolist() == [1, 3, 1]
    assert blocks_of(batch) == [(0, [3]), (1, [0, 2]), (1, [4]), (2, [5])]
    assert batch.num_blocks == max_blocks(7, 3, 2) == 6
    assert batch.block_rows.tolist() == [[3, -1], [0, 2], [4, -1], [5, -1], [-1, -1], [-1, -1]]


def test_an_empty_step_has_no_rows():
    batch = LoRABatch.build(torch.zeros(0, dtype=torch.int32), 2)
    assert batch.block_rows.tolist() == [[-1] * batch.block_m] * batch.num_blocks


@pytest.mark.parametrize(
    "token_slots,num_slots,block_m",
    [
        ([-1, -1, -1], 4, 16),
        ([0] * 40, 1, 16),
        (list(range(8)), 8, 16),
        ([3, 3, -1, 0, 3, 0, -1, 3, 2], 4, 2),
        ([5] * 7 + [-1] * 3 + [1] * 20, 6, 4),
    ],
)
def test_blocks_cover_each_adapter_row_once(token_slots, num_slots, block_m):
    batch = LoRABatch.build(torch.tensor(token_slots, dtype=torch.int32), num_slots, block_m=block_m)
    blocks = blocks_of(batch)
    seen = sorted(row for _, rows in blocks for row in rows)
    assert seen == [t for t, s in enumerate(token_slots) if s >= 0]
    for slot, rows in blocks:
        assert 1 <= len(rows) <= block_m
        assert all(token_slots[r] == slot for r in rows)
    # Blocks of one slot are consecutive and slots ascend: each adapter's weights stream once.
    slots_in_order = [slot for slot, _ in blocks]
    assert slots_in_order == sorted(slots_in_order)
    assert batch.num_blocks >= len(blocks)


def test_random_assignments_never_exceed_the_grid():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_tokens = int(torch.randint(1, 300, (1,), generator=gen))
        num_slots = int(torch.randint(1, 40, (1,), generator=gen))
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(torch.int32)
        batch = LoRABatch.build(slots, num_slots)
        assert sum(len(rows) for _, rows in blocks_of(batch)) == int((slots >= 0).sum())


def test_a_bound_on_distinct_adapters_shrinks_the_grid_not_the_blocks():
    """An engine knows how many distinct adapters its rows use; the grid is sized for those."""
    gen = torch.Generator().manual_seed(1)
    for used in (1, 3, 8, 32):
        chosen = torch.randperm(64, generator=gen)[:used]
        slots = chosen[torch.randint(0, used, (64,), generator=gen)].to(torch.int32)
        slots[::5] = -1
        distinct = len(set(slots[slots >= 0].tolist()))
        bounded = LoRABatch.build(slots, 64, max_adapters=distinct)
        assert bounded.num_blocks == max_blocks(64, distinct, bounded.block_m) < LoRABatch.build(slots, 64).num_blocks
        assert blocks_of(bounded) == blocks_of(LoRABatch.build(slots, 64))
    with pytest.raises(ValueError, match="max_adapters"):
        LoRABatch.build(slots, 64, max_adapters=0)


@pytest.mark.parametrize("bad,error", [(torch.zeros(2, 2, dtype=torch.int32), ValueError), (torch.zeros(3), TypeError)])
def test_refuses_bad_token_slots(bad, error):
    with pytest.raises(error):
        LoRABatch.build(bad, 4)


@pytest.mark.parametrize("slot", [4, 9])
def test_refuses_slots_past_num_slots(slot):
    """A slot past the buffers: on the CPU a clear error, not a row silently taken for a base
    row by the Triton path (slot == num_slots) or an index error deep in torch."""
    with pytest.raises(ValueError, match=f"slot {slot}, past the 4 slots"):
        LoRABatch.build(torch.tensor([0, slot, -1], dtype=torch.int32), 4)


def test_refuses_a_negative_block_m():
    with pytest.raises(ValueError, match="block_m"):
        LoRABatch.build(torch.tensor([0, 1], dtype=torch.int32), 4, block_m=-16)


def test_refuses_more_adapters_than_max_adapters():
    """On the CPU the grid's bound is checked: rows of adapters past it would get no block,
    and so, on the Triton path, silently no term."""
    slots = torch.tensor([0, 2, -1, 3, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="3 distinct slots, more than max_adapters=2"):
        LoRABatch.build(slots, 4, max_adapters=2)
    LoRABatch.build(slots, 4, max_adapters=3)


@pytest.mark.parametrize("slot", [4, 5, 40])
def test_slot_counts_refuse_slots_past_num_slots_without_a_host_check(slot):
    """On a GPU build cannot check slots on the host; its counting scatter must not take slot
    num_slots for a base row (it shared the base rows' bucket: silently no LoRA term) but
    index out of bounds, as every larger slot does (a device-side assert there; here, the
    CPU's error)."""
    from loraplex.kernels.batch import slot_counts

    assert slot_counts(torch.tensor([0, 3, -1, 3, -2]), 4).tolist() == [1, 0, 0, 2]
    with pytest.raises(RuntimeError, match="out of bounds"):
        slot_counts(torch.tensor([0, slot, -1]), 4)
