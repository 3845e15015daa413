"""vLLM's `prompt_logprobs` on completions and chat: each prompt token's logprob and rank,
and the k most likely tokens there, against HF transformers (+ peft) over the same prompt;
apart from echo's logprobs, refused with a stream as vLLM refuses it."""

from __future__ import annotations

import httpx
import pytest

from .test_echo import hf_prompt_logprobs
from .test_logprobs import ATOL

IDS = [1, 17, 40, 9, 120, 33, 71]


def post(served, path: str, **body) -> httpx.Response:
    return httpx.post(served.url + path, timeout=60, json={"temperature": 0, "max_tokens": 2, **body})


def check(entries: list, ids: list[int], k: int, ref) -> None:
    """entries: the response's prompt_logprobs; ref: HF's log_softmax over the prompt."""
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        want = ref[p - 1]
        entry = entries[p]
        own = entry[str(ids[p])]
        assert own["logprob"] == pytest.approx(want[ids[p]].item(), abs=ATOL), p
        assert own["rank"] == int((want >= want[ids[p]]).sum())  # vLLM's: tokens at least as likely
        best = want.topk(k).indices.tolist()
        assert set(entry) == {str(ids[p]), *map(str, best)}, p
        for r, t in enumerate(best, 1):
            assert entry[str(t)]["logprob"] == pytest.approx(want[t].item(), abs=ATOL)
            if t != ids[p]:
                assert entry[str(t)]["rank"] == r
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


@pytest.mark.parametrize("model, adapter", [("tiny-llama", None), ("all-r16", "all-r16")])
def test_completions_prompt_logprobs_match_hf(served, hf_llama, llama_adapters, model, adapter):
    r = post(served, "/v1/completions", model=model, prompt=IDS, prompt_logprobs=3, n=2, seed=1, temperature=1.0)
    assert r.status_code == 200, r.text
    ref = hf_prompt_logprobs(hf_llama, llama_adapters.get(adapter), IDS)
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:  # each choice carries its prompt's, as vLLM's
        check(choice["prompt_logprobs"], IDS, 3, ref)
        assert choice["logprobs"] is None  # not asked: prompt_logprobs is apart from logprobs
    # Not asked: no such key; asked with 0: the prompt tokens alone.
    assert "prompt_logprobs" not in post(served, "/v1/completions", model=model, prompt=IDS).json()["choices"][0]
    zero = post(served, "/v1/completions", model=model, prompt=IDS, prompt_logprobs=0).json()["choices"][0]
    assert [list(e) if e else e for e in zero["prompt_logprobs"]] == [None, *([str(t)] for t in IDS[1:])]


def test_echo_keeps_its_own_number_of_alternatives_beside_prompt_logprobs(served):
    r = post(served, "/v1/completions", model="tiny-llama", prompt=IDS, echo=True, logprobs=1, prompt_logprobs=4,
             max_tokens=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    top = choice["logprobs"]["top_logprobs"]
    assert top[0] is None and all(1 <= len(t) <= 2 for t in top[1:])  # echo's 1, plus the prompt token
    assert all(len(e) >= 4 for e in choice["prompt_logprobs"][1:])


def test_chat_prompt_logprobs_cover_the_rendered_prompt(served, hf_llama):
    messages = [{"role": "user", "content": "the quick fox"}]
    ids = httpx.post(served.url + "/tokenize", timeout=60, json={"messages": messages}).json()["tokens"]
    r = post(served, "/v1/chat/completions", model="tiny-llama", messages=messages, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    check(r.json()["prompt_logprobs"], ids, 2, hf_prompt_logprobs(hf_llama, None, ids))


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": IDS}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_prompt_logprobs_out_of_bounds_or_with_a_stream_are_refused(served, path, extra):
    for value in (21, -1):
        r = post(served, path, model="tiny-llama", prompt_logprobs=value, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    r = post(served, path, model="tiny-llama", prompt_logprobs=1, stream=True, **extra)
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"], r.text
    with httpx.stream("POST", served.url + path, timeout=60,
                      json={"model": "tiny-llama", "max_tokens": 2, "prompt_logprobs": 0, "stream": True, **extra}) as s:
        assert s.status_code == 200 and any(line.startswith("data: [DONE]") for line in s.iter_lines())
