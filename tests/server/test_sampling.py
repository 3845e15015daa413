"""Sampling (masks, seeded noise) and the request's stop logic, without a model."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.request import Request
from loraplex.server.sampling import Sampler, SamplingParams, apply_top_k_top_p, uniform_noise


def test_noise_is_a_pure_function_of_seed_counter_and_index():
    a = uniform_noise(torch.tensor([7, 8]), torch.tensor([3, 3]), 1000)
    b = uniform_noise(torch.tensor([8, 7, 7]), torch.tensor([3, 3, 4]), 1000)
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])
    assert not torch.equal(b[1], b[2])  # the counter matters
    assert (a > 0).all() and (a < 1).all()
    # Roughly uniform: mean 0.5, and a seed's 1000 draws are nearly all distinct.
    assert abs(a.mean().item() - 0.5) < 0.03
    assert a[0].unique().numel() > 990


@pytest.mark.parametrize(
    "logits, k, p, kept",
    [
        ([1.0, 3.0, 2.0, 0.0], 2, 1.0, {1, 2}),
        ([1.0, 3.0, 2.0, 0.0], 0, 1.0, {0, 1, 2, 3}),
        ([0.0, 10.0, 0.0, 0.0], 0, 0.5, {1}),  # one token holds > half the mass
        ([2.0, 2.0, 2.0, 2.0], 0, 0.5, {0, 1}),  # 0.25 + 0.25 reaches 0.5: two kept (ties in index order)
        ([1.0, 3.0, 2.0, 0.0], 3, 0.7, {1, 2}),  # top-k first, then top-p on what is left
        ([5.0, 1.0], 1, 0.01, {0}),
    ],
)
def test_top_k_top_p_masks(logits, k, p, kept):
    out = apply_top_k_top_p(torch.tensor([logits]), torch.tensor([k]), torch.tensor([p]))
    assert {i for i, v in enumerate(out[0].tolist()) if v != float("-inf")} == kept


def test_greedy_rows_take_the_argmax_and_seeded_rows_repeat():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    s = Sampler()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(top_k=1, temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9, seed=5)]
    seeds = [1, 5, 2, 5]
    t1 = s.sample(logits, params, seeds, [0, 0, 0, 0])
    assert t1[0] == logits[0].argmax() and t1[2] == logits[2].argmax()
    # The same seeded row alone, or in another batch, draws the same token.
    alone = s.sample(logits[1:2], params[1:2], seeds[1:2], [0])
    assert alone[0] == t1[1]


def test_sampling_follows_the_distribution_and_respects_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    probs = torch.softmax(logits[0], 0)
    s = Sampler()
    n = 3000
    counts = torch.zeros(5)
    topk_seen = set()
    for seed in range(n):
        counts[s.sample(logits, [SamplingParams(temperature=1.0)], [seed], [0])[0]] += 1
        topk_seen.add(int(s.sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [seed], [1])[0]))
    assert torch.allclose(counts / n, probs, atol=0.03)
    assert topk_seen == {0, 1}


class CharTokenizer:
    """Token id i is chr(i); enough to test text handling."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def feed(req: Request, text: str, eos=(), max_len=1000) -> list[str]:
    deltas = []
    for ch in text:
        if req.finished:
            break
        req.append(ord(ch), eos, max_len)
        deltas.append(req.take_output().text)
    return deltas


def make(params: SamplingParams) -> Request:
    return Request.new("r", [1, 2], params, None, 0, CharTokenizer())


def test_stop_strings_cut_the_text_and_hold_back_prefixes():
    req = make(SamplingParams(max_tokens=100, stop=["END", "!!"]))
    deltas = feed(req, "hello EN world END tail")
    assert req.finished and req.finish_reason == "stop"
    assert "".join(deltas) == "hello EN world "
    # "E" and "EN" were held back until the next character ruled "END" out.
    assert "E" not in deltas[6] and deltas[7] == "" and deltas[8] == "EN "


def test_stop_token_ids_eos_and_length():
    req = make(SamplingParams(max_tokens=100, stop_token_ids=[ord("x")]))
    feed(req, "abxcd")
    assert req.finish_reason == "stop" and req.output_ids == [ord(c) for c in "abx"]
    req = make(SamplingParams(max_tokens=100))
    feed(req, "abcd", eos=(ord("c"),))
    assert req.finish_reason == "stop" and len(req.output_ids) == 3
    req = make(SamplingParams(max_tokens=100, ignore_eos=True))
    feed(req, "abcd", eos=(ord("c"),))
    assert not req.finished
    req = make(SamplingParams(max_tokens=3))
    assert "".join(feed(req, "abcdef")) == "abc" and req.finish_reason == "length"
    req = make(SamplingParams(max_tokens=100))
    feed(req, "abcdef", max_len=5)  # 2 prompt tokens + 3 = the context limit
    assert req.finish_reason == "length" and len(req.output_ids) == 3


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_invalid_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
