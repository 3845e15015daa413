"""A body sent without a JSON content type (curl's -d alone sends
application/x-www-form-urlencoded) is named for what it is: a 415 saying the body must be
JSON, not a 400 about "a valid dictionary or object to extract fields from"."""

from __future__ import annotations

import httpx
import pytest

from .test_http import error_of

BODY = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}'


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
def test_a_body_that_is_not_sent_as_json_is_a_415_that_says_so(served, path, content_type):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post(path, content=BODY, headers={"content-type": content_type})
        assert r.status_code == 415, r.text
        error = error_of(r)
        assert "application/json" in error["message"] and content_type in error["message"]
        assert error["type"] == "invalid_request_error"


def test_json_bodies_keep_their_answers(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        for content_type in ("application/json", "application/json; charset=utf-8"):
            r = c.post("/v1/completions", content=BODY, headers={"content-type": content_type})
            assert r.status_code == 200, r.text
        r = c.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
        assert r.status_code == 400  # JSON, but not an object: the fields are what is wrong
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and error_of(r)["param"] == "model"
