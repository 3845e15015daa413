"""A session start's lease over real HTTP: `POST /v1/sessions` promises that the session's
first request hits, so the adapter it prefetched is held resident (a lease) until that
request comes, or the lease times out (--session-lease-seconds). A lease is weaker than a
pin: when every idle slot is leased, a request still gets one (the policy's pick among the
leased gives its lease up), and a lease never outlives its timeout."""

from __future__ import annotations

import time

import httpx

from .test_adapter_cache import check_invariants
from .test_adapter_cache_http import completion
from .test_cache_http_races import disk, rows, serve  # noqa: F401 (fixtures)


def test_a_session_start_keeps_its_adapter_resident_until_its_first_request(serve):
    """Two slots. A session for a starts (a resident), then requests for b and c come before
    a's first request: without a lease c took a's slot (LRU: a is the older idle one), and the
    session's first request missed, against the endpoint's promise."""
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/sessions", json={"model": "a"})
        assert r.status_code == 200 and r.json()["tier"] == "gpu", r.text
        assert rows(client)["a"]["leases"] == 1
        for name in ("b", "c"):
            assert client.post("/v1/completions", json=completion(name)).status_code == 200
        listing = rows(client)
        assert listing["a"]["tier"] == "gpu", listing["a"]
        assert client.post("/v1/completions", json=completion("a")).status_code == 200
        a = rows(client)["a"]
        assert (a["hits"], a["misses"], a["leases"]) == (1, 0, 0), a
    check_invariants(server.engine.adapters)


def test_when_every_slot_is_leased_a_request_still_gets_one(serve):
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in ("a", "b"):
            assert client.post("/v1/sessions", json={"model": name}).status_code == 200
        r = client.post("/v1/completions", json=completion("c"))
        assert r.status_code == 200, r.text
        listing = rows(client)
        assert listing["c"]["tier"] == "gpu"
        # One lease yielded (the policy's pick: a, the least recently used), the other held.
        assert listing["a"]["tier"] != "gpu" and listing["a"]["leases"] == 0, listing["a"]
        assert (listing["b"]["tier"], listing["b"]["leases"]) == ("gpu", 1), listing["b"]
    check_invariants(server.engine.adapters)


def test_a_lease_never_blocks_a_pin(serve):
    """A pin takes its share (all slots but one) even where every slot is leased."""
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in ("a", "b"):
            assert client.post("/v1/sessions", json={"model": name}).status_code == 200
        r = client.post("/v1/adapters/c/pin")
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while rows(client)["c"]["tier"] != "gpu":
            assert time.monotonic() < deadline, rows(client)["c"]
            time.sleep(0.02)
    check_invariants(server.engine.adapters)


def test_leases_time_out_and_an_unload_drops_them(serve):
    """Many session starts and no request: once the lease timeout passes, no slot is held by a
    lease (the policy chooses among every idle slot again), and an unload takes its leases."""
    server = serve()
    cache = server.engine.adapters
    cache.session_lease_s = 0.3
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(4):
            for name in ("a", "b", "c"):
                assert client.post("/v1/sessions", json={"model": name}).status_code == 200
        assert sum(r["leases"] for r in rows(client).values()) > 0
        time.sleep(0.4)
        assert all(r["leases"] == 0 for r in rows(client).values()), rows(client)
        with cache._lock:
            assert not any(e.leases for e in cache.table.entries.values())
        # The LRU order decides again: b and c resident, b the older: a request for a takes b's slot.
        resident = {n for n, r in rows(client).items() if r["tier"] == "gpu"}
        assert resident == {"b", "c"}, resident
        assert client.post("/v1/completions", json=completion("a")).status_code == 200
        assert {n for n, r in rows(client).items() if r["tier"] == "gpu"} == {"a", "c"}
        cache.session_lease_s = 60
        assert client.post("/v1/sessions", json={"model": "c"}).status_code == 200
        assert rows(client)["c"]["leases"] == 1
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200, r.text
        assert cache.table.entries.get("c") is None
    check_invariants(cache)
