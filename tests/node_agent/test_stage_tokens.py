"""--stage-token-audience: POST /v1/stage takes a service-account token of that audience,
reviewed by the Kubernetes API (TokenReview), and stages for the token's own namespace
alone: no token or a bad one is a 401, another namespace a 403, an API that cannot review a
503; the agent's API key passes; a review is kept a while, not asked again per stage."""

from __future__ import annotations

import pytest

from loraplex.node_agent.app import AGENT, AgentConfig
from loraplex.node_agent.cli import Settings as AgentSettings

AUDIENCE = "loraplex-node-agent"


async def _agent(tmp_path, kube_api, client_factory, **config):
    kube_api.tokens.update({
        "tok-acme": ("system:serviceaccount:acme:default", [AUDIENCE]),
        "tok-globex": ("system:serviceaccount:globex:default", [AUDIENCE]),
        "tok-api": ("system:serviceaccount:acme:default", ["https://kubernetes.default.svc"]),  # another audience
        "tok-user": ("jane@example.com", [AUDIENCE]),  # not a service account
    })
    return await client_factory(AgentConfig(tmp_path / "cache", 10**9, kube_api_url=kube_api.url,
                                            stage_token_audience=AUDIENCE, **config))


def _body(object_store, name, namespace="acme"):
    return {"name": name, "source": object_store.source(name), "namespace": namespace}


async def test_a_server_stages_its_own_namespaces_adapters_only(tmp_path, object_store, kube_api, client_factory):
    object_store.add("sql", tmp_path, seed=1)
    client = await _agent(tmp_path, kube_api, client_factory)
    ok = await client.post("/v1/stage", json=_body(object_store, "sql"), headers={"Authorization": "Bearer tok-acme"})
    assert ok.status == 200, await ok.text()
    assert (tmp_path / "cache" / ".namespaces" / "acme" / "sql").is_dir()
    other = await client.post("/v1/stage", json=_body(object_store, "sql", "globex"),
                              headers={"Authorization": "Bearer tok-acme"})
    assert other.status == 403 and (await other.json())["error"]["reason"] == "Forbidden"
    assert not (tmp_path / "cache" / ".namespaces" / "globex").exists()
    # No namespace: the cache's top folder, the agent's own --namespace's (none here): refused.
    top = await client.post("/v1/stage", json={"name": "sql", "source": object_store.source("sql")},
                            headers={"Authorization": "Bearer tok-acme"})
    assert top.status == 403


@pytest.mark.parametrize("header", [None, "Bearer nonsense", "Bearer tok-api", "Bearer tok-user", "Basic abc"])
async def test_no_token_or_a_bad_one_is_a_401(tmp_path, object_store, kube_api, client_factory, header):
    object_store.add("sql", tmp_path, seed=1)
    client = await _agent(tmp_path, kube_api, client_factory)
    r = await client.post("/v1/stage", json=_body(object_store, "sql"),
                          headers={"Authorization": header} if header else {})
    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert (await r.json())["error"]["reason"] == "Unauthorized"
    assert not (tmp_path / "cache" / ".namespaces").exists()


async def test_the_agents_key_passes_and_reviews_are_kept(tmp_path, object_store, kube_api, client_factory):
    object_store.add("sql", tmp_path, seed=1)
    object_store.add("chat", tmp_path, seed=2)
    client = await _agent(tmp_path, kube_api, client_factory, api_key="agent-key")
    keyed = await client.post("/v1/stage", json=_body(object_store, "sql", "globex"),
                              headers={"Authorization": "Bearer agent-key"})
    assert keyed.status == 200 and kube_api.reviews == []  # the key needs no review
    for name in ("sql", "chat", "sql"):
        r = await client.post("/v1/stage", json=_body(object_store, name), headers={"Authorization": "Bearer tok-acme"})
        assert r.status == 200
    assert len(kube_api.reviews) == 1 and kube_api.reviews[0]["spec"] == {"token": "tok-acme", "audiences": [AUDIENCE]}
    auth = client.server.app[AGENT].stage_auth
    auth.clock = lambda: 1e12  # the kept review has expired
    r = await client.post("/v1/stage", json=_body(object_store, "chat"), headers={"Authorization": "Bearer tok-acme"})
    assert r.status == 200 and len(kube_api.reviews) == 2


async def test_an_api_that_cannot_review_is_a_503(tmp_path, object_store, kube_api, client_factory):
    object_store.add("sql", tmp_path, seed=1)
    client = await _agent(tmp_path, kube_api, client_factory)
    kube_api.fail_reviews = 1
    r = await client.post("/v1/stage", json=_body(object_store, "sql"), headers={"Authorization": "Bearer tok-acme"})
    assert r.status == 503 and (await r.json())["error"]["reason"] == "TokenReviewFailed"
    again = await client.post("/v1/stage", json=_body(object_store, "sql"), headers={"Authorization": "Bearer tok-acme"})
    assert again.status == 200  # a failed review is not kept


def test_the_flag_needs_the_api():
    with pytest.raises(ValueError, match="stage-token-audience"):
        AgentSettings.from_env_and_args(["--cache-dir", "/tmp/c", "--budget-bytes", "1000",
                                         "--stage-token-audience", AUDIENCE], env={})
    s = AgentSettings.from_env_and_args(["--cache-dir", "/tmp/c", "--budget-bytes", "1000", "--stage-token-audience",
                                         AUDIENCE, "--kube-api-url", "https://10.0.0.1"], env={})
    assert s.agent_config().stage_token_audience == AUDIENCE


async def test_a_servers_fetch_sends_its_token_file_and_stages(tmp_path, object_store, kube_api, client_factory):
    """The server's side (adapter_sources.fetch_adapter with --node-agent-token-file) against
    this agent: its token file's token is reviewed, and the adapter lands in its namespace's
    folder, which is the server's --adapter-cache-dir."""
    import asyncio

    from loraplex.server.adapter_sources import AdapterLoadError, fetch_adapter

    object_store.add("sql", tmp_path, seed=1)
    client = await _agent(tmp_path, kube_api, client_factory)
    url = str(client.server.make_url("")).rstrip("/")
    token = tmp_path / "token"
    token.write_text("tok-acme\n")
    served = tmp_path / "cache" / ".namespaces" / "acme"
    path = await asyncio.to_thread(fetch_adapter, "sql", object_store.source("sql"), None, served, url,
                                   namespace="acme", agent_token_file=token)
    assert path == served / "sql" and (path / "adapter_config.json").is_file()
    token.write_text("tok-globex")  # another namespace's server token, asking for acme's folder
    with pytest.raises(AdapterLoadError, match="HTTP 403"):
        await asyncio.to_thread(fetch_adapter, "sql", object_store.source("sql"), None, served, url,
                                namespace="acme", agent_token_file=token)
