"""Request bodies past --max-request-bytes are refused (413, OpenAI error shape) before the
server reads them whole, whether the Content-Length says so or the body comes chunked; the
server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from .conftest import serve_tiny_llama
from .test_http import error_of

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def small(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters, max_request_bytes=LIMIT) as server:
        yield server


def body_of(size: int) -> bytes:
    prefix = b'{"model": "tiny-llama", "max_tokens": 1, "prompt": "'
    return prefix + b"a" * (size - len(prefix) - 2) + b'"}'


def test_a_body_over_the_limit_is_a_413_and_the_server_keeps_serving(small):
    with httpx.Client(base_url=small.url, timeout=60) as c:
        r = c.post("/v1/completions", content=body_of(LIMIT + 1), headers={"content-type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large", r.text

        def chunked():  # no Content-Length: the bound is found as the chunks arrive
            for _ in range(4):
                yield b" " * (LIMIT // 2)

        r = c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large", r.text
    with httpx.Client(base_url=small.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_a_body_at_the_limit_is_served_chunked_or_not(small):
    with httpx.Client(base_url=small.url, timeout=60) as c:
        r = c.post("/v1/completions", content=body_of(LIMIT), headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), r.text  # served (or refused for its length in tokens), not a 413
        assert r.status_code != 413

        def chunked():
            yield b'{"model": "tiny-llama", "max_tokens": 2, '
            yield b'"prompt": [5, 6, 7]}'

        r = c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


def test_streaming_still_sees_a_client_leave(small):
    with httpx.Client(base_url=small.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6], "max_tokens": 50,
                                                        "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    # the row the stream held is freed (the disconnect reached the app through the middleware)
    import time

    deadline = time.monotonic() + 10
    while small.engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not small.engine.scheduler.running
