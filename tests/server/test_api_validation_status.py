"""A request body whose fields are wrong (a value out of range, a wrong type, a field missing)
is a 400 invalid_request_error naming the parameter, as OpenAI and vLLM answer it. It was a
422 (FastAPI's default), which the official client raises as UnprocessableEntityError, not
the BadRequestError that tools catch for a bad request, and which disagreed with this
server's own 400 for other out-of-range values (presence_penalty, logprobs)."""

from __future__ import annotations

import httpx
import openai
import pytest

from .test_http import error_of

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "temperature": 7}, "temperature"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "top_p": "high"}, "top_p"),
    ("/v1/completions", {"model": "tiny-llama"}, "prompt"),
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MSGS, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "bogus", "content": "x"}]},
     "messages.0.role"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
    ("/v1/unload_lora_adapter", {}, "lora_name"),
])
def test_a_body_with_wrong_fields_is_a_400_naming_the_parameter(served, path, body, param):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        error = error_of(r)
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert param in error["message"]


def test_the_official_client_raises_bad_request_for_them(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=MSGS, temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="x", n=0)
