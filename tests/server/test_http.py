"""The OpenAI-compatible server over real HTTP: uvicorn on a loopback port, httpx and the
official openai client, streaming and not."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from loraplex.server.tokenizer import Tokenizer

from .conftest import ADAPTERS, make_hf_base, make_peft_adapter, serve_tiny_llama
from .test_parity import hf_greedy, prompts_for

MAX_NEW = 6


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    """conftest's server, with room for the adapters these tests load and longer prompts."""
    with serve_tiny_llama(hf_llama, llama_adapters, max_model_len=512, max_loras=8) as server:
        yield server


def wait_until(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


async def test_mixed_batch_over_http_matches_hf_peft(served, hf_llama, llama_adapters):
    names = ["tiny-llama", *ADAPTERS]
    prompts = prompts_for(names, seed=7)
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        async def one(name):
            r = await client.post("/v1/completions", json={
                "model": name, "prompt": prompts[name], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()
        results = await asyncio.gather(*(one(n) for n in names))
    tok = Tokenizer(hf_llama)
    for name, body in zip(names, results):
        want = hf_greedy(hf_llama, llama_adapters.get(name), prompts[name], MAX_NEW)
        assert body["choices"][0]["text"] == tok.decode(want), name
        assert body["usage"] == {"prompt_tokens": len(prompts[name]), "completion_tokens": MAX_NEW,
                                 "total_tokens": len(prompts[name]) + MAX_NEW}
        assert body["choices"][0]["finish_reason"] == "length"


def test_openai_client_completions_and_chat(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    ids = sorted(m.id for m in client.models.list().data)
    assert ids == sorted(["tiny-llama", *ADAPTERS])

    c = client.completions.create(model="qv-r8", prompt="The quick brown fox", max_tokens=5, temperature=0, seed=1)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="qv-r8", prompt="The quick brown fox", max_tokens=5, temperature=0, stream=True) if ch.choices)
    assert streamed == c.choices[0].text

    msgs = [{"role": "user", "content": "hello!"}]
    chat = client.chat.completions.create(model="all-r16", messages=msgs, max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="all-r16", messages=msgs, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}) if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content



def test_chat_text_parts_join_with_newlines_as_vllm_does(served):
    # vLLM renders a message's text parts as one string joined by "\n"; joined by "" the
    # template saw "Question:What is it?" and the adapter another prompt than on vLLM.
    parts = [{"type": "text", "text": "Question:"}, {"type": "text", "text": "What is it?"}]
    with httpx.Client(base_url=served.url, timeout=30) as c:
        def reply(content):
            r = c.post("/v1/chat/completions", json={"model": "qv-r8", "max_tokens": 6, "temperature": 0,
                                                     "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]
        assert reply(parts) == reply("Question:\nWhat is it?")
        assert reply(parts[:1]) == reply("Question:")  # one part: its text as it is


def test_seeded_sampling_is_reproducible_over_http(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    kw = dict(model="patterns", prompt="Pack my box", max_tokens=8, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    a = client.completions.create(seed=123, **kw).choices[0].text
    b = client.completions.create(seed=123, **kw).choices[0].text
    assert a == b


def test_seeds_are_int64(served):
    """As vLLM takes them: any int64 is served; one past its ends is a 400 naming the field."""
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for seed in (-(1 << 63), -5, (1 << 63) - 1):
            r = c.post("/v1/completions", json={"model": "patterns", "prompt": "Pack", "max_tokens": 2, "seed": seed,
                                                "temperature": 1.0, "n": 2})
            assert r.status_code == 200, r.text
        for seed in (1 << 63, -(1 << 63) - 1):
            r = c.post("/v1/completions", json={"model": "patterns", "prompt": "Pack", "max_tokens": 2, "seed": seed})
            assert r.status_code == 400 and error_of(r)["param"] == "seed", r.text


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_error_shapes(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
        r = c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"
        r = c.post("/v1/completions", json={"prompt": "no model"})
        assert r.status_code == 400 and "model" in error_of(r)["message"]
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "temperature": 7})
        assert r.status_code == 400 and error_of(r)["param"] == "temperature"
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [5] * 600})
        assert r.status_code == 400 and "maximum context length" in error_of(r)["message"]
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [5] * 10, "max_tokens": 509})
        assert r.status_code == 400
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "n": 17})
        assert r.status_code == 400
        # Stop strings are checked at every step on the engine thread: their number and length
        # are bounded (a 30,000-character one cost every row ~12 ms a step).
        for stop in (["s"] * 17, "x" * 257, ["ok", "y" * 300]):
            for path, body in (("/v1/completions", {"prompt": "x"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
                r = c.post(path, json={"model": "tiny-llama", "stop": stop, "max_tokens": 2, **body})
                assert r.status_code == 400 and error_of(r)["param"] == "stop", (path, r.text)
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2,
                                            "stop": ["s"] * 16})
        assert r.status_code == 200
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "stop": "z" * 256})
        assert r.status_code == 200
        # What the server does not implement is refused by name, not silently dropped; neutral
        # values (as some clients always send) are served.
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for field, value in (("response_format", {"type": "structural_tag"}), ("tools", [tool])):
            r = c.post("/v1/chat/completions", json=chat | {field: value})
            # (chat takes tools; its default tool_choice, auto, needs a parser this server lacks)
            assert r.status_code == 400 and error_of(r)["param"] == ("tool_choice" if field == "tools" else field), \
                (field, r.text)
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "tools": [tool]})
        assert r.status_code == 400 and error_of(r)["param"] == "tools", r.text
        for field, value in (("response_format", {"type": "text"}), ("tools", [])):
            assert c.post("/v1/chat/completions", json=chat | {field: value}).status_code == 200, field
        # logit_bias is served (test_sampling_logit_bias.py); a bias past OpenAI's range is refused by name.
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "logit_bias": {"5": -101}})
        assert r.status_code == 400 and error_of(r)["param"] == "logit_bias"
        for echo in (False, True):  # echo decodes the ids: they are checked before
            for ids in ([-1, 5], [10**9], [[1, 2], [3, 2**40]]):
                r = c.post("/v1/completions", json={"model": "qv-r8", "prompt": ids, "echo": echo, "max_tokens": 1})
                assert r.status_code == 400 and "outside the vocabulary" in error_of(r)["message"], (ids, r.text)
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").json()["status"] == "ready"
        metrics = c.get("/metrics").text
        assert "loraplex_generation_tokens_total" in metrics and "vllm:lora_requests_info" in metrics



