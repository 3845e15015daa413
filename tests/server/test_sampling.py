"""Sampling (masks, seeded noise) and the request's stop logic, without a model."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.request import Request
from loraplex.server.sampling import Sampler, SamplingParams, apply_penalties, apply_top_k_top_p, uniform_noise


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
        # Ties with the k-th value stay, as vLLM and transformers keep them.
        ([1.0, 2.0, 2.0, 0.0], 1, 1.0, {1, 2}),
        ([3.0, 2.0, 2.0, 0.0], 2, 1.0, {0, 1, 2}),
        ([2.0, 2.0, 2.0, 2.0], 3, 1.0, {0, 1, 2, 3}),
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
    t1, lps = s.sample(logits, params, seeds, [0, 0, 0, 0])
    assert lps == [None] * 4  # nobody asked
    assert t1[0] == logits[0].argmax() and t1[2] == logits[2].argmax()
    # The same seeded row alone, or in another batch, draws the same token.
    alone, _ = s.sample(logits[1:2], params[1:2], seeds[1:2], [0])
    assert alone[0] == t1[1]


def test_sampling_follows_the_distribution_and_respects_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    probs = torch.softmax(logits[0], 0)
    s = Sampler()
    n = 3000
    counts = torch.zeros(5)
    topk_seen = set()
    for seed in range(n):
        counts[s.sample(logits, [SamplingParams(temperature=1.0)], [seed], [0])[0][0]] += 1
        topk_seen.add(s.sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [seed], [1])[0][0])
    assert torch.allclose(counts / n, probs, atol=0.03)
    assert topk_seen == {0, 1}




@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 1e-45])
def test_a_temperature_near_zero_samples_greedily(temperature):
    # logits / 1e-40 overflows float32: the draw was the argmax of NaNs, token 0 every time.
    torch.manual_seed(5)
    logits = torch.randn(4, 50) * 10
    s = Sampler()
    tokens, _ = s.sample(logits, [SamplingParams(temperature=temperature, seed=j) for j in range(4)],
                         list(range(4)), [0] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_a_top_k_past_the_vocabulary_keeps_every_token():
    # Any int a client sends is a valid top_k (pydantic takes 10**20); past the vocabulary it
    # is no mask, and it must not overflow the int64 tensor on its way to the device.
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    s = Sampler()
    want = s.sample(logits, [SamplingParams(temperature=1.0, top_k=50)] * 3, [3, 4, 5], [0, 0, 0])
    for k in (51, 2**63 - 1, 2**63, 10**20):
        assert s.sample(logits, [SamplingParams(temperature=1.0, top_k=k)] * 3, [3, 4, 5], [0, 0, 0]) == want


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


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                dict(logprobs=21), dict(logprobs=-1), dict(presence_penalty=2.5),
                                dict(frequency_penalty=-3)])
def test_invalid_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def reference_penalties(logits, generated, presence, frequency):
    """The OpenAI definition as a plain loop over tokens."""
    out = logits.clone()
    for t in set(generated):
        out[t] -= frequency * generated.count(t) + presence
    return out


@pytest.mark.parametrize(
    "generated, presence, frequency",
    [
        ([[3, 3, 3, 1], [], [0, 4]], [0.5, 1.0, -1.0], [1.5, 2.0, 0.0]),
        ([[7], [2, 2, 9, 2]], [0.0, -2.0], [-0.5, 2.0]),  # negative penalties encourage repeats
    ],
)
def test_penalties_match_the_definition(generated, presence, frequency):
    torch.manual_seed(1)
    logits = torch.randn(5, 10)
    rows = [4, 0, 2][:len(generated)]
    got = apply_penalties(logits, torch.tensor(rows), generated, torch.tensor(presence), torch.tensor(frequency))
    want = logits.clone()
    for r, g, p, f in zip(rows, generated, presence, frequency):
        want[r] = reference_penalties(logits[r], g, p, f)
    assert torch.allclose(got, want, atol=1e-6)
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


def test_penalties_stop_a_repeated_token_and_zero_penalties_change_nothing():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])  # greedy: token 1, again and again
    s = Sampler()
    greedy = SamplingParams(temperature=0)
    assert s.sample(logits, [greedy], [0], [3], generated=[[1, 1, 1]])[0] == [1]
    # 3 repeats * 0.3 = 0.9 pulls token 1 below token 2 (3.0 - 0.9 = 2.1 < 2.5).
    freq = SamplingParams(temperature=0, frequency_penalty=0.3)
    assert s.sample(logits, [freq], [0], [3], generated=[[1, 1, 1]])[0] == [2]
    assert s.sample(logits, [freq], [0], [1], generated=[[1]])[0] == [1]  # one repeat is not enough
    pres = SamplingParams(temperature=0, presence_penalty=0.6)  # once, however many repeats
    assert s.sample(logits, [pres], [0], [3], generated=[[1, 1, 1]])[0] == [2]
    # Zero penalties: the same tokens and logprobs, bit for bit, sampled rows included.
    torch.manual_seed(2)
    big = torch.randn(3, 64)
    gen = [[5, 5, 6], [7], [8, 8]]
    plain = [SamplingParams(temperature=0.8, seed=1, logprobs=2), SamplingParams(temperature=0),
             SamplingParams(temperature=1.0, top_p=0.9, logprobs=0)]
    zeros = [SamplingParams(temperature=0.8, seed=1, logprobs=2, presence_penalty=0.0, frequency_penalty=0.0),
             SamplingParams(temperature=0, presence_penalty=0.0),
             SamplingParams(temperature=1.0, top_p=0.9, logprobs=0, frequency_penalty=0.0)]
    a = s.sample(big, plain, [1, 2, 3], [3, 1, 2], generated=gen)
    b = s.sample(big, zeros, [1, 2, 3], [3, 1, 2], generated=gen)
    assert a == b


def test_logprobs_are_of_the_raw_logits_and_mix_with_other_rows():
    torch.manual_seed(3)
    logits = torch.randn(6, 100)
    before = logits.clone()
    s = Sampler()
    params = [SamplingParams(temperature=0, logprobs=5),
              SamplingParams(temperature=0),  # no logprobs
              SamplingParams(temperature=0.5, top_k=3, seed=9, logprobs=0, frequency_penalty=2.0),
              SamplingParams(temperature=0, logprobs=20, presence_penalty=2.0)]
    rows = [5, 0, 3, 1]  # decode rows: request i reads logits row rows[i]
    gen = [[1, 2], [], [4, 4], [int(logits[1].argmax())]]
    tokens, lps = s.sample(logits, params, [0, 0, 9, 0], [2, 0, 2, 1], rows, gen)
    assert torch.equal(logits, before)  # read, never written
    assert lps[1] is None
    for i in (0, 2, 3):
        want = torch.log_softmax(logits[rows[i]], -1)  # raw: before penalties and temperature
        lp = lps[i]
        assert lp.logprob == pytest.approx(want[tokens[i]].item(), abs=1e-6)
        assert len(lp.top) == params[i].logprobs
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        top_ids = want.topk(params[i].logprobs).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert all(v == pytest.approx(want[t].item(), abs=1e-6) for t, v in lp.top)
    # Greedy without penalties: the sampled token is the most likely one.
    assert lps[0].top[0] == (tokens[0], pytest.approx(lps[0].logprob))
    # The presence penalty moved row 3 off its argmax, and the logprob still describes the raw logits.
    assert tokens[3] != int(logits[1].argmax()) and lps[3].top[0][0] == int(logits[1].argmax())
    # Row 2 drew from the top 3 of its penalised logits (token 4 lowered by 2 * 2.0).
    penalised = logits[3].clone()
    penalised[4] -= 4.0
    assert tokens[2] in penalised.topk(3).indices.tolist()


def test_logprobs_ride_with_their_tokens_through_held_back_text():
    from loraplex.server.sampling import TokenLogprobs

    req = make(SamplingParams(max_tokens=100, stop=["END"], logprobs=1))
    outs = []
    for i, ch in enumerate("aEN!END"):
        if req.finished:
            break
        req.append(ord(ch), (), 1000, TokenLogprobs(-float(i), ((ord(ch), -float(i)),)))
        outs.append(req.take_output())
    # "E" and "EN" are held back as text, but each token's logprobs come with the token.
    assert [o.text for o in outs[:4]] == ["a", "", "", "EN!"]
    assert all(len(o.logprobs) == len(o.token_ids) == 1 for o in outs)
    assert [o.logprobs[0].logprob for o in outs] == [-float(i) for i in range(len(outs))]
    assert make(SamplingParams()).take_output().logprobs is None  # not asked: None, not []


def test_negative_seeds_draw_their_own_noise():
    """The API takes any int64 seed (as vLLM does): -5 is not 2**63 - 5."""
    u = uniform_noise(torch.tensor([-5, (1 << 63) - 5, -(1 << 63)]), torch.tensor([0, 0, 0]), 1000)
    assert (u > 0).all() and (u < 1).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
