"""vLLM's allowed_token_ids, bad_words, include_stop_str_in_output and skip_special_tokens:
each as vLLM applies it, on the parts (Request, Sampler, the tokenizer) and over HTTP."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams, Sampler
from loraplex.server.tokenizer import IncrementalDetokenizer, Tokenizer, bad_words_token_ids

from .test_min_p_min_tokens import complete
from .test_stop_strings_min_tokens import CharTokenizer, run

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


# -- include_stop_str_in_output ------------------------------------------------------------


def test_the_stop_string_stays_in_the_text_with_include_stop_str_in_output():
    out, req = run(SamplingParams(max_tokens=20, stop=["cd"], include_stop_str_in_output=True), "abcdefg")
    assert (out, req.finish_reason, len(req.output_ids)) == ("abcd", "stop", 4)
    out, _ = run(SamplingParams(max_tokens=20, stop=["cd"]), "abcdefg")
    assert out == "ab"
    # Of two stop strings the first in the text ends it, whichever the list names first.
    out, _ = run(SamplingParams(max_tokens=20, stop=["ef", "bc"], include_stop_str_in_output=True), "abcdefg")
    assert out == "abc"


def test_streamed_text_is_not_held_back_when_the_stop_string_stays_in_it():
    def deltas(params):
        req = Request.new("r", [1], params, None, 0, CharTokenizer())
        got = []
        for ch in "abxab":
            req.append(ord(ch), (), 1000)
            got.append(req.take_output().text)
        return got

    # "ab" could begin "abc": held back without the flag, sent as it comes with it.
    assert deltas(SamplingParams(max_tokens=5, stop=["abc"])) == ["", "", "abx", "", "ab"]
    assert deltas(SamplingParams(max_tokens=5, stop=["abc"], include_stop_str_in_output=True)) == \
        ["a", "b", "x", "a", "b"]


def test_a_stop_tokens_text_stays_in_with_include_stop_str_in_output():
    for include, text in ((False, "ab"), (True, "abx")):
        req = Request.new("r", [1], SamplingParams(max_tokens=9, stop_token_ids=[ord("x")],
                                                   include_stop_str_in_output=include), None, 0, CharTokenizer())
        for ch in "abxyz":
            if req.finished:
                break
            req.append(ord(ch), (), 1000)
        assert (req.take_output().text, req.finish_reason) == (text, "stop")


# -- bad_words -------------------------------------------------------------------------------


def test_a_bad_words_last_token_is_banned_where_the_output_ends_in_the_rest_of_it():
    params = SamplingParams(max_tokens=9, bad_words_ids=[(5,), (7, 8), (1, 2, 3)])
    req = Request.new("r", [7, 1, 2], params, None, 0, None)  # the prompt does not count
    assert set(req.banned_tokens(())) == {5}
    for token, banned in ((7, {5, 8}), (1, {5}), (2, {5, 3}), (9, {5}), (7, {5, 8})):
        req.append(token, (), 1000)
        assert set(req.banned_tokens(())) == banned, req.output_ids
    # With min_tokens, both kinds of ban together.
    req = Request.new("s", [1], SamplingParams(max_tokens=9, min_tokens=2, bad_words_ids=[(5,)]), None, 0, None)
    assert set(req.banned_tokens((2,))) == {2, 5}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from loraplex.server.demo import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=320)
    return Tokenizer(path)


def test_bad_words_are_tokenized_as_written_and_after_a_space(tokenizer):
    sequences = bad_words_token_ids(tokenizer, ["  the", "quick fox", ""])
    plain = tuple(tokenizer.encode("the", add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" the", add_special_tokens=False))
    assert sequences[0] == plain and tokenizer.decode(list(plain)) == "the"
    # " the" is its own sequence only where it is as many tokens and starts on another one.
    assert (spaced in sequences) == (len(spaced) == len(plain) and spaced[0] != plain[0])
    assert tuple(tokenizer.encode("quick fox", add_special_tokens=False)) in sequences
    assert all(sequences)  # the empty word made none


# -- allowed_token_ids ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_allowed_tokens_are_sampled_and_logprobs_stay_raw(device):
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]], device=device).repeat(300, 1)
    sampler = Sampler()
    greedy, lps = sampler.sample(logits[:2], [SamplingParams(temperature=0, allowed_token_ids=[0, 2], logprobs=1),
                                              SamplingParams(temperature=0)], [0, 1], [0, 0])
    assert greedy == [2, 1]  # the best allowed one; the other row unchanged
    raw = torch.log_softmax(logits[0].float(), dim=-1)
    assert lps[0].logprob == pytest.approx(raw[2].item()) and lps[0].top[0][0] == 1  # of the model, not the mask
    drawn = set(sampler.sample(logits, [SamplingParams(allowed_token_ids=[0, 3, 99])] * 300, list(range(300)),
                               [0] * 300)[0])
    assert drawn == {0, 3}  # an id past the vocabulary is dropped (the API refuses it first)
    assert logits[0, 1] == 5.0  # the caller's logits (the graph's buffer) are left as they were
    with pytest.raises(ValueError):
        SamplingParams(allowed_token_ids=[])


# -- skip_special_tokens ----------------------------------------------------------------------


def test_special_tokens_text_is_kept_with_skip_special_tokens_false(tokenizer):
    ids = tokenizer.encode("the fox", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip, text in ((True, "the fox"), (False, "the fox</s>")):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        assert "".join(detok.add(i) for i in ids) + detok.flush() == text


# -- over HTTP (conftest's `served`: the tiny Llama and its adapters) ----------------------------


def output_ids(response) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def test_allowed_token_ids_over_http(served):
    free = output_ids(complete(served, max_tokens=6, logprobs=0, return_tokens_as_token_ids=True))
    allowed = sorted({free[0] + 1, 40, 41})
    r = complete(served, max_tokens=6, logprobs=0, return_tokens_as_token_ids=True, allowed_token_ids=allowed,
                 ignore_eos=True)
    assert r.status_code == 200, r.text
    assert set(output_ids(r)) <= set(allowed) and len(output_ids(r)) == 6
    for bad, words in (([], "at least one"), ([5, 320], "outside the vocabulary"), ([-1], "outside")):
        r = complete(served, max_tokens=2, allowed_token_ids=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        assert words in r.json()["error"]["message"]


def test_allowed_token_ids_that_leave_nothing_to_sample_are_a_400(served):
    """allowed_token_ids of EOS alone before min_tokens, or of a one-token bad word alone: no
    token may be sampled (the sampler would have drawn token 0, which was never allowed)."""
    eos = served.engine.eos_ids[0]
    r = complete(served, max_tokens=4, min_tokens=2, allowed_token_ids=[eos])
    assert r.status_code == 400 and "leaves no token" in r.json()["error"]["message"], r.text
    tok = served.engine.tokenizer
    word = next(w for t in range(40, 300) if (w := tok.decode([t])) == w.strip() and w.isalpha()
                and tok.encode(w, add_special_tokens=False) == [t])
    (t,) = tok.encode(word, add_special_tokens=False)
    r = complete(served, max_tokens=4, allowed_token_ids=[t], bad_words=[word])
    assert r.status_code == 400 and "bad word" in r.json()["error"]["message"], r.text
    # Another allowed token, or EOS with ignore_eos (not banned then): served.
    r = complete(served, max_tokens=2, min_tokens=2, allowed_token_ids=[eos, 40], logprobs=0,
                 return_tokens_as_token_ids=True)
    assert r.status_code == 200 and output_ids(r) == [40, 40], r.text
    r = complete(served, max_tokens=2, min_tokens=2, allowed_token_ids=[eos], ignore_eos=True)
    assert r.status_code == 200, r.text


def test_bad_words_over_http(served):
    tok = served.engine.tokenizer
    free = output_ids(complete(served, max_tokens=8, logprobs=0, return_tokens_as_token_ids=True, ignore_eos=True))
    word = tok.decode(free[1:3]).strip() or tok.decode(free[:1])
    banned = bad_words_token_ids(tok, [word])
    r = complete(served, max_tokens=8, logprobs=0, return_tokens_as_token_ids=True, ignore_eos=True, bad_words=[word])
    assert r.status_code == 200, r.text
    got = output_ids(r)
    for seq in banned:  # no banned sequence anywhere in the output
        assert not any(tuple(got[i:i + len(seq)]) == seq for i in range(len(got) - len(seq) + 1)), (seq, got)
    assert got != free  # the free output held one
    r = complete(served, max_tokens=2, bad_words=["x"] * 600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_include_stop_str_in_output_over_http_streamed_and_not(served):
    import httpx

    text = complete(served, max_tokens=10, ignore_eos=True).json()["choices"][0]["text"]
    assert len(text) >= 3, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    at = text.find(stop)
    for include, want in ((False, text[:at]), (True, text[:at + len(stop)])):
        body = dict(max_tokens=10, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        choice = complete(served, **body).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (want, "stop")
        with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                          json={"model": "tiny-llama", "prompt": [5, 6, 7, 8], "temperature": 0, "stream": True,
                                **body}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == want


def test_skip_special_tokens_over_http(served):
    """With ignore_eos the greedy output may hold </s>: its text is there only with
    skip_special_tokens false; a chat request takes the field too."""
    import httpx

    eos = served.engine.tokenizer.eos_token_id
    body = dict(max_tokens=6, ignore_eos=True, allowed_token_ids=[eos, 40], logit_bias={str(eos): 100})
    kept = complete(served, skip_special_tokens=False, **body).json()["choices"][0]["text"]
    skipped = complete(served, **body).json()["choices"][0]["text"]
    assert kept == "</s>" * 6 and skipped == ""
    chat = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "skip_special_tokens": False, **body})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "</s>" * 6, chat.text
