"""A failed fetch backs off, as the kubelet does an image pull: a request for the adapter
within the back-off fails at once with that fetch's error and downloads nothing, so a CR whose
sha256 does not match its source (or a source that is down) costs one download per back-off,
not one per request. A new version, the node agent staging it meanwhile, or the back-off
running out lets the next request fetch again."""

from __future__ import annotations

import hashlib
import time

import pytest

from loraplex.server import adapter_loader
from loraplex.server.adapter_format import WEIGHTS_FILE
from loraplex.server.adapter_sources import AdapterLoadError

from .test_adapter_cache import _Files, check_invariants, make_cache, wait_ready, write_adapter


class Skewed:
    """The cache's clock, moved forward by hand (the back-off's time) and otherwise real."""

    def __init__(self):
        self.skew = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.skew


def _weights_gets(files: _Files) -> int:
    return sum(p.endswith(WEIGHTS_FILE) for p in files.gets)


def _fails(fut, reason: str) -> AdapterLoadError:
    with pytest.raises(AdapterLoadError) as err:
        fut.result(10)
    assert err.value.reason == reason
    return err.value


def test_a_sha256_mismatch_is_downloaded_once_per_backoff(tmp_path_factory):
    bucket, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(bucket / "sql", seed=1)
    clock = Skewed()
    with _Files(bucket) as files:
        cache = make_cache(cache_dir, slots=2, clock=clock)
        cache.register("sql", source=f"{files.url}/sql", sha256="ab" * 32)
        first = _fails(cache.prefetch("sql"), "corrupt")
        assert "does not match sha256" in str(first) and _weights_gets(files) == 1
        # Within the back-off: prefetches and requests fail at once, and nothing is downloaded.
        again = _fails(cache.prefetch("sql"), "corrupt")
        assert "does not match sha256" in str(again) and "fetch failed once" in str(again)
        assert cache.acquire("sql") == -1 and cache.failed_load("sql")
        cache.release("sql")
        assert _weights_gets(files) == 1
        row = {r["name"]: r for r in cache.describe()}["sql"]
        assert row["state"] == "failed" and 0 < row["retry_in_s"] <= adapter_loader.FETCH_RETRY_FIRST_S
        # Past it: one more download, which fails the same way; the next back-off is longer.
        clock.skew += adapter_loader.FETCH_RETRY_FIRST_S + 0.1
        _fails(cache.prefetch("sql"), "corrupt")
        assert _weights_gets(files) == 2
        clock.skew += adapter_loader.FETCH_RETRY_FIRST_S + 0.1  # less than the second back-off (4 s)
        assert "fetch failed 2 times in a row" in str(_fails(cache.prefetch("sql"), "corrupt"))
        assert _weights_gets(files) == 2
        # The right sha256 (a new version of the CR) is fetched at once, and loads.
        digest = hashlib.sha256((bucket / "sql" / WEIGHTS_FILE).read_bytes()).hexdigest()
        cache.register("sql", source=f"{files.url}/sql", sha256=digest)
        cache.prefetch("sql").result(10)
        assert _weights_gets(files) == 3 and "sql" in cache.ready_slots()
        assert {r["name"]: r for r in cache.describe()}["sql"]["retry_in_s"] is None
        check_invariants(cache)
        cache.close()


def test_a_source_that_is_down_backs_off_and_is_fetched_once_it_is_up(tmp_path_factory):
    bucket, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    clock = Skewed()
    with _Files(bucket) as files:
        cache = make_cache(cache_dir, slots=2, clock=clock)
        cache.register("late", source=f"{files.url}/late")
        assert "HTTP 404" in str(_fails(cache.prefetch("late"), "fetch"))
        write_adapter(bucket / "late", seed=2)  # uploaded now: the back-off still runs
        assert "tried in" in str(_fails(cache.prefetch("late"), "fetch"))
        assert len(files.gets) == 1
        clock.skew += adapter_loader.FETCH_RETRY_FIRST_S + 0.1
        cache.acquire("late")
        wait_ready(cache, "late")
        cache.release("late")
        # A success forgets the failures: the next failure backs off from the first step again.
        assert "late" not in cache.loader._failed_fetches
        check_invariants(cache)
        cache.close()


def test_the_node_agent_staging_it_meanwhile_ends_the_backoff(tmp_path_factory):
    bucket, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    with _Files(bucket, cache_dir) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        cache.register("sql", source="s3://bucket/sql")
        _fails(cache.prefetch("sql"), "fetch")  # the agent answers 404: no such source
        assert len(agent.staged) == 1
        _fails(cache.prefetch("sql"), "fetch")
        assert len(agent.staged) == 1  # backing off: the agent is not asked again
        write_adapter(cache_dir / "sql", seed=3)  # the agent staged it for another server's session
        cache.prefetch("sql").result(10)  # on disk now: loaded from there, no fetch
        assert len(agent.staged) == 1 and "sql" in cache.ready_slots()
        cache.close()


def test_the_backoff_doubles_up_to_its_cap(tmp_path_factory, monkeypatch):
    cache_dir = tmp_path_factory.mktemp("cache")
    clock = Skewed()
    cache = make_cache(cache_dir, slots=1, clock=clock)
    cache.register("gone", source=str(cache_dir / "nowhere"))
    seen = []
    for _ in range(9):
        _fails(cache.prefetch("gone"), "missing")
        failed = cache.loader._failed_fetches["gone"]
        seen.append(round(failed.until - failed.at, 6))
        clock.skew += failed.until - failed.at + 0.01
    assert seen == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 120.0, 120.0, 120.0]
    cache.close()
