"""The adapter cache: GPU slots as a cache over host memory, local disk and a source.

Tiers, fastest first (an adapter is "in" the fastest tier that holds it)::

    gpu     a slot of the LoRABuffers (--max-loras slots)          -> requests run at once
    host    a HostCopy in (pinned) host memory, slot layout        -> ~bytes / PCIe bandwidth
    disk    a PEFT directory: registered path or --adapter-cache-dir/<name>/ (the node agent's cache)
    source  the plan's source URI: staged through the node agent (--node-agent-url) or fetched here

Running example, 2 slots holding a (pinned) and b (one running request), a request for c::

    acquire("c")    c is known (registered, plan, or found on disk): refs 1, returns -1 (not resident)
                    -> pending; a load worker is free; no free slot; evictable = {} (a pinned, b in use)
                    -> c stays pending, its request stays in the queue (not the batch)
    release("b")    b's request finished: b is evictable -> the policy picks b, c loads into b's slot
    worker          disk -> host copy (safetensors into pinned memory) -> slot (side stream, event)
    ready_slots()   {"a": 0, "c": 1}: the scheduler admits c's request at the next step

Rules: an adapter held by a request (`refs`: from `acquire` when the request is made until
`release` when it leaves) is never evicted, so an adapter whose load finished stays until
its waiting requests are admitted; a pinned adapter is never evicted, and pins take at most
all slots but one (the rest stay pending, reported by `describe`) so requests always have a
slot to page through. At most `max_concurrent_loads` loads run at once. A failed load
frees its slot, fails its waiters (`take_failures` for the engine's queued requests) and
is retried by the next request. Under overload (every slot's adapter always has requests) a
cold request would starve: after `drain_after` seconds one busy adapter stops admitting and
gives up its slot once its running requests finish (`_drain`), round robin through the slots.

Threads: one lock guards the tables and the eviction policy; the HTTP thread (`acquire`,
`prefetch`, `pin`), the engine thread (`ready_slots`, `release`, `take_failures`) and the
load workers call in. Loads never run on the engine thread: it only reads `ready_slots`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, AdapterSpec, BaseSpec, read_adapter
from .adapter_sources import AdapterLoadError, fetch_adapter, load_error, redact
from .adapters import AdapterId, LoRABuffers
from .cache_metrics import CacheMetrics
from .cache_policy import make_policy
from .host_tier import HostCopy, HostTier, host_copy_from_tensors, read_into_host, slot_views

log = logging.getLogger(__name__)

# An adapter name as it may appear in a path under --adapter-cache-dir: no separators, no "..".
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,252}$")

@dataclass
class CachedAdapter:
    """One known adapter and where it is. Mutated under the cache's lock only."""

    name: str
    path: Path | None = None  # a PEFT directory registered for it (load_lora_adapter, --lora-modules)
    source: str | None = None  # the plan's source URI
    sha256: str | None = None  # the plan's digest of adapter_model.safetensors
    id: AdapterId | None = None  # set once its files are read
    spec: AdapterSpec | None = None
    state: str = "cold"  # cold -> pending -> loading -> ready (-> cold when evicted or failed)
    slot: int = -1
    refs: int = 0  # requests holding it (queued or running)
    pinned_api: bool = False
    pinned_plan: bool = False
    prefetch: bool = False  # the pending load was asked ahead of demand
    memory: HostCopy | None = None  # installed from memory: its only copy
    hits: int = 0  # requests that found it resident
    misses: int = 0  # requests that had to wait for a load
    error: str | None = None  # the last load's error
    unloading: bool = False
    draining: bool = False  # no new admissions; evicted once its running requests finish
    pending_since: float = 0.0  # when its load was asked for (clock seconds)
    waiters: list[concurrent.futures.Future] = field(default_factory=list)

    @property
    def pinned(self) -> bool:
        return self.pinned_api or self.pinned_plan

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class AdapterCache:
    """Adapter name -> GPU slot, paged over host memory, disk and a source. Thread-safe."""

    def __init__(self, buffers: LoRABuffers, base: BaseSpec, *, policy: str = "lru", max_cpu_loras: int = 0,
                 max_concurrent_loads: int = 4, cache_dir: str | Path | None = None,
                 node_agent_url: str | None = None, metrics: CacheMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.buffers = buffers
        self.base = base
        self.policy = make_policy(policy)
        self.max_concurrent_loads = max_concurrent_loads
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.node_agent_url = node_agent_url.rstrip("/") if node_agent_url else None
        self.metrics = metrics or CacheMetrics()
        self.clock = clock
        self.pin_memory = buffers.device.type == "cuda"
        host_slots = max_cpu_loras if max_cpu_loras > 0 else buffers.num_slots
        self.host = HostTier(host_slots * LoRABuffers.slot_bytes(buffers.cfg, buffers.max_rank, buffers.dtype),
                             on_evict=lambda name: self.metrics.evictions.labels("host").inc())
        self.wake: Callable[[], None] = lambda: None  # the engine loop's wake-up (set by AsyncEngine)
        self._entries: dict[str, CachedAdapter] = {}
        self._ready: dict[str, int] = {}  # name -> slot of the resident adapters (read every step)
        self._draining: str | None = None  # the adapter giving up its slot to starved loads
        self.drain_after = 2.0  # seconds a request's load waits for a slot before one drains
        self._free = list(range(buffers.num_slots))
        self._pending: deque[str] = deque()
        self._in_flight = 0
        self._failures: dict[str, str] = {}
        self._lock = threading.RLock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, max_concurrent_loads),
                                                           thread_name_prefix="loraplex-load")
        self._local = threading.local()  # a side CUDA stream per load worker
        # Held by a load thread around its CUDA calls, and by the engine while it captures a
        # CUDA graph: a global-mode capture forbids other threads' allocations and syncs.
        self.cuda_lock = threading.Lock()
        self._views = [slot_views(buffers, s) for s in range(buffers.num_slots)]  # copy targets, per slot
        self._staging: HostCopy | None = None  # CUDA: the device side of a host -> slot copy
        self.max_in_flight_seen = 0

    @classmethod
    def from_settings(cls, buffers: LoRABuffers, base: BaseSpec, settings, metrics: CacheMetrics | None = None
                      ) -> "AdapterCache":
        return cls(buffers, base, policy=settings.eviction_policy, max_cpu_loras=settings.max_cpu_loras,
                   max_concurrent_loads=settings.max_concurrent_loads, cache_dir=settings.adapter_cache_dir,
                   node_agent_url=settings.node_agent_url, metrics=metrics)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- where adapters are known -------------------------------------------------------------

    def register(self, name: str, path: str | Path | None = None, source: str | None = None,
                 sha256: str | None = None) -> None:
        """Make `name` known: a PEFT directory on disk, and/or a source to fetch it from.
        A new sha256 (a new version) drops the host copy, so the next load reads the new files."""
        with self._lock:
            e = self._entries.get(name)
            if e is not None and e.unloading:
                raise AdapterError(f"adapter {name!r} is being unloaded (requests still use it); try again "
                                   f"when they finish")
            if e is None:
                e = self._entries[name] = CachedAdapter(name)
            if path is not None:
                e.path = Path(path)
            if source is not None:
                e.source = source
            if sha256 is not None and sha256 != e.sha256:
                if e.sha256 is not None:
                    self.host.discard(name)
                    log.info("adapter %s: new version %s (takes effect at its next load)", name, sha256[:12])
                e.sha256 = sha256

    def _lookup(self, name: str) -> CachedAdapter | None:
        """The entry for `name`, registering one found in --adapter-cache-dir (lazy discovery)."""
        e = self._entries.get(name)
        if e is not None:
            return None if e.unloading else e
        if self.cache_dir is not None and _NAME.match(name) and (self.cache_dir / name / CONFIG_FILE).is_file():
            e = self._entries[name] = CachedAdapter(name, path=self.cache_dir / name)
            log.info("adapter %s found in %s", name, self.cache_dir)
            return e
        return None

    def has(self, name: str) -> bool:
        with self._lock:
            return self._lookup(name) is not None

    # -- requests ----------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """A request holds `name` from now until `release`: its slot, or -1 while it loads (a
        load starts if none runs). KeyError if the adapter is known nowhere."""
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            e.refs += 1
            self.policy.record_access(name)
            tier = self._tier(e)
            self.metrics.record_lookup(tier)
            if e.ready:
                e.hits += 1
                return e.slot
            e.misses += 1
            e.prefetch = False
            self._want(e)
            return -1

    def release(self, name: str) -> None:
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                return
            e.refs -= 1
            if e.refs > 0:
                return
            if e.unloading:
                self._drop(e)
            self._pump()

    def ready_slots(self, running: set[str] | None = None) -> dict[str, int]:
        """{name: slot} of the adapters resident now: the scheduler admits their requests.

        The engine calls it once per step, before admitting, with `running` (the adapters of
        the batch's requests); then it also keeps a cold request from starving behind busy
        adapters (see `_drain`)."""
        with self._lock:
            if running is not None:
                self._drain(running)
            if self._draining is None:
                return dict(self._ready)
            return {n: s for n, s in self._ready.items() if n != self._draining}

    def _drain(self, running: set[str]) -> None:
        """Anti-starvation. Queued requests hold their adapter, so while every slot holds an
        adapter that has requests (running or queued), a cold adapter's requests could wait for
        ever. When the oldest such request's load has waited `drain_after` seconds with no slot
        free or evictable, one resident adapter (the policy's pick) stops admitting; once its
        running requests finish it gives up its slot, and its queued requests wait for a reload
        at the back of the line: round robin through the slots under overload."""
        if self._draining is not None:
            e = self._entries.get(self._draining)
            if e is None or not e.ready or e.pinned:
                if e is not None:
                    e.draining = False
                self._draining = None
            elif self._draining not in running:  # accurate: it admits nothing since it drains
                self._draining, e.draining = None, False
                self._release_slot(e)
                log.info("adapter %s drained out of slot for the starved loads", e.name)
                if e.refs > 0:
                    self._want(e)
                else:
                    self._pump()
                return
        if self._draining is not None or self._free or self._in_flight >= self.max_concurrent_loads:
            return
        starved = next((self._entries[n] for n in self._pending if self._entries[n].refs > 0), None)
        if starved is None or self.clock() - starved.pending_since < self.drain_after:
            return
        resident = {n for n, o in self._entries.items() if o.ready and not o.pinned}
        if any(self._entries[n].refs == 0 for n in resident):
            return  # a slot is evictable: the normal path serves it
        victim = self.policy.select_victim(resident)
        if victim is not None:
            self._draining = victim
            self._entries[victim].draining = True
            log.info("adapter %s drains: %s has waited %.1fs for a slot", victim, starved.name,
                     self.clock() - starved.pending_since)

    def take_failures(self) -> dict[str, str]:
        """{name: error} of loads that failed since the last call (the engine fails the queued
        requests for those adapters)."""
        with self._lock:
            failures, self._failures = self._failures, {}
            return failures

    # -- prefetch, pins, plan ------------------------------------------------------------------

    def prefetch(self, name: str) -> concurrent.futures.Future:
        """Bring `name` into a GPU slot ahead of its requests (through every tier). The future
        gives its slot once resident, or raises AdapterLoadError; KeyError if unknown."""
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            if e.ready:
                fut.set_result(e.slot)
                return fut
            e.waiters.append(fut)
            if e.state == "cold":
                e.prefetch = e.refs == 0
            self._want(e)
            return fut

    def pin(self, name: str, *, plan: bool = False) -> concurrent.futures.Future:
        """Pin `name` (never evicted) and load it; KeyError if unknown."""
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            if plan:
                e.pinned_plan = True
            else:
                e.pinned_api = True
            self._update_pinned_gauge()
            return self.prefetch(name)

    def unpin(self, name: str, *, plan: bool = False) -> bool:
        """Unpin `name`; returns whether it is still pinned (by the other of API and plan)."""
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                raise KeyError(name)
            if plan:
                e.pinned_plan = False
            else:
                e.pinned_api = False
            self._update_pinned_gauge()
            self._pump()
            return e.pinned

    def apply_plan(self, plan: dict) -> None:
        """Follow the operator's plan: register its adapters (source, sha256), pin its pinned set
        and unpin what left it. Plan format: operator/plan.py."""
        pinned = set(plan.get("pinned") or [])
        for a in plan.get("adapters") or []:
            try:
                self.register(a["name"], source=a.get("source"), sha256=a.get("sha256"))
            except AdapterError as err:
                log.warning("plan: %s", err)
            if a.get("pinned"):
                pinned.add(a["name"])
        with self._lock:
            before = {n for n, e in self._entries.items() if e.pinned_plan}
        for name in sorted(before - pinned):
            self.unpin(name, plan=True)
        for name in sorted(pinned - before):
            try:
                self.pin(name, plan=True)
            except KeyError:
                log.warning("plan pins %s, which is known nowhere (no source, not on disk)", name)
        if pinned != before:
            log.info("plan: %d pinned (%s)", len(pinned), ", ".join(sorted(pinned)) or "none")

    # -- vLLM-style admin and benchmarks ---------------------------------------------------------

    def load(self, name: str, path: str | Path, timeout: float | None = 120.0) -> int:
        """Register `name` at `path` and load it into a slot (evicting an idle adapter if all are
        taken); returns the slot. Raises AdapterError when it does not fit the base, or when no
        slot frees up within `timeout` seconds (it stays registered and queued for one)."""
        spec = read_adapter(path, self.base)  # a refused adapter is refused before anything changes
        with self._lock:
            if name in self._entries:
                raise AdapterError(f"adapter {name!r} is already loaded")
        self.register(name, path=path)
        with self._lock:
            self._entries[name].spec = spec
        try:
            return self.prefetch(name).result(timeout)
        except AdapterLoadError as e:
            raise AdapterError(str(e)) from None
        except concurrent.futures.TimeoutError:
            raise AdapterError(f"adapter {name!r} is registered, but no slot freed up within {timeout:g}s "
                               f"(every slot is pinned or in use); it loads when one does") from None

    def install(self, adapter: AdapterId, spec: AdapterSpec, tensors: dict[str, torch.Tensor], *,
                keep_host_copy: bool = False) -> int:
        """An adapter made in memory (benchmarks, tests), written into a slot now (call between
        steps); returns the slot. With `keep_host_copy` it pages like any other adapter (a
        pinned host copy is its source); without, it is forgotten when evicted."""
        with self._lock:
            if adapter.name in self._entries:
                raise AdapterError(f"adapter {adapter.name!r} is already loaded")
            e = self._entries[adapter.name] = CachedAdapter(adapter.name, id=adapter, spec=spec)
        if keep_host_copy:
            with self.cuda_lock:
                e.memory = host_copy_from_tensors(spec, tensors, self.buffers, self.pin_memory)
            return self.prefetch(adapter.name).result()
        with self._lock:
            slot = self._take_slot(e)
            if slot is None:
                del self._entries[adapter.name]
                raise AdapterError(f"no slot for {adapter.name!r}: every slot is pinned or in use")
            e.state, e.slot = "loading", slot
        try:
            self.buffers.write(slot, spec, tensors)
        except BaseException:
            with self._lock:
                self._entries.pop(adapter.name, None)
                self._free.append(slot)
            raise
        with self._lock:
            e.state = "ready"
            self._ready[e.name] = slot
            self.policy.record_insert(adapter.name)
        return slot

    def evict(self, name: str) -> bool:
        """Take `name` out of its GPU slot now (its host copy stays), if it is idle and not
        pinned; returns whether it was evicted. For benchmarks and admin."""
        with self._lock:
            e = self._entries.get(name)
            if e is None or not e.ready or e.refs > 0 or e.pinned:
                return False
            self._release_slot(e)
            self._pump()
            return True

    def unload(self, name: str) -> bool:
        """Forget `name`: now, or when its last request releases it. Returns True if now."""
        with self._lock:
            e = self._entries.get(name)
            if e is None or e.unloading:
                raise KeyError(name)
            e.unloading = True
            if e.refs > 0 or e.state == "loading":
                return False
            self._drop(e)
            return True

    # -- inspection -------------------------------------------------------------------------------

    def list(self) -> list[CachedAdapter]:
        """Adapters resident in GPU slots."""
        with self._lock:
            return [e for e in self._entries.values() if e.ready and not e.unloading]

    def known(self) -> list[CachedAdapter]:
        with self._lock:
            return [e for e in self._entries.values() if not e.unloading]

    def slot_of(self, name: str) -> int:
        with self._lock:
            e = self._entries[name]
            if not e.ready:
                raise KeyError(name)
            return e.slot

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def tier_of(self, name: str) -> str:
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            return self._tier(e)

    def describe(self) -> list[dict]:
        """One row per known adapter, for GET /v1/adapters."""
        if self.cache_dir is not None and self.cache_dir.is_dir():
            for child in sorted(self.cache_dir.iterdir()):  # show the node agent's cache too
                if _NAME.match(child.name):
                    self.has(child.name)
        with self._lock:
            rows = []
            for e in sorted(self._entries.values(), key=lambda e: e.name):
                if e.unloading:
                    continue
                state = e.state if e.state != "cold" else ("failed" if e.error else "idle")
                rows.append({
                    "name": e.name, "tier": self._tier(e), "state": state, "slot": e.slot if e.ready else None,
                    "pinned": e.pinned, "pin_pending": e.pinned and not e.ready,
                    "rank": e.spec.max_rank if e.spec else None, "bytes": self._size(e),
                    "hits": e.hits, "misses": e.misses, "requests": e.refs,
                    "path": str(e.path) if e.path else None, "source": redact(e.source), "sha256": e.sha256,
                    "error": e.error})
            return rows

    def refresh_metrics(self) -> None:
        with self._lock:
            self.metrics.loads_in_flight.set(self._in_flight)
            self.metrics.loads_pending.set(len(self._pending))
            self._update_pinned_gauge()
        names = self.host.names()
        self.metrics.host.set(len(names))
        self.metrics.host_bytes.set(self.host.used_bytes)

    # -- internals (under the lock) ---------------------------------------------------------------

    def _tier(self, e: CachedAdapter) -> str:
        if e.ready:
            return "gpu"
        if e.memory is not None or e.name in self.host:
            return "host"
        if self._disk_dir(e) is not None:
            return "disk"
        return "source"

    def _disk_dir(self, e: CachedAdapter) -> Path | None:
        if e.path is not None and (e.path / CONFIG_FILE).is_file():
            return e.path
        if self.cache_dir is not None and _NAME.match(e.name) and (self.cache_dir / e.name / CONFIG_FILE).is_file():
            return self.cache_dir / e.name
        return None

    def _size(self, e: CachedAdapter) -> int | None:
        if e.spec is not None:
            return e.spec.nbytes
        d = self._disk_dir(e)
        if d is not None and (d / WEIGHTS_FILE).is_file():
            return (d / WEIGHTS_FILE).stat().st_size
        return None

    def _update_pinned_gauge(self) -> None:
        self.metrics.pinned.set(sum(1 for e in self._entries.values() if e.pinned and not e.unloading))

    def _want(self, e: CachedAdapter) -> None:
        if e.state in ("ready", "loading", "pending"):
            return
        e.state, e.pending_since = "pending", self.clock()
        self._pending.append(e.name)
        self._pump()

    def _pump(self) -> None:
        """Start pending loads, oldest first, while a load worker and a slot are free."""
        pinned_slots = sum(1 for o in self._entries.values() if o.pinned and o.state in ("ready", "loading"))
        for name in list(self._pending):
            if self._in_flight >= self.max_concurrent_loads:
                break
            e = self._entries.get(name)
            if e is None or e.state != "pending":
                self._pending.remove(name)
                continue
            if e.pinned and e.refs == 0 and pinned_slots >= self.buffers.num_slots - 1:
                continue  # pins take all slots but one: this pin waits, requests still page
            slot = self._take_slot(e)
            if slot is None:
                break  # no slot free or evictable: none of the others would get one either
            pinned_slots += e.pinned
            self._pending.remove(name)
            e.state, e.slot = "loading", slot
            self._in_flight += 1
            self.max_in_flight_seen = max(self.max_in_flight_seen, self._in_flight)
            self.metrics.loads_in_flight.set(self._in_flight)
            self._pool.submit(self._load, e, slot)
        self.metrics.loads_pending.set(len(self._pending))

    def _take_slot(self, e: CachedAdapter) -> int | None:
        """A free slot, or one taken from an evictable adapter (the policy's pick)."""
        if self._free:
            return self._free.pop(0)
        evictable = {n for n, o in self._entries.items()
                     if o.ready and o.refs == 0 and not o.pinned}
        victim = self.policy.select_victim(evictable)
        if victim is None:
            return None
        v = self._entries[victim]
        slot = self._release_slot(v, free=False)
        log.debug("adapter %s evicted from slot %d for %s", victim, slot, e.name)
        if v.unloading or (v.memory is None and v.path is None and v.source is None):
            self._entries.pop(victim, None)  # nothing to load it from again (installed from memory)
        return slot

    def _release_slot(self, v: CachedAdapter, free: bool = True) -> int:
        """Evict a resident adapter: its slot goes back to the free list (or to the caller)."""
        slot = v.slot
        self.policy.record_evict(v.name)
        v.state, v.slot = "cold", -1
        del self._ready[v.name]
        self.metrics.evictions.labels("gpu").inc()
        if free:
            self._free.append(slot)
            self._free.sort()
        return slot

    def _drop(self, e: CachedAdapter) -> None:
        if e.ready:
            self.policy.record_evict(e.name)
            self._free.append(e.slot)
            self._free.sort()
            del self._ready[e.name]
        self._entries.pop(e.name, None)
        self.host.discard(e.name)
        waiters, e.waiters = e.waiters, []
        for fut in waiters:  # a prefetch of a pending load that will never run
            if not fut.done():
                fut.set_exception(AdapterLoadError(e.name, "other", "unloaded before it was loaded"))
        log.info("adapter %s unloaded", e.name)

    # -- the load (worker thread) -------------------------------------------------------------------

    def _load(self, e: CachedAdapter, slot: int) -> None:
        t0 = self.clock()
        tier = "host"
        error: AdapterLoadError | None = None
        try:
            copy, tier = self._host_copy(e)
            self._copy_to_slot(copy, slot)
        except AdapterLoadError as err:
            error = err
        except BaseException as err:  # noqa: BLE001 - any failure fails this adapter only
            error = load_error(e.name, err)
        with self._lock:
            self._in_flight -= 1
            waiters, e.waiters = e.waiters, []
            if error is None:
                e.state, e.error = "ready", None
                self._ready[e.name] = slot
                self.policy.record_insert(e.name, cost=1.0, prefetch=e.prefetch)
                self.metrics.load_seconds.labels(tier).observe(self.clock() - t0)
                log.info("adapter %s loaded into slot %d from %s in %.1f ms", e.name, slot, tier,
                         (self.clock() - t0) * 1e3)
                if e.unloading and e.refs == 0:
                    self._drop(e)
            else:
                e.state, e.slot, e.error = "cold", -1, str(error)
                self._free.append(slot)
                self._free.sort()
                self.metrics.load_failures.labels(error.reason).inc()
                if e.refs > 0:
                    self._failures[e.name] = str(error)
                log.warning("%s", error)
                if e.unloading:
                    self._entries.pop(e.name, None)
            self._pump()
        for fut in waiters:
            if fut.done():
                continue
            if error is None:
                fut.set_result(slot)
            else:
                fut.set_exception(error)
        self.wake()

    def _host_copy(self, e: CachedAdapter) -> tuple[HostCopy, str]:
        """The adapter in host memory, reading (and fetching) it if needed; the tier it came from."""
        if e.memory is not None:
            return e.memory, "host"
        copy = self.host.get(e.name)
        if copy is not None:
            return copy, "host"
        with self._lock:
            path = self._disk_dir(e)
        tier = "disk"
        if path is None:
            path, tier = fetch_adapter(e.name, e.source, e.sha256, self.cache_dir, self.node_agent_url,
                                       missing=e.path), "source"
        spec = read_adapter(path, self.base)
        digest = e.sha256 or _stat_digest(path / WEIGHTS_FILE)
        copy = read_into_host(path, spec, self.buffers, self.pin_memory, self.cuda_lock)
        with self._lock:
            e.spec = spec
            e.id = AdapterId(name=e.name, digest=digest, uri=str(path))
        if not self.host.add(e.name, copy):
            log.debug("adapter %s: no room in the host tier", e.name)
        return copy, tier

    def _copy_to_slot(self, copy: HostCopy, slot: int) -> None:
        """Host -> slot. On CUDA: a side stream and an event this worker waits on, so the decode
        loop never waits on PCIe; the slot is not in any batch until the load is marked ready."""
        if self.buffers.device.type != "cuda":
            copy.copy_to(self.buffers, slot, self._views[slot])
            return
        with self.cuda_lock:  # ~bytes / PCIe bandwidth: a graph capture waits at most that long
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = torch.cuda.Stream(self.buffers.device)
            if self._staging is None:  # one slot's bytes on the device; loads copy one at a time (the lock)
                self._staging = HostCopy(self.buffers, pin=False, device=self.buffers.device)
            with torch.cuda.stream(stream):
                copy.copy_to(self.buffers, slot, self._views[slot], staging=self._staging)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()


def _stat_digest(path: Path) -> str:
    """A cheap version stamp when no sha256 is known: hashing 80 MB would cost more than the copy."""
    st = path.stat()
    return f"stat:{st.st_size}-{st.st_mtime_ns}"

