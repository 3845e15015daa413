"""Property test of the adapter cache: random sequences of requests, admissions, finishes,
aborts, pins (API and plan), prefetches, evictions, unloads and new versions (a rollout: a
new sha256 registered, which reloads a slot once its requests stop running) over real files
and real load workers, for each eviction policy, with the cache's rules checked after every
step:

- every slot is free or held by one loading or resident adapter (check_invariants);
- a running request's adapter stays resident in the slot it was admitted with, until the
  request leaves (never evicted in use, whatever the policy or the drain);
- an adapter leaves a slot only when no request runs on it; a pinned one only when pins hold
  every slot (the newest idle pin then yields), or to load its new version;
- at most --max-concurrent-loads loads in flight; the host tier within its bytes;
- an adapter known by its source only is fetched (slowly, at random) before its load takes a
  slot: never while it holds one; one whose source fails fails its own requests only;
- an adapter's refs are the requests holding it;
- the hit and miss counters count each request once;
- once traffic stops, every queued request is admitted or failed with its load (nothing
  starves), an adapter whose file is cut short failing its own requests only.
"""

from __future__ import annotations

import random
import time

import pytest

from loraplex.server import adapter_loader
from loraplex.server.adapter_format import AdapterError

from .test_adapter_cache import check_invariants, make_cache, write_adapter

# z: its weights file is cut short, every load of it fails; s: known by its source only (a
# local folder outside the cache: every load not from host memory fetches it, slowly); x: a
# source that cannot be fetched (every fetch fails)
NAMES = "abcdefzsx"
SOURCES = {"s": None, "x": "s3://nowhere/x"}
STEPS = 400
SEEDS = 6


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(NAMES):
        write_adapter(root / name, seed=i)
    weights = root / "z" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    for name in SOURCES:  # not in the cache's folder: only their sources have them
        (root / name).rename(root.parent / f"{root.name}-src-{name}")
    return root


