"""`echo` and prompt logprobs on /v1/completions (what lm-eval-harness sends to score a text):
the prefill's prompt logprobs against HF transformers (+ peft) over the same prompt, in a
batch that mixes echoing and plain requests, chunked and not; then the OpenAI shape over
real HTTP, streamed and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from loraplex.server import model as model_module
from loraplex.server.model import PrefillSeq
from loraplex.server.sampling import SamplingParams
from loraplex.server.tokenizer import Tokenizer

from .test_logprobs import ATOL, error_of, prompt
from .test_ops import tiny_model
from .test_parity import engine_for, hf_greedy


def hf_prompt_logprobs(base_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """transformers (+ peft): log_softmax of the logits at every prompt position, float32
    [len(ids), vocab]; row p scores token p + 1."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def check_prompt_logprobs(got, ids: list[int], k: int, ref: torch.Tensor) -> None:
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        lp, want = got[p], ref[p - 1]
        assert lp.logprob == pytest.approx(want[ids[p]].item(), abs=ATOL), p
        assert [t for t, _ in lp.top] == want.topk(k).indices.tolist(), p
        for t, v in lp.top:
            assert v == pytest.approx(want[t].item(), abs=ATOL)


# -- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [model_module.PROMPT_LOGPROBS_CHUNK, 5])
def test_prompt_logprobs_in_a_mixed_batch_match_hf(hf_llama, llama_adapters, monkeypatch, chunk):
    monkeypatch.setattr(model_module, "PROMPT_LOGPROBS_CHUNK", chunk)
    engine = engine_for(hf_llama, llama_adapters)
    rows_seen = []  # rows of every logits computation: none holds more than a chunk of positions
    logits = engine.model._logits
    engine.model._logits = lambda h: rows_seen.append(h.shape[0]) or logits(h)
    greedy = dict(temperature=0, ignore_eos=True)
    batch = {  # name: (prompt, adapter, params)
        "score-base": (prompt(1, 20), None, SamplingParams(max_tokens=0, echo=True, logprobs=3, **greedy)),
        "echo-adapter": (prompt(2, 9), "all-r16", SamplingParams(max_tokens=4, echo=True, logprobs=5, **greedy)),
        "plain-adapter": (prompt(3), "qv-r8", SamplingParams(max_tokens=4, logprobs=2, **greedy)),
        "echo-no-logprobs": (prompt(4), None, SamplingParams(max_tokens=0, echo=True, **greedy)),
        "score-k0-adapter": (prompt(5, 11), "mlp-rslora-r4",
                             SamplingParams(max_tokens=1, echo=True, logprobs=0, **greedy)),
        "one-token": ([1], None, SamplingParams(max_tokens=2, echo=True, logprobs=2, **greedy)),
    }
    reqs = {name: engine.make_request(p, params, adapter) for name, (p, adapter, params) in batch.items()}
    for r in reqs.values():
        engine.add_request(r)
    outputs = {r.request_id: [] for r in reqs.values()}
    first = True
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
        if first:  # one prefill mixed them all; those with max_tokens 0 or 1 are done already
            assert all(outputs.values())
            assert {r.request_id for r in engine.scheduler.running.values()} == {
                reqs[n].request_id for n in ("echo-adapter", "plain-adapter", "one-token")}
            first = False
    # One row per prompt for the last tokens, then the wanted prompts' other positions by chunks.
    wanted = sum(len(p) - 1 for p, _, params in batch.values() if params.prompt_logprobs is not None)
    assert rows_seen[0] == len(batch) and sum(rows_seen[1:]) == wanted and max(rows_seen[1:]) <= chunk

    for name, (ids, adapter, params) in batch.items():
        req, outs = reqs[name], outputs[reqs[name].request_id]
        assert outs[-1].finished and outs[-1].finish_reason == "length", name
        assert len(req.output_ids) == params.max_tokens, name
        # Echo changes nothing about what is generated.
        assert req.output_ids == hf_greedy(hf_llama, llama_adapters.get(adapter), ids, params.max_tokens), name
        # The prompt's logprobs come once, with the first output.
        assert all(o.prompt_logprobs is None for o in outs[1:]), name
        if params.prompt_logprobs is None:
            assert outs[0].prompt_logprobs is None and req.prompt_logprobs is None, name
            continue
        assert outs[0].prompt_logprobs is req.prompt_logprobs
        ref = hf_prompt_logprobs(hf_llama, llama_adapters.get(adapter), ids)
        check_prompt_logprobs(req.prompt_logprobs, ids, params.logprobs, ref)
    score = outputs[reqs["score-base"].request_id]
    assert len(score) == 1 and score[0].token_ids == [] and score[0].completion_tokens == 0


