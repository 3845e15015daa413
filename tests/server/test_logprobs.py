"""Logprobs and presence/frequency penalties end to end: the engine against HF transformers
(+ peft) running the same model, and both OpenAI response shapes over real HTTP."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
import torch

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.tokenizer import Tokenizer

from .test_parity import engine_for, hf_greedy

MAX_NEW = 12
ATOL = 1e-4  # float32 logprobs of the same weights through two implementations


def hf_reference(base_dir, adapter_dir, prompt: list[int], n: int, presence: float = 0.0,
                 frequency: float = 0.0) -> tuple[list[int], torch.Tensor]:
    """transformers (+ peft): n greedy tokens under OpenAI's penalties, and the log_softmax
    of the raw logits at each step, float32 [n, vocab]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logprobs.append(torch.log_softmax(logits, -1))
            out = ids[len(prompt):]
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(logprobs)


def prompt(seed: int, n: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 320) for _ in range(n)]


def run(engine: LLMEngine, batch: dict[str, tuple[list[int], str | None, SamplingParams]]):
    reqs = {name: engine.make_request(p, params, adapter) for name, (p, adapter, params) in batch.items()}
    for r in reqs.values():
        engine.add_request(r)
    first = True
    while engine.has_work():
        engine.step()
        if first:  # all admitted together: one batch mixes them
            assert len(engine.scheduler.running) == len(batch)
            first = False
    return reqs


def check_logprobs(output_ids, output_logprobs, k: int, ref: torch.Tensor) -> None:
    assert len(output_logprobs) == len(output_ids)
    for step, (tok, lp) in enumerate(zip(output_ids, output_logprobs)):
        want = ref[step]
        assert lp.logprob == pytest.approx(want[tok].item(), abs=ATOL)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == want.topk(k).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(want[t].item(), abs=ATOL)


def test_mixed_batch_logprobs_and_penalties_match_hf(hf_llama, llama_adapters):
    """One batch: plain greedy, logprobs only, penalties only, both; base and adapters."""
    engine = engine_for(hf_llama, llama_adapters)
    greedy = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    batch = {
        "logprobs-base": (prompt(4), None, SamplingParams(logprobs=5, **greedy)),
        "plain-adapter": (prompt(1), "qv-r8", SamplingParams(**greedy)),
        "frequency-base": (prompt(5), None, SamplingParams(frequency_penalty=2.0, **greedy)),
        "both-adapter": (prompt(4), "all-r16", SamplingParams(logprobs=0, presence_penalty=1.5, **greedy)),
        "presence-logprobs-base": (prompt(4), None, SamplingParams(logprobs=20, presence_penalty=2.0, **greedy)),
    }
    reqs = run(engine, batch)
    for name, (p, adapter, params) in batch.items():
        req = reqs[name]
        want_ids, ref = hf_reference(hf_llama, llama_adapters.get(adapter), p, MAX_NEW,
                                     params.presence_penalty, params.frequency_penalty)
        assert req.output_ids == want_ids, name
        if params.logprobs is None:
            assert req.output_logprobs == []
        else:
            check_logprobs(req.output_ids, req.output_logprobs, params.logprobs, ref)
        if params.penalised:  # the penalty mattered here: greedy alone repeats tokens
            plain = hf_greedy(hf_llama, llama_adapters.get(adapter), p, MAX_NEW)
            assert len(set(plain)) < len(plain) and plain != want_ids, name
    # Greedy without penalties: the sampled token is the most likely one.
    top = reqs["logprobs-base"].output_logprobs
    assert all(lp.top[0][0] == tok for lp, tok in zip(top, reqs["logprobs-base"].output_ids))


def test_zero_penalties_leave_outputs_bit_identical(hf_llama, llama_adapters):
    # Without prefix caching: the second run's prompts would be found in the first's rows and
    # prefilled from their last token, the same values to float rounding, not to the bit.
    engine = engine_for(hf_llama, llama_adapters, enable_prefix_caching=False)
    kw = dict(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True, logprobs=4)
    names = {"a": (prompt(1), None), "b": (prompt(2), "all-r16"), "c": (prompt(3), "qv-r8")}
    plain = run(engine, {n: (p, a, SamplingParams(**kw)) for n, (p, a) in names.items()})
    zeros = run(engine, {n: (p, a, SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, **kw))
                         for n, (p, a) in names.items()})
    for n in names:
        assert plain[n].output_ids == zeros[n].output_ids
        assert plain[n].output_logprobs == zeros[n].output_logprobs  # exact float equality