def _settle(cache, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (cache.in_flight or cache.table.staging) and time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.mark.parametrize("policy", ["lru", "lfu-aged", "wtinylfu"])
@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_operations_keep_the_cache_rules(disk, policy, seed, monkeypatch):
    rng = random.Random(seed * 101 + len(policy))
    cache = make_cache(disk, slots=3, policy=policy, max_cpu_loras=2, max_concurrent_loads=2)
    sources = {n: src or str(disk.parent / f"{disk.name}-src-{n}") for n, src in SOURCES.items()}
    cache.drain_after = 0.0 if seed % 2 else 3600.0  # half the runs drain at once under overload
    table = cache.table
    queued: list[str] = []  # adapters of requests acquired and not admitted yet
    running: list[tuple[str, int]] = []  # (adapter, slot admitted with)
    violations: list[str] = []
    acquires = [0, 0]  # all, found resident

    real_release_slot = table.release_slot
    real_fetch = adapter_loader.fetch_adapter
    delays = random.Random(seed)
    fetches: list[str] = []

    def slow_fetch(name, *args, **kw):  # a staging thread, no lock held
        if name not in NAMES:  # another cache's (a thread an earlier test left): not this one's rule
            return real_fetch(name, *args, **kw)
        fetches.append(name)
        with cache._lock:
            e = table.entries.get(name)
            if e is None or e.state != "staging" or e.slot != -1:
                violations.append(f"{name} fetched in state {e and e.state}, slot {e and e.slot}")
        time.sleep(delays.choice([0.0, 0.005, 0.05]))
        return real_fetch(name, *args, **kw)

    monkeypatch.setattr(adapter_loader, "fetch_adapter", slow_fetch)

    def known(name: str) -> bool:  # a source-only adapter unloaded is registered again (the plan)
        if name in sources and not cache.has(name):
            try:
                cache.register(name, source=sources[name])
            except AdapterError:
                return False  # still being unloaded
        return cache.has(name)

    def release_slot(v, free=True):  # runs under the cache's lock, on any thread
        if any(name == v.name for name, _ in running):
            violations.append(f"{v.name} evicted while a request runs on it")
        if v.pinned and v.name not in table.stale and table.pinned_slots() < table.num_slots:
            violations.append(f"pinned {v.name} evicted while pins held {table.pinned_slots()} of "
                              f"{table.num_slots} slots")
        return real_release_slot(v, free)

    table.release_slot = release_slot

    def check(step: str) -> None:
        check_invariants(cache)
        with cache._lock:
            for name, slot in running:
                e = table.entries.get(name)
                assert e is not None and e.ready and e.slot == slot, f"{step}: running {name} lost slot {slot}"
            want = {n: queued.count(n) + sum(1 for r, _ in running if r == n) for n in NAMES}
            for name, e in table.entries.items():
                assert e.refs == want.get(name, 0), f"{step}: {name} refs {e.refs}, {want.get(name, 0)} requests"
            assert table.in_flight <= cache.max_concurrent_loads
            assert table.staging == sum(1 for e in table.entries.values() if e.state == "staging")
        assert cache.host.used_bytes <= cache.host.capacity_bytes
        assert not violations, f"{step}: {violations}"

    def admit() -> None:  # as the engine's step: failed loads fail their queued requests, then admit
        failed = set(cache.take_failures()) | {n for n in set(queued) if cache.failed_load(n)}
        for name in [n for n in queued if n in failed]:
            queued.remove(name)
            cache.release(name)
        ready = cache.ready_slots({name for name, _ in running})
        for name in list(queued):
            if name in ready:
                queued.remove(name)
                running.append((name, ready[name]))

    try:
        for i in range(STEPS):
            op = rng.choices(["request", "admit", "finish", "abort", "pin", "unpin", "plan", "prefetch",
                              "evict", "unload", "version", "settle"], [8, 6, 5, 1, 1, 1, 1, 1, 1, 1, 1, 3])[0]
            name = rng.choice(NAMES)
            if op in ("request", "pin", "prefetch") and not known(name):
                pass  # unloaded, its load still running: unknown until it ends (then found on disk again)
            elif op == "request":
                acquires[0] += 1
                if cache.acquire(name) >= 0:
                    acquires[1] += 1
                queued.append(name)
            elif op == "admit":
                admit()
            elif op == "finish" and running:
                done, _ = running.pop(rng.randrange(len(running)))
                cache.release(done)
            elif op == "abort" and queued:
                cache.release(queued.pop(rng.randrange(len(queued))))
            elif op == "pin":
                cache.pin(name)
            elif op == "unpin" and cache.has(name):
                cache.unpin(name)
            elif op == "plan":
                cache.apply_plan({"pinned": rng.sample(NAMES, rng.randrange(3)), "adapters": [], "prefetch": []})
            elif op == "prefetch":
                cache.prefetch(name)
            elif op == "version" and cache.has(name):  # (the files stay: a folder with no record is taken as is)
                try:
                    cache.register(name, sha256=f"{rng.getrandbits(256):064x}")
                except AdapterError:
                    pass  # being unloaded
            elif op == "evict":
                cache.evict(name)
            elif op == "unload" and cache.has(name) and name not in queued and all(r != name for r, _ in running):
                cache.unload(name)
            elif op == "settle":
                _settle(cache)
            check(f"step {i} ({op} {name})")

        # Traffic stops: pins go, running requests finish; every queued request must get in.
        cache.apply_plan({"pinned": [], "adapters": [], "prefetch": []})
        for name in NAMES:
            if cache.has(name):
                cache.unpin(name)
        deadline = time.monotonic() + 30
        while (queued or running) and time.monotonic() < deadline:
            admit()
            while running:
                cache.release(running.pop()[0])
            check("drain")
            time.sleep(0.001)
        assert not queued, f"starved: {queued}; {cache.describe()}"
        _settle(cache)
        check("settled")
        assert set(fetches) == set(SOURCES), fetches  # both were staged, at least once
        hits = sum(cache.metrics.hits.labels(t)._value.get() for t in ("gpu", "host", "disk", "source"))
        assert hits == acquires[0]
        assert cache.metrics.hits.labels("gpu")._value.get() == acquires[1]
        assert cache.metrics.misses.labels("gpu")._value.get() == acquires[0] - acquires[1]
    finally:
        cache.close()
