"""Adapter names with a slash ("org/sql-lora", as Hugging Face repositories are named and as
vLLM users name their LoRA modules) over every route that takes a name in its path, as the
completions endpoints take them in the body."""

from __future__ import annotations

import httpx
import pytest

from .test_http import error_of

NAME = "acme/sql-lora"


@pytest.fixture(scope="module")
def slashed(served, llama_adapters):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": str(llama_adapters["qv-r8"])})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    return served


@pytest.mark.parametrize("spelling", [NAME, NAME.replace("/", "%2F")])
def test_pin_prefetch_unpin_an_adapter_whose_name_has_a_slash(slashed, spelling):
    with httpx.Client(base_url=slashed.url, timeout=60) as c:
        for action, pinned in (("pin", True), ("prefetch", True), ("unpin", False), ("prefetch?wait=false", False)):
            r = c.post(f"/v1/adapters/{spelling}/{action}")
            assert r.status_code in (200, 202), (action, r.text)
            assert r.json()["name"] == NAME and r.json()["pinned"] is pinned, (action, r.json())
        r = c.post("/v1/sessions", json={"model": NAME})
        assert r.status_code == 200 and r.json()["adapter"]["name"] == NAME


def test_an_unknown_slashed_name_is_a_model_not_found(slashed):
    with httpx.Client(base_url=slashed.url, timeout=60) as c:
        for action in ("pin", "unpin", "prefetch"):
            r = c.post(f"/v1/adapters/acme/nope/{action}")
            assert r.status_code == 404 and error_of(r)["code"] == "model_not_found", (action, r.text)
            assert "acme/nope" in error_of(r)["message"]
