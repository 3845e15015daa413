"""A request that ends on a stop token (one of `stop_token_ids`, or EOS) leaves that token's
text out of the answer, as vLLM does (its detokenizer skips the stop-terminating token unless
`include_stop_str_in_output`) and as stop strings are left out: the token is still counted and
still has its logprobs. EOS is a special token whose text is empty; a stop token id often is
not (a newline, a "###" a fine-tune ends its answers with)."""

from __future__ import annotations

import json

import httpx

from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams


class CharTokenizer:
    """Token id i is chr(i)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def run(params: SamplingParams, text: str, eos=()) -> tuple[list[str], Request]:
    req = Request.new("r", [1, 2], params, None, 0, CharTokenizer())
    deltas = []
    for ch in text:
        if req.finished:
            break
        req.append(ord(ch), eos, 1000)
        deltas.append(req.take_output().text)
    return deltas, req


def test_a_stop_token_id_ends_the_text_before_its_own_text():
    deltas, req = run(SamplingParams(max_tokens=100, stop_token_ids=[ord("\n")]), "one line\nnext")
    assert req.finish_reason == "stop" and "".join(deltas) == "one line"
    assert req.output_ids == [ord(c) for c in "one line\n"]  # counted: it was generated


def test_an_eos_that_has_text_is_left_out_too_and_ignore_eos_keeps_it():
    deltas, req = run(SamplingParams(max_tokens=100), "abc#def", eos=(ord("#"),))
    assert req.finish_reason == "stop" and "".join(deltas) == "abc"
    deltas, req = run(SamplingParams(max_tokens=7, ignore_eos=True), "abc#def", eos=(ord("#"),))
    assert req.finish_reason == "length" and "".join(deltas) == "abc#def"


def test_a_stop_token_after_held_back_text_releases_what_was_held():
    # "en" could begin the stop string "end": held back, then the stop token ends the request.
    deltas, req = run(SamplingParams(max_tokens=100, stop=["end"], stop_token_ids=[ord("|")]), "the en|d")
    assert req.finish_reason == "stop" and "".join(deltas) == "the en"


def sse_text(r: httpx.Response, chat: bool) -> tuple[str, list[str]]:
    """The streamed text and the finish reasons of a one-choice SSE response."""
    text, reasons = "", []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
                reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
    return text, reasons


def test_a_stop_token_id_over_http_streamed_and_not(served):
    """Every id a stop token: the first token ends the request, and the answer has no text
    (its first token's text, without the stop, is not empty)."""
    every = list(range(served.engine.cfg.vocab_size))
    for path, body, chat in (
            ("/v1/completions", {"prompt": "The quick brown fox"}, False),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}, True)):
        body = body | {"model": "qv-r8", "max_tokens": 1, "temperature": 0}
        with httpx.Client(base_url=served.url, timeout=60) as c:
            free = c.post(path, json=body).json()["choices"][0]
            assert (free["message"]["content"] if chat else free["text"]).strip(), free
            stopped = c.post(path, json=body | {"max_tokens": 4, "stop_token_ids": every,
                                                "logprobs": True if chat else 0}).json()
            choice = stopped["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert (choice["message"]["content"] if chat else choice["text"]) == ""
            assert stopped["usage"]["completion_tokens"] == 1  # generated, counted, and scored:
            assert len(choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]) == 1
            r = c.post(path, json=body | {"max_tokens": 4, "stop_token_ids": every, "stream": True})
            assert sse_text(r, chat) == ("", ["stop"])
