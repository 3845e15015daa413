"""The adapter cache's HTTP API under races and admin calls, over real HTTP (uvicorn on
loopback): an unload while a prefetch or a session start waits, an unpin of a pin that waits
over the pins' share, and an unload of a pinned adapter."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from .test_adapter_cache import check_invariants, write_adapter
# serve: the fixture, on this module's own disk
from .test_adapter_cache_http import completion, gate_loads, serve  # noqa: F401
from .test_http import error_of


@pytest.fixture
def disk(tmp_path) -> Path:
    for i, name in enumerate(["a", "b", "c", "slow"]):
        write_adapter(tmp_path / name, seed=i)
    return tmp_path


def rows(client: httpx.Client) -> dict[str, dict]:
    return {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}


async def until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_an_unload_while_a_prefetch_or_session_waits_is_a_404_not_a_failed_load(serve):
    """One load worker, held by `slow`: a prefetch and a session start for `c` wait pending.
    An unload of `c` ends their wait. The adapter no longer exists: a 404 model_not_found (what
    every call naming it gets from now on), not a 500 adapter_load_failed saying that a load
    which never ran failed, which reads as a server fault and is retried as one."""
    server = serve(max_concurrent_loads=1)
    gate = gate_loads(server.engine, "slow")
    entries = server.engine.adapters.table.entries
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        slow = asyncio.create_task(client.post("/v1/adapters/slow/prefetch"))
        try:
            await until(lambda: "slow" in entries and entries["slow"].state == "loading")
            prefetch = asyncio.create_task(client.post("/v1/adapters/c/prefetch"))
            session = asyncio.create_task(client.post("/v1/sessions", json={"model": "c"}))
            await until(lambda: "c" in entries and len(entries["c"].waiters) == 2)
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
            assert r.status_code == 200, r.text
            for r in (await prefetch, await session):
                assert r.status_code == 404, r.text
                err = error_of(r)
                assert err["code"] == "model_not_found" and "'c'" in err["message"] and "unloaded" in err["message"]
        finally:
            gate.set()
        assert (await slow).status_code == 200
    check_invariants(server.engine.adapters)


def test_unpinning_a_pin_that_waits_over_the_share_calls_its_load_off(serve):
    """Two slots: a pinned and resident, c resident (used), b pinned over the pins' share and
    waiting (pin_pending). Unpinning b leaves nobody who wants b resident; its queued load
    must not run then, evicting c (an adapter in use by the traffic) for an adapter nobody
    asked for."""
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/v1/adapters/a/prefetch").status_code == 200
        assert client.post("/v1/adapters/a/pin").json()["tier"] == "gpu"
        assert client.post("/v1/completions", json=completion("c")).status_code == 200
        r = client.post("/v1/adapters/b/pin")
        assert r.json()["pin_pending"] and r.json()["state"] in ("staging", "pending")  # (its files checked first)
        deadline = time.monotonic() + 10
        while rows(client)["b"]["state"] != "pending":
            assert time.monotonic() < deadline, rows(client)["b"]
            time.sleep(0.01)
        r = client.post("/v1/adapters/b/unpin")
        assert r.status_code == 200 and not r.json()["pinned"]
        time.sleep(0.3)  # a load (wrongly) started would be done by now
        listing = rows(client)
        assert listing["c"]["tier"] == "gpu", listing["c"]
        assert listing["b"]["state"] == "idle" and listing["b"]["tier"] == "disk", listing["b"]
        # b still loads when asked for.
        assert client.post("/v1/adapters/b/prefetch").json()["tier"] == "gpu"
    check_invariants(server.engine.adapters)


def test_unloading_a_pinned_adapter_is_refused_until_it_is_unpinned(serve):
    """A pin means "keep it resident": an unload_lora_adapter of a pinned adapter dropped the
    pin with the row, silently (the name, found again on disk, came back unpinned: a plan's pin
    stayed lost until the plan changed). It is refused with a 409 naming the pin; after an
    unpin the unload goes through."""
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/v1/adapters/a/pin").status_code == 200
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 409, r.text
        err = error_of(r)
        assert err["code"] == "adapter_pinned" and err["param"] == "lora_name" and "unpin" in err["message"]
        assert rows(client)["a"]["pinned"]
        assert client.post("/v1/adapters/a/unpin").status_code == 200
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200 and r.text.startswith("Success"), r.text


def test_unloading_a_plan_pinned_adapter_is_refused(serve, tmp_path_factory):
    import json

    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.write_text(json.dumps({"pinned": ["b"], "adapters": [], "prefetch": []}))
    server = serve(plan_file=str(plan))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert rows(client)["b"]["pinned"]
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 409 and error_of(r)["code"] == "adapter_pinned", r.text
        assert rows(client)["b"]["pinned"]


def test_a_duplicate_load_names_the_name_not_the_path(serve, disk):
    """A load_lora_adapter of a name already known is a 400 about `lora_name` (code
    adapter_exists), as vLLM answers it; it was an `adapter_refused` about `lora_path`, which
    reads as "these files do not fit the base" for files that were never read."""
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in ("a", "x"):
            r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(disk / "b")})
            if name == "x":
                assert r.status_code == 200, r.text
                r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(disk / "b")})
            assert r.status_code == 400, r.text
            err = error_of(r)
            assert (err["param"], err["code"]) == ("lora_name", "adapter_exists"), err
            assert f"'{name}' is already loaded" in err["message"]