def test_prefill_outputs_unchanged_and_fused_path_agrees():
    """Asking for prompt logprobs changes nothing else prefill returns; the fused-ops path
    (silu*mul as a Triton kernel) gives the torch path's prompt logprobs."""
    model = tiny_model(torch.float32, fused=False)
    gen = torch.Generator().manual_seed(4)
    lengths = (13, 1, 9)
    tokens = torch.randint(3, model.cfg.vocab_size, (sum(lengths),), generator=gen)
    slots = torch.tensor([0] * 13 + [-1] + [1] * 9, dtype=torch.int32)
    seqs = [PrefillSeq(row=r, start=sum(lengths[:i]), length=n) for i, (r, n) in enumerate(zip((0, 3, 2), lengths))]
    plain = model.prefill(tokens, slots, seqs)
    logits, lps = model.prefill(tokens, slots, seqs, prompt_logprobs={0: 4, 1: 2})
    assert torch.equal(logits, plain)
    assert set(lps) == {0, 1} and lps[1] == [None] and len(lps[0]) == 13 and lps[0][0] is None
    assert all(len(lp.top) == 4 and lp.top[0][1] >= lp.logprob for lp in lps[0][1:])
    model.fused_ops = True
    fused_logits, fused = model.prefill(tokens, slots, seqs, prompt_logprobs={0: 4, 1: 2})
    assert torch.allclose(fused_logits, plain, atol=1e-4)
    for want, got in zip(lps[0][1:], fused[0][1:]):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_max_tokens_zero_needs_echo():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, echo=True, logprobs=1).prompt_logprobs == 1
    assert SamplingParams(max_tokens=3, logprobs=1).prompt_logprobs is None


# -- over HTTP ---------------------------------------------------------------------------------


TEXT = "the quick brown fox jumps"


@pytest.mark.parametrize("model, adapter", [("tiny-llama", None), ("all-r16", "all-r16")])
def test_score_a_text_as_lm_eval_does(served, hf_llama, llama_adapters, model, adapter):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    c = client.completions.create(model=model, prompt=TEXT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = c.choices[0]
    tok = Tokenizer(hf_llama)
    ids = tok.encode(TEXT)
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    texts = [tok.decode([t]) for t in ids]
    assert lp.tokens == texts
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_prompt_logprobs(hf_llama, llama_adapters.get(adapter), ids)
    assert lp.token_logprobs[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                  abs=ATOL)
    for p in range(1, len(ids)):  # the prompt token and the top 2 there (fewer keys where tokens decode alike)
        top = lp.top_logprobs[p]
        assert texts[p] in top and top[texts[p]] == pytest.approx(lp.token_logprobs[p])
        best = ref[p - 1].topk(2).indices.tolist()
        assert {tok.decode([t]) for t in best} <= set(top) and len(top) <= 3


def test_echo_with_generation_streamed_and_not(served, hf_llama):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    prompts = [prompt(6), prompt(7, 10)]  # token ids: echo decodes them
    kw = dict(model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    echo = client.completions.create(echo=True, **kw)
    tok = Tokenizer(hf_llama)
    assert len(echo.choices) == 2
    for i, ids in enumerate(prompts):
        want, got = plain.choices[i], echo.choices[i]
        assert got.index == i and got.text == tok.decode(ids) + want.text
        n = len(ids)
        assert got.logprobs.tokens == [tok.decode([t]) for t in ids] + want.logprobs.tokens
        assert got.logprobs.token_logprobs[0] is None and got.logprobs.top_logprobs[0] is None
        assert got.logprobs.token_logprobs[n:] == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
        # text_offset runs on from the prompt into the completion.
        prompt_chars = sum(len(t) for t in got.logprobs.tokens[:n])
        assert got.logprobs.text_offset[n:] == [prompt_chars + o for o in want.logprobs.text_offset]

    # Streamed: each choice's first chunk carries its prompt and the prompt's logprobs.
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, echo=True, **kw) if ch.choices]
    for i, ids in enumerate(prompts):
        mine = [c for c in chunks if c.index == i]
        assert mine[0].text.startswith(tok.decode(ids))
        assert mine[0].logprobs.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
        assert mine[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in mine) == echo.choices[i].text
        lps = [c.logprobs for c in mine if c.logprobs is not None]
        assert sum((x.tokens for x in lps), []) == echo.choices[i].logprobs.tokens
        assert sum((x.text_offset for x in lps), []) == echo.choices[i].logprobs.text_offset
        streamed = sum((x.token_logprobs for x in lps), [])
        assert streamed[0] is None and streamed[1:] == pytest.approx(echo.choices[i].logprobs.token_logprobs[1:],
                                                                     abs=1e-5)
        assert mine[-1].finish_reason == "length"


def test_echo_without_logprobs_and_score_only_stream(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    c = client.completions.create(model="qv-r8", prompt=TEXT, max_tokens=3, echo=True, temperature=0,
                                  extra_body={"ignore_eos": True})
    plain = client.completions.create(model="qv-r8", prompt=TEXT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert c.choices[0].text == TEXT + plain.choices[0].text and c.choices[0].logprobs is None

    # max_tokens 0 streamed: one chunk, the prompt and its logprobs, finished.
    r = httpx.post(served.url + "/v1/completions", timeout=30, json={
        "model": "tiny-llama", "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert len(chunks) == 1
    choice = chunks[0]["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in choice["logprobs"]["token_logprobs"][1:])
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: the token itself


def test_max_tokens_zero_without_echo_is_a_400(served):
    r = httpx.post(served.url + "/v1/completions", timeout=30,
                   json={"model": "tiny-llama", "prompt": TEXT, "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == "max_tokens" and "echo" in err["message"]
