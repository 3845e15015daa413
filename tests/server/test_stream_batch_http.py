"""Continuous batching seen from HTTP: many streams with mixed max_tokens, n, stop strings and logprobs, some cut off by their client,
each end with one finish_reason per choice and usage equal to the tokens they streamed."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from .conftest import serve_tiny_llama

ML = 96


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters, max_num_seqs=4, max_model_len=ML) as server:
        yield server


async def sse(c: httpx.AsyncClient, path: str, body: dict, cut: int | None = None):
    """The chunks of a stream (None when `cut` chunks were read and the client left)."""
    out = []
    async with c.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return out
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
                if cut and len(out) >= cut:
                    return None
    raise AssertionError("no [DONE]")


async def one(c: httpx.AsyncClient, rng: random.Random, i: int, problems: list) -> None:
    chat = rng.random() < 0.4
    n = rng.choice([1, 1, 2, 3, 5])
    plen = rng.randrange(1, 40)
    # Some fill the context exactly (a chat prompt has a few template tokens more).
    mt = min(rng.randrange(1, 40), ML - plen - 8) if rng.random() < 0.8 else ML - plen - (8 if chat else 1)
    body = {"model": "tiny-llama", "max_tokens": mt, "n": n, "temperature": rng.choice([0, 1.0]), "seed": i}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.4:
        body["stop"] = [rng.choice([" the", "a", "e ", "\n", "or"])]
    if rng.random() < 0.3:
        body["stop_token_ids"] = [rng.randrange(3, 320)]
    logprobs = rng.random() < 0.5
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "x" * max(1, plen - 8)}]
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": 1}
    else:
        path = "/v1/completions"
        body["prompt"] = [1] + [rng.randrange(3, 320) for _ in range(plen - 1)]
        if logprobs:
            body["logprobs"] = 1
    chunks = await sse(c, path, body, cut=rng.randrange(1, 6) if rng.random() < 0.2 else None)
    if chunks is None:
        return
    reasons, tokens = {}, {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            k = ch["index"]
            if ch["finish_reason"]:
                reasons.setdefault(k, []).append(ch["finish_reason"])
            if ch.get("logprobs"):
                tokens[k] = tokens.get(k, 0) + len(ch["logprobs"]["content" if chat else "tokens"])
    usage = chunks[-1].get("usage")
    if sorted(reasons) != list(range(n)) or any(len(v) != 1 or v[0] not in ("stop", "length") for v in reasons.values()):
        problems.append(("finish reasons", reasons, body))
    if usage is None or usage["completion_tokens"] > n * mt:
        problems.append(("usage", usage, body))
    elif logprobs and sum(tokens.values()) != usage["completion_tokens"]:
        problems.append(("streamed tokens != usage", tokens, usage, body))
    for k, (reason,) in reasons.items():
        if logprobs and reason == "length" and tokens.get(k) != mt:
            problems.append(("length before max_tokens", tokens.get(k), body))


def test_many_mixed_streams_end_cleanly(served):
    engine = served.engine
    problems: list = []

    async def main():
        rng = random.Random(1)
        async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            for wave in range(3):
                await asyncio.gather(*[one(c, rng, wave * 100 + i, problems) for i in range(20)])

    asyncio.run(main())
    assert not problems, problems[:5]
    deadline = time.monotonic() + 5
    while (engine.scheduler.running or engine.scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.scheduler.running and not engine.scheduler.waiting and engine.kv.num_free == engine.kv.rows
