"""Every error of the node agent's HTTP API in its one shape, {"error": {"reason", "message"}},
including those aiohttp answers itself (unknown path, wrong method, body too large)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from loraplex.node_agent.app import AgentConfig, create_app


@pytest.fixture
async def client(tmp_path):
    c = TestClient(TestServer(create_app(AgentConfig(tmp_path / "cache", 10**9)), host="127.0.0.1"))
    await c.start_server()
    yield c
    await c.close()


@pytest.mark.parametrize("method,path,kw,status,reason,allow", [
    ("GET", "/v1/stage", {}, 405, "MethodNotAllowed", "POST"),
    ("DELETE", "/v1/adapters", {}, 405, "MethodNotAllowed", "GET"),
    ("GET", "/v1/sessions", {}, 405, "MethodNotAllowed", "POST"),
    ("GET", "/v1/nope", {}, 404, "NotFound", None),
    ("POST", "/v1/stage", {"data": b"x" * (2 << 20), "headers": {"Content-Type": "application/json"}},
     413, "RequestTooLarge", None),
])
async def test_errors_aiohttp_answers_are_in_the_api_shape(client, method, path, kw, status, reason, allow):
    r = await client.request(method, path, **kw)
    assert r.status == status
    assert r.content_type == "application/json", await r.text()
    err = (await r.json())["error"]
    assert err["reason"] == reason and err["message"]
    if allow is not None:
        assert allow in r.headers["Allow"] and allow in err["message"]


async def test_the_api_own_errors_keep_their_reasons(client):
    r = await client.post("/v1/stage", data=b"{", headers={"Content-Type": "application/json"})
    assert r.status == 400 and (await r.json())["error"]["reason"] == "InvalidRequest"
    r = await client.post("/v1/sessions", json={"model": "x"})
    assert r.status == 404 and (await r.json())["error"]["reason"] == "UnknownAdapter"
    r = await client.get("/healthz")
    assert r.status == 200


@pytest.mark.parametrize("namespace", [5, "", "Team_A", ["team-a"]])
async def test_a_session_naming_no_namespace_name_is_a_400_as_a_stage_is(client, namespace):
    """A `namespace` that cannot be one (not a DNS-1123 label) is the request's fault, as
    /v1/stage answers it, not a 404 'in no plan of namespace 5'."""
    for path, body in (("/v1/sessions", {"model": "x", "namespace": namespace}),
                       ("/v1/stage", {"name": "x", "source": "/x", "namespace": namespace})):
        r = await client.post(path, json=body)
        assert r.status == 400, (path, await r.text())
        err = (await r.json())["error"]
        assert err["reason"] == "InvalidRequest" and "namespace" in err["message"]
