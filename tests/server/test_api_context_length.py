"""A request longer than the context is a 400 with OpenAI's code `context_length_exceeded`,
the parameter to shorten, and the wording OpenAI and vLLM use ("This model's maximum context
length is N tokens. However, you requested ..."). Tools that trim a conversation and retry
(LiteLLM's ContextWindowExceededError, LangChain's) recognise the overflow by that code or
that sentence; the engine's own message ("the prompt has N tokens; this model's maximum
context length ...", code null) was taken for any other bad request."""

from __future__ import annotations

import httpx
import openai
import pytest

from .test_http import error_of

MSGS = [{"role": "user", "content": "hi"}]  # 7 tokens with the demo chat template


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [5] * 600}, "prompt"),
    ("/v1/completions", {"prompt": [[5] * 3, [5] * 256]}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, "messages"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 600}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 600}, "max_completion_tokens"),
])
def test_a_request_past_the_context_says_so_as_openai_does(served, path, body, param):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for stream in (False, True):
            r = c.post(path, json={"model": "qv-r8", "stream": stream, **body})
            assert r.status_code == 400, r.text
            error = error_of(r)
            assert error["code"] == "context_length_exceeded" and error["param"] == param, error
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith("This model's maximum context length is 256 tokens. However, ")
    assert not served.engine.has_work()


def test_the_message_counts_the_tokens(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"model": "qv-r8", "messages": MSGS, "max_tokens": 600})
        assert "you requested 607 tokens (7 in the messages, 600 in the completion)" in error_of(r)["message"]
        r = c.post("/v1/completions", json={"model": "qv-r8", "prompt": [5] * 10, "max_tokens": 300})
        assert "you requested 310 tokens (10 in the prompt, 300 in the completion)" in error_of(r)["message"]
        r = c.post("/v1/completions", json={"model": "qv-r8", "prompt": [5] * 600})
        assert "your prompt has 600 tokens" in error_of(r)["message"]
        # At the limit exactly, served.
        r = c.post("/v1/completions", json={"model": "qv-r8", "prompt": [5] * 250, "max_tokens": 6})
        assert r.status_code == 200, r.text


def test_the_official_client_sees_the_code(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qv-r8", messages=MSGS, max_tokens=600)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
