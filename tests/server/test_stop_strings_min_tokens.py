"""min_tokens holds off stop strings as it holds off EOS and stop_token_ids (vLLM's rule:
stop strings are looked for only once more than min_tokens tokens are out, and then only in
text that ends in the new tokens): a client asking for at least N tokens gets them."""

from __future__ import annotations

import pytest

from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams


class CharTokenizer:
    """Token id i is chr(i)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def run(params: SamplingParams, text: str) -> tuple[str, Request]:
    req = Request.new("r", [1, 2], params, None, 0, CharTokenizer())
    out = ""
    for ch in text:
        if req.finished:
            break
        req.append(ord(ch), (), 1000)
        out += req.take_output().text
    return out, req


def test_a_stop_string_inside_the_min_tokens_does_not_end_the_request():
    out, req = run(SamplingParams(max_tokens=6, min_tokens=4, stop=["b"]), "abcdefgh")
    assert len(req.output_ids) == 6 and req.finish_reason == "length" and out == "abcdef"


def test_a_stop_string_after_the_min_tokens_still_ends_it():
    out, req = run(SamplingParams(max_tokens=10, min_tokens=2, stop=["d"]), "abcdefgh")
    assert req.finish_reason == "stop" and out == "abc" and len(req.output_ids) == 4


def test_a_stop_string_that_the_first_token_past_min_tokens_completes_counts():
    # "bc" begins inside the min_tokens and ends on the 3rd token: found, as in vLLM.
    out, req = run(SamplingParams(max_tokens=10, min_tokens=2, stop=["bc"]), "abcdefgh")
    assert req.finish_reason == "stop" and out == "a" and len(req.output_ids) == 3


def test_an_old_whole_stop_string_is_not_found_later():
    # "ab" was out whole during the min_tokens: later tokens do not end the request on it.
    out, req = run(SamplingParams(max_tokens=5, min_tokens=2, stop=["ab"]), "abcde")
    assert req.finish_reason == "length" and out == "abcde"


def test_no_min_tokens_is_unchanged():
    out, req = run(SamplingParams(max_tokens=10, stop=["b"]), "abcdefgh")
    assert req.finish_reason == "stop" and out == "a" and len(req.output_ids) == 2


def test_min_tokens_holds_off_a_stop_string_over_http_streamed_and_not(served):
    import json

    import httpx

    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8], "temperature": 0, "ignore_eos": True, "max_tokens": 8}
    with httpx.Client(base_url=served.url, timeout=60) as c:
        free = c.post("/v1/completions", json=body | {"logprobs": 0}).json()["choices"][0]
        first = free["logprobs"]["tokens"][0]
        assert first, free  # its first token's text: a stop string that the first token completes
        stopped = c.post("/v1/completions", json=body | {"stop": [first]}).json()
        assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
        for stream in (False, True):
            held = c.post("/v1/completions", json=body | {"stop": [first], "min_tokens": 3, "stream": stream,
                                                        "stream_options": {"include_usage": True} if stream else None})
            if stream:
                chunks = [json.loads(line[6:]) for line in held.text.splitlines() if line.startswith("data: {")]
                usage = chunks[-1]["usage"]
                text = "".join(ch["text"] for c_ in chunks for ch in c_["choices"])
            else:
                usage, text = held.json()["usage"], held.json()["choices"][0]["text"]
            assert usage["completion_tokens"] >= 3, held.text
            assert text.startswith(first)



@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    from .conftest import serve_tiny_llama

    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server