def test_a_huge_top_k_is_served_and_the_engine_keeps_running(served):
    # top_k has no upper bound in the API; 10**20 once overflowed the sampler's int64 tensor
    # inside the engine thread, which stopped the engine: every later request got a 503.
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for top_k in (10**20, 2**63):
            r = c.post("/v1/completions", json={"model": "qv-r8", "prompt": "hi", "max_tokens": 2, "top_k": top_k})
            assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 2, "top_k": 10**20, "stream": True})
        assert r.status_code == 200 and '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert c.get("/healthz").status_code == 200
        assert c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).status_code == 200



@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", '{"model": "tiny-llama", "prompt": "hi \\ud800 there"}', "prompt"),
    ("/v1/completions", '{"model": "tiny-llama", "prompt": ["ok", "\\udfff"], "echo": true}', "prompt.1"),
    ("/v1/completions", '{"model": "tiny-\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", '{"model": "tiny-llama", "prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/chat/completions", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "qv-r8", "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "a\\udc00"}]}]}', "messages.0.content.0.text"),
    ("/v1/load_lora_adapter", '{"lora_name": "x\\ud800", "lora_path": "/nowhere"}', "lora_name"),
    ("/v1/sessions", '{"model": "\\ud800"}', "model"),
])
def test_an_unpaired_surrogate_is_a_400_not_a_500(served, path, body, where):
    # JSON may escape half a surrogate pair alone; decoded, it is a str no tokenizer takes and
    # no UTF-8 response can quote (the 404 for an unknown model names it): each was a 500.
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert where in error_of(r)["message"] and "surrogate" in error_of(r)["message"]
        # A pair that makes one character is text, and served.
        ok = c.post("/v1/completions", content=b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude00", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text


def test_load_unload_and_refused_adapters(served, hf_llama, tmp_path):
    # Same shapes, other weights: its adapters fit (shapes are what the server can check).
    sibling_base = make_hf_base(tmp_path / "sibling-base", "llama", seed=9)
    from transformers import AutoConfig, AutoModelForCausalLM
    small = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    small.save_pretrained(tmp_path / "small-base")
    refused = {
        "other-shapes": make_peft_adapter(tmp_path / "small-base", tmp_path / "r1", seed=1, r=8, lora_alpha=8,
                                          target_modules=["q_proj"]),
        "rank-too-big": make_peft_adapter(hf_llama, tmp_path / "r2", seed=2, r=32, lora_alpha=8,
                                          target_modules=["q_proj"]),
        "embeddings": make_peft_adapter(hf_llama, tmp_path / "r3", seed=3, r=4, lora_alpha=8,
                                        target_modules=["embed_tokens", "q_proj"]),
    }
    good = make_peft_adapter(sibling_base, tmp_path / "good", seed=4, r=8, lora_alpha=8, target_modules=["v_proj", "up_proj"])
    probe = {"model": "qv-r8", "prompt": [1, 5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        before = c.post("/v1/completions", json=probe).json()["choices"][0]["text"]
        reasons = {}
        for name, path in refused.items():
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 400, (name, r.text)
            reasons[name] = error_of(r)["message"]
        assert "do not fit the base" in reasons["other-shapes"]
        assert "rank 32 exceeds" in reasons["rank-too-big"]
        assert "embed_tokens" in reasons["embeddings"]
        # A path that holds no adapter is a 404, as vLLM answers "No adapter found": no such
        # folder, or a folder without adapter_config.json.
        (tmp_path / "empty").mkdir()
        for where in ("nowhere", "empty"):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "missing", "lora_path": str(tmp_path / where)})
            assert r.status_code == 404, r.text
            assert error_of(r)["type"] == "not_found_error" and error_of(r)["code"] == "adapter_not_found"
            assert error_of(r)["param"] == "lora_path" and str(tmp_path / where) in error_of(r)["message"]
        # The others keep serving, unchanged.
        assert c.post("/v1/completions", json=probe).json()["choices"][0]["text"] == before
        ids = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert not ids & set(refused)

        r = c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(good)})
        assert r.status_code == 200, r.text
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(good)}).status_code == 400
        assert "late" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        r = c.post("/v1/completions", json=probe | {"model": "late"})
        assert r.status_code == 200
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert c.post("/v1/completions", json=probe | {"model": "late"}).status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
        assert c.post("/v1/completions", json=probe).json()["choices"][0]["text"] == before