# -- over HTTP --------------------------------------------------------------------------------


def test_completions_logprobs_shape_and_values(served, hf_llama):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    p = prompt(4)
    kw = dict(model="tiny-llama", prompt=p, max_tokens=MAX_NEW, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    lp = client.completions.create(**kw).choices[0].logprobs
    want_ids, ref = hf_reference(hf_llama, None, p, MAX_NEW)
    tok = Tokenizer(hf_llama)
    texts = [tok.decode([t]) for t in want_ids]
    assert lp.tokens == texts
    assert lp.token_logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(want_ids)], abs=ATOL)
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for i, top in enumerate(lp.top_logprobs):
        ids = ref[i].topk(3).indices.tolist()
        assert {tok.decode([t]) for t in ids} <= set(top) and lp.tokens[i] in top
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i])  # greedy: the best one
        want = {}  # tokens that decode alike (pieces of UTF-8 characters) share a key: the best keeps it
        for t in ids:
            want.setdefault(tok.decode([t]), ref[i, t].item())
        assert {k: top[k] for k in want} == pytest.approx(want, abs=ATOL)

    # Streamed, each chunk carries its new tokens' logprobs; joined, they are the same object.
    chunks = [ch.choices[0].logprobs for ch in client.completions.create(stream=True, **kw) if ch.choices]
    joined = {k: sum((getattr(c, k) for c in chunks if c is not None), []) for k in ("tokens", "text_offset")}
    assert joined == {"tokens": lp.tokens, "text_offset": lp.text_offset}
    streamed = sum((c.token_logprobs for c in chunks if c is not None), [])
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)

    # logprobs 0: the sampled token's own, and it alone in top_logprobs.
    zero = client.completions.create(**{**kw, "logprobs": 0}).choices[0].logprobs
    assert all(list(top) == [t] for top, t in zip(zero.top_logprobs, zero.tokens))
    # Without logprobs the field stays null.
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None


def test_completions_penalties_over_http(served, hf_llama):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    p = prompt(5)
    c = client.completions.create(model="tiny-llama", prompt=p, max_tokens=MAX_NEW, temperature=0,
                                  frequency_penalty=1.0, presence_penalty=0.5, extra_body={"ignore_eos": True})
    want_ids, _ = hf_reference(hf_llama, None, p, MAX_NEW, presence=0.5, frequency=1.0)
    assert c.choices[0].text == Tokenizer(hf_llama).decode(want_ids)
    assert want_ids != hf_greedy(hf_llama, None, p, MAX_NEW)


def test_chat_logprobs_shape_streaming_and_not(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    kw = dict(model="all-r16", messages=[{"role": "user", "content": "hello there"}], max_tokens=8,
              temperature=0, logprobs=True, top_logprobs=2)
    chat = client.chat.completions.create(**kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    for entry in content:
        if "\ufffd" not in entry.token:  # a piece of a character has its own bytes (test_api_logprob_bytes.py)
            assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0

    stream = list(client.chat.completions.create(stream=True, **kw))
    assert stream[0].choices[0].logprobs is None  # the role chunk
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat.choices[0].message.content

    bare = client.chat.completions.create(**{**kw, "top_logprobs": None}).choices[0].logprobs.content
    assert [e.top_logprobs for e in bare] == [[]] * 8
    assert client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None}).choices[0].logprobs is None


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"frequency_penalty": 3}, "frequency_penalty"),
])
def test_out_of_bounds_is_a_400_in_openai_shape(served, path, extra, param):
    body = {"model": "tiny-llama", "max_tokens": 2, **extra}
    body |= {"prompt": [1, 5, 6]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(served.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_the_bounds_themselves_are_served(served):
    r = httpx.post(served.url + "/v1/completions", timeout=30, json={
        "model": "tiny-llama", "prompt": [1, 5, 6], "max_tokens": 2, "logprobs": 20,
        "presence_penalty": -2, "frequency_penalty": 2, "seed": 0, "stream": True})
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    pairs = [(tok, top) for lp in lps for tok, top in zip(lp["tokens"], lp["top_logprobs"])]
    assert len(pairs) == 2
    for tok, top in pairs:  # 20 alternatives, most likely first (fewer keys where tokens decode alike)
        assert tok in top and 1 <= len(top) <= 21
        values = [v for k, v in top.items() if k != tok]
        assert values == sorted(values, reverse=True)
