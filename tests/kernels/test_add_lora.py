"""add_lora against the float64 reference, on both backends (Triton through its interpreter).

Inputs are poisoned so that a wrong read or a missed write fails: y starts random (not
zero), rank rows and columns past a slot's rank are NaN, unused slots are NaN, and strided
inputs carry NaN in the gaps between rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.kernels import LoRABatch, add_lora, add_lora_reference

# Real model projections scaled down (widths / 32 for Llama-3-8B, / 8 for Qwen2-0.5B):
# (in_features, output_slices).
LLAMA3_QKV = (128, (128, 32, 32))
LLAMA3_GATE_UP = (128, (448, 448))
LLAMA3_DOWN = (448, (128,))
QWEN2_QKV = (112, (112, 16, 16))
SHAPES = {"llama3-qkv": LLAMA3_QKV, "llama3-gate-up": LLAMA3_GATE_UP, "llama3-down": LLAMA3_DOWN, "qwen2-qkv": QWEN2_QKV}

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}


def slot_pattern(pattern: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """token_slots for a named pattern of rows."""
    if pattern == "all-base":
        slots = torch.full((num_tokens,), -1)
    elif pattern == "one-adapter":
        slots = torch.full((num_tokens,), num_slots - 1)
    elif pattern == "every-row-own":  # decode: each request its own adapter
        slots = torch.arange(num_tokens) % num_slots
    elif pattern == "prefill-segments":  # a few long runs, base rows among them
        bounds = sorted(torch.randint(1, num_tokens, (3,), generator=gen).tolist())
        slots = torch.empty(num_tokens, dtype=torch.long)
        for i, (lo, hi) in enumerate(zip([0, *bounds], [*bounds, num_tokens])):
            slots[lo:hi] = -1 if i == 1 else (i * 3) % num_slots
    elif pattern == "random-mixed":
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    else:
        raise ValueError(pattern)
    return slots.to(torch.int32)


def make_weights(num_slots, rank, in_features, slices, ranks, dtype, gen, used):
    """Adapter buffers with NaN past each slice's rank (ranks [S], or [S, n]: one per slice)
    and in slots no row uses."""
    n = len(slices)
    lora_a = torch.randn(num_slots, n * rank, in_features, generator=gen) / math.sqrt(in_features)
    lora_b = torch.randn(num_slots, sum(slices), rank, generator=gen) / math.sqrt(rank)
    per_slice = ranks[:, None].expand(-1, n) if ranks.dim() == 1 else ranks
    for s in range(num_slots):
        off = 0
        for i, width in enumerate(slices):
            r = int(per_slice[s, i])
            lora_a[s, i * rank + r : (i + 1) * rank] = float("nan")
            lora_b[s, off : off + width, r:] = float("nan")
            off += width
        if s not in used:
            lora_a[s] = float("nan")
            lora_b[s] = float("nan")
    scaling = torch.rand(num_slots, n, generator=gen) * 2 + 0.1
    return lora_a.to(dtype), lora_b.to(dtype), scaling


def check(case_seed, num_tokens, num_slots, rank, shape, pattern, dtype, backend, mixed_ranks=True, strided=False,
          zero_ranks=False, per_slice=False):
    """One call of add_lora against the reference. ``per_slice``: one rank per slot and slice
    (0 for some: projections an adapter does not target), read through a strided view."""
    gen = torch.Generator().manual_seed(case_seed)
    in_features, slices = SHAPES[shape]
    token_slots = slot_pattern(pattern, num_tokens, num_slots, gen)
    used = set(token_slots[token_slots >= 0].tolist())
    if mixed_ranks:
        ranks = torch.randint(1, rank + 1, (num_slots,), generator=gen).to(torch.int32)
        ranks[0] = rank
    else:
        ranks = torch.full((num_slots,), rank, dtype=torch.int32)
    if zero_ranks:  # every other slot has no weights here (all NaN), as for an untargeted group
        ranks[1::2] = 0
    if per_slice:  # a different rank per slice, some 0; columns of a wider table, as the engine keeps
        table = torch.full((num_slots, len(slices) + 3), -9, dtype=torch.int32)
        table[:, 1 : 1 + len(slices)] = torch.randint(0, rank + 1, (num_slots, len(slices)), generator=gen)
        table[0, 1] = rank
        table[1 % num_slots, 1:] = 0  # a slot with nothing in any slice
        ranks = table[:, 1 : 1 + len(slices)]
    lora_a, lora_b, scaling = make_weights(num_slots, rank, in_features, slices, ranks, dtype, gen, used)

    out_features = sum(slices)
    if strided:  # rows of x and y are views into wider buffers, NaN in between
        x_buf = torch.full((num_tokens, in_features + 24), float("nan"), dtype=dtype)
        y_buf = torch.full((num_tokens, out_features + 40), float("nan"), dtype=dtype)
        x, y = x_buf[:, 8 : 8 + in_features], y_buf[:, 16 : 16 + out_features]
        x.copy_(torch.randn(num_tokens, in_features, generator=gen))
        y.copy_(torch.randn(num_tokens, out_features, generator=gen))
    else:
        x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
        y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)

    expected = add_lora_reference(y, x, torch.nan_to_num(lora_a), torch.nan_to_num(lora_b), scaling, token_slots, ranks, slices)
    before = y.clone()
    # The grid sized for the adapters in use, as an engine sizes it (other tests: every slot).
    batch = LoRABatch.build(token_slots, num_slots, max_adapters=max(1, len(used)))
    if strided:  # ranks as a column of a [S, 4] table, as the engine keeps one rank per layer group
        table = torch.full((num_slots, 4), -9, dtype=torch.int32)
        table[:, 2] = ranks
        ranks = table[:, 2]
    out = add_lora(y, x, lora_a, lora_b, scaling, batch, ranks=ranks, backend=backend, output_slices=slices)
    assert out is y

    base_rows = token_slots < 0
    if zero_ranks:
        base_rows |= (ranks[token_slots.clamp(min=0).long()] == 0) & (token_slots >= 0)
    assert torch.equal(y[base_rows], before[base_rows]), "a base-only row changed"
    if per_slice:  # a slice of rank 0 leaves its columns as they were, bit for bit
        off = 0
        for i, width in enumerate(slices):
            idle = (token_slots >= 0) & (ranks[token_slots.clamp(min=0).long(), i] == 0)
            assert torch.equal(y[idle, off : off + width], before[idle, off : off + width]), f"slice {i} of rank 0 changed"
            off += width
    delta = y.double() - before.double()
    expected_delta = expected - before.double()
    assert torch.isfinite(delta).all(), "NaN read from padding, an unused slot or a stride gap"
    if expected_delta.abs().sum() > 0:
        err = ((delta - expected_delta).norm() / expected_delta.norm()).item()
        assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    if strided:
        assert torch.isnan(y_buf[:, :16]).all() and torch.isnan(y_buf[:, 16 + out_features :]).all(), "wrote outside y"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "num_tokens,num_slots,rank,shape,pattern",
    [
        (1, 4, 16, "llama3-qkv", "one-adapter"),
        (8, 8, 16, "llama3-qkv", "every-row-own"),
        (8, 4, 8, "llama3-qkv", "all-base"),
        (33, 5, 32, "llama3-gate-up", "random-mixed"),
        (40, 6, 16, "llama3-down", "every-row-own"),
        (96, 8, 64, "qwen2-qkv", "prefill-segments"),
        (600, 4, 16, "llama3-qkv", "prefill-segments"),  # prefill block size (64 rows)
    ],
)
def test_matches_reference(backend, dtype, num_tokens, num_slots, rank, shape, pattern):
    check(num_tokens * 131 + rank, num_tokens, num_slots, rank, shape, pattern, dtype, backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_strided_rows(backend):
    check(7, 24, 4, 16, "llama3-qkv", "random-mixed", torch.float32, backend, strided=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("num_tokens,pattern", [(8, "every-row-own"), (600, "prefill-segments"), (40, "random-mixed")])
def test_slots_of_rank_zero_leave_their_rows_alone(backend, num_tokens, pattern):
    """A slot of rank 0 (an adapter with no weights in this layer group, all NaN here) costs
    its rows nothing and never reads its weights; the others are added as usual."""
    check(num_tokens + 3, num_tokens, 6, 16, "llama3-qkv", pattern, torch.float16, backend, zero_ranks=True)
    check(num_tokens + 5, num_tokens, 6, 8, "llama3-down", pattern, torch.float32, backend, zero_ranks=True,
          strided=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "num_tokens,shape,pattern",
    [(1, "llama3-qkv", "one-adapter"), (8, "llama3-qkv", "every-row-own"), (40, "llama3-gate-up", "random-mixed"),
     (33, "llama3-down", "random-mixed"), (600, "qwen2-qkv", "prefill-segments")],
)
def test_one_rank_per_slice(backend, dtype, num_tokens, shape, pattern):
    """ranks [S, n]: each slice of a fused call reads its own rank (an adapter on q and v
    alone has k of rank 0: its NaN weights are never read and its columns stay as they were)."""
    check(num_tokens * 11 + 1, num_tokens, 5, 16, shape, pattern, dtype, backend, per_slice=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_uniform_ranks_without_ranks_tensor(backend):
    """ranks=None means every slot uses the buffers' full rank."""
    gen = torch.Generator().manual_seed(3)
    in_features, slices = LLAMA3_GATE_UP
    token_slots = slot_pattern("random-mixed", 20, 3, gen)
    lora_a = torch.randn(3, 2 * 16, in_features, generator=gen) / 10
    lora_b = torch.randn(3, sum(slices), 16, generator=gen) / 4
    scaling = torch.rand(3, generator=gen)
    x = torch.randn(20, in_features, generator=gen)
    y = torch.randn(20, sum(slices), generator=gen)
    expected = add_lora_reference(y, x, lora_a, lora_b, scaling, token_slots, None, slices)
    add_lora(y, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, 3), backend=backend, output_slices=slices)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_scales_of_unused_slots_and_idle_slices_are_never_read(backend):
    """Only a row's own slot and its slices of nonzero rank read a scale: NaN in slot 0 (no
    row uses it) and in a slice of rank 0 leave base rows and that slice's columns alone."""
    gen = torch.Generator().manual_seed(13)
    token_slots = torch.tensor([1, -1, 1, -1], dtype=torch.int32)
    lora_a, lora_b = torch.randn(2, 16, 16, generator=gen), torch.randn(2, 32, 8, generator=gen)
    scaling = torch.tensor([[float("nan"), float("nan")], [0.5, float("nan")]])
    ranks = torch.tensor([[8, 8], [8, 0]], dtype=torch.int32)
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 32, generator=gen)
    expected = add_lora_reference(y, x, lora_a, lora_b, scaling.nan_to_num(), token_slots, ranks, (16, 16))
    add_lora(y, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, 2), ranks, backend=backend,
             output_slices=(16, 16))
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_reference_reads_nothing_past_the_ranks():
    """The reference's own contract: what lies past a slice's rank (and the scale of a slice
    of rank 0) does not change its result."""
    gen = torch.Generator().manual_seed(17)
    token_slots = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    ranks = torch.tensor([[3, 0], [8, 5]], dtype=torch.int32)
    lora_a, lora_b, scaling = make_weights(2, 8, 16, (12, 20), ranks, torch.float32, gen, {0, 1})
    scaling[0, 1] = float("nan")
    x, y = torch.randn(5, 16, generator=gen), torch.randn(5, 32, generator=gen)
    got = add_lora_reference(y, x, lora_a, lora_b, scaling, token_slots, ranks, (12, 20))
    clean = add_lora_reference(y, x, lora_a.nan_to_num(), lora_b.nan_to_num(), scaling.nan_to_num(), token_slots,
                               ranks, (12, 20))
    assert torch.equal(got, clean)
    assert torch.equal(got[:, 12:][token_slots == 0], y[:, 12:][token_slots == 0].double())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_slices_equal_separate_calls(backend):
    """One launch over q/k/v gives what three single-slice calls give."""
    gen = torch.Generator().manual_seed(11)
    in_features, slices = LLAMA3_QKV
    num_slots, rank, num_tokens = 4, 16, 12
    token_slots = slot_pattern("random-mixed", num_tokens, num_slots, gen)
    batch = LoRABatch.build(token_slots, num_slots)
    lora_a = torch.randn(num_slots, 3 * rank, in_features, generator=gen) / 10
    lora_b = torch.randn(num_slots, sum(slices), rank, generator=gen) / 4
    scaling = torch.rand(num_slots, 3, generator=gen)
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, sum(slices), generator=gen)
    fused = add_lora(y.clone(), x, lora_a, lora_b, scaling, batch, backend=backend, output_slices=slices)
    offset = 0
    for i, width in enumerate(slices):
        part = y[:, offset : offset + width].contiguous()
        add_lora(
            part, x, lora_a[:, i * rank : (i + 1) * rank].contiguous(), lora_b[:, offset : offset + width].contiguous(),
            scaling[:, i].contiguous(), batch, backend=backend,
        )
        torch.testing.assert_close(fused[:, offset : offset + width], part, rtol=1e-5, atol=1e-5)
        offset += width