def only_running(engine):
    running = list(engine.scheduler.running.values())
    return running[0] if len(running) == 1 else None


def test_disconnect_mid_stream_frees_the_row(served):
    engine = served.engine
    with httpx.Client(base_url=served.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": "all-r16", "prompt": [1, 9, 9], "max_tokens": 500, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            got = []
            for line in lines:
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
                if len(got) >= 3:
                    break
            req = only_running(engine)
            assert req is not None and req.adapter == "all-r16"
    # The client has gone: the row is freed long before 500 tokens.
    assert wait_until(lambda: not engine.scheduler.running, timeout=5)
    assert req.finish_reason == "abort" and len(req.output_ids) < 500
    assert engine.kv.num_free == engine.kv.rows


def aborted(engine) -> float:
    return engine.metrics.registry.get_sample_value("loraplex_requests_aborted_total")


def test_disconnect_without_streaming_frees_the_row(served):
    engine = served.engine
    before = aborted(engine)
    errors = ErrorRecords()
    logging.getLogger("uvicorn.error").addHandler(errors)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", timeout=httpx.Timeout(5.0, read=0.05), json={
                "model": "tiny-llama", "prompt": [1, 4, 4], "max_tokens": 500, "temperature": 0,
                "ignore_eos": True})
        # The row leaves the batch a moment before the abort is counted, in the same step.
        assert wait_until(lambda: not engine.scheduler.running and aborted(engine) == before + 1, timeout=5)
        assert engine.kv.num_free == engine.kv.rows
        time.sleep(0.1)  # the handler returns after the abort
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert errors.records == []  # a client that leaves is no "Exception in ASGI application"


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())
