"""--enable-prompt-tokens-details: a response's usage says how many prompt tokens the prefix
cache gave (`prompt_tokens_details.cached_tokens`, as vLLM and OpenAI put it), streamed or
not, for completions and chat; without the flag usage is as before."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import serve_tiny_llama

PROMPT = list(range(5, 45))  # 40 tokens: all but the last can be found (that one is prefilled)


@pytest.fixture(scope="module")
def detailed(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters, enable_prompt_tokens_details=True) as server:
        yield server


def _stream_usage(c: httpx.Client, path: str, body: dict) -> dict:
    with c.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: {")]
    return json.loads(lines[-1])["usage"]


def test_a_repeated_prompt_reports_the_tokens_it_found(detailed):
    body = {"model": "qv-r8", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=detailed.url, timeout=30) as c:
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = c.post("/v1/completions", json=body).json()
        assert second["usage"]["prompt_tokens"] == 40
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 39}
        assert second["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert _stream_usage(c, "/v1/completions", body)["prompt_tokens_details"] == {"cached_tokens": 39}
        # Another adapter's KV differs: nothing of this prompt is found for it.
        other = c.post("/v1/completions", json=body | {"model": "all-r16"}).json()
        assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # n choices: the prompt, and what was found of it, count once.
        n2 = c.post("/v1/completions", json=body | {"n": 2}).json()
        assert n2["usage"]["prompt_tokens"] == 40 and n2["usage"]["prompt_tokens_details"] == {"cached_tokens": 39}
        # Two prompts in one request: each one's own count, summed.
        two = c.post("/v1/completions", json=body | {"prompt": [PROMPT, PROMPT[:20] + [3] * 20]}).json()
        assert two["usage"]["prompt_tokens"] == 80
        assert two["usage"]["prompt_tokens_details"] == {"cached_tokens": 39 + 20}


def test_chat_turns_report_the_system_prompt_found(detailed):
    system = {"role": "system", "content": "You are a careful assistant who answers in one short line. " * 3}
    body = {"model": "qv-r8", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=detailed.url, timeout=30) as c:
        first = c.post("/v1/chat/completions", json=body | {"messages": [system, {"role": "user", "content": "a"}]})
        assert first.status_code == 200, first.text
        found = first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        usage = _stream_usage(c, "/v1/chat/completions", body | {"messages": [system, {"role": "user", "content": "b"}]})
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16 + found
        assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_without_the_flag_usage_has_no_details(served):
    body = {"model": "qv-r8", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for _ in range(2):
            usage = c.post("/v1/completions", json=body).json()["usage"]
            assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
