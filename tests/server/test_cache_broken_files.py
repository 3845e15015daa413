"""An adapter whose files are broken: its first load fails with the reason; while the files stay
as they were, every later request, prefetch or pin of it fails at once with that error and
takes no slot, so traffic to it evicts no healthy adapter. Once the files change (rewritten, a
new version registered) a load is tried again. Failures that are not the files' (out of
memory, an unreadable disk) are tried again at the next request, as before."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from loraplex.server.adapter_sources import AdapterLoadError
from loraplex.server.adapters import random_adapter

from .conftest import make_peft_adapter, serve_tiny_llama
from .test_adapter_cache import (CFG, check_invariants, corrupt, garbled, make_cache, missing, use, wait_ready,
                                 write_adapter, wrong_shape)


@pytest.fixture
def disk(tmp_path) -> Path:
    for i, name in enumerate("abcx"):
        write_adapter(tmp_path / name, seed=i)
    return tmp_path


def config_not_json(path: Path) -> None:
    (path / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')


def shape_not_the_header(path: Path) -> None:
    """Weights of rank 2 under a config that says r=4."""
    spec, tensors = random_adapter(CFG, 2, targets=("q_proj",), seed=5)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))


DAMAGE = [(corrupt, "corrupt"), (garbled, "corrupt"), (config_not_json, "corrupt"), (missing, "missing"),
          (wrong_shape, "mismatch"), (shape_not_the_header, "mismatch")]


def evictions(cache) -> float:
    return cache.metrics.evictions.labels("gpu")._value.get()


def failures(cache, reason: str) -> float:
    return cache.metrics.load_failures.labels(reason)._value.get()


def retry_timers(cache) -> list[threading.Timer]:
    return [t for t in threading.enumerate()
            if isinstance(t, threading.Timer) and getattr(t.function, "__self__", None) is cache]


def request_fails_at_once(cache, name: str) -> str:
    """One request for `name`, as the engine makes it (acquire, then `failed_load` when it is
    queued): its error, which must be there at once, no load of it on its way."""
    assert cache.acquire(name) == -1
    try:
        error = cache.failed_load(name)
        assert error is not None, cache.describe()
        assert cache.in_flight == 0 and cache.table.num_pending() == 0
        return error
    finally:
        cache.release(name)


def fail_first_load(cache, name: str, reason: str) -> str:
    """The broken adapter's first load: tried (into a free slot), fails with `reason`."""
    with pytest.raises(AdapterLoadError) as err:
        cache.prefetch(name).result(10)
    assert err.value.reason == reason
    return str(err.value)


def fill(cache, names: str) -> dict[str, int]:
    for name in names:
        use(cache, name)
    slots = cache.ready_slots()
    assert set(slots) == set(names) and cache.num_free == 0
    return slots


