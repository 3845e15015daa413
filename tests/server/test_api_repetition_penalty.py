"""`repetition_penalty`, vLLM's sampling parameter (and transformers'): a token already in the
prompt or the output has its logit divided by the penalty when positive, multiplied when
negative; 1 is off, values above 1 discourage repeats. It used to be dropped without a word
(an unknown field), so a client written for vLLM got a different, repetitive output.

Checked against transformers' own RepetitionPenaltyLogitsProcessor, against transformers'
greedy generation in a mixed batch, and over HTTP."""

from __future__ import annotations

import httpx
import pytest
import torch

from loraplex.server.sampling import Sampler, SamplingParams, apply_penalties
from loraplex.server.tokenizer import Tokenizer

from .test_http import error_of
from .test_logprobs import prompt, run
from .test_parity import engine_for

MAX_NEW = 10


def hf_processed(logits: torch.Tensor, seen: list[int], repetition: float, generated: list[int],
                 presence: float, frequency: float) -> torch.Tensor:
    """transformers' repetition penalty over `seen` (prompt + output), then OpenAI's two."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([seen]), logits[None].clone())[0]
    for t in set(generated):
        out[t] -= frequency * generated.count(t) + presence
    return out


@pytest.mark.parametrize("repetition", [1.3, 0.7, 1.0])
def test_the_penalty_is_transformers_and_mixes_with_presence_and_frequency(repetition):
    torch.manual_seed(3)
    logits = torch.randn(4, 12) * 3  # positive and negative logits
    rows = [3, 0, 1]
    prompts = [[1, 5, 5, 7], [2], [9, 10, 11]]
    generated = [[5, 8, 8], [], [0, 11]]
    presence, frequency, rep = [0.5, 0.0, -1.0], [0.2, 0.0, 1.0], [repetition, repetition, 1.0]
    got = apply_penalties(logits, torch.tensor(rows), generated, torch.tensor(presence), torch.tensor(frequency),
                          prompts, torch.tensor(rep))
    want = logits.clone()
    for r, p, g, pr, fr, rp in zip(rows, prompts, generated, presence, frequency, rep):
        want[r] = hf_processed(logits[r], p + g, rp, g, pr, fr)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[2], logits[2])  # a row nobody penalises


def test_the_prompt_counts_from_the_first_token():
    """No output yet: the prompt's tokens are already penalised (the first token after it)."""
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0]])
    s = Sampler()
    plain = SamplingParams(temperature=0)
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)  # 3.0 / 1.5 = 2.0 < 2.5
    assert s.sample(logits, [plain], [0], [0], generated=[[]], prompts=[[1, 3]])[0] == [1]
    assert s.sample(logits, [rep], [0], [0], generated=[[]], prompts=[[1, 3]])[0] == [2]
    assert s.sample(logits, [rep], [0], [0], generated=[[]], prompts=[[3]])[0] == [1]  # 1 unseen


def hf_reference(base_dir, adapter_dir, prompt_ids: list[int], n: int, repetition: float) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, repetition_penalty=repetition,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_a_mixed_batch_matches_transformers_generate(hf_llama, llama_adapters):
    engine = engine_for(hf_llama, llama_adapters)
    greedy = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    batch = {
        "rep-base": (prompt(4), None, SamplingParams(repetition_penalty=1.8, **greedy)),
        "plain-adapter": (prompt(1), "qv-r8", SamplingParams(**greedy)),
        "rep-adapter": (prompt(5), "all-r16", SamplingParams(repetition_penalty=1.4, logprobs=2, **greedy)),
        "rep-below-one": (prompt(6), None, SamplingParams(repetition_penalty=0.6, **greedy)),
    }
    reqs = run(engine, batch)
    for name, (p, adapter, params) in batch.items():
        want = hf_reference(hf_llama, llama_adapters.get(adapter), p, MAX_NEW, params.repetition_penalty)
        assert reqs[name].output_ids == want, name
    plain = hf_reference(hf_llama, None, prompt(4), MAX_NEW, 1.0)
    assert plain != reqs["rep-base"].output_ids  # the penalty mattered


def test_over_http_and_out_of_range_values(served, hf_llama):
    ids = prompt(4)
    tok = Tokenizer(hf_llama)
    with httpx.Client(base_url=served.url, timeout=60) as c:
        def text(extra: dict, path="/v1/completions") -> httpx.Response:
            body = {"model": "tiny-llama", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True} | extra
            body |= {"prompt": ids} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
            return c.post(path, json=body)

        r = text({"repetition_penalty": 1.8})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == \
            tok.decode(hf_reference(hf_llama, None, ids, MAX_NEW, 1.8))
        assert text({"repetition_penalty": 1.0}).json()["choices"][0]["text"] == text({}).json()["choices"][0]["text"]
        chat = "/v1/chat/completions"
        assert text({"repetition_penalty": 1.8}, chat).status_code == 200
        for path in ("/v1/completions", chat):
            for bad in (0, -1.0):
                r = text({"repetition_penalty": bad}, path)
                assert r.status_code == 400 and error_of(r)["param"] == "repetition_penalty", (path, bad, r.text)
            r = c.post(path, content=b'{"model": "tiny-llama", "prompt": "x", "messages": [{"role": "user", '
                                     b'"content": "x"}], "repetition_penalty": Infinity}',
                       headers={"content-type": "application/json"})
            assert r.status_code == 400 and error_of(r)["param"] == "repetition_penalty", r.text
