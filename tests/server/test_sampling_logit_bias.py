"""OpenAI's logit_bias, as OpenAI and vLLM define it: {token id: bias in [-100, 100]} added
to the logits before sampling, per request inside a mixed batch (rows without a bias as
they were, greedy and sampled); logprobs stay the raw logits' (vLLM's default), and bad input
is a 400 naming logit_bias."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from loraplex.server.engine import LLMEngine, RequestError
from loraplex.server.sampling import MAX_LOGIT_BIAS, Sampler, SamplingParams
from loraplex.server.settings import ServerSettings

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
SEEDS = list(range(300))


def draw(logits, params, rows=None):
    n = len(params)
    return Sampler().sample(logits, params, SEEDS[:n], [0] * n, rows)


@pytest.mark.parametrize("device", DEVICES)
def test_plus_100_takes_the_token_and_minus_100_never_samples_it(device):
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]], device=device)
    before = logits.clone()
    greedy = SamplingParams(temperature=0)
    assert draw(logits, [greedy])[0] == [1]
    assert draw(logits, [SamplingParams(temperature=0, logit_bias={0: 100.0})])[0] == [0]
    assert draw(logits, [SamplingParams(temperature=0, logit_bias={1: -100.0})])[0] == [3]
    # Sampled: the banned token is never drawn, in 300 seeds at a high temperature.
    many = logits.repeat(300, 1)
    free = set(draw(many, [SamplingParams(temperature=2.0)] * 300)[0])
    banned = draw(many, [SamplingParams(temperature=2.0, logit_bias={1: -100.0, 3: -100})] * 300)[0]
    assert 1 in free and 3 in free and set(banned) == {0, 2}
    forced = draw(many, [SamplingParams(temperature=2.0, logit_bias={2: 100})] * 300)[0]
    assert set(forced) == {2}
    assert torch.equal(logits, before)  # the caller's logits (the graph's buffer) are left as they were


@pytest.mark.parametrize("device", DEVICES)
def test_biased_and_unbiased_rows_in_one_batch_each_sample_as_alone(device):
    torch.manual_seed(3)
    logits = torch.randn(6, 50, device=device) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.9, seed=2, logit_bias={7: 100}),
              SamplingParams(temperature=0.9, top_p=0.8, seed=3), SamplingParams(temperature=0, logit_bias={})]
    seeds = [11, 12, 13, 14, 15, 16]
    together, _ = Sampler().sample(logits, params, seeds, [4] * 6)
    alone = [Sampler().sample(logits[i:i + 1], [p], [seeds[i]], [4])[0][0] for i, p in enumerate(params)]
    assert together == alone
    assert together[1] == together[3] == 7
    # The unbiased rows are what they are with no bias anywhere in the batch.
    plain = [SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=p.seed) for p in params]
    unbiased, _ = Sampler().sample(logits, plain, seeds, [4] * 6)
    assert [together[i] for i in (0, 2, 4, 5)] == [unbiased[i] for i in (0, 2, 4, 5)]
    # Rows of a bigger logits tensor (the decode graph's bucket) bias only the row asked.
    big = torch.zeros(4, 50, device=device)
    tokens, _ = Sampler().sample(big, [SamplingParams(temperature=0, logit_bias={9: 5.0}),
                                       SamplingParams(temperature=0)], [0, 0], [0, 0], [2, 0])
    assert tokens == [9, 0]


def test_bias_comes_before_the_penalties_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    # vLLM's order: the bias first, then the repetition penalty (a positive logit divided by it).
    # Token 2 biased to 3.0, then divided by 2 (it is in the prompt): 1.5 < 2.0, token 1 wins.
    params = SamplingParams(temperature=0, logit_bias={2: 2.0}, repetition_penalty=2.0)
    tokens, _ = Sampler().sample(logits, [params], [0], [0], prompts=[[2]])
    assert tokens == [1]
    tokens, lps = Sampler().sample(logits, [SamplingParams(temperature=0, logit_bias={0: 100.0}, logprobs=2)],
                                   [0], [0])
    assert tokens == [0]
    assert lps[0].logprob == pytest.approx(raw[0].item())  # the model's logprob, not the biased one
    assert [t for t, _ in lps[0].top] == [1, 2]


@pytest.mark.parametrize("bias, why", [
    ({1: 101.0}, "values"), ({1: float("nan")}, "values"), ({-1: 1.0}, "keys"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
])
def test_sampling_params_refuse_bad_biases(bias, why):
    with pytest.raises(ValueError, match=why):
        SamplingParams(logit_bias=bias)
    assert len(SamplingParams(logit_bias={i: -100.0 for i in range(MAX_LOGIT_BIAS)}).bias_ids) == MAX_LOGIT_BIAS


def tiny_engine(**kw) -> LLMEngine:
    return LLMEngine.from_settings(ServerSettings(
        dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, max_loras=1,
        max_lora_rank=8, cuda_graphs=False, seed=1, **kw))


def run(engine: LLMEngine, params: list[SamplingParams], prompt=(1, 5, 6)) -> list[list[int]]:
    reqs = [engine.make_request(list(prompt), p) for p in params]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    return [r.output_ids for r in reqs]


def test_engine_biases_each_row_of_a_batch_over_prefill_and_decode_steps():
    engine = tiny_engine()
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    sampled = dict(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    (plain,) = run(engine, [SamplingParams(**greedy)])
    (plain_sampled,) = run(engine, [SamplingParams(**sampled)])
    target = next(t for t in range(10, 100) if t not in plain)
    banned = {t: -100.0 for t in set(plain)}
    together = run(engine, [SamplingParams(**greedy), SamplingParams(**greedy, logit_bias={target: 100.0}),
                            SamplingParams(**sampled), SamplingParams(**greedy, logit_bias=banned)])
    assert together[0] == plain and together[2] == plain_sampled  # unbiased rows: as alone
    assert together[1] == [target] * 6
    assert together[3] != plain and not set(together[3]) & set(plain)
    with pytest.raises(RequestError, match="logit_bias"):
        engine.make_request([1, 2], SamplingParams(logit_bias={engine.cfg.vocab_size: 1.0}))


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    from .conftest import serve_tiny_llama

    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server


def post(served, path, **body):
    if path == "chat":
        body = {"messages": [{"role": "user", "content": "hello"}], **body}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": [5, 6, 7, 8], **body}
        path = "/v1/completions"
    return httpx.post(served.url + path, timeout=60, json={"model": "tiny-llama", "temperature": 0, **body})


def ids_of(tokens) -> list[int]:
    """Token ids from logprob tokens spelled "token_id:N" (return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_logit_bias_over_http(served):
    as_ids = dict(max_tokens=4, logprobs=5, ignore_eos=True, return_tokens_as_token_ids=True)
    lp = post(served, "cmpl", **as_ids).json()["choices"][0]["logprobs"]
    first = lp["top_logprobs"][0]  # {"token_id:N": logprob}, the 5 most likely first tokens
    # The 5th most likely first token, forced with +100: it comes out, with its raw logprob.
    (fifth, fifth_lp), = [(t, v) for t, v in first.items() if t == list(first)[4]]
    target = ids_of([fifth])[0]
    forced = post(served, "cmpl", **as_ids, logit_bias={str(target): 100}).json()["choices"][0]["logprobs"]
    assert ids_of(forced["tokens"]) == [target] * 4
    assert forced["token_logprobs"][0] == pytest.approx(fifth_lp, abs=1e-5)
    assert forced["top_logprobs"][0] == pytest.approx(first, abs=1e-5)  # raw, as vLLM's default
    # -100 on the greedy tokens: none of them comes out.
    greedy = set(ids_of(lp["tokens"]))
    banned = post(served, "cmpl", **as_ids, logit_bias={str(t): -100 for t in greedy}).json()
    out = set(ids_of(banned["choices"][0]["logprobs"]["tokens"]))
    assert out and not out & greedy
    # Chat, and streamed with sampling.
    text = served.engine.tokenizer.decode([target] * 3)
    chat = post(served, "chat", max_tokens=3, logit_bias={str(target): 100}).json()
    assert chat["choices"][0]["message"]["content"] == text
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "temperature": 0.8, "seed": 4, "logprobs": True, "return_tokens_as_token_ids": True,
            "logit_bias": {str(target): 100}}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = [c["token"] for e in events[:-1] for ch in json.loads(e)["choices"]
                for c in ((ch.get("logprobs") or {}).get("content") or [])]
    assert ids_of(streamed) == [target] * 3