@pytest.mark.parametrize("damage, reason", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_a_broken_adapter_requested_many_times_evicts_no_healthy_one(disk, damage, reason):
    cache = make_cache(disk, slots=3)
    try:
        damage(disk / "x")
        first = fail_first_load(cache, "x", reason)
        assert "'x'" in first
        slots = fill(cache, "abc")  # every slot: an idle healthy adapter, evictable
        before, failed = evictions(cache), failures(cache, reason)
        for _ in range(25):
            assert request_fails_at_once(cache, "x") == first
            with pytest.raises(AdapterLoadError) as err:  # a prefetch (the node agent's) too
                cache.prefetch("x").result(0)
            assert str(err.value) == first and err.value.reason == reason
        assert evictions(cache) == before  # no slot was taken for x
        assert cache.ready_slots() == slots and {cache.tier_of(n) for n in "abc"} == {"gpu"}
        # Each refused request is still a failed load to the metrics, and the listing shows why.
        assert failures(cache, reason) == failed + 50
        row = {r["name"]: r for r in cache.describe()}["x"]
        assert row["state"] == "failed" and row["error"] == first and row["slot"] is None
        check_invariants(cache)

        # Fixed: the files rewritten in place (new content, mtime): loaded at the next request.
        write_adapter(disk / "x", seed=42)
        assert cache.acquire("x") == -1
        wait_ready(cache, "x")
        cache.release("x")
        assert evictions(cache) == before + 1  # now x takes a slot, as a healthy adapter does
        row = {r["name"]: r for r in cache.describe()}["x"]
        assert row["state"] == "ready" and row["error"] is None
        check_invariants(cache)
    finally:
        cache.close()


@pytest.mark.parametrize("damage, reason", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_even_the_first_failure_of_broken_files_takes_no_slot(disk, damage, reason):
    """Every slot holds an idle healthy adapter when the broken one is first asked for: its
    files are checked (config, header, shapes) before a slot is taken for them, so its first
    request fails too without evicting one (a load's own failure freed the slot, but the
    adapter it had evicted for it was gone)."""
    cache = make_cache(disk, slots=3)
    try:
        slots = fill(cache, "abc")
        damage(disk / "x")
        before = evictions(cache)
        with pytest.raises(AdapterLoadError) as err:
            cache.prefetch("x").result(10)
        assert err.value.reason == reason and "'x'" in str(err.value)
        assert evictions(cache) == before and cache.ready_slots() == slots
        assert request_fails_at_once(cache, "x") == str(err.value)  # then as before: kept with its files
        check_invariants(cache)
    finally:
        cache.close()


def test_a_healthy_adapters_files_are_parsed_once_for_its_check_and_first_load(disk, monkeypatch):
    """The check before the slot hands its spec to the load: the files' config and header are
    parsed once, not once for the check and again in the load; a reload from disk of the same
    files parses nothing."""
    import loraplex.server.adapter_loader as loader_module

    parsed = []
    real = loader_module.read_adapter
    monkeypatch.setattr(loader_module, "read_adapter", lambda path, base: parsed.append(path.name) or real(path, base))
    cache = make_cache(disk, slots=1)
    try:
        use(cache, "a")
        use(cache, "b")  # evicts a: its reload (from host memory or disk) parses nothing
        use(cache, "a")
        assert parsed == ["a", "b"]
        check_invariants(cache)
    finally:
        cache.close()


def test_the_same_files_touched_are_tried_again(disk):
    """Only the stamp (inode, size, mtime) tells: a weights file whose mtime moved (written
    again, maybe as broken as before) is loaded once more, not assumed to be the same; when
    that load fails too, its requests fail and the next ones are refused again."""
    cache = make_cache(disk, slots=2)
    try:
        corrupt(disk / "x")
        fail_first_load(cache, "x", "corrupt")
        assert request_fails_at_once(cache, "x")
        weights = disk / "x" / "adapter_model.safetensors"
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert cache.acquire("x") == -1  # a load starts: the files may be the fixed ones
        deadline = time.monotonic() + 10
        while cache.failed_load("x") is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        cache.release("x")
        assert failures(cache, "corrupt") == 3  # the first load, one refused, the second load
        assert "x" in cache.take_failures()
        assert request_fails_at_once(cache, "x")  # and refused again after that one
        check_invariants(cache)
    finally:
        cache.close()


def test_a_failure_not_of_the_files_is_tried_again(disk, monkeypatch):
    """Out of memory, or a disk read that fails (not the files' contents): the next request
    loads, as before."""
    import torch

    import loraplex.server.adapter_loader as loader
    from loraplex.server.host_tier import read_into_host

    cache = make_cache(disk, slots=2)
    errors = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 84.00 MiB"), OSError("EIO")]

    def flaky(path, *a, **kw):
        if Path(path).name == "b" and errors:
            raise errors.pop(0)
        return read_into_host(path, *a, **kw)

    monkeypatch.setattr(loader, "read_into_host", flaky)
    try:
        for reason in ("oom", "other"):
            assert cache.acquire("b") == -1
            deadline = time.monotonic() + 10
            while cache.failed_load("b") is None:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            cache.release("b")
            assert failures(cache, reason) == 1
        assert use(cache, "b") in (0, 1)
    finally:
        cache.close()


def test_a_pinned_broken_adapter_waits_for_new_files_without_taking_slots(disk, monkeypatch):
    """A plan's pin on broken files: its retries (on their own, after a back-off) load nothing
    while the files are unchanged, so they evict nothing; new files load on their own."""
    import loraplex.server.adapter_cache as cache_module

    monkeypatch.setattr(cache_module, "PIN_RETRY_FIRST_S", 0.02)
    monkeypatch.setattr(cache_module, "PIN_RETRY_MAX_S", 0.05)
    cache = make_cache(disk, slots=3)
    try:
        garbled(disk / "x")
        with pytest.raises(AdapterLoadError):
            cache.pin("x").result(10)
        fill(cache, "abc")  # every slot: an idle healthy adapter, evictable for the pin
        before = evictions(cache)
        for _ in range(3):
            with pytest.raises(AdapterLoadError, match="'x'"):  # a pin again (a new plan): at once too
                cache.pin("x").result(0)
        time.sleep(0.5)  # some ten retries
        assert evictions(cache) == before and set(cache.ready_slots()) == set("abc")
        assert failures(cache, "corrupt") == 1 + 3  # the load, the pins again; retries are no traffic
        # One chain of retry timers, however many pins and failures started one (else each
        # would run for ever): at most its timer and the next it arms, alive at once.
        for _ in range(5):
            assert len(retry_timers(cache)) <= 2
            time.sleep(0.02)
        write_adapter(disk / "x", seed=43)
        wait_ready(cache, "x")
        assert {r["name"]: r for r in cache.describe()}["x"]["pinned"]
        check_invariants(cache)
    finally:
        cache.close()


def test_a_new_version_registered_is_loaded_again(tmp_path):
    """A plan's adapter read from its local source in place (no copy in the cache folder):
    refused while that source's files are unchanged; the plan naming another source (a new
    version) loads that one."""
    bad = write_adapter(tmp_path / "src" / "v1", seed=1)
    good = write_adapter(tmp_path / "src" / "v2", seed=2)
    config_not_json(bad)
    cache = make_cache(tmp_path / "cache", slots=2)
    try:
        cache.register("x", source=str(bad))
        assert cache.acquire("x") == -1
        deadline = time.monotonic() + 10
        while cache.failed_load("x") is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        cache.release("x")
        first = cache.failed_load("x")
        assert "invalid JSON" in first
        for _ in range(5):
            assert request_fails_at_once(cache, "x") == first
        assert failures(cache, "corrupt") == 6
        cache.register("x", source=str(good))
        assert cache.acquire("x") == -1
        wait_ready(cache, "x")
        cache.release("x")
        check_invariants(cache)
    finally:
        cache.close()


def test_over_http_requests_for_a_broken_adapter_fail_and_the_others_stay_resident(hf_llama, tmp_path):
    """The whole path: completions for a broken adapter of the node's cache folder each get
    its load error (500 adapter_load_failed), while the healthy ones stay in their slots
    (GET /v1/adapters, the evictions counter on /metrics); new files are served."""
    cache_dir = tmp_path / "cache"
    for i, name in enumerate(["a", "b", "broken"]):
        make_peft_adapter(hf_llama, cache_dir / name, seed=i, r=4, lora_alpha=8, target_modules=["q_proj"])
    good_weights = (cache_dir / "a" / "adapter_model.safetensors").read_bytes()
    (cache_dir / "broken" / "adapter_model.safetensors").write_bytes(good_weights[:-64])  # cut short

    def evicted(c) -> float:
        line = next(x for x in c.get("/metrics").text.splitlines()
                    if x.startswith('loraplex_adapter_evictions_total{tier="gpu"}'))
        return float(line.split()[-1])

    body = {"prompt": [1, 5, 6], "max_tokens": 2}
    with serve_tiny_llama(hf_llama, {}, lora_modules=[], max_loras=2, adapter_cache_dir=str(cache_dir)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={**body, "model": "broken"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "adapter_load_failed", r.text
        first = r.json()["error"]["message"]
        for name in "ab":
            assert c.post("/v1/completions", json={**body, "model": name}).status_code == 200
        before = evicted(c)
        for _ in range(10):
            r = c.post("/v1/completions", json={**body, "model": "broken"})
            assert r.status_code == 500 and r.json()["error"]["message"] == first, r.text
        assert evicted(c) == before
        rows = {row["name"]: row for row in c.get("/v1/adapters").json()["data"]}
        assert rows["a"]["tier"] == rows["b"]["tier"] == "gpu"
        assert rows["broken"]["state"] == "failed" and rows["broken"]["error"] == first
        (cache_dir / "broken" / "adapter_model.safetensors").write_bytes(good_weights)
        cfg = json.loads((cache_dir / "a" / "adapter_config.json").read_text())
        (cache_dir / "broken" / "adapter_config.json").write_text(json.dumps(cfg))
        r = c.post("/v1/completions", json={**body, "model": "broken"})
        assert r.status_code == 200, r.text
        assert {row["name"]: row["tier"] for row in c.get("/v1/adapters").json()["data"]}["broken"] == "gpu"


def test_a_first_reads_cold_load_seconds_count_the_check_of_its_files(disk, monkeypatch):
    """The parse a first read from disk skips (the check before its slot did it) is still the
    load's time in loraplex_adapter_load_seconds{source="disk"}, as it was when the load
    parsed the files itself; the wait for a slot between them is not."""
    import loraplex.server.adapter_loader as loader_module

    real = loader_module.read_adapter

    def slow_parse(path, base):
        time.sleep(0.2)
        return real(path, base)

    monkeypatch.setattr(loader_module, "read_adapter", slow_parse)
    cache = make_cache(disk, slots=1)
    try:
        use(cache, "a")
        assert cache.metrics.load_seconds.labels("disk")._sum.get() >= 0.2
        check_invariants(cache)
    finally:
        cache.close()
