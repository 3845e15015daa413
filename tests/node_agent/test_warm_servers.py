"""The warmer's calls to the node's servers when one of them misbehaves: a server that is
down, hangs or answers errors must not hold up the others, nor the plan loop.

Real HTTP on 127.0.0.1: a healthy fake server (conftest.FakeServer) beside one that accepts
connections and never answers.
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraplex.node_agent.store import AdapterStore
from loraplex.node_agent.warmer import StaticServers, Warmer
from loraplex.server import api_keys
from loraplex.server.api_keys import WatchedFile, read_key_file

from .helpers import ConfigMapDir, plan_json

TIMEOUT = 0.5  # the warmer's per-call timeout in these tests


@pytest.fixture
async def hung_server():
    """Ready by /readyz, but every adapter call hangs (a server stuck in a long load)."""
    calls: list[str] = []
    release = asyncio.Event()

    async def readyz(request):
        return web.json_response({"ready": True})

    async def admin(request):
        calls.append(request.match_info["action"] + " " + request.match_info["name"])
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_post("/v1/adapters/{name}/{action}", admin)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    server.calls = calls
    server.base = str(server.make_url("")).rstrip("/")
    yield server
    release.set()
    await server.close()


async def _warmer(tmp_path, object_store, session, urls) -> Warmer:
    names = [f"p{i}" for i in range(4)]
    for i, n in enumerate(names):
        object_store.add(n, tmp_path, seed=i)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=names, others=[]))
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, discovery=StaticServers(urls, session),
                    server_timeout_seconds=TIMEOUT)
    assert await warmer.check_plan()
    await warmer.reconcile()
    return warmer


async def test_a_hung_server_does_not_hold_up_the_others(tmp_path, object_store, session, fake_server,
                                                         hung_server):
    """Two servers turn ready, the first hangs on every call. The warm-up of the healthy one
    used to wait for the hung one's calls, one timeout each (8 calls x 10 s here); now the
    servers are warmed side by side and a server that does not answer is given up on after
    one timeout, and tried again at the next check."""
    fake_server.ready = True
    warmer = await _warmer(tmp_path, object_store, session, [hung_server.base, fake_server.url])
    t0 = time.monotonic()
    warmed = await warmer.check_servers()
    elapsed = time.monotonic() - t0
    assert elapsed < 3 * TIMEOUT, elapsed
    assert warmed == [fake_server.url]  # the hung one is not counted as warm: tried again next time
    assert [(a, n) for a, n, _ in fake_server.calls] == [
        (a, f"p{i}") for i in range(4) for a in ("prefetch", "pin")]
    assert len(hung_server.calls) == 1  # given up on after its first call timed out
    t0 = time.monotonic()
    assert await warmer.check_servers() == []
    assert time.monotonic() - t0 < 3 * TIMEOUT
    assert len(hung_server.calls) == 2 and len(fake_server.calls) == 8


async def test_a_session_answers_without_waiting_on_a_hung_server(tmp_path, object_store, session, fake_server,
                                                                  hung_server):
    """A session start prefetches into every warm server: one that hangs costs one timeout
    overall, not one per server before it, and is reported as failed."""
    fake_server.ready = True
    warmer = await _warmer(tmp_path, object_store, session, [fake_server.url])
    await warmer.check_servers()
    warmer._ready.update({f"hung-{i}": hung_server.base for i in range(6)})  # six servers that hang
    t0 = time.monotonic()
    staged, results = await warmer.start_session("p1")
    assert time.monotonic() - t0 < 3 * TIMEOUT  # (one after the other: 6 timeouts)
    assert sorted(r.ok for r in results) == [False] * 6 + [True]


async def test_the_plan_loop_is_not_held_by_a_hung_server(tmp_path, object_store, session, fake_server,
                                                         hung_server):
    """A new plan re-warms the servers already warm; with several of them hanging, the
    reconcile (and so the plan loop that stages new adapters) waits one timeout, not one
    per server and call."""
    fake_server.ready = True
    warmer = await _warmer(tmp_path, object_store, session, [fake_server.url])
    await warmer.check_servers()
    warmer._ready.update({f"hung-{i}": hung_server.base for i in range(3)})
    t0 = time.monotonic()
    await warmer.reconcile()
    assert time.monotonic() - t0 < 3 * TIMEOUT


async def test_a_pin_the_plan_drops_is_taken_back_from_the_servers(tmp_path, object_store, session, fake_server):
    """The warmer pins the plan's pinned set on each server through the API; a server keeps
    an API pin apart from its own plan's pins, and drops it only on /unpin. The warmer never
    called /unpin: an adapter the plan stopped pinning (a lower priority, or deleted) stayed
    pinned on every server it had warmed, holding a slot, for the life of the pod. Now a
    plan change unpins what the plan pinned before and pins no more, on every warm server,
    and so does the warm-up after a restart of the agent for the last run's pins."""
    for i, n in enumerate(["p1", "p2", "p3"]):
        object_store.add(n, tmp_path, seed=i)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["p1", "p2", "p3"]))
    fake_server.ready = True
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, discovery=StaticServers([fake_server.url], session))
    assert await warmer.check_plan()
    await warmer.reconcile()
    await warmer.check_servers()
    assert {n for a, n, _ in fake_server.calls if a == "pin"} == {"p1", "p2", "p3"}
    fake_server.calls.clear()
    previous = warmer.plan
    cm.write(plan_json(object_store, pinned=["p1"], others=["p2"]))  # p2 unpinned, p3 deleted
    assert await warmer.check_plan()
    await warmer.reconcile(previous)
    unpins = {n for a, n, _ in fake_server.calls if a == "unpin"}
    assert unpins == {"p2", "p3"}
    assert [n for a, n, _ in fake_server.calls if a == "pin"] == ["p1"]

    # The agent restarts; the server, still up, holds the pins of its last run.
    fake_server.calls.clear()
    cm.write(plan_json(object_store, pinned=[], others=["p1", "p2"]))  # changed while it was down
    restarted = Warmer(AdapterStore(tmp_path / "cache", 10**9, session=session), cm.path, session,
                       discovery=StaticServers([fake_server.url], session))
    assert await restarted.check_plan()
    await restarted.reconcile()
    await restarted.check_servers()
    assert {n for a, n, _ in fake_server.calls if a == "unpin"} >= {"p1"}
    assert [c for c in fake_server.calls if c[0] == "pin"] == []


