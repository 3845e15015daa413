"""Adapter names with a slash ("org/sql-lora", as Hugging Face repositories are named) are
refused where a name enters (server/adapter_names.py: a name is a directory in the adapter
caches and one segment of the /v1/adapters/{name} URLs); a route that takes a name in its path
answers such a name as an unknown model, in the OpenAI error shape."""

from __future__ import annotations

import httpx

from .test_http import error_of


def test_a_slashed_adapter_name_is_refused_at_load(served, llama_adapters):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "acme/sql-lora",
                                                 "lora_path": str(llama_adapters["qv-r8"])})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_adapter_name", r.text
        assert "/" in error_of(r)["message"]


def test_an_unknown_slashed_name_is_a_model_not_found(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        for action in ("pin", "unpin", "prefetch"):
            r = c.post(f"/v1/adapters/acme/nope/{action}")
            assert r.status_code == 404 and error_of(r)["code"] == "model_not_found", (action, r.text)
            assert "acme/nope" in error_of(r)["message"]
