"""On a CUDA device only: CUDA-graph decode computes what eager decode computes, step after
step, in a batch that mixes adapters and the base, as rows leave and KV lengths cross buckets.

tests/conftest.py sends Triton through its interpreter (for the CPU); on a GPU run these as
`TRITON_INTERPRET=0 pytest tests/server/test_cuda.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.server.adapters import AdapterId, random_adapter
from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interpreter on: set TRITON_INTERPRET=0"),
]


def build(dtype: str) -> LLMEngine:
    settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=160,
                              max_loras=4, max_lora_rank=16, kv_block=16, seed=3)
    engine = LLMEngine.from_settings(settings)
    for i in range(4):
        spec, tensors = random_adapter(engine.cfg, rank=8 + 2 * i, seed=i, device="cuda", dtype=engine.dtype)
        engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
    gen = torch.Generator().manual_seed(0)
    for i in range(7):
        prompt = torch.randint(3, engine.cfg.vocab_size, (5 + 7 * i,), generator=gen).tolist()
        adapter = None if i % 5 == 4 else f"a{i % 4}"
        params = SamplingParams(max_tokens=40 - 3 * i, temperature=0, ignore_eos=True)
        engine.add_request(engine.make_request(prompt, params, adapter))
    engine.step()  # prefill
    return engine


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_cuda_graph_decode_matches_eager(dtype, tol):
    engine = build(dtype)
    steps = 0
    while engine.has_work():
        running = {row: r for row, r in engine.scheduler.running.items()}
        span = engine.kv.span()
        graphed = engine.decoder.run(running, span).clone()
        eager = engine.decoder.rerun_eager()[:span]
        rows = list(running)
        assert torch.allclose(graphed[rows], eager[rows], atol=tol, rtol=tol), steps
        engine.step()
        steps += 1
    assert engine.decoder.num_graphs >= 3 and steps >= 30

