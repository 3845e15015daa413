"""make_config: the launch heuristics the H200 runs chose (bench/results/kernels_h200_notes.md)."""

from __future__ import annotations

import pytest

from loraplex.kernels.batch import DECODE_BLOCK_M, PREFILL_BLOCK_M, LoRABatch, max_blocks
from loraplex.kernels.block_rows import alignment
from loraplex.kernels.configs import MIN_K_CHUNK, make_config

QKV = (4096, (4096, 1024, 1024))
SMS = 132


def config(num_tokens: int, num_adapters: int, **kw):
    block_m = DECODE_BLOCK_M if num_tokens < 512 else PREFILL_BLOCK_M
    blocks = max_blocks(num_tokens, num_adapters, block_m)
    return make_config(blocks, QKV[0], QKV[1], 16, 2, SMS, block_m=block_m, **kw)


def test_decode_adds_in_memory_and_uses_pdl_where_the_device_has_it():
    c = config(64, 16, device_pdl=True)
    assert c.pdl and c.add_in_memory
    assert not config(64, 16, device_pdl=False).pdl


def test_decode_launches_the_expand_at_the_shrinks_start():
    assert config(64, 16, device_pdl=True).pdl_early


def test_prefill_reads_y_and_launches_the_expand_in_the_shrinks_tail():
    c = config(4096, 8, device_pdl=True)
    assert c.pdl and not c.pdl_early and not c.add_in_memory
    assert not config(4096, 8, device_pdl=False).pdl


def test_prefill_adds_in_memory_from_rank_64():
    blocks = max_blocks(4096, 8, PREFILL_BLOCK_M)
    assert make_config(blocks, QKV[0], QKV[1], 64, 2, SMS, block_m=PREFILL_BLOCK_M).add_in_memory
    assert not make_config(blocks, QKV[0], QKV[1], 16, 2, SMS, block_m=PREFILL_BLOCK_M).add_in_memory


@pytest.mark.parametrize("stride,expected", [(16, 16), (4096, 16), (8, 8), (24, 8), (12, 4), (3, 1), (0, 16)])
def test_alignment_is_the_largest_power_of_two_dividing_the_stride(stride, expected):
    assert alignment(stride) == expected


@pytest.mark.parametrize("num_tokens,num_adapters", [(1, 1), (64, 16), (256, 256), (4096, 8)])
def test_the_grid_covers_k_and_the_columns(num_tokens, num_adapters):
    c = config(num_tokens, num_adapters)
    assert 1 <= c.k_splits <= -(-QKV[0] // MIN_K_CHUNK)
    assert c.span % c.block_n == 0 and c.span >= c.block_n
    assert c.span <= -(-max(QKV[1]) // c.block_n) * c.block_n


def test_overrides_win():
    c = config(64, 16, device_pdl=True, pdl=False, add_in_memory=False, k_splits=3)
    assert (c.pdl, c.add_in_memory, c.k_splits) == (False, False, 3)


def test_a_decode_batch_uses_decode_blocks():
    import torch

    assert LoRABatch.build(torch.zeros(64, dtype=torch.int32), 4).block_m == DECODE_BLOCK_M
    assert LoRABatch.build(torch.zeros(4096, dtype=torch.int32), 4).block_m == PREFILL_BLOCK_M


def test_decode_expand_spans_are_capped():
    """64 tokens, 32 adapters: 36 blocks; gate/up's 28,672 columns in spans of 1,024."""
    blocks = max_blocks(64, 32, DECODE_BLOCK_M)
    c = make_config(blocks, 4096, (14336, 14336), 16, 2, SMS, block_m=DECODE_BLOCK_M)
    spans = sum(-(-w // c.span) for w in (14336, 14336))
    assert c.span == 1024 and spans == 28  # the sweep's fastest span here
    assert 4 * SMS <= c.k_splits * blocks < 4 * SMS + blocks
    # Prefill is not spread further: a 4096-token step has 136 blocks of 32 rows.
    p = make_config(max_blocks(4096, 8, PREFILL_BLOCK_M), 4096, (14336, 14336), 16, 2, SMS, block_m=PREFILL_BLOCK_M)
    assert p.span == 7168


@pytest.mark.parametrize("num_adapters", [1, 3, 8, 40])
def test_prefill_splits_k_into_a_power_of_two_of_even_chunks(num_adapters):
    c = config(4096, num_adapters)
    assert c.k_splits & (c.k_splits - 1) == 0 and QKV[0] % c.k_splits == 0
    assert config(4096, 1).k_splits == 4  # 129 blocks: 5 splits before, the uneven 896-column chunks


def test_decode_takes_wide_steps_where_the_grid_is_small():
    """kernels_h200_r64_block_n*.json, kernels_h200_r8_r16_block_n_*.json: 256 columns a step
    beat 64 (rank 64) and 128 (below) at decode, but not on grids of more than six programs per
    multiprocessor, nor at prefill."""
    gate_up = (4096, (14336, 14336))
    few = make_config(max_blocks(128, 8, DECODE_BLOCK_M), *gate_up, 64, 2, SMS)
    assert few.block_n == 256 and few.span % 256 == 0
    many = make_config(max_blocks(64, 32, DECODE_BLOCK_M), *gate_up, 64, 2, SMS)
    assert many.block_n == 64
    assert make_config(max_blocks(4096, 8, PREFILL_BLOCK_M), *gate_up, 64, 2, SMS, block_m=PREFILL_BLOCK_M).block_n == 64
    assert make_config(max_blocks(128, 8, DECODE_BLOCK_M), *gate_up, 16, 2, SMS).block_n == 256
    assert make_config(max_blocks(64, 32, DECODE_BLOCK_M), *gate_up, 16, 2, SMS).block_n == 128
    assert make_config(max_blocks(4096, 8, PREFILL_BLOCK_M), *gate_up, 16, 2, SMS, block_m=PREFILL_BLOCK_M).block_n == 128
    assert make_config(max_blocks(128, 8, DECODE_BLOCK_M), *gate_up, 64, 2, SMS, block_n=128).block_n == 128
