"""Bugs found in the HTTP layer, each shown over HTTP as a client meets it: a validation
error's `param` names the request's field (not pydantic's name for a member of a union
type), and logprobs with skip_special_tokens false spell special tokens as the text does."""

from __future__ import annotations

import json

import httpx
import pytest

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path, body, param", [
    # Fields whose type is a union (str | list[str] | ...): pydantic names each member in the
    # error's location ("prompt.str", "stop.list[str]"), which is no parameter of the API.
    ("/v1/completions", {"model": "tiny-llama", "prompt": [1, [2]]}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "stop": 5}, "stop"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    # /tokenize's body is a prompt's or a chat's: the one the body is, by its "messages".
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"model": 3, "prompt": "x"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
])
def test_a_union_fields_error_names_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for internal in ("Tokenize", "list[", ".str", "TextContent"):
        assert internal not in error["message"], error["message"]


def test_logprob_tokens_keep_special_tokens_text_with_skip_special_tokens_false(client, served):
    """The text keeps </s> with skip_special_tokens false; the logprobs' tokens (and chat's
    bytes) must too, or they no longer join into the text and text_offset points past the
    tokens it names, as vLLM's (which spell </s> either way) do not."""
    eos = served.engine.tokenizer.eos_token_id
    body = dict(model="tiny-llama", max_tokens=4, ignore_eos=True, allowed_token_ids=[eos, 40],
                temperature=1.0, seed=1, skip_special_tokens=False)
    r = client.post("/v1/completions", json=body | {"prompt": "the", "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert "</s>" in text, text  # the seed's draw holds EOS
    assert "".join(lp["tokens"]) == text
    assert all(text[at:].startswith(t) for at, t in zip(lp["text_offset"], lp["tokens"])), lp
    r = client.post("/v1/chat/completions", json=body | {"messages": MSGS, "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    # skip_special_tokens left at true: no text for </s>, in the text or in the logprobs.
    r = client.post("/v1/completions", json=body | {"prompt": "the", "logprobs": 0, "skip_special_tokens": True})
    choice = r.json()["choices"][0]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"] and "</s>" not in choice["text"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["the quick", [1, 79, 6]])
def test_echoed_logprobs_join_into_the_echoed_text_with_skip_special_tokens_false(client, served, prompt, stream):
    """The echoed prompt is its text (as sent, or its ids decoded), which has no BOS: its
    tokens are spelled so, whatever skip_special_tokens says of the output's."""
    eos = served.engine.tokenizer.eos_token_id
    body = dict(model="tiny-llama", prompt=prompt, echo=True, logprobs=1, max_tokens=4, ignore_eos=True,
                allowed_token_ids=[eos, 40], temperature=1.0, seed=1, skip_special_tokens=False, stream=stream)
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        lp = {key: [v for e in events for v in e["choices"][0]["logprobs"][key]] for key in ("tokens", "text_offset")}
    else:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text, lp = r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]
    assert text.endswith("</s>") or "</s>" in text, text
    assert "".join(lp["tokens"]) == text, (lp["tokens"], text)
    assert all(text[at:].startswith(t) for at, t in zip(lp["text_offset"], lp["tokens"])), lp


def test_an_unknown_model_is_a_404_before_any_value_is_checked(served):
    """vLLM looks the model up first: a request for a model that does not exist is a 404,
    whatever else it gets wrong (here a token outside the vocabulary)."""
    import httpx

    for path, body in (("/v1/completions", {"prompt": [5, 6]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(served.url + path, timeout=60,
                       json={"model": "no-such-model", "allowed_token_ids": [10**6], "max_tokens": 2, **body})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_stream_options_without_a_stream_are_refused_as_vllm_refuses_them(served):
    import httpx

    for path, body in (("/v1/completions", {"prompt": [5, 6]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(served.url + path, timeout=60, json={"model": "tiny-llama", "max_tokens": 2,
                                                             "stream_options": {"include_usage": True}, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        # Empty options, or none, are fine without a stream.
        for options in ({}, None):
            r = httpx.post(served.url + path, timeout=60, json={"model": "tiny-llama", "max_tokens": 2,
                                                                 "stream_options": options, **body})
            assert r.status_code == 200, r.text
