"""vLLM's min_p and min_tokens, and the vLLM / OpenAI fields this server does not implement:
refused when they would change the output, never silently dropped."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams, Sampler

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def draw(logits, params, seeds, banned=None):
    n = len(params)
    tokens, _ = Sampler().sample(logits, params, seeds, [0] * n, banned=banned)
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_keeps_the_tokens_at_least_that_likely_relative_to_the_best(device):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])  # min_p 0.4: the bar is 0.2, tokens 0 and 1 pass
    logits = probs.log()[None, :].repeat(400, 1).to(device)
    seeds = list(range(400))
    with_min_p = set(draw(logits, [SamplingParams(min_p=0.4)] * 400, seeds))
    without = set(draw(logits, [SamplingParams()] * 400, seeds))
    assert with_min_p == {0, 1}
    assert without == {0, 1, 2, 3}
    # With top_k 3 the bar is the same: relative to the most likely token.
    assert set(draw(logits, [SamplingParams(min_p=0.4, top_k=3)] * 400, seeds)) == {0, 1}
    # min_p comes before top_p, as in vLLM's sampler: top_p 0.6 then measures what min_p kept
    # (0.625 and 0.375), and keeps token 0 alone; top_p first would have kept tokens 0 and 1.
    assert set(draw(logits, [SamplingParams(min_p=0.4, top_p=0.6)] * 400, seeds)) == {0}
    assert set(draw(logits, [SamplingParams(top_p=0.6)] * 400, seeds)) == {0, 1}


@pytest.mark.parametrize("device", DEVICES)
def test_banned_tokens_are_not_sampled_and_ids_past_the_vocabulary_are_ignored(device):
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0]], device=device)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    assert draw(logits, params, [0, 1], banned=[(1,), ()]) == [3, 1]
    assert draw(logits, params, [0, 1], banned=[(1, 3, 99, -5), None]) == [2, 1]
    assert logits[0, 1] == 5.0  # the caller's logits (the graph's buffer) are left as they were


def test_a_request_bans_eos_and_stop_tokens_until_its_min_tokens():
    req = Request.new("r", [1, 2], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[7]), None, 0, None)
    assert set(req.banned_tokens((0,))) == {0, 7}
    req.append(5, (0,), 100)
    assert set(req.banned_tokens((0,))) == {0, 7}
    req.append(5, (0,), 100)
    assert req.banned_tokens((0,)) == ()
    ignoring = Request.new("s", [1], SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True, stop_token_ids=[7]),
                           None, 0, None)
    assert ignoring.banned_tokens((0,)) == (7,)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError):
        SamplingParams(min_p=1.5)


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    from .conftest import serve_tiny_llama

    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server


def complete(served, **body):
    import httpx

    return httpx.post(served.url + "/v1/completions", timeout=60,
                      json={"model": "tiny-llama", "prompt": [5, 6, 7, 8], "temperature": 0, **body})


def test_min_tokens_holds_off_a_stop_token_over_http(served):
    first = complete(served, max_tokens=1).json()["choices"][0]
    # The greedy first token, as a stop token: the reply ends at once ...
    tok = served.engine.tokenizer.encode(first["text"]) if first["text"] else None
    stopped = complete(served, max_tokens=6, stop_token_ids=tok, logprobs=0).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    # ... unless min_tokens asks for more first; then that token is never the first three.
    held = complete(served, max_tokens=6, min_tokens=3, stop_token_ids=tok, logprobs=0).json()
    assert held["usage"]["completion_tokens"] >= 3, held
    assert held["choices"][0]["logprobs"]["tokens"][0] != first["text"]
    r = complete(served, max_tokens=2, min_tokens=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize(("field", "value"), [
    ("structured_outputs", {"whitespace_pattern": " "}), ("use_beam_search", True),
    ("functions", [{"name": "f"}]), ("logits_processors", ["p"]), ("truncate_prompt_tokens", 4),
])
def test_unimplemented_fields_are_refused_naming_themselves_over_http(served, field, value):
    r = complete(served, max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]
    import httpx

    chat = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == field


def test_neutral_values_of_those_fields_and_min_p_are_served_over_http(served):
    r = complete(served, max_tokens=2, skip_special_tokens=True, include_stop_str_in_output=False, bad_words=[],
                 guided_json=None, use_beam_search=False, length_penalty=1.0, some_unknown_field=3,
                 temperature=0.8, seed=1, min_p=0.1)
    assert r.status_code == 200, r.text
    r = complete(served, max_tokens=2, min_p=1.5)
    assert r.status_code in (400, 422)
