"""Bugs found in the HTTP layer, each shown over HTTP as a client meets it: a validation
error's `param` names the request's field (not pydantic's name for a member of a union
type)."""

from __future__ import annotations

import httpx
import pytest

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path, body, param", [
    # Fields whose type is a union (str | list[str] | ...): pydantic names each member in the
    # error's location ("prompt.str", "stop.list[str]"), which is no parameter of the API.
    ("/v1/completions", {"model": "tiny-llama", "prompt": [1, [2]]}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "stop": 5}, "stop"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    # /tokenize's body is a prompt's or a chat's: the one the body is, by its "messages".
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"model": 3, "prompt": "x"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
])
def test_a_union_fields_error_names_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for internal in ("Tokenize", "list[", ".str", "TextContent"):
        assert internal not in error["message"], error["message"]
