"""GET /v1/models/{model}: the official client's `models.retrieve`, for the base, an adapter
(a slash in its name too) and an unknown name, each card as the list gives it."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import ADAPTERS
from .test_http import error_of


def test_retrieve_each_listed_model_as_the_list_gives_it(served, llama_adapters):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    with httpx.Client(base_url=served.url, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "acme/qv", "lora_path": str(llama_adapters["qv-r8"])})
        assert r.status_code == 200, r.text
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert set(listed) == {"tiny-llama", "acme/qv", *ADAPTERS}
        for name, card in listed.items():
            r = c.get(f"/v1/models/{name}")
            assert r.status_code == 200, (name, r.text)
            assert {k: v for k, v in r.json().items() if k != "created"} == \
                {k: v for k, v in card.items() if k != "created"}
            model = client.models.retrieve(name)
            assert model.id == name and model.object == "model" and model.owned_by == card["owned_by"]
        assert c.get("/v1/models/acme%2Fqv").json()["parent"] == "tiny-llama"


@pytest.mark.parametrize("name", ["nope", "acme/nope"])
def test_retrieve_an_unknown_model_is_a_404_in_the_openai_shape(served, name):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        r = c.get(f"/v1/models/{name}")
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found" and name in error_of(r)["message"]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)
