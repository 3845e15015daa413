"""Stage first: an adapter not on local disk is fetched from its source (or through the node
agent) before its load takes a GPU slot and a load worker, so a slow fetch never holds up
the cold loads from host memory or disk behind it (head-of-line blocking under churn).

The slow source here is a loopback HTTP server that sleeps before it answers (the server's
own http fetch, and the node agent's /v1/stage), or fetch_adapter made slow."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from loraplex.server import adapter_loader
from loraplex.server.adapter_sources import AdapterLoadError

from .test_adapter_cache import _Files, check_invariants, make_cache, wait_ready, write_adapter

SLOW_S = 1.5


@pytest.fixture
def bucket(tmp_path) -> Path:
    root = tmp_path / "bucket"
    for i, name in enumerate(("slow1", "slow2")):
        write_adapter(root / name, seed=20 + i)
    return root


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    d = tmp_path / "cache"
    for i, name in enumerate("abc"):
        write_adapter(d / name, seed=i)
    return d


def _time_to_ready(cache, name: str) -> float:
    t0 = time.monotonic()
    cache.acquire(name)
    wait_ready(cache, name, timeout=30)
    return time.monotonic() - t0


@pytest.mark.parametrize("through", ["http", "agent"])
@pytest.mark.parametrize("loads", [1, 2])
def test_a_slow_fetch_does_not_hold_up_a_load_from_disk_or_host(bucket, cache_dir, through, loads):
    with _Files(bucket, cache_dir, delay=SLOW_S) as files:
        cache = make_cache(cache_dir, slots=4, max_concurrent_loads=loads,
                           node_agent_url=files.url if through == "agent" else None)
        try:
            cache.prefetch("b").result(10)  # b: in the host tier once evicted
            assert cache.evict("b") and cache.tier_of("b") == "host"
            for i in range(loads):  # as many slow fetches as load workers
                cache.register(f"slow{i + 1}", source=f"{files.url}/slow{i + 1}")
                cache.acquire(f"slow{i + 1}")
            time.sleep(0.1)  # the fetches are under way
            assert _time_to_ready(cache, "a") < SLOW_S / 2  # from disk
            assert _time_to_ready(cache, "b") < SLOW_S / 2  # from host memory
            with cache._lock:
                assert {cache.table.entries[f"slow{i + 1}"].state for i in range(loads)} == {"staging"}
                assert cache.table.in_flight == 0 and cache.table.staging == loads
            check_invariants(cache)
            for i in range(loads):  # then the fetched ones load from disk, timed from their fetch
                wait_ready(cache, f"slow{i + 1}", timeout=30)
            source = cache.metrics.load_seconds.labels("source")
            assert source._sum.get() >= loads * SLOW_S * 0.9
            cache.refresh_metrics()  # as a /metrics scrape does
            assert cache.metrics.loads_in_flight._value.get() == 0 and cache.table.staging == 0
            assert cache.metrics.loads_pending._value.get() == 0
            rows = {r["name"]: r for r in cache.describe()}
            assert rows["slow1"]["state"] == "ready" and rows["slow1"]["tier"] == "gpu"
        finally:
            cache.close()


def test_a_failed_fetch_fails_its_requests_only_with_the_same_reason(bucket, cache_dir):
    with _Files(bucket, cache_dir, delay=1.0) as files:
        cache = make_cache(cache_dir, slots=2, max_concurrent_loads=1, node_agent_url=files.url)
        try:
            cache.register("gone", source="s3://bucket/nothing-here")
            cache.acquire("gone")
            fut = cache.prefetch("gone")
            assert _time_to_ready(cache, "a") < 0.5  # not behind the failing fetch
            with pytest.raises(AdapterLoadError, match="node agent could not stage it") as err:
                fut.result(10)
            assert err.value.reason == "fetch"
            assert cache.take_failures() == {"gone": str(err.value)}
            assert cache.failed_load("gone") == str(err.value)
            assert cache.metrics.load_failures.labels("fetch")._value.get() == 1
            assert cache.num_free == 1 and cache.in_flight == 0 and cache.table.staging == 0
            assert {r["name"]: r["state"] for r in cache.describe()}["gone"] == "failed"
            check_invariants(cache)
        finally:
            cache.close()


def test_no_source_fails_as_missing_without_a_slot(cache_dir):
    cache = make_cache(cache_dir, slots=1)
    try:
        cache.register("nowhere", path=cache_dir / "nope")
        with pytest.raises(AdapterLoadError, match="no adapter files at .* and no source") as err:
            cache.prefetch("nowhere").result(10)
        assert err.value.reason == "missing" and cache.num_free == 1
    finally:
        cache.close()


@pytest.fixture
def slow_fetch(monkeypatch):
    """fetch_adapter made slow: it waits for `gate` (or SLOW_S) before it fetches."""
    gate = threading.Event()
    real = adapter_loader.fetch_adapter

    def fetch(*args, **kw):
        gate.wait(SLOW_S)
        return real(*args, **kw)

    monkeypatch.setattr(adapter_loader, "fetch_adapter", fetch)
    return gate


def test_an_adapter_unloaded_while_staging_is_never_loaded(bucket, cache_dir, slow_fetch):
    cache = make_cache(cache_dir, slots=2)
    try:
        cache.register("slow1", source=str(bucket / "slow1"))
        fut = cache.prefetch("slow1")
        assert cache.table.entries["slow1"].state == "staging"
        assert not cache.unload("slow1")  # deferred: one fetch or load of a name at a time
        assert not cache.has("slow1")
        slow_fetch.set()
        with pytest.raises(AdapterLoadError, match="unloaded before it was loaded"):
            fut.result(10)
        assert "slow1" not in cache.table.entries and cache.num_free == 2 and cache.table.staging == 0
    finally:
        cache.close()


def test_an_adapter_re_versioned_while_staging_loads_the_new_version(tmp_path, cache_dir, slow_fetch):
    v1 = write_adapter(tmp_path / "v1", seed=1, rank=4)
    v2 = write_adapter(tmp_path / "v2", seed=2, rank=2)
    cache = make_cache(cache_dir, slots=2)
    try:
        cache.register("sql", source=str(v1))
        fut = cache.prefetch("sql")
        cache.register("sql", source=str(v2))  # the plan moves on during the fetch of v1
        slow_fetch.set()
        fut.result(10)
        e = cache.table.entries["sql"]
        assert e.spec.max_rank == 2 and e.id.uri == str(v2)
    finally:
        cache.close()


def test_a_load_that_finds_another_version_on_disk_gives_its_slot_back_and_stages(tmp_path, cache_dir,
                                                                                  monkeypatch):
    """The version on disk is checked when the load is asked for; if it is replaced before
    the load runs (or the row was wanted without that check, as the engine thread's drain
    does), the load gives its slot and worker back and the adapter is staged first: nothing
    is fetched while a slot is held."""
    import hashlib

    v2 = write_adapter(tmp_path / "v2", seed=2, rank=2)
    sha2 = hashlib.sha256((v2 / "adapter_model.safetensors").read_bytes()).hexdigest()
    write_adapter(cache_dir / "sql", seed=1, rank=4)  # the previous version, staged by a node agent
    (cache_dir / "sql" / ".loraplex.json").write_text(json.dumps({"name": "sql", "sha256": "11" * 32}))
    cache = make_cache(cache_dir, slots=1, max_concurrent_loads=1)
    in_flight_at_fetch = []

    def fetch(name, *args, **kw):  # the node agent stages the plan's version
        in_flight_at_fetch.append(cache.table.in_flight)
        shutil.rmtree(cache_dir / name)
        shutil.copytree(v2, cache_dir / name)
        (cache_dir / name / ".loraplex.json").write_text(json.dumps({"name": name, "sha256": sha2}))
        return cache_dir / name

    monkeypatch.setattr(adapter_loader, "fetch_adapter", fetch)
    try:
        cache.register("sql", source="s3://bucket/sql", sha256=sha2)
        with cache._lock:
            e = cache.table.entries["sql"]
            e.refs += 1
            cache.table.want(e, check=False)
        wait_ready(cache, "sql")
        assert in_flight_at_fetch == [0]  # fetched with no slot and no load worker held
        assert cache.table.entries["sql"].spec.max_rank == 2 and cache.num_free == 0
        assert cache.metrics.load_seconds.labels("source")._sum.get() > 0
    finally:
        cache.close()


def test_a_load_whose_requests_all_left_during_its_fetch_is_called_off(bucket, cache_dir, slow_fetch):
    cache = make_cache(cache_dir, slots=2)
    try:
        cache.register("slow1", source=str(bucket / "slow1"))
        cache.acquire("slow1")
        cache.release("slow1")  # the client went away during the fetch
        slow_fetch.set()
        deadline = time.monotonic() + 10
        while cache.table.staging and time.monotonic() < deadline:
            time.sleep(0.01)
        e = cache.table.entries["slow1"]
        assert e.state == "cold" and cache.num_free == 2 and cache.in_flight == 0
        assert cache.prefetch("slow1").result(10) in (0, 1)  # wanted again: fetched and loaded
    finally:
        cache.close()


def test_a_pin_whose_fetch_failed_is_fetched_again_after_its_back_off(bucket, cache_dir, monkeypatch):
    from loraplex.server import adapter_cache

    monkeypatch.setattr(adapter_cache, "PIN_RETRY_FIRST_S", 0.05)
    cache = make_cache(cache_dir, slots=2)
    real = adapter_loader.fetch_adapter
    calls = []

    def flaky(name, *args, **kw):  # the node agent down for the first try
        calls.append(name)
        if len(calls) == 1:
            raise AdapterLoadError(name, "fetch", "node agent at http://agent unreachable: down")
        return real(name, *args, **kw)

    monkeypatch.setattr(adapter_loader, "fetch_adapter", flaky)
    try:
        cache.register("slow1", source=str(bucket / "slow1"))
        with pytest.raises(AdapterLoadError, match="unreachable"):
            cache.pin("slow1").result(10)
        wait_ready(cache, "slow1")
        assert calls == ["slow1", "slow1"] and cache.table.entries["slow1"].failed_in_row == 0
    finally:
        cache.close()


@pytest.mark.parametrize("prefetched", [False, True])
def test_an_unpin_during_its_fetch_calls_the_load_off_unless_a_prefetch_waits(bucket, cache_dir, slow_fetch,
                                                                              prefetched):
    """A pin of an adapter not on local disk waits on its fetch (staging). Unpinned meanwhile,
    nothing wants it resident any more: its fetch ends, and its load must not run then
    to take a slot (evicting an idle adapter the traffic uses) for nobody; the pin's own future
    is cancelled, as an unpin of a queued pin's load does. A prefetch waiting too keeps it."""
    cache = make_cache(cache_dir, slots=2)
    try:
        for name in "ab":  # both slots hold adapters the traffic used
            cache.prefetch(name).result(10)
        cache.register("slow1", source=str(bucket / "slow1"))
        pin = cache.pin("slow1")
        prefetch = cache.prefetch("slow1") if prefetched else None
        assert cache.table.entries["slow1"].state == "staging"
        assert not cache.unpin("slow1")
        slow_fetch.set()
        if prefetched:
            assert prefetch.result(10) in (0, 1)
            assert cache.tier_of("slow1") == "gpu"
        else:
            deadline = time.monotonic() + 10
            while cache.table.staging and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # a load (wrongly) started would be done by now
            e = cache.table.entries["slow1"]
            assert e.state == "cold" and cache.in_flight == 0 and cache.tier_of("slow1") != "gpu"
            assert pin.cancelled()
            assert set(cache.ready_slots()) == {"a", "b"}
            assert cache.prefetch("slow1").result(10) in (0, 1)  # still loads when asked for
        check_invariants(cache)
    finally:
        cache.close()