async def test_a_session_for_an_adapter_that_failed_for_good_does_not_download_it_again(
        tmp_path, object_store, session):
    """A plan adapter whose file does not match its digest fails for good: the plan loop
    tries it again only when the plan gives a new digest or source. A session start for it
    downloaded the whole adapter again, each time, to fail the same way (chatty clients of a
    bad adapter: a download per session). It now answers the recorded failure at once."""
    from loraplex.node_agent.store import StoreError

    object_store.add("bad", tmp_path)
    doc = plan_json(object_store, others=["bad"])
    doc["adapters"][0]["sha256"] = "f" * 64
    doc["pinned"] = ["bad"]
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(doc)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session)
    assert await warmer.check_plan()
    await warmer.reconcile()
    assert object_store.gets["bad/adapter_model.safetensors"] == 1
    for _ in range(3):
        with pytest.raises(StoreError) as err:
            await warmer.start_session("bad")
        assert err.value.reason == "DigestMismatch" and err.value.status == 422
    assert object_store.gets["bad/adapter_model.safetensors"] == 1


async def test_the_servers_api_key_goes_to_the_servers_and_never_to_a_source(tmp_path, object_store, session,
                                                                            fake_server):
    """Servers started with --api-key answer 401 to a call without it: the agent sends its
    --server-api-key on the calls that warm them, and only there (the same HTTP session
    downloads adapters from their sources, which must never see it)."""
    fake_server.ready = True
    names = ["p0", "p1"]
    for i, n in enumerate(names):
        object_store.add(n, tmp_path, seed=i)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=names, others=[]))
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, discovery=StaticServers([fake_server.url], session),
                    server_timeout_seconds=TIMEOUT, server_api_key="sk-admin-1")
    assert await warmer.check_plan()
    await warmer.reconcile()
    await warmer.check_servers()
    assert {(a, n) for a, n, _ in fake_server.calls} >= {("prefetch", "p0"), ("pin", "p0"), ("prefetch", "p1")}
    assert set(fake_server.authorizations) == {"Bearer sk-admin-1"}
    assert object_store.authorizations and set(object_store.authorizations) == {None}


async def test_a_servers_key_file_is_read_as_it_is_now_so_a_rotated_key_needs_no_restart(
        tmp_path, object_store, session, fake_server, monkeypatch):
    """--server-api-key-file (the chart mounts the Secret): each warm-up sends the key the file
    holds then; one swapped in (as the kubelet updates a Secret's mount) is sent from then on."""
    monkeypatch.setattr(api_keys, "RELOAD_SECONDS", 0.0)
    fake_server.ready = True
    key_file = tmp_path / "server-api-key"
    key_file.write_text("sk-admin-1\n")
    warmer = Warmer(AdapterStore(tmp_path / "cache", 10**9, session=session), None, session,
                    server_timeout_seconds=TIMEOUT, server_api_key=WatchedFile(key_file, read_key_file))
    assert (await warmer.call_server(fake_server.url, "p0", "prefetch")).ok
    new = tmp_path / "server-api-key.new"
    new.write_text("sk-admin-2")
    os.replace(new, key_file)
    assert (await warmer.call_server(fake_server.url, "p0", "prefetch")).ok
    assert fake_server.authorizations[-2:] == ["Bearer sk-admin-1", "Bearer sk-admin-2"]
