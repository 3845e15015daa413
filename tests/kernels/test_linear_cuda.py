"""On a CUDA device only: ``gemm`` and ``lora_linear`` in bfloat16 (which the interpreter
cannot check), float16 and float32, with programmatic dependent launch where the device has
it (against the same launches without it: the same bits), eagerly and replayed from a CUDA
graph.

`TRITON_INTERPRET=0 pytest tests/kernels/test_linear_cuda.py` on a GPU.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from loraplex.kernels import LoRABatch, add_lora, add_lora_reference
from loraplex.kernels.linear import gemm, gemm_config, lora_linear

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interpreter on: set TRITON_INTERPRET=0"),
]

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-3}
# Llama-3-8B widths / 8: q/k/v, gate/up, down.
SHAPES = {"qkv": (512, (512, 128, 128)), "gate_up": (512, (1792, 1792)), "down": (1792, (512,))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens,num_slots", [(1, 4), (16, 8), (32, 8), (64, 32), (100, 8)])
def test_lora_linear_on_gpu(num_tokens, num_slots, shape, dtype):
    gen = torch.Generator().manual_seed(num_tokens + num_slots)
    in_features, slices = SHAPES[shape]
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(torch.int32).cuda()
    ranks = torch.randint(0, 17, (num_slots, len(slices)), generator=gen).to(torch.int32)
    lora_a = torch.randn(num_slots, len(slices) * 16, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(num_slots, sum(slices), 16, generator=gen) / 4
    for s in range(num_slots):  # NaN past each slice's rank: never read
        off = 0
        for i, width in enumerate(slices):
            r = int(ranks[s, i])
            lora_a[s, i * 16 + r:(i + 1) * 16] = float("nan")
            lora_b[s, off:off + width, r:] = float("nan")
            off += width
    cuda = lambda t: t.to("cuda", dtype)  # noqa: E731
    lora_a, lora_b = cuda(lora_a), cuda(lora_b)
    ranks = ranks.cuda()
    scaling = (torch.rand(num_slots, len(slices), generator=gen) + 0.5).cuda()
    x = cuda(torch.randn(num_tokens, in_features, generator=gen))
    weight = cuda(torch.randn(sum(slices), in_features, generator=gen) / in_features**0.5)
    batch = LoRABatch.build(token_slots, num_slots)
    args = (lora_a, lora_b, scaling, batch, ranks, slices)

    config = gemm_config(num_tokens, weight)
    y = lora_linear(x, weight, *args, config=config)
    # The same kernels one after the other (on a GPU without PDL, the only way): the same bits.
    serial = lora_linear(x, weight, *args, config=dataclasses.replace(config, pdl=False))
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    assert torch.equal(y, serial), "the overlapped launches differ from the same launches in turn"
    # gemm then add_lora: the shrink adds its K splits in another order, so not the same bits.
    then = gemm(x, weight)
    add_lora(then, x, *args[:4], ranks=ranks, output_slices=slices)
    torch.testing.assert_close(y, then, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    expected = add_lora_reference(x.double() @ weight.double().T, x, torch.nan_to_num(lora_a),
                                  torch.nan_to_num(lora_b), scaling, token_slots, ranks, slices)
    err = ((y.double() - expected).norm() / expected.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"

    out = torch.empty_like(y)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lora_linear(x, weight, *args, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):  # the split counters must be back at zero after each replay
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)


@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_gemm_default_configs_on_llama_shapes(num_tokens):
    """The default configurations on full Llama-3-8B layers: q/k/v and down (K split)."""
    for in_features, out_features in ((4096, 6144), (14336, 4096)):
        x = torch.randn(num_tokens, in_features, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / 64
        y = gemm(x, weight)
        expected = x.float() @ weight.float().T
        err = ((y.float() - expected).norm() / expected.norm()).item()
        assert err < 1e-2, (gemm_config(num_tokens, weight), err)
