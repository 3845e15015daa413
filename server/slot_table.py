"""The slot table: which adapter holds which GPU slot, and the loads waiting for one.

Where it sits in the adapter cache's data flow::

    request -> lookup, refs, pins      adapter_cache.py  (AdapterCache, the public face)
            -> slot choice / eviction  slot_table.py     (here: want, pump, take_slot, drain)
            -> stage from its source   adapter_loader.py (stage: onto local disk, no slot held)
            -> load through the tiers  adapter_loader.py (disk -> host -> slot)
            -> ready                   slot_table.py     (finish_load: the slot joins ready_slots)

One `CachedAdapter` row per known adapter. Its state, with the step that moves it::

    cold --want: not on local disk--> staging --finish_stage--> pending
    cold --want: in host memory or on disk--> pending
    pending --pump: a load worker and a slot--> loading --finish_load--> ready
    staging --finish_stage, failed--> cold;  loading --finish_load, failed--> cold (slot freed)
    loading --unstage: the load found it must be fetched after all--> staging (slot freed)
    ready --release_slot (evicted by take_slot, evict, or drained)--> cold
    ready, stale (a new version registered) --refresh, once none of its requests runs--> cold
        --want, if pinned or requests wait for it--> pending: the new version loads

Stage first: a fetch from the source (or the node agent) takes seconds, a load from host
memory ~2 ms. A fetch runs before its load takes a slot and a load worker, on the loader's
own staging threads, so slow fetches never hold the --max-concurrent-loads workers or slots
that other cold loads wait for.

Running example, 2 slots holding a (pinned) and b (one request), a request for c::

    want(c)          c pending; pump: a worker is free, no slot free, evictable {} -> c waits
    (b's request leaves, refs 0)
    pump()           take_slot(c): the policy picks b; release_slot(b); c loading in b's slot
    finish_load(c)   c ready, in `ready` -> the engine admits its request at the next step

The table is not thread-safe: the cache calls every method under its one lock, which also
guards the rows and the eviction policy. Loads are started through `start_load`, a callback
(the cache hands it to the loader's workers), so this module imports nothing that loads.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .adapter_format import AdapterSpec
from .adapter_sources import AdapterLoadError, Fetched, redact
from .adapters import AdapterId
from .cache_metrics import CacheMetrics
from .cache_policy import EvictionPolicy
from .disk_read import DiskRead
from .host_tier import HostCopy, HostTier

log = logging.getLogger(__name__)


@dataclass
class CachedAdapter:
    """One known adapter and where it is. Mutated under the cache's lock only."""

    name: str
    path: Path | None = None  # a PEFT directory registered for it (load_lora_adapter, --lora-modules)
    admin: bool = False  # loaded by load_lora_adapter or --lora-modules: a plan never unloads it
    source: str | None = None  # the plan's source URI
    sha256: str | None = None  # the plan's digest of adapter_model.safetensors
    id: AdapterId | None = None  # set once its files are read
    spec: AdapterSpec | None = None
    disk_read: DiskRead | None = None  # its last read from disk (spec, read plan): reused while its files match
    state: str = "cold"  # cold -> (staging ->) pending -> loading -> ready (-> cold when evicted or failed)
    slot: int = -1
    refs: int = 0  # requests holding it (queued or running)
    pinned_api: bool = False
    pinned_plan: bool = False
    pin_order: int = 0  # when it was pinned (a count): over the pins' share, the newest yields
    prefetch: bool = False  # the pending load was asked ahead of demand
    asked: bool = False  # a prefetch (not its pin) waits for its pending load: a pin over the share loads
    memory: HostCopy | None = None  # installed from memory: its only copy
    hits: int = 0  # requests that found it resident
    misses: int = 0  # requests that had to wait for a load
    error: str | None = None  # the last load's error
    failed_in_row: int = 0  # loads that failed since the last that did not (a pin's retries back off)
    unloading: bool = False
    draining: bool = False  # no new admissions; evicted once its running requests finish
    served: bool = False  # ran a request since its last load: only then may it be drained
    expired: bool = False  # its warm-up window ended with no request since: evicted before any other
    pending_since: float = 0.0  # when its load was asked for (clock seconds)
    # Session starts' leases: a deadline (clock seconds) each, until which the adapter stays
    # resident for that session's first request (`AdapterCache.start_session`; `SlotTable.leased`).
    leases: list[float] = field(default_factory=list)
    fetched: Fetched | None = None  # what its staging put on disk, for its next load (taken at its start)
    waiters: list[concurrent.futures.Future] = field(default_factory=list)

    @property
    def pinned(self) -> bool:
        return self.pinned_api or self.pinned_plan

    @property
    def version(self) -> tuple[str, str | None]:
        """What tells its versions apart, as the node agent does: its sha256, or without one
        its source, query string and user info aside (a new source is a new version; a
        re-signed URL is not)."""
        return ("sha256", self.sha256) if self.sha256 is not None else ("source", redact(self.source))

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class AdapterUnloaded(AdapterLoadError):
    """A prefetch's (or a session start's) wait ended because its adapter was unloaded before
    any load of it ran: the adapter is gone, no load failed (the HTTP layer answers 404)."""

    def __init__(self, name: str):
        super().__init__(name, "other", "unloaded before it was loaded")
        self.args = (f"adapter {name!r} was unloaded before it was loaded",)


