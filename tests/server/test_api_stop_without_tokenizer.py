"""A server without a tokenizer (token-id prompts only) has no text to match a stop string
against: a request with one is a 400 naming `stop`, not one that silently runs on to
max_tokens and reports "length"; stop_token_ids still work there."""

from __future__ import annotations

import httpx
import pytest

from loraplex.server.api.app import create_app
from loraplex.server.engine import LLMEngine
from loraplex.server.settings import ServerSettings


@pytest.fixture(scope="module")
def bare():
    from .conftest import LiveServer

    engine = LLMEngine.from_settings(ServerSettings(dummy_weights="tiny", device="cpu", dtype="float32",
                                                    max_num_seqs=2, max_model_len=64))
    assert engine.tokenizer is None
    with LiveServer(create_app(engine)) as server:
        server.engine = engine
        yield server


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_without_a_tokenizer_are_refused(bare, stream):
    r = httpx.post(bare.url + "/v1/completions", timeout=30, json={
        "model": bare.engine.model_name, "prompt": [1, 2, 3], "max_tokens": 5, "stop": ["a"], "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop"
    assert not bare.engine.scheduler.running and not bare.engine.scheduler.waiting


def test_stop_token_ids_and_empty_stops_without_a_tokenizer_still_work(bare):
    body = {"model": bare.engine.model_name, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    free = httpx.post(bare.url + "/v1/completions", timeout=30, json=body).json()["choices"][0]
    assert free["finish_reason"] == "length"
    first = int(free["logprobs"]["tokens"][0].split(":")[1])
    stopped = httpx.post(bare.url + "/v1/completions", timeout=30,
                         json=body | {"stop_token_ids": [first], "stop": [""]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
