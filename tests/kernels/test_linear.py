"""The decode GEMM (``gemm``) and ``lora_linear`` through the Triton interpreter.

``gemm`` is checked against float64 over tile shapes and K splits (the split-K path with its
counters is run twice in a row, so counters left behind would show). ``lora_linear`` must
give what ``gemm`` then ``add_lora`` give with the same arguments (base-only rows to the
bit), whatever the rows' adapters, with NaN in every byte the kernels must not read.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import LoRABatch, add_lora, add_lora_reference
from loraplex.kernels.linear import GemmConfig, gemm, lora_linear, make_gemm_config

from .test_add_lora import SHAPES, TOLERANCE, make_weights, slot_pattern

CONFIGS = {
    "one-split": GemmConfig(block_m=16, block_n=32, block_k=32, splits=1),
    "two-splits": GemmConfig(block_m=16, block_n=64, block_k=32, splits=2),
    "uneven-splits": GemmConfig(block_m=32, block_n=32, block_k=64, splits=3),  # K chunks of unequal length
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("num_tokens,shape", [(1, "llama3-qkv"), (19, "llama3-down"), (40, "qwen2-qkv")])
def test_gemm_matches_float64(num_tokens, shape, config, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    in_features, slices = SHAPES[shape]
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    weight = (torch.randn(sum(slices), in_features, generator=gen) / in_features**0.5).to(dtype)
    expected = x.double() @ weight.double().T
    for _ in range(2):  # the second call finds the split counters back at zero
        y = torch.full((num_tokens, sum(slices)), float("nan"), dtype=dtype)
        assert gemm(x, weight, y, CONFIGS[config]) is y
        err = ((y.double() - expected).norm() / expected.norm()).item()
        assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_gemm_strided_rows():
    """x and y as views into wider rows: the gaps stay as they were."""
    gen = torch.Generator().manual_seed(3)
    x_buf = torch.full((9, 140), float("nan"))
    x = x_buf[:, 4:132]
    x.copy_(torch.randn(9, 128, generator=gen))
    weight = torch.randn(96, 128, generator=gen) / 11
    y_buf = torch.full((9, 100), float("nan"))
    y = y_buf[:, 2:98]
    gemm(x, weight, y, CONFIGS["two-splits"])
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-5, atol=1e-5)
    assert torch.isnan(y_buf[:, :2]).all() and torch.isnan(y_buf[:, 98:]).all()


def test_gemm_refuses_bad_inputs():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        gemm(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="contiguous"):
        gemm(torch.randn(64, 4).T, torch.randn(32, 64))
    with pytest.raises(TypeError, match="weight is"):
        gemm(x, torch.randn(32, 64, dtype=torch.float16))
    for dtype in (torch.float64, torch.int32):  # float64 came out wrong, int32 failed inside Triton
        with pytest.raises(TypeError, match="not supported"):
            gemm(x.to(dtype), torch.randn(32, 64).to(dtype))
    with pytest.raises(ValueError, match="out must be"):
        gemm(x, torch.randn(32, 64), out=torch.empty(32, 4).T)  # a column-major out
    with pytest.raises(ValueError, match="out must be"):
        gemm(x, torch.randn(32, 64), out=torch.empty(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        gemm(x, torch.randn(32, 64), out=torch.empty(32).expand(4, 32))  # rows that share memory
    square = torch.randn(64, 64)
    with pytest.raises(ValueError, match="out shares memory with x"):
        gemm(x, square, out=x)  # tiles written while other tiles still read x: wrong with K split
    with pytest.raises(ValueError, match="out shares memory with weight"):
        gemm(x, square, out=square[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", ["one-split", "uneven-splits"])
@pytest.mark.parametrize(
    "num_tokens,num_slots,shape,pattern",
    [
        (1, 4, "llama3-qkv", "one-adapter"),
        (16, 16, "llama3-qkv", "every-row-own"),
        (24, 6, "llama3-gate-up", "random-mixed"),
        (12, 5, "llama3-down", "all-base"),
        (33, 8, "qwen2-qkv", "random-mixed"),
    ],
)
def test_lora_linear_matches_gemm_then_add_lora(num_tokens, num_slots, shape, pattern, config, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_slots)
    in_features, slices = SHAPES[shape]
    token_slots = slot_pattern(pattern, num_tokens, num_slots, gen)
    used = set(token_slots[token_slots >= 0].tolist())
    ranks = torch.randint(0, 17, (num_slots, len(slices)), generator=gen).to(torch.int32)  # some slices 0
    lora_a, lora_b, scaling = make_weights(num_slots, 16, in_features, slices, ranks, dtype, gen, used)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    weight = (torch.randn(sum(slices), in_features, generator=gen) / in_features**0.5).to(dtype)
    batch = LoRABatch.build(token_slots, num_slots, max_adapters=max(1, len(used)))
    cfg = CONFIGS[config]

    y = lora_linear(x, weight, lora_a, lora_b, scaling, batch, ranks, slices, config=cfg)
    then = gemm(x, weight, config=cfg)
    add_lora(then, x, lora_a, lora_b, scaling, batch, ranks, backend="triton", output_slices=slices)
    assert torch.isfinite(y).all(), "NaN read from padding or an unused slot"
    # The shrink may cut K otherwise than add_lora's (GemmConfig.shrink_splits): close, not equal.
    torch.testing.assert_close(y, then, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    base_rows = token_slots < 0
    assert torch.equal(y[base_rows], then[base_rows]), "a base-only row differs from the GEMM's"
    expected = add_lora_reference(x.double() @ weight.double().T, x, torch.nan_to_num(lora_a),
                                  torch.nan_to_num(lora_b), scaling, token_slots, ranks, slices)
    err = ((y.double() - expected).norm() / expected.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_no_input_columns_gives_zeros():
    """in_features 0 (an empty sum): zeros, and y unchanged by add_lora, on every path."""
    batch = LoRABatch.build(torch.tensor([0, -1, 1], dtype=torch.int32), 2)
    x, weight, a, b, sc = torch.zeros(3, 0), torch.zeros(32, 0), torch.zeros(2, 8, 0), torch.ones(2, 32, 8), torch.ones(2)
    assert torch.equal(gemm(x, weight, out=torch.full((3, 32), 7.0)), torch.zeros(3, 32))
    assert torch.equal(lora_linear(x, weight, a, b, sc, batch, out=torch.full((3, 32), 7.0)), torch.zeros(3, 32))
    for backend in ("triton", "torch"):
        assert torch.equal(add_lora(torch.ones(3, 32), x, a, b, sc, batch, backend=backend), torch.ones(3, 32))


def test_lora_linear_checks_like_add_lora():
    x = torch.randn(4, 64)
    batch = LoRABatch.build(torch.zeros(4, dtype=torch.int32), 2)
    a, b, sc = torch.randn(2, 16, 64), torch.randn(2, 32, 16), torch.ones(2)
    with pytest.raises(ValueError, match="lora_b has 32 output rows"):
        lora_linear(x, torch.randn(48, 64), a, b, sc, batch)
    with pytest.raises(ValueError, match="rows of y overlap"):
        lora_linear(x, torch.randn(32, 64), a, b, sc, batch, out=torch.empty(32).expand(4, 32))
    with pytest.raises(ValueError, match="built for 2 slots"):
        lora_linear(x, torch.randn(32, 64), torch.randn(3, 16, 64), torch.randn(3, 32, 16), torch.ones(3), batch)


def test_default_configs_divide_the_work():
    """The defaults on Llama-3-8B decode shapes: K split where the column tiles alone leave
    multiprocessors idle (132 on an H200), never into chunks under 512 columns."""
    def cfg(tokens, k, n):
        return make_gemm_config(tokens, k, n, sms=132)

    assert cfg(64, 4096, 6144).splits == 1 and cfg(64, 4096, 6144).block_m == 64
    assert cfg(1, 4096, 4096).splits > 1 and cfg(1, 4096, 4096).block_m == 16
    assert cfg(16, 4096, 28672).splits == 1
    # 17-32 rows: tiles of 32 rows, K split as at 16 rows (linear_h200_grid.json).
    assert (cfg(32, 4096, 6144).block_m, cfg(32, 4096, 6144).splits) == (32, 4)
    assert cfg(17, 4096, 4096).splits == 4 and cfg(32, 14336, 4096).splits == 4
    assert cfg(32, 4096, 28672).splits == 1
    for tokens in (1, 16, 64):
        c = cfg(tokens, 14336, 4096)
        assert 14336 // c.splits >= 512