class PinFuture(concurrent.futures.Future):
    """The future a pin's own wait is (`AdapterCache.pin`): not a wanter of the load once the
    adapter is unpinned; an unpin (of a queued load) or the end of its fetch (`finish_stage`)
    cancels it and calls that load off if nothing else wants it."""


def wanted_by_others(e: "CachedAdapter") -> bool:
    """Whether a request, a prefetch (or a session start) or a pin still wants `e`'s load: an
    unpinned pin's own wait does not count (its future is cancelled by whoever calls it off)."""
    return e.refs > 0 or e.pinned or not all(f.done() or isinstance(f, PinFuture) for f in e.waiters)


def call_off(e: "CachedAdapter") -> None:
    """`e`'s load (queued, or about to be after its fetch) is not run: it goes cold, and the
    pins' own futures still waiting on it are cancelled."""
    e.state = "cold"
    pins, e.waiters = e.waiters, []
    for fut in pins:
        fut.cancel()


class SessionFuture(concurrent.futures.Future):
    """A session start's wait (`AdapterCache.start_session`): the load it waits for leases the
    adapter to it once resident (`finish_load`), unless its client gave up meanwhile."""


def tell(fut: concurrent.futures.Future, slot: int = -1, error: BaseException | None = None) -> None:
    """Resolve a prefetch's future with its slot or its error, unless its client gave up: a
    timeout cancels it from the event loop's thread at any moment, even after a done() check."""
    try:
        if error is None:
            fut.set_result(slot)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled


def reloadable(e: CachedAdapter) -> bool:
    """Whether `e` can be loaded again once evicted (one installed from memory alone cannot)."""
    return e.memory is not None or e.path is not None or e.source is not None