def _call_args(**overrides):
    args = dict(
        y=torch.zeros(4, 32), x=torch.zeros(4, 16), lora_a=torch.zeros(2, 8, 16), lora_b=torch.zeros(2, 32, 8),
        scaling=torch.ones(2), batch=LoRABatch.build(torch.tensor([0, 1, -1, 0], dtype=torch.int32), 2),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(x=torch.zeros(3, 16)), ValueError, "rows"),
        (dict(lora_a=torch.zeros(2, 8, 15)), ValueError, "lora_a is"),
        (dict(lora_b=torch.zeros(3, 32, 8)), ValueError, "lora_a is"),
        (dict(y=torch.zeros(4, 32, dtype=torch.float16)), TypeError, "share a dtype"),
        (dict(scaling=torch.ones(2, dtype=torch.float64)), ValueError, "scaling"),
        (dict(ranks=torch.ones(2, dtype=torch.int64)), ValueError, "ranks"),
        (dict(x=torch.zeros(16, 4).t()), ValueError, "contiguous"),
        (dict(output_slices=(16, 8)), ValueError, "output_slices"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(batch=torch.tensor([0, 1, -1, 0], dtype=torch.int32)), TypeError, "LoRABatch"),  # token_slots itself
        (dict(x=torch.zeros(4, 16, dtype=torch.int32)), TypeError, "not supported"),
    ],
)
def test_refuses_bad_calls(overrides, error, match):
    with pytest.raises(error, match=match):
        add_lora(**_call_args(**overrides))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_refuses_y_whose_rows_overlap(backend):
    """Rows of y that share memory (a broadcast row, a row stride under the width) would each
    add their own term into the same elements: refused, on either backend."""
    for y in (torch.zeros(32).expand(4, 32), torch.zeros(4 * 16 + 16).as_strided((4, 32), (16, 1))):
        with pytest.raises(ValueError, match="rows of y overlap"):
            add_lora(**_call_args(y=y), backend=backend)
    add_lora(**_call_args(y=torch.zeros(32).expand(4, 32)[:1], x=torch.zeros(1, 16),
                          batch=LoRABatch.build(torch.tensor([0], dtype=torch.int32), 2)), backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_refuses_y_that_shares_memory_with_x(backend):
    """y is written while x is read: y as x itself, or as a view that overlaps it, is refused."""
    buf = torch.zeros(4, 32)
    for x in (buf[:, :16], buf[:, 16:]):
        with pytest.raises(ValueError, match="y shares memory with x"):
            add_lora(**_call_args(y=buf, x=x), backend=backend)
    wide = torch.zeros(4, 48)  # side by side in one buffer, apart: accepted
    add_lora(**_call_args(y=wide[:, :32], x=wide[:, 32:][:4]), backend=backend)


def test_overlap_test_agrees_with_the_elements():
    """_overlaps on random blocks of one buffer (rows and columns of it) against the elements
    the blocks touch."""
    from loraplex.kernels.add_lora import _overlaps

    buf = torch.zeros(6, 10)
    gen = torch.Generator().manual_seed(5)

    def draw(lo, hi):
        return int(torch.randint(lo, hi, (), generator=gen))

    def block():
        r, c = draw(0, 6), draw(0, 10)
        h, w = draw(1, 7 - r), draw(1, 11 - c)
        mark = torch.zeros(6, 10, dtype=torch.bool)
        mark[r : r + h, c : c + w] = True
        return buf[r : r + h, c : c + w], mark

    for _ in range(300):
        (a, a_mark), (b, b_mark) = block(), block()
        assert _overlaps(a, b) == _overlaps(b, a) == bool((a_mark & b_mark).any()), (a.shape, b.shape)


def test_triton_backend_needs_block_m_of_16():
    args = _call_args(batch=LoRABatch.build(torch.tensor([0, 1, -1, 0], dtype=torch.int32), 2, block_m=2))
    with pytest.raises(ValueError, match="block_m"):
        add_lora(**args, backend="triton")


@pytest.mark.parametrize("add_in_memory", [False, True])
@pytest.mark.parametrize("k_splits,block_k,span_tiles,block_m", [(1, 16, 1, 16), (3, 32, 2, 16), (7, 16, 9, 32), (2, 64, 1, 64)])
def test_launch_configurations_agree(k_splits, block_k, span_tiles, block_m, add_in_memory):
    """Every split of K, span and block size, and either way of adding into y, computes the
    same sum (Triton path)."""
    from loraplex.kernels.add_lora import sgmv_lora
    from loraplex.kernels.configs import SGMVConfig

    gen = torch.Generator().manual_seed(k_splits)
    in_features, slices = QWEN2_QKV
    num_slots, rank, num_tokens = 5, 16, 70
    token_slots = slot_pattern("random-mixed", num_tokens, num_slots, gen)
    ranks = torch.randint(1, rank + 1, (num_slots,), generator=gen).to(torch.int32)
    lora_a, lora_b, scaling = make_weights(num_slots, rank, in_features, slices, ranks, torch.float32, gen, set(range(num_slots)))
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, sum(slices), generator=gen)
    expected = add_lora_reference(y, x, lora_a.nan_to_num(), lora_b.nan_to_num(), scaling, token_slots, ranks, slices)
    config = SGMVConfig(k_splits=k_splits, block_k=block_k, span=16 * span_tiles, block_n=16, num_warps=4, num_stages=2,
                        add_in_memory=add_in_memory)
    batch = LoRABatch.build(token_slots, num_slots, block_m=block_m)
    sgmv_lora(y, x, lora_a, lora_b, scaling, batch, ranks, slices, config=config)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 33, 34])
def test_partial_planes_start_on_16_element_boundaries(num_tokens):
    """The shrink's plane stride is a multiple of 16 whatever the rows (rank 8, one slice: T*8),
    so a new prefill length never makes Triton compile a new variant; the sums stay right."""
    from loraplex.kernels.shrink import sgmv_shrink

    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=gen)
    lora_a = torch.randn(2, 8, 64, generator=gen)
    token_slots = torch.zeros(num_tokens, dtype=torch.int32)
    partial = sgmv_shrink(x, lora_a, LoRABatch.build(token_slots, 2), None, 8, k_splits=2, block_k=16)
    assert partial.shape == (2, num_tokens, 8) and partial.stride(0) % 16 == 0
    torch.testing.assert_close(partial.sum(0), x @ lora_a[0].T, rtol=1e-5, atol=1e-5)