@pytest.mark.parametrize("path", ["cmpl", "chat"])
@pytest.mark.parametrize("bias, words", [
    ({"abc": 1}, "integers"), ({"1.5": 1}, "integers"), ({" 5": 1}, "integers"), ({"": 1}, "integers"),
    ({"5": 100.5}, "between -100 and 100"), ({"5": -101}, "between -100 and 100"), ({"5": "1"}, "numbers"),
    ({"5": True}, "numbers"), ({"5": None}, "numbers"), ({"5": 1, "05": 2}, "twice"),
    ({"-1": 1}, "outside the vocabulary"), ({"1000000": 1}, "outside the vocabulary"),
    ({"9" * 19: 1}, "integers"), ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}"),
])
def test_bad_logit_bias_is_a_400_naming_it(served, path, bias, words):
    r = post(served, path, max_tokens=2, logit_bias=bias)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and error["type"] == "invalid_request_error" and words in error["message"]


def test_neutral_and_boundary_biases_are_served(served):
    vocab = served.engine.cfg.vocab_size
    for bias in ({}, None, {"0": -100, str(vocab - 1): 100.0}, {str(i): 0 for i in range(vocab)}):
        for path in ("cmpl", "chat"):
            r = post(served, path, max_tokens=2, logit_bias=bias)
            assert r.status_code == 200, (bias, r.text)
