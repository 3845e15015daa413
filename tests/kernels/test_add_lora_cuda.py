"""On a CUDA device only: the Triton kernels in bfloat16 (which the interpreter cannot check),
float16 and float32, against the float64 reference, and captured in a CUDA graph.

tests/conftest.py turns the Triton interpreter on for the CPU; on a GPU run these as
`TRITON_INTERPRET=0 pytest tests/kernels/test_add_lora_cuda.py`.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from loraplex.kernels import LoRABatch, add_lora, add_lora_reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interpreter on: set TRITON_INTERPRET=0"),
]

# bf16 operands land between 1e-3 and 1e-2 (the LoRA term alone, relative).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-3}


def inputs(num_tokens, num_slots, rank, in_features, slices, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(torch.int32)
    ranks = torch.randint(1, rank + 1, (num_slots,), generator=gen).to(torch.int32)
    lora_a = torch.randn(num_slots, len(slices) * rank, in_features, generator=gen) / math.sqrt(in_features)
    lora_b = torch.randn(num_slots, sum(slices), rank, generator=gen) / math.sqrt(rank)
    for s in range(num_slots):  # NaN past each slot's rank: the kernels must never read it
        for i in range(len(slices)):
            lora_a[s, i * rank + int(ranks[s]) : (i + 1) * rank] = float("nan")
        lora_b[s, :, int(ranks[s]) :] = float("nan")
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, sum(slices), generator=gen)
    scaling = torch.rand(num_slots, len(slices), generator=gen) + 0.5
    cuda = lambda t: t.to("cuda", dtype) if t.is_floating_point() and t is not scaling else t.cuda()  # noqa: E731
    return cuda(token_slots), cuda(ranks), cuda(lora_a), cuda(lora_b), cuda(x), cuda(y), scaling.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("num_tokens,num_slots,rank,in_features,slices", [
    (1, 4, 16, 4096, (4096, 1024, 1024)),  # decode, Llama-3-8B q/k/v
    (64, 16, 16, 4096, (14336, 14336)),  # decode, gate/up
    (64, 64, 64, 14336, (4096,)),  # one adapter per row, down
    (1024, 8, 8, 896, (896, 128, 128)),  # prefill, Qwen2-0.5B q/k/v
])
def test_matches_reference_on_cuda(dtype, num_tokens, num_slots, rank, in_features, slices):
    token_slots, ranks, lora_a, lora_b, x, y, scaling = inputs(num_tokens, num_slots, rank, in_features, slices,
                                                                dtype, seed=num_tokens + rank)
    expected = add_lora_reference(y, x, lora_a.nan_to_num(), lora_b.nan_to_num(), scaling, token_slots, ranks, slices)
    before = y.clone()
    add_lora(y, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, num_slots), ranks=ranks, output_slices=slices)
    base_rows = token_slots < 0
    assert torch.equal(y[base_rows], before[base_rows])
    delta, want = y.double() - before.double(), expected - before.double()
    assert torch.isfinite(delta).all()
    assert ((delta - want).norm() / want.norm()).item() < TOLERANCE[dtype]


def test_captured_in_a_cuda_graph():
    """Building the batch and adding the term need no host synchronisation: both capture."""
    token_slots, ranks, lora_a, lora_b, x, y, scaling = inputs(64, 8, 16, 1024, (1024, 256, 256), torch.bfloat16, 7)
    eager = y.clone()
    add_lora(eager, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, 8), ranks=ranks, output_slices=(1024, 256, 256))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    replayed = y.clone()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        add_lora(replayed, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, 8), ranks=ranks,
                 output_slices=(1024, 256, 256))
    replayed.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [64, 1024], ids=["decode", "prefill"])
@pytest.mark.parametrize("rank,row_stride", [(8, 8), (8, 12), (4, 4), (24, 24)])
def test_weight_rows_off_vector_boundaries_on_cuda(num_tokens, rank, row_stride):
    """lora_b rows of 4, 8, 12 or 24 elements (views into wider buffers too): the kernels
    promise the compiler only the alignment the strides have."""
    slices = (896, 128, 128)
    token_slots, ranks, lora_a, lora_b, x, y, scaling = inputs(num_tokens, 8, rank, 896, slices, torch.bfloat16, rank)
    wide_b = torch.full((8, sum(slices), row_stride), float("nan"), dtype=lora_b.dtype, device="cuda")
    wide_b[:, :, :rank] = lora_b
    lora_b = wide_b[:, :, :rank]
    expected = add_lora_reference(y, x, lora_a.nan_to_num(), lora_b.nan_to_num(), scaling, token_slots, ranks, slices)
    before = y.clone()
    add_lora(y, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, 8), ranks=ranks, output_slices=slices)
    delta, want = y.double() - before.double(), expected - before.double()
    assert ((delta - want).norm() / want.norm()).item() < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_tokens", [64, 1024], ids=["decode", "prefill"])
def test_one_rank_per_slice_on_cuda(num_tokens):
    """ranks [S, 3] as columns of a per-projection table: k of rank 0 for q/v adapters (NaN
    weights, never read, its columns unchanged), bf16."""
    slices = (4096, 1024, 1024)
    token_slots, _, _, _, x, y, scaling = inputs(num_tokens, 8, 16, 4096, slices, torch.bfloat16, 3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    lora_a = (torch.randn(8, 48, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    lora_b = (torch.randn(8, 6144, 16, device="cuda", generator=gen) / 4).to(torch.bfloat16)
    table = torch.zeros(8, 7, dtype=torch.int32, device="cuda")
    table[:, 0], table[:, 2] = 16, 8  # q rank 16, v rank 8, k none
    ranks = table[:, 0:3]
    lora_a[:, 16:32] = float("nan")
    lora_b[:, 4096:5120] = float("nan")
    lora_a[:, 32 + 8 :] = float("nan")
    lora_b[:, 5120:, 8:] = float("nan")
    expected = add_lora_reference(y, x, lora_a.nan_to_num(), lora_b.nan_to_num(), scaling, token_slots, ranks, slices)
    before = y.clone()
    add_lora(y, x, lora_a, lora_b, scaling, LoRABatch.build(token_slots, 8), ranks=ranks, output_slices=slices)
    assert torch.equal(y[:, 4096:5120], before[:, 4096:5120])
    delta, want = y.double() - before.double(), expected - before.double()
    assert torch.isfinite(delta).all()
    assert ((delta - want).norm() / want.norm()).item() < TOLERANCE[torch.bfloat16]
