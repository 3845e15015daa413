"""The adapter cache: GPU slots as a cache over host memory, local disk and a source.

Tiers, fastest first (an adapter is "in" the fastest tier that holds it)::

    gpu     a slot of the LoRABuffers (--max-loras slots)          -> requests run at once
    host    a HostCopy in (pinned) host memory, slot layout        -> ~bytes / PCIe bandwidth
    disk    a PEFT directory: registered path or --adapter-cache-dir/<name>/ (the node agent's cache)
    source  the plan's source URI: staged through the node agent (--node-agent-url) or fetched here

The data flow, one module per stage; this module is the public face (`AdapterCache`): what
the engine, the HTTP layer and the plan watcher call::

    request -> lookup, refs, pins, plan  adapter_cache.py   acquire/release, prefetch, pin, apply_plan
            -> slot choice / eviction    slot_table.py      want, pump, take_slot (the policy's victim), drain
            -> stage from its source     adapter_loader.py  source -> disk, on staging threads, no slot held
            -> load through the tiers    adapter_loader.py  disk -> host -> slot, on load workers
            -> ready                     slot_table.py      finish_load; the engine reads ready_slots
    (the slot count: slot_sizing.py; the tiers below: host_tier.py, adapter_sources.py;
     the eviction policies: cache_policy.py; the metrics: cache_metrics.py)

Running example, 2 slots holding a (pinned) and b (one running request), a request for c::

    acquire("c")    c is known (registered, plan, or found on disk): refs 1, returns -1 (not resident)
                    -> pending; a load worker is free; no free slot; evictable = {} (a pinned, b in use)
                    -> c stays pending, its request stays in the queue (not the batch)
    release("b")    b's request finished: b is evictable -> the policy picks b, c loads into b's slot
    worker          disk -> host copy (safetensors into pinned memory) -> slot (side stream, event)
    ready_slots()   {"a": 0, "c": 1}: the scheduler admits c's request at the next step

Rules: an adapter held by a request (`refs`: from `acquire` when the request is made until
`release` when it leaves) is never evicted, so an adapter whose load finished stays until
its waiting requests are admitted; a pinned adapter is not evicted, and pins take at most
all slots but one (the rest stay pending, reported by `describe`) so requests always have a
slot to page through (pins made while resident, or loaded for a request or a prefetch of
their own, can fill every slot: then the newest idle one gives its slot to a request and
waits pending, `SlotTable.take_slot`). At most
`max_concurrent_loads` loads run at once; an adapter not on local disk is fetched before its
load takes a slot or a load worker (on as many staging threads), so slow fetches never hold
up the loads from host memory or disk behind them. A failed load frees its slot; it, or a
failed fetch, fails its waiters
(`take_failures` for the engine's queued requests, `failed_load` for one queued after that)
and is retried by the next request (a failed fetch only once its back-off ran out:
`AdapterLoader.fetch_backoff`); a pin's also on its own, after a back-off (`_retry_pin`).
Not a load that failed on the adapter's files, while they are unchanged (`AdapterLoader.broken`:
the same stamp of config, weights and served copy): a request, prefetch or pin of it fails at
once with that error (`_refused`), taking no slot, so traffic to one broken adapter evicts no
healthy one; once the files change, or a new version is registered, a load is tried again.
Files no load has read yet are checked before their first load takes a slot (config, header,
shapes; on a thread of their own: `AdapterLoader.needs_stage`), so most broken files fail
there, and even their first failure takes no slot.
Under overload (every slot's adapter always has requests) a cold request would starve: after
`drain_after` seconds one busy adapter stops admitting and gives up its slot once its running
requests finish (`SlotTable.drain`), round robin through the slots.

Threads: one lock (`_lock`) guards the slot table, its rows and the eviction policy; the
HTTP thread (`acquire`, `prefetch`, `pin`), the engine thread (`ready_slots`, `release`,
`take_failures`) and the load workers and staging threads (`_loaded`, `_staged`) call in.
Loads and fetches never run on the engine thread: it only reads `ready_slots`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .adapter_format import WEIGHTS_FILE, AdapterError, AdapterSpec, BaseSpec, read_adapter
from .adapter_loader import AdapterLoader, doubling_backoff
from .adapter_names import InvalidAdapterName, check_adapter_name
from .adapter_sources import AdapterLoadError, Fetched, redact
from .adapters import AdapterId, LoRABuffers
from .cache_metrics import CacheMetrics
from .cache_policy import make_policy
from .host_tier import HostTier, host_copy_from_tensors
from .slot_table import CachedAdapter, PinFuture, SessionFuture, SlotTable, call_off, tell, wanted_by_others

log = logging.getLogger(__name__)

# A pin whose load failed is loaded again after this many seconds, doubled after each failure
# in a row, up to the most (a request for it, or a new plan, tries at once as before).
PIN_RETRY_FIRST_S = 2.0
PIN_RETRY_MAX_S = 120.0

# A session start (`start_session`) leases its adapter this long once resident (or until the
# session's first request for it comes): --session-lease-seconds.
SESSION_LEASE_S = 60.0


class AdapterExistsError(AdapterError):
    """A load of a name already known (vLLM's "has already been loaded"), or still unloading."""


class AdapterPinnedError(Exception):
    """An unload_lora_adapter of a pinned adapter: refused, the pin kept (`unload`)."""


class AdapterCache:
    """Adapter name -> GPU slot, paged over host memory, disk and a source. Thread-safe."""

    def __init__(self, buffers: LoRABuffers, base: BaseSpec, *, policy: str = "lru", max_cpu_loras: int = 0,
                 max_concurrent_loads: int = 4, cache_dir: str | Path | None = None,
                 node_agent_url: str | None = None, namespace: str | None = None,
                 node_agent_token_file: str | None = None,
                 metrics: CacheMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter, base_name: str | None = None,
                 plan_scoped: bool = False, session_lease_s: float = SESSION_LEASE_S):
        self.buffers = buffers
        # The base model's name in the API: a request for it runs on the base, so no adapter
        # may take it (one would be loaded, pinned and listed, and never used).
        self.base_name = base_name
        # A server that follows a plan finds on disk only the plan's adapters: the node's cache
        # holds every base's and every namespace's adapters on that node (one host path).
        self.plan_scoped = plan_scoped
        self._plan_names: frozenset[str] = frozenset()  # the last plan's adapters, pins and prefetches
        self._plan_adapters: frozenset[str] = frozenset()  # the last plan's adapters list
        self._plan_tenants: dict[str, str] = {}  # the last plan's adapters' tenants (tenant_of)
        self.base = base
        self.policy = make_policy(policy)
        self.max_concurrent_loads = max_concurrent_loads
        self.metrics = metrics or CacheMetrics()
        self.clock = clock
        host_slots = max_cpu_loras if max_cpu_loras > 0 else buffers.num_slots
        # A host copy is laid out as a slot (HostCopy): max_cpu_loras copies of the slots' size.
        self.host = HostTier(host_slots * buffers.bytes_per_slot,
                             on_evict=lambda name: self.metrics.evictions.labels("host").inc())
        self.wake: Callable[[], None] = lambda: None  # the engine loop's wake-up (set by AsyncEngine)
        self._pin_orders = itertools.count(1)  # pins are numbered as made: the newest yields first
        self._pin_retries: dict[str, object] = {}  # name -> its newest pin retry timer's token
        self._lock = threading.RLock()
        self._plan_prefetch: set[str] = set()  # the last plan's prefetch list (open warm-up windows)
        self._closed = False
        self.loader = AdapterLoader(buffers, base, self.host, lock=self._lock, done=self._loaded,
                                    max_concurrent_loads=max_concurrent_loads, cache_dir=cache_dir,
                                    node_agent_url=node_agent_url, namespace=namespace, clock=clock,
                                    node_agent_token_file=node_agent_token_file,
                                    staged=self._staged,
                                    unstaged=self._unstaged)
        self.table = SlotTable(buffers.num_slots, self.policy, self.host, self.metrics,
                               max_concurrent_loads=max_concurrent_loads, start_load=self.loader.start, clock=clock,
                               start_stage=self.loader.stage, needs_stage=self.loader.needs_stage)
        self.session_lease_s = session_lease_s
        # Held by a load worker around its CUDA calls, and by the engine while it captures a CUDA graph.
        self.cuda_lock = self.loader.cuda_lock

    @classmethod
    def from_settings(cls, buffers: LoRABuffers, base: BaseSpec, settings, metrics: CacheMetrics | None = None,
                      base_name: str | None = None) -> "AdapterCache":
        return cls(buffers, base, policy=settings.eviction_policy, max_cpu_loras=settings.max_cpu_loras,
                   max_concurrent_loads=settings.max_concurrent_loads, cache_dir=settings.adapter_cache_dir,
                   node_agent_url=settings.node_agent_url, namespace=settings.adapter_namespace, metrics=metrics,
                   node_agent_token_file=settings.node_agent_token_file,
                   base_name=base_name,
                   plan_scoped=bool(settings.plan_file),
                   session_lease_s=float(getattr(settings, "session_lease_seconds", SESSION_LEASE_S)))

    @property
    def session_lease_s(self) -> float:
        """Seconds a session start's lease holds its adapter resident (0: no lease)."""
        return self.table.session_lease_s

    @session_lease_s.setter
    def session_lease_s(self, seconds: float) -> None:
        self.table.session_lease_s = seconds

    def close(self) -> None:
        self._closed = True  # no pin retry starts a load after this
        self.loader.close()

    @property
    def drain_after(self) -> float:
        """Seconds a request's load waits for a slot before a busy adapter drains (SlotTable.drain)."""
        return self.table.drain_after

    @drain_after.setter
    def drain_after(self, seconds: float) -> None:
        self.table.drain_after = seconds

    @property
    def max_in_flight_seen(self) -> int:
        return self.table.max_in_flight_seen

    # -- where adapters are known -------------------------------------------------------------

    def register(self, name: str, path: str | Path | None = None, source: str | None = None,
                 sha256: str | None = None) -> None:
        """Make `name` known: a PEFT directory on disk, and/or a source to fetch it from
        (with its sha256, or None: it has none). A new version (a new sha256; without one, a
        new source: CachedAdapter.version) drops the host copy, so the next load reads the new
        files, and a slot holding the old one is reloaded once its running requests finish
        (`SlotTable.refresh`). AdapterError if `name` is not an adapter name (`adapter_names`)."""
        self._check_name(name)
        with self._lock:
            e = self.table.entries.get(name)
            if e is not None and e.unloading:
                raise AdapterExistsError(f"adapter {name!r} is being unloaded (requests still use it); try "
                                         f"again when they finish")
            if e is None:
                e = self.table.entries[name] = CachedAdapter(name)
            before = e.version
            if path is not None:
                e.path = Path(path)
            if source is not None:
                # A source comes with its digest, or with none (the plan's entry: a sha256 taken
                # out of a LoRAAdapter is gone, not kept to check the new source's files against).
                e.source, e.sha256 = source, sha256
            elif sha256 is not None:
                e.sha256 = sha256
            stale = False
            # (A sha256 given where there was only a source is a new version too: the source's
            # digest was never known, and the node agent stages by the digest from then on.)
            if e.version != before and before[1] is not None:
                self.host.discard(name)
                self.table.mark_stale(e)
                stale = name in self.table.stale
                log.info("adapter %s: new version %s%s", name, e.version[1] if e.sha256 is None else e.sha256[:12],
                         " (its slot reloads once its running requests finish)" if stale else "")
                # Held by no request: now (an idle engine takes no step that would); else at the
                # engine's next step, which the wake-up below brings.
                self.table.refresh(None)
        if stale:
            self.wake()

    def _lookup(self, name: str) -> CachedAdapter | None:
        """The entry for `name`, registering one found in --adapter-cache-dir (lazy discovery:
        with a plan, of the plan's adapters only)."""
        e = self.table.entries.get(name)
        if e is not None:
            return None if e.unloading else e
        discoverable = name != self.base_name and (not self.plan_scoped or name in self._plan_names)
        path = self.loader.staged(name) if discoverable else None
        if path is not None:
            e = self.table.entries[name] = CachedAdapter(name, path=path)
            log.info("adapter %s found in %s", name, self.loader.cache_dir)
            return e
        return None

    def has(self, name: str) -> bool:
        with self._lock:
            return self._lookup(name) is not None

    def _name_error(self, name: str) -> str | None:
        """Why `name` cannot be an adapter's here, or None."""
        try:
            check_adapter_name(name)
        except InvalidAdapterName as e:
            return str(e)
        if name == self.base_name:
            return f"{name!r} is the base model's name (a request for it runs on the base)"
        return None

    def _check_name(self, name: str) -> None:
        """AdapterError (the refusal every caller already reports) for a name that is not one."""
        error = self._name_error(name)
        if error is not None:
            raise AdapterError(error)

    # -- requests ----------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """A request holds `name` from now until `release`: its slot, or -1 while it loads (a
        load starts if none runs). KeyError if the adapter is known nowhere."""
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            e.refs += 1
            e.expired = False
            if self.table.leased(e):
                # A session's first request: its lease ends (the request's hold keeps the adapter
                # now); the soonest to expire, as requests do not say which session they are of.
                e.leases.remove(min(e.leases))
            self.policy.record_access(name)
            tier = self._tier(e, gpu=name not in self.table.stale)
            self.metrics.record_lookup(tier)
            if e.ready and name not in self.table.stale:
                e.hits += 1
                return e.slot
            e.misses += 1  # (a slot of a replaced version admits it only once reloaded)
            e.prefetch = False
            if self._refused(e) is None:  # else the engine fails the request (`failed_load`)
                self.table.want(e)
            return -1

    def release(self, name: str) -> None:
        with self._lock:
            e = self.table.entries.get(name)
            if e is None:
                return
            e.refs -= 1
            if e.refs > 0:
                return
            if e.unloading and e.state not in ("loading", "staging"):  # their end drops it
                self.table.drop(e)
            elif e.state == "pending" and not wanted_by_others(e):
                # Its last request left (an abort) before its load started, and no pin or
                # prefetch wants it (the wait of a pin taken off since does not): the load is
                # called off, not run later to evict an idle adapter for nobody (pump drops the
                # name from the queue when it meets it), as `unpin` calls one off.
                call_off(e)
            elif name in self.table.stale:
                # Its slot holds a replaced version and its last request left: reload it now, as
                # `register` does for one held by no request. The engine releases a request at
                # the end of the step it finished in; with nothing else to run it takes no step
                # after, whose ready_slots would.
                self.table.refresh(None)
            self.table.pump()

    def ready_slots(self, running: set[str] | None = None) -> dict[str, int]:
        """{name: slot} of the adapters resident now: the scheduler admits their requests.

        The engine calls it once per step, before admitting, with `running` (the adapters of
        the batch's requests); then it also keeps a cold request from starving behind busy
        adapters (see `SlotTable.drain`)."""
        with self._lock:
            return self.table.ready_slots(running)

    def take_failures(self) -> dict[str, str]:
        """{name: error} of loads that failed since the last call (the engine fails the queued
        requests for those adapters)."""
        with self._lock:
            return self.table.take_failures()

    def failed_load(self, name: str) -> str | None:
        """The error of `name`'s last load if it failed and no load of it is on its way again,
        else None. A request that acquired `name` but reached the engine's queue only after
        `take_failures` reported that failure asks here, so it fails too instead of waiting
        for a load that nothing will start."""
        with self._lock:
            e = self.table.entries.get(name)
            if e is None:
                return f"adapter {name!r} was unloaded before it loaded"
            return e.error if e.state == "cold" and e.error else None

    # -- prefetch, pins, plan ------------------------------------------------------------------

    def prefetch(self, name: str) -> concurrent.futures.Future:
        """Bring `name` into a GPU slot ahead of its requests (through every tier). The future
        gives its slot once resident, or raises AdapterLoadError; KeyError if unknown. A pin
        waiting over the pins' share loads for it, as for a request (a session start waits)."""
        return self._prefetch(name, asked=True)

    def start_session(self, name: str) -> concurrent.futures.Future:
        """A session starts for `name`: prefetch it (as `prefetch`), and lease it resident from
        the moment it is until the session's first request for it (`acquire`) or for
        `session_lease_s` seconds, so that request hits. A lease is weaker than a pin: it never
        holds a slot a pin's share or a request needs when no other idle slot is left
        (`SlotTable.take_slot`), and it ends with an eviction, an unload or its timeout."""
        return self._prefetch(name, asked=True, session=self.session_lease_s > 0)

    def _prefetch(self, name: str, *, asked: bool, session: bool = False) -> concurrent.futures.Future:
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            # A pin's own wait is told apart from a prefetch's: an unpin calls off a load that
            # only the pin wanted (`unpin`); a session's, for the lease its load gives it.
            fut: concurrent.futures.Future = (
                (SessionFuture() if session else concurrent.futures.Future()) if asked else PinFuture())
            e.expired = False  # wanted again (a new window, a session)
            if e.ready and name not in self.table.stale:
                if asked:  # about to be used, as a prefetch's load tells the policy (finish_load)
                    self.policy.record_insert(name, cost=1.0, prefetch=True)
                if session:
                    e.leases.append(self.clock() + self.session_lease_s)
                fut.set_result(e.slot)
                return fut
            error = self._refused(e)
            if error is not None:
                if e.pinned and not asked:  # a pin: it loads on its own once the files change
                    self._arm_pin_retry(e)
                fut.set_exception(error)
                return fut
            e.waiters.append(fut)
            if e.state == "cold":
                e.prefetch = e.refs == 0
            e.asked = e.asked or asked
            self.table.want(e)
            return fut

    def pin(self, name: str, *, plan: bool = False) -> concurrent.futures.Future:
        """Pin `name` (never evicted) and load it; KeyError if unknown."""
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            if not e.pinned:
                e.pin_order = next(self._pin_orders)
            if plan:
                e.pinned_plan = True
            else:
                e.pinned_api = True
            self._update_pinned_gauge()
            return self._prefetch(name, asked=False)  # a pin alone keeps to the pins' share

    def unpin(self, name: str, *, plan: bool = False) -> bool:
        """Unpin `name`; returns whether it is still pinned (by the other of API and plan)."""
        with self._lock:
            e = self.table.entries.get(name)
            if e is None:
                raise KeyError(name)
            if plan:
                e.pinned_plan = False
            else:
                e.pinned_api = False
            self._update_pinned_gauge()
            if e.state == "pending" and not wanted_by_others(e):
                # A pin waiting over the pins' share, or behind other loads, that nothing else
                # wants now (no request, no prefetch): its load is called off, as `release` calls
                # off one whose requests left, not run later to evict an adapter in use for
                # nobody. (pump drops the name from the queue when it meets it.) One still
                # fetching is called off when its fetch ends (`SlotTable.finish_stage`).
                call_off(e)
            self.table.pump()
            return e.pinned

    def apply_plan(self, plan: dict) -> None:
        """Follow the operator's plan: register its adapters (source, sha256), pin its pinned set
        and unpin what left it; unload an adapter that left the plan (deleted, or moved to
        another base), once its requests finish, unless the admin API or --lora-modules loaded
        it. An adapter that enters the plan's prefetch list (a warm-up window, which the
        operator lists warmupLeadSeconds before its start) is loaded at once. One that leaves
        it (its warm-up window ended: the campaign is over) is evicted before any other until
        it is requested again, so an ended
        campaign does not hold slots until its counts age out (bench/results/cache_sim_notes.md,
        "The end of a campaign"). AdapterExistsError, once the rest is applied, when an adapter
        of the plan is still being unloaded (it left an earlier plan): apply it again later.
        Plan format: operator/plan.py."""
        prefetch = {p["name"] for p in plan.get("prefetch") or [] if p.get("name")}
        pinned = set(plan.get("pinned") or [])
        adapters = {a.get("name") for a in plan.get("adapters") or []}
        tenants = {a["name"]: a["tenant"] for a in plan.get("adapters") or [] if a.get("tenant") is not None}
        with self._lock:
            left = self._plan_adapters - adapters  # the pinned and prefetch lists name adapters of these
            self._plan_adapters = frozenset(adapters)
            self._plan_tenants = tenants
            self._plan_names = frozenset(n for n in adapters | pinned | prefetch if isinstance(n, str))
            ended = self._plan_prefetch - prefetch
            entered = prefetch - self._plan_prefetch
            self._plan_prefetch = prefetch
            for name in sorted(ended):
                e = self.table.entries.get(name)
                if e is not None and not e.pinned:
                    e.expired = True
            for name in prefetch:  # a window open (again)
                e = self.table.entries.get(name)
                if e is not None:
                    e.expired = False
        if ended:
            log.info("plan: warm-up window ended for %s", ", ".join(sorted(ended)))
        unloading = set()  # left an earlier plan and still being unloaded: this plan is applied again
        for a in plan.get("adapters") or []:
            try:
                self.register(a["name"], source=a.get("source"), sha256=a.get("sha256"))
            except AdapterExistsError:
                unloading.add(a["name"])
            except AdapterError as err:
                log.warning("plan: %s", err)
            if a.get("pinned"):
                pinned.add(a["name"])
        bad = {n for n in pinned if self._name_error(n)}
        if bad:  # a hand-written plan's (the operator plans Kubernetes object names only)
            log.warning("plan: not pinning %s: not adapter names", ", ".join(sorted(map(repr, bad))))
            pinned -= bad
        with self._lock:
            before = {n for n, e in self.table.entries.items() if e.pinned_plan}
        for name in sorted(before - pinned):
            try:
                self.unpin(name, plan=True)
            except KeyError:
                pass  # unloaded since `before` was read: nothing left to unpin
        for name in sorted(pinned - before):
            try:
                self.pin(name, plan=True)
            except KeyError:
                if name not in unloading:
                    log.warning("plan pins %s, which is known nowhere (no source, not on disk)", name)
        for name in sorted(entered - pinned):
            # A warm-up window entered the list (the operator lists it warmupLeadSeconds before
            # its start): load it now, so the campaign's first requests hit. The node agent asks
            # for it too, but may ask before this server has read the plan (the kubelet updates
            # a mounted ConfigMap up to a minute after the API has it): then it is unknown here.
            try:
                self.prefetch(name)
            except KeyError:
                log.warning("plan prefetches %s, which is known nowhere (no source, not on disk)", name)
        if pinned != before:
            log.info("plan: %d pinned (%s)", len(pinned), ", ".join(sorted(pinned)) or "none")
        for name in sorted(left):  # deleted, or moved to another base: no longer served here
            with self._lock:
                e = self.table.entries.get(name)
                if e is None or e.admin or e.unloading:
                    continue
                now = self.unload(name)
            log.info("plan: %s left the plan; unloaded%s", name, "" if now else " once its requests finish")
        if unloading:
            # Back in the plan before the requests that held up their unload finished: the
            # plan watcher applies the plan again at each look until they can be registered
            # (else they stayed unknown, and unpinned, until the plan file changed again); a
            # warm-up window of theirs that entered with this plan is entered then.
            with self._lock:
                self._plan_prefetch -= unloading
            raise AdapterExistsError(f"plan: {', '.join(sorted(unloading))} left an earlier plan and are still "
                                     f"being unloaded (requests still use them); the plan is applied again")

    # -- vLLM-style admin and benchmarks ---------------------------------------------------------

    def load(self, name: str, path: str | Path, timeout: float | None = 120.0) -> int:
        """Register `name` at `path` and load it into a slot (evicting an idle adapter if all are
        taken); returns the slot. Raises AdapterError when it does not fit the base, or when no
        slot frees up within `timeout` seconds (it stays registered and queued for one)."""
        self._check_name(name)
        spec = read_adapter(path, self.base)  # a refused adapter is refused before anything changes
        with self._lock:  # one step: a second load of the name (or an unload) cannot come between
            e = self.table.entries.get(name)
            if e is not None:
                raise AdapterExistsError(
                    f"The lora adapter '{name}' is being unloaded (requests still use it); try again when "
                    f"they finish" if e.unloading else f"The lora adapter '{name}' is already loaded.")
            self.register(name, path=path)
            self.table.entries[name].spec = spec
            self.table.entries[name].admin = True
            fut = self.prefetch(name)
        try:
            return fut.result(timeout)
        except AdapterLoadError as e:
            self._forget_failed(name)
            raise AdapterError(str(e)) from None
        except concurrent.futures.TimeoutError:
            raise AdapterError(f"adapter {name!r} is registered, but no slot freed up within {timeout:g}s "
                               f"(every slot is pinned or in use); it loads when one does") from None

    def _forget_failed(self, name: str) -> None:
        """After `load`'s load failed: the name is forgotten, as vLLM registers nothing for a
        load_lora_adapter that fails, so that the call can be made again (it would find the name
        "already loaded"). Kept if a request or a pin holds it meanwhile: a request retries it."""
        with self._lock:
            e = self.table.entries.get(name)
            if e is not None and e.state == "cold" and e.refs == 0 and not e.pinned and not e.unloading:
                self.table.failures.pop(name, None)  # nobody queued for it to fail
                self.table.drop(e)

    def install(self, adapter: AdapterId, spec: AdapterSpec, tensors: dict[str, torch.Tensor], *,
                keep_host_copy: bool = False) -> int:
        """An adapter made in memory (benchmarks, tests), written into a slot now (call between
        steps); returns the slot. With `keep_host_copy` it pages like any other adapter (a
        pinned host copy is its source); without, it is forgotten when evicted."""
        self._check_name(adapter.name)
        with self._lock:
            if adapter.name in self.table.entries:
                raise AdapterError(f"adapter {adapter.name!r} is already loaded")
            e = self.table.entries[adapter.name] = CachedAdapter(adapter.name, id=adapter, spec=spec)
        if keep_host_copy:
            try:
                with self.cuda_lock:
                    e.memory = host_copy_from_tensors(spec, tensors, self.buffers, self.loader.pin_memory)
            except BaseException:
                with self._lock:
                    self.table.entries.pop(adapter.name, None)
                raise
            return self.prefetch(adapter.name).result()
        with self._lock:
            slot = self.table.take_slot(e)
            if slot is None:
                del self.table.entries[adapter.name]
                raise AdapterError(f"no slot for {adapter.name!r}: every slot is pinned or in use")
            e.state, e.slot = "loading", slot
        try:
            self.buffers.write(slot, spec, tensors)
        except BaseException:
            with self._lock:
                self.table.entries.pop(adapter.name, None)
                self.table.free.append(slot)
            raise
        with self._lock:
            e.state = "ready"
            self.table.ready[e.name] = slot
            self.policy.record_insert(adapter.name)
        return slot

    def evict(self, name: str) -> bool:
        """Take `name` out of its GPU slot now (its host copy stays), if it is idle and not
        pinned; returns whether it was evicted. For benchmarks and admin."""
        with self._lock:
            e = self.table.entries.get(name)
            if e is None or not e.ready or e.refs > 0 or e.pinned:
                return False
            self.table.release_slot(e)
            self.table.pump()
            return True

    def unload(self, name: str, *, refuse_pinned: bool = False) -> bool:
        """Forget `name`: now, or when its last request releases it. Returns True if now.
        `refuse_pinned` (unload_lora_adapter): AdapterPinnedError if it is pinned, by the API or
        the plan, instead of dropping the pin with it."""
        with self._lock:
            e = self.table.entries.get(name)
            if e is None or e.unloading:
                raise KeyError(name)
            if refuse_pinned and e.pinned:
                by = " and ".join(w for w, on in (("the API", e.pinned_api), ("the plan", e.pinned_plan)) if on)
                raise AdapterPinnedError(
                    f"The lora adapter '{name}' is pinned (by {by}); unpin it first "
                    f"(POST /v1/adapters/{name}/unpin{'' if not e.pinned_plan else ', and take it out of the plan'})")
            e.unloading = True
            if e.refs > 0 or e.state in ("loading", "staging"):  # one fetch or load of a name at a time
                return False
            freed = e.ready
            self.table.drop(e)
            if freed:
                self.table.pump()  # its slot may be the one a pending load waits for
            return True

    # -- inspection -------------------------------------------------------------------------------

    def list(self) -> list[CachedAdapter]:
        """Adapters resident in GPU slots."""
        with self._lock:
            return [e for e in self.table.entries.values() if e.ready and not e.unloading]

    def tenant_of(self, name: str) -> str | None:
        """The tenant whose API keys may use `name`: the plan's (its LoRAAdapter's spec.tenant),
        kept with the plan rather than with the adapter's row, which an eviction may drop and
        a later request find on disk again; None: any caller's."""
        with self._lock:
            return self._plan_tenants.get(name)

    def known(self) -> list[CachedAdapter]:
        with self._lock:
            return [e for e in self.table.entries.values() if not e.unloading]

    def slot_of(self, name: str) -> int:
        with self._lock:
            e = self.table.entries[name]
            if not e.ready:
                raise KeyError(name)
            return e.slot

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self.table.free)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self.table.in_flight

    def tier_of(self, name: str) -> str:
        with self._lock:
            e = self._lookup(name)
            if e is None:
                raise KeyError(name)
            return self._tier(e)

    def describe(self) -> list[dict]:
        """One row per known adapter, for GET /v1/adapters."""
        for name in self.loader.staged_names():  # show the node agent's cache too
            self.has(name)
        with self._lock:
            rows = []
            for e in sorted(self.table.entries.values(), key=lambda e: e.name):
                if e.unloading:
                    continue
                state = e.state if e.state != "cold" else ("failed" if e.error else "idle")
                retry = self.loader.fetch_retry_in(e) if e.state == "cold" else None
                rows.append({
                    "name": e.name, "tenant": self._plan_tenants.get(e.name), "tier": self._tier(e), "state": state, "slot": e.slot if e.ready else None,
                    "pinned": e.pinned, "pin_pending": e.pinned and not e.ready, "expired": e.expired,
                    "rank": e.spec.max_rank if e.spec else None, "bytes": self._size(e),
                    "hits": e.hits, "misses": e.misses, "requests": e.refs,
                    "leases": len(e.leases) if e.ready and self.table.leased(e) else 0,
                    "path": str(e.path) if e.path else None, "source": redact(e.source), "sha256": e.sha256,
                    "error": e.error, "retry_in_s": round(retry, 1) if retry is not None else None})
            return rows

    def refresh_metrics(self) -> None:
        with self._lock:
            self.metrics.loads_in_flight.set(self.table.in_flight)
            self.metrics.loads_pending.set(self.table.num_pending())
            self._update_pinned_gauge()
        names = self.host.names()
        self.metrics.host.set(len(names))
        self.metrics.host_bytes.set(self.host.used_bytes)

    # -- internals (under the lock) ---------------------------------------------------------------

    def _tier(self, e: CachedAdapter, gpu: bool = True) -> str:
        """The fastest tier holding `e` (`gpu=False`: below its slot, which holds a replaced version)."""
        if gpu and e.ready:
            return "gpu"
        if e.memory is not None or e.name in self.host:
            return "host"
        if self.loader.disk_dir(e) is not None:
            return "disk"
        return "source"

    def _size(self, e: CachedAdapter) -> int | None:
        if e.spec is not None:
            return e.spec.nbytes
        d = self.loader.disk_dir(e)
        if d is not None and (d / WEIGHTS_FILE).is_file():
            return (d / WEIGHTS_FILE).stat().st_size
        return None

    def _refused(self, e: CachedAdapter) -> AdapterLoadError | None:
        """For a row no load of which is on its way: the error of its last load if that failed
        on its files and they are unchanged since (`AdapterLoader.broken`), a new one of the
        same words for each caller; or of its last fetch, while that one's back-off runs
        (`AdapterLoader.fetch_backoff`); None: a load may start. A load would take a slot
        (evicting an idle adapter) to fail the same way; a fetch would download again what
        has just failed. Counted as a failed load, as each was before
        (loraplex_adapter_load_failures_total keeps rising while traffic hits the adapter)."""
        if e.state != "cold":
            return None
        backoff = self.loader.fetch_backoff(e)
        if backoff is not None:
            self.metrics.load_failures.labels(backoff.reason).inc()
            return backoff
        failed = self.loader.broken(e)
        if failed is None:
            return None
        self.metrics.load_failures.labels(failed.reason).inc()
        error = AdapterLoadError(e.name, failed.reason, failed.message)
        error.args = failed.args
        return error

    def _update_pinned_gauge(self) -> None:
        self.metrics.pinned.set(sum(1 for e in self.table.entries.values() if e.pinned and not e.unloading))

    # -- a load worker reports (worker thread) ---------------------------------------------------------

    def _loaded(self, e: CachedAdapter, slot: int, tier: str, error: AdapterLoadError | None, t0: float) -> None:
        """The loader's `done`: the table marks `e` ready (or failed) and starts the next loads;
        then the prefetches waiting on it hear the outcome and the engine wakes up. A pin whose
        load failed is tried again later (`_retry_pin`)."""
        with self._lock:
            waiters = self.table.finish_load(e, slot, tier, error, t0)
            e.failed_in_row = e.failed_in_row + 1 if error is not None else 0
            retry = error is not None and e.pinned and not e.unloading
            if e.name in self.table.stale:  # a new version came during the load: reload now if unheld
                self.table.refresh(None)
        self._tell(e, waiters, slot, error, retry)

    def _staged(self, e: CachedAdapter, version: tuple, fetched: Fetched | None,
                error: AdapterLoadError | None) -> None:
        """The loader's `staged_done`: `e` is on local disk and waits for a slot, or its fetch
        failed as a load does (its requests and prefetches fail, a pin is tried again later)."""
        with self._lock:
            waiters = self.table.finish_stage(e, version, fetched, error)
            if error is not None:
                e.failed_in_row += 1
            retry = error is not None and e.pinned and not e.unloading
        self._tell(e, waiters, -1, error, retry)

    def _unstaged(self, e: CachedAdapter, slot: int) -> None:
        """The loader's `unstaged`: a load found `e` not on local disk; it stages it first."""
        with self._lock:
            self.table.unstage(e, slot)
        self.wake()

    def _tell(self, e: CachedAdapter, waiters: list[concurrent.futures.Future], slot: int,
              error: AdapterLoadError | None, retry: bool) -> None:
        for fut in waiters:
            tell(fut, slot, error)
        if retry:
            self._arm_pin_retry(e)
        self.wake()

    def _arm_pin_retry(self, e: CachedAdapter) -> None:
        """`_retry_pin` of `e` after its back-off: 2 s doubled after each failure in a row, up
        to 2 minutes. The newest timer of a name is the one that looks again at files its load
        failed on (`_retry_pin`), so one chain of them runs however many pins and failures
        started one."""
        delay = doubling_backoff(e.failed_in_row, PIN_RETRY_FIRST_S, PIN_RETRY_MAX_S)
        token = object()
        with self._lock:
            self._pin_retries[e.name] = token
        timer = threading.Timer(delay, self._retry_pin, (e, token))
        timer.daemon = True
        timer.start()

    def _retry_pin(self, e: CachedAdapter, token: object) -> None:
        """Load a pin again after its load failed, if it is still this name's row, pinned and
        cold: a pin is wanted resident whether or not a request asks for it (a plan's pins
        would otherwise stay cold after one failure, the node agent down for a moment, say,
        until traffic or a new plan came). Files its load failed on, unchanged, are not loaded
        (`_refused`): they are looked at again after a longer back-off, by the newest timer."""
        again = False
        with self._lock:
            if self._closed:
                return
            if self.table.entries.get(e.name) is e and e.pinned and not e.unloading and e.state == "cold":
                if self.loader.broken(e) is None:
                    log.info("adapter %s: pinned, its last load failed (%s); loading it again", e.name, e.error)
                    self.table.want(e)
                elif self._pin_retries.get(e.name) is token:
                    e.failed_in_row += 1
                    again = True
        if again:
            self._arm_pin_retry(e)
