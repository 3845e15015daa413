"""Paging must never change an answer: greedy completions for the tiny Llama's PEFT adapters
and the base, sent all at once to a server with one GPU slot (so adapters are evicted and
loaded again between and beside other requests), equal the same requests answered one by
one with every adapter resident: the same tokens, and logprobs within float32 noise. A slot
reused before its last request left, or a request admitted before its adapter's copy landed,
would show here as a different continuation."""

from __future__ import annotations

import asyncio
import random

import httpx

from .conftest import ADAPTERS, serve_tiny_llama


async def answers(url: str, cases: list, together: bool) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(model, prompt, n, delay):
            await asyncio.sleep(delay if together else 0)
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "logprobs": 0})
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            return lp["tokens"], lp["token_logprobs"]
        if together:
            return await asyncio.gather(*[one(*case) for case in cases])
        return [await one(*case) for case in cases]


def test_greedy_answers_under_paging_equal_answers_alone(hf_llama, llama_adapters):
    # Synchronous (asyncio.run), so it also runs where pytest-asyncio is not installed.
    rng = random.Random(4)
    models = ["tiny-llama", *ADAPTERS]
    cases = [(rng.choice(models), [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))],
              rng.randint(1, 24), rng.random() * 0.5) for _ in range(48)]
    with serve_tiny_llama(hf_llama, llama_adapters, max_loras=len(ADAPTERS), max_num_seqs=1) as server:
        alone = asyncio.run(answers(server.url, cases, together=False))
    with serve_tiny_llama(hf_llama, llama_adapters, max_loras=1, max_num_seqs=8, max_concurrent_loads=1) as server:
        paged = asyncio.run(answers(server.url, cases, together=True))
        evictions = server.engine.adapters.metrics.evictions.labels("gpu")._value.get()
    assert evictions >= 3  # adapters really went in and out of the one slot
    for case, (tokens, lps), (want_tokens, want_lps) in zip(cases, paged, alone):
        assert tokens == want_tokens, case[:3]
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4, case[:3]
