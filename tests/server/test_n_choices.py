"""`n` choices per prompt on /v1/completions and /v1/chat/completions over real HTTP, with the
official openai client and raw SSE: indices (prompt-major for several prompts), seeds (choice
j samples with seed + j), usage (a prompt counts once), streamed chunks joined per index
against the non-streamed response, the cap on n, disconnects and failed adapter loads."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from loraplex.server.api.app import create_app
from loraplex.server.api.schemas import MAX_N
from loraplex.server.engine import LLMEngine
from loraplex.server.settings import ServerSettings
from loraplex.server.tokenizer import Tokenizer

from .conftest import LiveServer
from .test_adapter_cache import corrupt, write_adapter
from .test_http import aborted, error_of, wait_until

PROMPT = "The quick brown fox"
MSGS = [{"role": "user", "content": "hello there!"}]
SAMPLED = dict(max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
GREEDY = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused")


def texts(response) -> list[str]:
    assert [c.index for c in response.choices] == list(range(len(response.choices)))
    return [c.text if hasattr(c, "text") else c.message.content for c in response.choices]


def sse_chunks(served, path: str, body: dict) -> list[dict]:
    """Every chunk of a streamed response; asserts it ends with exactly one [DONE]."""
    with httpx.Client(base_url=served.url, timeout=60) as c:
        with c.stream("POST", path, json=body | {"stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


# -- choices and seeds -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-llama", "qv-r8"])
def test_completions_seeded_n_is_reproducible_and_distinct(client, hf_llama, model):
    r1 = client.completions.create(model=model, prompt=PROMPT, n=3, seed=42, **SAMPLED)
    r2 = client.completions.create(model=model, prompt=PROMPT, n=3, seed=42, **SAMPLED)
    assert texts(r1) == texts(r2)
    assert len(set(texts(r1))) > 1  # independent samples, not one sample three times
    assert all(c.finish_reason == "length" for c in r1.choices)
    # Choice j samples with seed + j: choice 0 is what n=1 gives, choice 2 is n=1 with seed 44.
    one = [client.completions.create(model=model, prompt=PROMPT, seed=s, **SAMPLED).choices[0].text
           for s in (42, 44)]
    assert one == [texts(r1)[0], texts(r1)[2]]
    prompt_tokens = len(Tokenizer(hf_llama).encode(PROMPT))
    assert (r1.usage.prompt_tokens, r1.usage.completion_tokens, r1.usage.total_tokens) == (
        prompt_tokens, 3 * 8, prompt_tokens + 3 * 8)


def test_chat_seeded_n_is_reproducible_and_distinct(client, hf_llama):
    kw = dict(model="all-r16", messages=MSGS, n=3, seed=7, logprobs=True, top_logprobs=2, **SAMPLED)
    r1, r2 = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert texts(r1) == texts(r2) and len(set(texts(r1))) > 1
    for c in r1.choices:
        assert c.message.role == "assistant" and c.finish_reason == "length"
        assert len(c.logprobs.content) == 8 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert [t.token for t in r1.choices[0].logprobs.content] != [t.token for t in r1.choices[1].logprobs.content]
    prompt_tokens = len(Tokenizer(hf_llama).apply_chat_template(MSGS))
    assert (r1.usage.prompt_tokens, r1.usage.completion_tokens) == (prompt_tokens, 3 * 8)


def test_unseeded_n_gives_each_choice_its_own_seed(client):
    r = client.completions.create(model="patterns", prompt=PROMPT, n=4, **SAMPLED)
    assert len(set(texts(r))) > 1


def test_greedy_n_gives_n_copies_of_the_greedy_output(client):
    one = client.completions.create(model="mlp-rslora-r4", prompt=PROMPT, **GREEDY)
    two = client.completions.create(model="mlp-rslora-r4", prompt=PROMPT, n=2, **GREEDY)
    assert texts(two) == [one.choices[0].text] * 2
    chat_one = client.chat.completions.create(model="qv-r8", messages=MSGS, **GREEDY)
    chat_two = client.chat.completions.create(model="qv-r8", messages=MSGS, n=2, **GREEDY)
    assert texts(chat_two) == [chat_one.choices[0].message.content] * 2


def test_several_prompts_times_n_are_prompt_major(client, hf_llama):
    prompts = ["Pack my box", "with five dozen liquor jugs"]
    r = client.completions.create(model="qv-r8", prompt=prompts, n=2, seed=5, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # index = prompt * n + j, and choice j samples with seed + j.
    want = [client.completions.create(model="qv-r8", prompt=p, seed=5 + j, **SAMPLED).choices[0].text
            for p in prompts for j in range(2)]
    assert texts(r) == want
    tok = Tokenizer(hf_llama)
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 8


def test_echo_and_prompt_logprobs_in_every_choice(client):
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, n=2, seed=3, echo=True, logprobs=1,
                                  max_tokens=3, temperature=1.0)
    one = client.completions.create(model="tiny-llama", prompt=PROMPT, seed=3, echo=True, logprobs=1,
                                    max_tokens=3, temperature=1.0)
    for c in r.choices:
        assert c.text.startswith(PROMPT)
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    # The prompt's part of the logprobs is the same in both choices and in n=1.
    n_prompt = len(one.choices[0].logprobs.tokens) - one.usage.completion_tokens
    for c in r.choices:
        assert c.logprobs.token_logprobs[:n_prompt] == one.choices[0].logprobs.token_logprobs[:n_prompt]
    assert r.choices[0].logprobs.tokens == one.choices[0].logprobs.tokens


# -- streaming ---------------------------------------------------------------------------------


def test_streamed_completion_choices_join_into_the_non_streamed_ones(served, client):
    body = {"model": "all-r16", "prompt": ["Pack my box", PROMPT], "n": 3, "seed": 11, "max_tokens": 8,
            "temperature": 1.0, "ignore_eos": True, "logprobs": 2, "echo": True,
            "stream_options": {"include_usage": True}}
    # (stream_options are the stream's: without one, a 400, as vLLM answers)
    whole = httpx.post(served.url + "/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"},
                       timeout=60).json()
    chunks = sse_chunks(served, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    joined = {k: {"text": "", "tokens": [], "token_logprobs": [], "text_offset": [], "finish": []} for k in range(6)}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        j = joined[c["index"]]
        j["text"] += c["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            j[key] += c["logprobs"][key]
        if c["finish_reason"] is not None:
            j["finish"].append(c["finish_reason"])
    indices = [ch["choices"][0]["index"] for ch in chunks[:-1]]
    assert indices != sorted(indices)  # the choices' chunks interleave
    for k, c in enumerate(whole["choices"]):
        assert c["index"] == k
        j = joined[k]
        assert j["text"] == c["text"] and j["finish"] == [c["finish_reason"]]  # one final chunk per choice
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert j[key] == c["logprobs"][key], (k, key)
    assert len({c["text"] for c in whole["choices"]}) > 2


def test_streamed_chat_choices_join_into_the_non_streamed_ones(served, client):
    kw = dict(model="patterns", messages=MSGS, n=3, seed=9, logprobs=True, top_logprobs=1, **SAMPLED)
    whole = client.chat.completions.create(**kw)
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    tokens: dict[int, list[str]] = {0: [], 1: [], 2: []}
    roles, finishes, usage = [], [], None
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if not ch.choices:
            usage = ch.usage
            continue
        (c,) = ch.choices
        if c.delta.role:
            roles.append(c.index)
        parts[c.index].append(c.delta.content or "")
        tokens[c.index] += [t.token for t in (c.logprobs.content if c.logprobs else [])]
        if c.finish_reason:
            finishes.append(c.index)
    assert sorted(roles) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert ["".join(parts[j]) for j in range(3)] == texts(whole)
    assert [tokens[j] for j in range(3)] == [[t.token for t in c.logprobs.content] for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 3 * 8


# -- refusals, disconnects, errors -------------------------------------------------------------


def test_n_above_the_cap_and_best_of_are_refused(served):
    before = aborted(served.engine)
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS})):
            r = c.post(path, json={"model": "tiny-llama", "n": MAX_N + 1, **body})
            assert r.status_code == 400 and error_of(r)["param"] == "n", r.text
            assert error_of(r)["type"] == "invalid_request_error"
            r = c.post(path, json={"model": "tiny-llama", "n": 2, "best_of": 3, **body})
            assert r.status_code == 400 and error_of(r)["param"] == "best_of"
            r = c.post(path, json={"model": "tiny-llama", "n": 0, **body})
            assert r.status_code == 400 and error_of(r)["param"] == "n"
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 5], "n": 2, "best_of": 2,
                                            "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        # A prompt past the context among several is refused before any is queued.
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [[1, 5], [5] * 300], "n": 3})
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
        # A bad prompt the engine refuses (empty) among several queues nothing: the choice
        # already queued (the first prompt's) is aborted. Its queueing and its abort reach the
        # engine thread as commands, after the response: wait for the abort's count, or the
        # next test would see it.
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [[1, 5], []], "n": 3})
        assert r.status_code == 400 and "empty" in error_of(r)["message"], r.text
    assert wait_until(lambda: aborted(served.engine) == before + 1 and not served.engine.has_work(), timeout=5)


def test_disconnect_aborts_every_choice(served):
    engine = served.engine
    before = aborted(engine)
    with httpx.Client(base_url=served.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": "qv-r8", "prompt": [1, 9, 9], "n": 3, "max_tokens": 200, "temperature": 1.0,
                "ignore_eos": True, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 6:
                    break
            assert len(engine.scheduler.running) == 3
    assert wait_until(lambda: not engine.scheduler.running and aborted(engine) == before + 3, timeout=5)
    assert engine.kv.num_free == engine.kv.rows


def test_failed_adapter_load_fails_all_choices(tmp_path):
    write_adapter(tmp_path / "bad", seed=0)
    corrupt(tmp_path / "bad")
    settings = ServerSettings(dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=4,
                              max_model_len=128, max_loras=2, max_lora_rank=8, adapter_cache_dir=str(tmp_path),
                              cuda_graphs=False, served_model_name="tiny", seed=1)
    engine = LLMEngine.from_settings(settings)
    body = {"model": "bad", "prompt": [1, 5, 7], "n": 3, "max_tokens": 4}
    with LiveServer(create_app(engine)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and error_of(r)["code"] == "adapter_load_failed"
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[0])["error"]["code"] == "adapter_load_failed" and events[1:] == ["[DONE]"]
        assert wait_until(lambda: not engine.has_work(), timeout=5)
        ok = c.post("/v1/completions", json=body | {"model": "tiny"})
        assert ok.status_code == 200 and [ch["index"] for ch in ok.json()["choices"]] == [0, 1, 2]


def test_disconnect_without_streaming_aborts_every_choice(served):
    engine = served.engine
    before = aborted(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/chat/completions", timeout=httpx.Timeout(5.0, read=0.05), json={
            "model": "tiny-llama", "messages": MSGS, "n": 4, "max_tokens": 200, "ignore_eos": True})
    assert wait_until(lambda: not engine.scheduler.running and aborted(engine) == before + 4, timeout=5)
    assert engine.kv.num_free == engine.kv.rows