class SlotTable:
    """The rows, the free slots, the pending queue and the loads in flight. Call under the cache's lock."""

    def __init__(self, num_slots: int, policy: EvictionPolicy, host: HostTier, metrics: CacheMetrics, *,
                 max_concurrent_loads: int, start_load: Callable[[CachedAdapter, int], None],
                 clock: Callable[[], float], start_stage: Callable[[CachedAdapter], None] | None = None,
                 needs_stage: Callable[[CachedAdapter], bool] | None = None):
        self.num_slots = num_slots
        self.policy = policy
        self.host = host  # an unloaded adapter's host copy goes too
        self.metrics = metrics
        self.max_concurrent_loads = max_concurrent_loads
        self.start_load = start_load  # runs the load of (row, slot) on a load worker; returns at once
        # Runs the staging of a row (a fetch onto local disk, a check of its files) on a staging
        # thread; returns at once.
        self.start_stage = start_stage
        self.needs_stage = needs_stage  # whether a row must be staged before its load (None: never)
        self.clock = clock
        self.entries: dict[str, CachedAdapter] = {}
        self.ready: dict[str, int] = {}  # name -> slot of the resident adapters (read every step)
        self.draining: str | None = None  # the adapter giving up its slot to starved loads
        # Rows whose slot holds (or whose load in flight may read) a version replaced since:
        # they admit no new request, and reload once none of theirs runs (`refresh`).
        self.stale: set[str] = set()
        self.drain_after = 2.0  # seconds a request's load waits for a slot before one drains
        self.free = list(range(num_slots))
        self.pending: deque[str] = deque()
        self.in_flight = 0
        self.staging = 0  # rows being staged (fetched onto disk, their files checked): no slot, no load worker
        self.failures: dict[str, str] = {}
        self.max_in_flight_seen = 0
        self.session_lease_s = 60.0  # how long a session start's lease holds (AdapterCache sets it)

    # -- request -> slot ----------------------------------------------------------------------------

    def want(self, e: CachedAdapter, check: bool = True) -> None:
        """Queue a load of `e` (if it is neither resident nor on its way) and start what can start.
        One not on local disk, or with files not checked yet (`needs_stage`), is staged first:
        it waits for its slot once there.
        `check=False` (the engine thread's calls) skips that look at the disk: the load then
        finds out, and gives its slot back to stage it first (`unstage`)."""
        if e.state == "pending":
            if e.pinned and (e.refs == 1 or e.asked):  # a pin waiting over its share is asked for:
                self.pump()  # pump's rule lets it start now (other pending rows gain nothing)
            return
        if e.state in ("ready", "loading", "staging"):
            return
        e.fetched = None
        if check and self.needs_stage is not None and self.needs_stage(e):
            self.stage(e)
            return
        self.enqueue(e)

    def enqueue(self, e: CachedAdapter) -> None:
        """`e` waits for a load worker and a slot (from now: `drain` counts its wait from here)."""
        e.state, e.pending_since = "pending", self.clock()
        self.pending.append(e.name)
        self.pump()

    def pump(self) -> None:
        """Start pending loads, oldest first, while a load worker and a slot are free."""
        pinned_slots = self.pinned_slots()
        for name in list(self.pending):
            if self.in_flight >= self.max_concurrent_loads:
                break
            e = self.entries.get(name)
            if e is None or e.state != "pending":
                self.pending.remove(name)
                continue
            if e.pinned and e.refs == 0 and not e.asked and pinned_slots >= self.num_slots - 1:
                continue  # pins take all slots but one: this pin waits, requests still page
            slot = self.take_slot(e)
            if slot is None:
                break  # no slot free or evictable: none of the others would get one either
            self.pending.remove(name)
            e.state, e.slot, e.asked = "loading", slot, False
            pinned_slots = self.pinned_slots()  # take_slot may have evicted a pin
            self.in_flight += 1
            self.max_in_flight_seen = max(self.max_in_flight_seen, self.in_flight)
            self.metrics.loads_in_flight.set(self.in_flight)
            self.start_load(e, slot)
        self.metrics.loads_pending.set(self.num_pending())

    def stage(self, e: CachedAdapter) -> None:
        """Fetch `e` onto local disk on a staging thread; `finish_stage` hears how it went."""
        assert self.start_stage is not None
        e.state = "staging"
        self.staging += 1
        self.start_stage(e)

    def finish_stage(self, e: CachedAdapter, version: tuple[str, str | None], fetched: Fetched | None,
                     error: AdapterLoadError | None) -> list[concurrent.futures.Future]:
        """A staging thread is done with `e` (staged for `version`): on disk, it waits for a slot
        (`fetched` goes to its load); failed, it fails as a load does. Returns the prefetches
        to fail (resolve them unlocked)."""
        self.staging -= 1
        if e.state != "staging" or self.entries.get(e.name) is not e:
            return []  # defensive: an unload defers while staging, so the row is still there
        if e.unloading and e.refs == 0:
            e.state = "cold"
            self.drop(e)  # its prefetches hear "unloaded before it was loaded"
            self.pump()
            return []
        if e.version != version:  # a new version registered during the fetch: stage that one
            log.info("adapter %s: a new version was registered during its staging; staging it", e.name)
            self.stage(e)
            return []
        if error is not None:
            e.state = "cold"
            waiters, e.waiters = e.waiters, []
            self.fail(e, error)
            self.pump()
            return waiters
        if not wanted_by_others(e):
            # Its requests left (aborts), or it was unpinned, during the fetch, and no prefetch
            # waits: the load is called off (the adapter stays on disk), not run to take a slot
            # (evicting an idle adapter in use by the traffic) for nobody; as `unpin` calls
            # off a queued pin's load. A pin's own wait is cancelled.
            call_off(e)
            return []
        e.fetched = fetched
        self.enqueue(e)
        return []

    def unstage(self, e: CachedAdapter, slot: int) -> None:
        """A load found `e` not on local disk (its version replaced, its files gone, or wanted
        with `check=False`): its slot and its worker go back, and it is staged first."""
        self.in_flight -= 1
        self.metrics.loads_in_flight.set(self.in_flight)
        e.state, e.slot = "cold", -1
        self.stale.discard(e.name)  # its staging takes the version registered now
        self.free.append(slot)
        self.free.sort()
        log.info("adapter %s is not on local disk: its load gives slot %d back and stages it first", e.name, slot)
        if e.unloading and e.refs == 0:
            self.drop(e)
        else:
            self.stage(e)
        self.pump()

    def num_pending(self) -> int:
        """Loads pending now: `pending` may still name rows unloaded since, once more if a new row
        of the name is pending (pump drops them as it meets them, and it stops at the first load
        that finds no slot)."""
        return sum(1 for n in set(self.pending) if (e := self.entries.get(n)) is not None and e.state == "pending")

    def take_slot(self, e: CachedAdapter) -> int | None:
        """A free slot, or one taken from an evictable adapter: an expired one first (its
        campaign ended), else the policy's pick.

        Pins hold at most all slots but one. `pump` keeps a pin's own load to that, but an
        adapter pinned while resident, or loaded for a request or a prefetch of its own, can
        take the last slot; then, when nothing unpinned is evictable, the newest idle pin is (the one over
        the share): it goes back to pending (`describe`'s pin_pending) until a share frees up."""
        if self.free:
            return self.free.pop(0)
        evictable = {n for n, o in self.entries.items()
                     if o.ready and o.refs == 0 and not o.pinned}
        unleased = {n for n in evictable if not self.leased(self.entries[n])}
        expired = sorted(n for n in unleased if self.entries[n].expired)
        victim = expired[0] if expired else self.policy.select_victim(unleased)
        if victim is None and evictable:
            # Every idle unpinned slot is leased to a session start that has not sent its first
            # request yet: a lease is weaker than a pin, so the policy's pick among them gives
            # its lease up (else requests would wait on sessions that may never come).
            victim = self.policy.select_victim(evictable)
            log.info("adapter %s gave up its session lease to %s: every idle slot was leased", victim, e.name)
        if victim is None and self.pinned_slots() >= self.num_slots:
            pins = [o for o in self.entries.values()
                    if o.ready and o.refs == 0 and o.pinned and not o.unloading and reloadable(o)]
            victim = max(pins, key=lambda o: o.pin_order).name if pins else None
        if victim is None:
            return None
        v = self.entries[victim]
        slot = self.release_slot(v, free=False)
        log.debug("adapter %s evicted from slot %d for %s", victim, slot, e.name)
        if v.unloading or not reloadable(v):
            self.entries.pop(victim, None)  # nothing to load it from again (installed from memory)
        elif v.pinned:
            v.state, v.pending_since = "pending", self.clock()
            self.pending.append(v.name)
            log.info("pinned adapter %s gave its slot to %s: pins held every slot", victim, e.name)
        return slot

    def leased(self, o: CachedAdapter) -> bool:
        """Whether a session start's lease holds `o` resident now (expired leases are dropped)."""
        if o.leases:
            now = self.clock()
            o.leases = [d for d in o.leases if d > now]
        return bool(o.leases)

    def pinned_slots(self) -> int:
        """Slots held by pinned adapters (resident or loading)."""
        return sum(1 for o in self.entries.values() if o.pinned and o.state in ("ready", "loading"))

    def release_slot(self, v: CachedAdapter, free: bool = True) -> int:
        """Evict a resident adapter: its slot goes back to the free list (or to the caller)."""
        slot = v.slot
        self.stale.discard(v.name)
        self.policy.record_evict(v.name)
        v.state, v.slot = "cold", -1
        v.leases = []  # evicted (as a last resort, or by an admin): its leases end with its slot
        del self.ready[v.name]
        self.metrics.evictions.labels("gpu").inc()
        if free:
            self.free.append(slot)
            self.free.sort()
        return slot

    def drop(self, e: CachedAdapter) -> None:
        """Forget `e`: its slot, its row, its host copy; a prefetch still waiting for it fails."""
        self.stale.discard(e.name)
        if e.ready:
            self.policy.record_evict(e.name)
            self.free.append(e.slot)
            self.free.sort()
            del self.ready[e.name]
        if self.entries.get(e.name) is e:
            del self.entries[e.name]
        self.host.discard(e.name)
        waiters, e.waiters = e.waiters, []
        for fut in waiters:  # a prefetch of a pending load that will never run
            tell(fut, error=AdapterUnloaded(e.name))
        log.info("adapter %s unloaded", e.name)

    # -- which resident adapters admit requests ------------------------------------------------------

    def ready_slots(self, running: set[str] | None) -> dict[str, int]:
        """{name: slot} of the resident adapters, less the one draining (see `drain`) and
        those holding a replaced version (see `refresh`)."""
        if self.stale:
            self.refresh(running)
        if running is not None:
            self.drain(running)
        if self.draining is None and not self.stale:
            return dict(self.ready)
        return {n: s for n, s in self.ready.items() if n != self.draining and n not in self.stale}

    def mark_stale(self, e: CachedAdapter) -> None:
        """A new version of `e` was registered: if its slot holds the old one, or a load of it
        is under way (which may have read the old files), the slot is refreshed (`refresh`)."""
        if e.state in ("ready", "loading"):
            self.stale.add(e.name)

    def refresh(self, running: set[str] | None) -> None:
        """Reload the rows whose slot holds a replaced version (a rollout of a resident or
        pinned adapter, which would otherwise serve the old version until it is evicted, and a
        pin never is). Such a row admits no new request (`ready_slots`); once none of its
        requests runs (`running`: the engine's batch; without it, once no request holds it)
        its slot is released, and if it is pinned or requests (or prefetches) wait for it, it
        loads again: its new version, since `register` dropped the old host copy. Requests
        already running finish on the version they started with. A row being unloaded is left
        to its unload."""
        for name in sorted(self.stale):
            e = self.entries.get(name)
            if e is None or e.state not in ("ready", "loading"):
                self.stale.discard(name)
                continue
            if e.state == "loading" or e.unloading or (name in running if running is not None else e.refs > 0):
                continue
            leases = e.leases if self.leased(e) else []
            self.release_slot(e)
            e.leases = leases  # a session's lease holds the new version
            # Requests, a pin, a prefetch waiting, or a session's lease.
            wanted = e.refs > 0 or e.pinned or bool(e.waiters) or bool(leases)
            log.info("adapter %s: its slot held a replaced version; %s", name,
                     "loading the new one" if wanted else "the next request loads the new one")
            if wanted:
                self.want(e, check=False)  # (the engine thread: no look at the disk here)
            else:
                self.pump()

    def drain(self, running: set[str]) -> None:
        """Anti-starvation. Queued requests hold their adapter, so while every slot holds an
        adapter that has requests (running or queued), a cold adapter's requests could wait for
        ever. When the oldest such request's load has waited `drain_after` seconds with no slot
        free or evictable, one resident adapter (the policy's pick) stops admitting; once its
        running requests finish it gives up its slot, and its queued requests wait for a reload
        at the back of the line: round robin through the slots under overload."""
        if self.draining is not None:
            e = self.entries.get(self.draining)
            if e is None or not e.ready or e.pinned:
                if e is not None:
                    e.draining = False
                self.draining = None
            elif self.draining not in running:  # accurate: it admits nothing since it drains
                self.draining, e.draining = None, False
                self.release_slot(e)
                log.info("adapter %s drained out of slot for the starved loads", e.name)
                if e.refs > 0:
                    self.want(e, check=False)  # the engine thread: no look at the disk here
                else:
                    self.pump()
                return
        for name in running:
            e = self.entries.get(name)
            if e is not None and e.ready:
                e.served = True
        if self.draining is not None or self.free or self.in_flight >= self.max_concurrent_loads:
            return
        # `pending` may still name rows unloaded since (pump drops them as it meets them).
        starved = next((e for e in map(self.entries.get, self.pending)
                        if e is not None and e.state == "pending" and e.refs > 0), None)
        if starved is None or self.clock() - starved.pending_since < self.drain_after:
            return
        resident = {n for n, o in self.entries.items() if o.ready and not o.pinned}
        if any(self.entries[n].refs == 0 for n in resident):
            return  # a slot is evictable: the normal path serves it
        # Only an adapter that has run a request since it loaded: one whose load took longer
        # than drain_after would otherwise be drained before admitting anything, and the next
        # one too, so that every slot swaps adapters for ever and no request is served.
        victim = self.policy.select_victim({n for n in resident if self.entries[n].served})
        if victim is not None:
            self.draining = victim
            self.entries[victim].draining = True
            log.info("adapter %s drains: %s has waited %.1fs for a slot", victim, starved.name,
                     self.clock() - starved.pending_since)

    # -- load -> ready ---------------------------------------------------------------------------------

    def finish_load(self, e: CachedAdapter, slot: int, tier: str, error: AdapterLoadError | None,
                    t0: float) -> list[concurrent.futures.Future]:
        """A load worker is done with `e` (started at clock `t0`, its bytes from `tier`): `e` is
        ready in `slot`, or cold again with the slot freed and its requests failed. Starts the
        next pending loads; returns the prefetches waiting on this load (resolve them unlocked)."""
        self.in_flight -= 1
        waiters, e.waiters = e.waiters, []
        if error is None:
            e.state, e.error, e.served = "ready", None, False
            self.ready[e.name] = slot
            # Each session start still waiting on this load leases the adapter from now (its
            # lease runs from residency: the client sends its first request after the answer).
            deadline = self.clock() + self.session_lease_s
            e.leases += [deadline for f in waiters if isinstance(f, SessionFuture) and not f.done()]
            self.policy.record_insert(e.name, cost=1.0, prefetch=e.prefetch)
            self.metrics.load_seconds.labels(tier).observe(self.clock() - t0)
            log.info("adapter %s loaded into slot %d from %s in %.1f ms", e.name, slot, tier,
                     (self.clock() - t0) * 1e3)
            if e.unloading and e.refs == 0:
                self.drop(e)
        else:
            e.state, e.slot = "cold", -1
            self.stale.discard(e.name)
            self.free.append(slot)
            self.free.sort()
            self.fail(e, error)
        self.pump()
        return waiters

    def fail(self, e: CachedAdapter, error: AdapterLoadError) -> None:
        """`e`'s load (or staging) failed: its queued requests fail with `error` (take_failures)."""
        e.error = str(error)
        self.metrics.load_failures.labels(error.reason).inc()
        if e.refs > 0:
            self.failures[e.name] = str(error)
        log.warning("%s", error)
        if e.unloading and e.refs == 0:  # else the last request's release drops it
            self.drop(e)

    def take_failures(self) -> dict[str, str]:
        """{name: error} of loads that failed since the last call."""
        failures, self.failures = self.failures, {}
        return failures
