"""The server and a real node agent over HTTP: the version the plan names is the one a server
loads from the node's cache. The agent's cache keeps one version per name (a symlink to a
version folder whose .loraplex.json gives its sha256); a server must not take another
version found there (the previous one, while the agent has not staged the new one yet) for
the plan's."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from loraplex.node_agent.app import AgentConfig, create_app

from .test_adapter_cache import make_cache, write_adapter


class RealAgent:
    """loraplex's node agent (its aiohttp app, its store) on a loopback port, in a thread."""

    def __init__(self, cache_dir: Path):
        self.app = create_app(AgentConfig(cache_dir=cache_dir, budget_bytes=10**9))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "RealAgent":
        self.thread.start()

        async def start() -> int:
            self.runner = web.AppRunner(self.app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def stage(self, name: str, source: Path, sha256: str) -> dict:
        r = httpx.post(f"{self.url}/v1/stage", json={"name": name, "source": str(source), "sha256": sha256},
                       timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["adapter"]


def digest(path: Path) -> str:
    return hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.fixture
def versions(tmp_path) -> dict[str, tuple[Path, str]]:
    """Two versions of one adapter: v1 of rank 4, v2 of rank 2 (so a read shows which)."""
    v1 = write_adapter(tmp_path / "bucket" / "sql-v1", seed=1, rank=4)
    v2 = write_adapter(tmp_path / "bucket" / "sql-v2", seed=2, rank=2)
    return {"v1": (v1, digest(v1)), "v2": (v2, digest(v2))}


def test_a_new_version_in_the_plan_is_staged_not_read_from_the_old_one(tmp_path, versions):
    (v1, sha1), (v2, sha2) = versions["v1"], versions["v2"]
    cache_dir = tmp_path / "node-cache"
    with RealAgent(cache_dir) as agent:
        agent.stage("sql", v1, sha1)  # the node holds v1 (staged for the old plan)
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        try:
            cache.apply_plan({"adapters": [{"name": "sql", "source": str(v2), "sha256": sha2}]})
            cache.prefetch("sql").result(30)
            e = cache.table.entries["sql"]
            assert e.spec.max_rank == 2 and e.id.digest == sha2  # v2's files, not v1's
            assert httpx.get(f"{agent.url}/v1/adapters").json()["adapters"][0]["sha256"] == sha2
        finally:
            cache.close()


def test_the_version_on_disk_is_read_when_it_is_the_plans(tmp_path, versions):
    (v1, sha1) = versions["v1"]
    cache_dir = tmp_path / "node-cache"
    with RealAgent(cache_dir) as agent:
        agent.stage("sql", v1, sha1)
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        try:
            cache.apply_plan({"adapters": [{"name": "sql", "source": "s3://nowhere/sql", "sha256": sha1}]})
            assert cache.tier_of("sql") == "disk"
            cache.prefetch("sql").result(30)  # no staging call needed (the source is unreachable)
            assert cache.table.entries["sql"].spec.max_rank == 4
        finally:
            cache.close()


def test_another_version_staged_under_the_name_meanwhile_fails_the_load(tmp_path, versions, monkeypatch):
    """Two adapters of one name (two namespaces' on one node) take turns in the node's cache:
    a load that finds the other one after staging its own fails with the reason, it never
    serves the other's weights as its own."""
    from loraplex.server import adapter_loader
    from loraplex.server.adapter_sources import AdapterLoadError

    (v1, sha1), (v2, sha2) = versions["v1"], versions["v2"]
    cache_dir = tmp_path / "node-cache"
    with RealAgent(cache_dir) as agent:
        real = adapter_loader.fetch_adapter

        def fetch_then_lose_the_race(*args, **kw):
            path = real(*args, **kw)  # stages v2 ...
            agent.stage("sql", v1, sha1)  # ... and the other namespace's server stages its own
            return path

        monkeypatch.setattr(adapter_loader, "fetch_adapter", fetch_then_lose_the_race)
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        try:
            cache.apply_plan({"adapters": [{"name": "sql", "source": str(v2), "sha256": sha2}]})
            with pytest.raises(AdapterLoadError, match="another adapter of that name") as err:
                cache.prefetch("sql").result(30)
            assert err.value.reason == "fetch" and cache.num_free == 2
        finally:
            cache.close()


def test_a_new_version_is_fetched_again_without_a_node_agent(tmp_path, versions):
    """The server's own http(s) fetch (no node agent) records the version it fetched, so a
    new sha256 in the plan fetches the new version instead of reading the old one."""
    from .test_adapter_cache import _Files

    sha1, sha2 = versions["v1"][1], versions["v2"][1]
    with _Files(tmp_path / "bucket") as bucket:
        cache = make_cache(tmp_path / "cache", slots=1)
        try:
            cache.apply_plan({"adapters": [{"name": "sql", "source": f"{bucket.url}/sql-v1", "sha256": sha1}]})
            cache.prefetch("sql").result(30)
            assert cache.table.entries["sql"].spec.max_rank == 4
            cache.evict("sql")
            cache.host.discard("sql")
            cache.apply_plan({"adapters": [{"name": "sql", "source": f"{bucket.url}/sql-v2", "sha256": sha2}]})
            cache.prefetch("sql").result(30)
            assert cache.table.entries["sql"].spec.max_rank == 2
        finally:
            cache.close()


def test_without_a_digest_the_source_tells_the_versions_apart(tmp_path, versions):
    """sha256 is optional in a LoRAAdapter: then the node agent stages a source as found and
    a new source is a new version (node_agent/store.py is_version); the server tells them
    apart the same way."""
    (v1, _), (v2, _) = versions["v1"], versions["v2"]
    cache_dir = tmp_path / "node-cache"
    with RealAgent(cache_dir) as agent:
        r = httpx.post(f"{agent.url}/v1/stage", json={"name": "sql", "source": str(v1)}, timeout=30)
        assert r.status_code == 200, r.text
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        try:
            cache.apply_plan({"adapters": [{"name": "sql", "source": str(v2)}]})
            cache.prefetch("sql").result(30)
            assert cache.table.entries["sql"].spec.max_rank == 2
        finally:
            cache.close()


@pytest.mark.parametrize("uri, shown", [
    ("https://robot:pa55@host:8443/a/b/?sig=x", "https://host:8443/a/b/"),
    ("https://host/a?token=y", "https://host/a"),
    ("/mnt/adapters/a", "/mnt/adapters/a"),
    (None, None),
])
def test_the_servers_redact_drops_the_query_and_the_user_info(uri, shown):
    """What GET /v1/adapters, the logs and the server's own fetch record show of a source."""
    from loraplex.server.adapter_sources import redact

    assert redact(uri) == shown
