"""On a CUDA device only: CUDA-graph decode computes what eager decode computes, step after
step, in a batch that mixes adapters and the base, as rows leave and KV lengths cross buckets."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.adapters import AdapterId, random_adapter
from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def build(dtype: str, lora_overlap: bool) -> LLMEngine:
    settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=160,
                              max_loras=4, max_lora_rank=16, kv_block=16, seed=3, lora_overlap=lora_overlap)
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


@pytest.mark.parametrize("lora_overlap", [True, False])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_cuda_graph_decode_matches_eager(dtype, tol, lora_overlap):
    engine = build(dtype, lora_overlap)
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


def test_side_stream_lora_matches_one_stream():
    one, two = build("float32", False), build("float32", True)
    assert two.model._side_stream is not None and one.model._side_stream is None
    for _ in range(3):
        a = one.decoder.run(dict(one.scheduler.running), one.kv.span()).clone()
        b = two.decoder.run(dict(two.scheduler.running), two.kv.span())
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
        one.step()
        two.step()
