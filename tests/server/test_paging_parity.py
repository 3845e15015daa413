"""Paging must never change an answer: greedy completions for the tiny Llama's PEFT adapters
and the base, arriving over many steps at an engine with one GPU slot (so adapters are
evicted and loaded again between and beside other requests), equal the same requests answered
one by one with every adapter resident: the same tokens, and logprobs within float32 noise.
A slot reused before its last request left, or a request admitted before its adapter's copy
landed, would show here as a different continuation.

Driven at the engine (no HTTP), so it runs on the GPU machine too, where the server's web
stack is not installed: there the loads go through pinned host copies and a side stream,
and decode replays CUDA graphs."""

from __future__ import annotations

import random
import time

import pytest
import torch

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

from .conftest import ADAPTERS


def engine_for(hf_llama, llama_adapters, device: str, **overrides) -> LLMEngine:
    fields = dict(model=str(hf_llama), served_model_name="tiny-llama", device=device, dtype="float32",
                  max_num_seqs=8, max_model_len=256, max_lora_rank=16,
                  lora_modules=[f"{n}={p}" for n, p in llama_adapters.items()])
    return LLMEngine.from_settings(ServerSettings(**(fields | overrides)))


def answer(engine: LLMEngine, cases: list, together: bool, timeout: float = 120) -> list:
    """Each case (adapter or None, prompt, max_tokens, arrival step): its tokens and logprobs.
    Together: each request joins at its arrival step; else one at a time, each run to its end."""
    deadline = time.monotonic() + timeout
    reqs = [None] * len(cases)

    def make(i):
        adapter, prompt, n, _ = cases[i]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
        reqs[i] = engine.make_request(prompt, params, adapter=adapter)
        engine.add_request(reqs[i])

    def run_until(done, step=0):
        while not done(step):
            assert time.monotonic() < deadline, "requests did not finish"
            if together:
                for i, case in enumerate(cases):
                    if case[3] == step:
                        make(i)
            engine.step()
            step += 1
            if engine.stalled:
                time.sleep(0.001)

    if together:
        last = max(c[3] for c in cases)
        run_until(lambda step: step > last and all(r.finished for r in reqs))
    else:
        for i in range(len(cases)):
            make(i)
            run_until(lambda step: reqs[i].finished)
    for r in reqs:
        assert r.finish_reason == "length", r.error
    return [(r.output_ids, [lp.logprob for lp in r.output_logprobs]) for r in reqs]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_greedy_answers_under_paging_equal_answers_alone(hf_llama, llama_adapters, device):
    rng = random.Random(4)
    models = [None, *ADAPTERS]
    cases = [(rng.choice(models), [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))],
              rng.randint(1, 24), rng.randrange(60)) for _ in range(48)]
    ref = engine_for(hf_llama, llama_adapters, device, max_loras=len(ADAPTERS), max_num_seqs=1)
    try:
        alone = answer(ref, cases, together=False)
    finally:
        ref.adapters.close()
    engine = engine_for(hf_llama, llama_adapters, device, max_loras=1, max_num_seqs=8, max_concurrent_loads=1)
    try:
        paged = answer(engine, cases, together=True)
        assert engine.adapters.metrics.evictions.labels("gpu")._value.get() >= 3  # paged through the one slot
    finally:
        engine.adapters.close()
    for case, (tokens, lps), (want_tokens, want_lps) in zip(cases, paged, alone):
        assert tokens == want_tokens, case[:3]
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4, case[:3]
