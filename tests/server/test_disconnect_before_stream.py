"""A client that goes away after its request was read but before the response started (its
long prompt was still being tokenized, off the event loop) must still have its requests
aborted: Starlette's StreamingResponse sees the disconnect first and never starts the body
iterator, so nothing inside it may be what frees the batch rows."""

from __future__ import annotations

import json
import socket
import time

import pytest

from loraplex.server.api import completions

from .conftest import serve_tiny_llama


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters, max_num_seqs=4, max_model_len=512) as server:
        step = server.engine.step

        def slow_step():  # 500 tokens take seconds: an abort is told from a finish
            time.sleep(0.01)
            return step()

        server.engine.step = slow_step
        yield server


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def post_and_leave(url: str, path: str, body: dict, after: float = 0.1) -> None:
    """Send the whole request, then close the connection without reading a byte."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after)


def aborted(engine) -> float:
    return engine.metrics.registry.get_sample_value("loraplex_requests_aborted_total") or 0.0


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_completions_client_gone_while_its_prompt_is_tokenized(served, monkeypatch, stream, n):
    engine, app_engine = served.engine, None
    real = completions._prompts

    def slow_prompts(*a):  # the client leaves during this
        time.sleep(0.5)
        return real(*a)

    monkeypatch.setattr(completions, "_prompts", slow_prompts)
    before = aborted(engine)
    post_and_leave(served.url, "/v1/completions", {
        "model": "tiny-llama", "prompt": "a long prompt", "max_tokens": 500, "temperature": 0,
        "ignore_eos": True, "stream": stream, "n": n})
    assert wait_until(lambda: aborted(engine) == before + n, timeout=3), "its requests were not aborted"
    assert wait_until(lambda: not engine.scheduler.running and not engine.scheduler.waiting, timeout=2)
    assert engine.kv.num_free == engine.kv.rows
    assert wait_until(lambda: not served.server.config.app.state.engine._streams, timeout=2)


def test_chat_stream_client_gone_while_its_messages_are_tokenized(served, monkeypatch):
    engine = served.engine
    tok = engine.tokenizer
    real = tok.apply_chat_template

    def slow_template(*a, **kw):
        time.sleep(0.5)
        return real(*a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", slow_template)
    before = aborted(engine)
    post_and_leave(served.url, "/v1/chat/completions", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True})
    assert wait_until(lambda: aborted(engine) == before + 1, timeout=3), "its request was not aborted"
    assert wait_until(lambda: not engine.scheduler.running and not engine.scheduler.waiting, timeout=2)
    assert engine.kv.num_free == engine.kv.rows
