"""The node agent's own API key, over real HTTP on 127.0.0.1: without one the API is open as
before; with one, listing the node's adapters and starting sessions need it (401 in the API's
error shape, with `WWW-Authenticate: Bearer`), while /v1/stage (the servers call it, and hold
no agent key), /healthz and /metrics stay open."""

from __future__ import annotations

import pytest

from loraplex.node_agent.app import AgentConfig

from .test_app import session_agent

KEY = "sk-agent-1"

GUARDED = [
    # (method, path, JSON body)
    ("GET", "/v1/adapters", None),
    ("POST", "/v1/sessions", {"model": "chat"}),
    ("DELETE", "/v1/adapters", None),  # under /v1/ but /v1/stage: the key before the route's answer
    ("GET", "/v1/nope", None),
]


async def test_without_a_key_every_endpoint_is_open_as_before(tmp_path, object_store, client_factory,
                                                              fake_server):
    client = await session_agent(tmp_path, object_store, client_factory, fake_server, None)
    for headers in ({}, {"Authorization": "Bearer anything"}):
        r = await client.get("/v1/adapters", headers=headers)
        assert r.status == 200, await r.text()
        r = await client.post("/v1/sessions", json={"model": "chat"}, headers=headers)
        assert r.status == 200, await r.text()
    assert ("prefetch", "chat", "wait=false") in fake_server.calls


@pytest.mark.parametrize("authorization", [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Bearer sk-agent-2",
    f"Bearer {KEY}x",
    f"Basic {KEY}",
    KEY,
])
@pytest.mark.parametrize("method,path,body", GUARDED)
async def test_with_a_key_a_request_without_it_is_a_401(tmp_path, client_factory, authorization,
                                                       method, path, body):
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, api_key=KEY))
    headers = {} if authorization is None else {"Authorization": authorization}
    r = await client.request(method, path, json=body, headers=headers)
    assert r.status == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert r.content_type == "application/json"
    err = (await r.json())["error"]
    assert set(err) == {"reason", "message"} and err["reason"] == "InvalidAPIKey"
    assert "Authorization: Bearer" in err["message"] and KEY not in err["message"]
    said = "No API key" if authorization in (None, "", "Bearer", "Bearer ", f"Basic {KEY}", KEY) else "Incorrect API key"
    assert err["message"].startswith(said), err["message"]


async def test_with_a_key_the_right_key_is_served(tmp_path, object_store, client_factory, fake_server):
    client = await session_agent(tmp_path, object_store, client_factory, fake_server, KEY)
    r = await client.post("/v1/sessions", json={"model": "chat"})
    assert r.status == 401
    assert not [c for c in fake_server.calls if c[0] == "prefetch"], "a refused session warmed a server"
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme in any case, as the servers take it
        r = await client.get("/v1/adapters", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status == 200, await r.text()
        assert "adapters" in await r.json()
    r = await client.post("/v1/sessions", json={"model": "chat"}, headers={"Authorization": f"Bearer  {KEY} "})
    assert r.status == 200, await r.text()
    assert (await r.json())["adapter"]["name"] == "chat"
    assert ("prefetch", "chat", "wait=false") in fake_server.calls
    # With the key, the endpoints answer their own errors as before.
    r = await client.post("/v1/sessions", json={"model": "nope"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status == 404 and (await r.json())["error"]["reason"] == "UnknownAdapter"
    r = await client.get("/v1/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status == 404 and (await r.json())["error"]["reason"] == "NotFound"


async def test_with_a_key_stage_healthz_and_metrics_stay_open(tmp_path, object_store, client_factory):
    """The servers stage through /v1/stage and hold no agent key; the kubelet probes /healthz
    and Prometheus scrapes /metrics without one."""
    src = object_store.add("sql", tmp_path)
    client = await client_factory(AgentConfig(tmp_path / "cache", 10**9, api_key=KEY))
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = await client.post("/v1/stage", json={"name": "sql", "source": src,
                                                 "sha256": object_store.adapters["sql"].sha256}, headers=headers)
        assert r.status == 200, await r.text()
        r = await client.post("/v1/stage", data=b"{", headers={**headers, "Content-Type": "application/json"})
        assert r.status == 400 and (await r.json())["error"]["reason"] == "InvalidRequest"
        r = await client.get("/healthz", headers=headers)
        assert r.status == 200, await r.text()
        r = await client.get("/metrics", headers=headers)
        assert r.status == 200 and "loraplex_node_agent_staged_adapters" in await r.text()


def test_the_key_is_not_in_the_configs_repr(tmp_path):
    assert KEY not in repr(AgentConfig(tmp_path, 10**9, api_key=KEY))
