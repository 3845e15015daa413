"""POST /tokenize and POST /detokenize as vLLM serves them: the served model's own tokenizer,
a chat prompt rendered as /v1/chat/completions renders it, `model` checked as elsewhere, and
errors in the OpenAI shape."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ADAPTERS

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox"}]


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def test_a_prompt_is_tokenized_by_the_models_tokenizer(client, served):
    tok = served.engine.tokenizer
    r = client.post("/tokenize", json={"model": "tiny-llama", "prompt": "the quick fox"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("the quick fox") and body["tokens"][0] == tok.bos_token_id
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == served.engine.max_model_len == 256
    assert body["token_strs"] is None
    plain = client.post("/tokenize", json={"prompt": "the quick fox", "add_special_tokens": False,
                                           "return_token_strs": True}).json()
    assert plain["tokens"] == body["tokens"][1:]  # no BOS; `model` left out: the base
    assert plain["token_strs"] == [tok.id_to_token(i) for i in plain["tokens"]] and "".join(plain["token_strs"])


def test_a_chat_is_tokenized_as_chat_completions_prompts_it(client):
    r = client.post("/tokenize", json={"model": "tiny-llama", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    count = r.json()["count"]
    chat = client.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == count
    # Without the assistant turn's opening, the prompt is shorter.
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < count and r.json()["tokens"][:bare["count"]] == bare["tokens"]
    r = client.post("/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = client.post("/tokenize", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_detokenize_is_the_inverse_and_keeps_special_tokens(client, served):
    tok = served.engine.tokenizer
    ids = tok.encode("the quick fox")
    r = client.post("/detokenize", json={"model": next(iter(ADAPTERS)), "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "<s>the quick fox"}  # BOS's text kept, as vLLM's decode keeps it
    for bad in ([5, 320], [-1]):
        r = client.post("/detokenize", json={"tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_an_unknown_model_or_a_body_of_neither_kind_is_refused(client):
    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope", "tokens": [1]})):
        r = client.post(path, json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = client.post("/tokenize", json={"model": "tiny-llama"})
    assert r.status_code in (400, 422) and "error" in r.json()
    r = client.post("/detokenize", json={"tokens": "12"})
    assert r.status_code in (400, 422) and "error" in r.json()
