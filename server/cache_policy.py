"""Eviction policies for the GPU adapter slots.

GPU slots are a cache over host memory and local disk. A policy only ranks adapters; the
cache that owns the slots decides *when* to evict and which adapters may go. Protocol, in
the order the cache calls it for one request (running example: 3 slots hold a, b, c and a
request for d arrives):

    policy.record_access("d")                 # every request, hit or miss, before loading
    victim = policy.select_victim(evictable)  # on a miss with no free slot, e.g. {"a", "c"}
    policy.record_evict(victim)               # the victim left its slot
    policy.record_insert("d", cost=1.0)       # d is now in a slot

`evictable` (a set or a dict's keys view: membership is tested) holds only adapters that
may leave: resident, not pinned, not in use by a running request. The cache guarantees
that; a policy never returns a name outside it and returns None when it is empty.

A prefetch (a warm-up window, a session start) calls `record_insert(name, prefetch=True)`
without an access: the policy treats the adapter as about to be hot, so a frequency policy
does not evict it on the next miss.

Aging counts requests (`record_access` calls), not seconds: a policy is deterministic, needs
no clock, and a quiet night does not wipe what the day taught it.

The policies: LRUPolicy ("lru") and AgedLFUPolicy ("lfu-aged") here, WTinyLFUPolicy
("wtinylfu") in wtinylfu_policy.py; bench/cache_sim.py compares them
(bench/results/cache_sim_notes.md).

Pinned adapters may stay known to the policy (they are simply never candidates), or the
cache may call `record_evict` when it pins one and `record_insert` when it unpins it, which
keeps them out of the walk in `select_victim` altogether. Policies are not thread-safe: call
them under the lock that guards the slot table.

Every operation is amortised O(log n) in the adapters the policy tracks; `select_victim`
additionally pays O(log n) for each candidate it skips, and it skips only adapters that
are resident but not evictable (pinned or in use), whose number the batch size and pin
share bound. A detected popularity shift (rare: none under stationary traffic) costs one
O(r) pass over the r resident adapters.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "AgedLFUPolicy",
    "POLICY_NAMES",
    "make_policy",
]

# Below this many candidates a scan over them is cheaper than walking the policy's order.
_SCAN_CANDIDATES = 32


class EvictionPolicy(Protocol):
    """Ranks resident adapters for eviction. See the module docstring for the call order."""

    name: str

    def record_access(self, name: str) -> None:
        """A request used `name` (hit or miss). Called before any insert for that request."""

    def record_insert(self, name: str, *, cost: float = 1.0, prefetch: bool = False) -> None:
        """`name` took a slot. `cost`: relative cost of loading it again (bytes, say);
        `prefetch`: loaded ahead of demand, keep it as if it were hot."""

    def record_evict(self, name: str) -> None:
        """`name` left its slot (evicted or unloaded). Its history may be kept."""

    def select_victim(self, candidates: Collection[str]) -> str | None:
        """The adapter in `candidates` to evict next, or None if `candidates` is empty."""


class LRUPolicy:
    """Least recently used: evict the adapter whose last access (or insert) is oldest."""

    name = "lru"

    def __init__(self) -> None:
        # Resident adapters -> access stamp; dict order is least recently used first
        # (an access pops and re-adds the adapter, which moves it to the end in O(1)).
        self._stamp: dict[str, int] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def record_access(self, name: str) -> None:
        if name in self._stamp:
            self._touch(name)

    def record_insert(self, name: str, *, cost: float = 1.0, prefetch: bool = False) -> None:
        self._touch(name)

    def record_evict(self, name: str) -> None:
        self._stamp.pop(name, None)

    def select_victim(self, candidates: Collection[str]) -> str | None:
        if not candidates:
            return None
        if len(candidates) <= _SCAN_CANDIDATES:
            # Unknown candidates (never inserted) have no history: they go first.
            return min(candidates, key=lambda n: self._stamp.get(n, -1))
        for name in self._stamp:
            if name in candidates:
                return name
        return next(iter(candidates))

    def _touch(self, name: str) -> None:
        self._clock += 1
        self._stamp.pop(name, None)
        self._stamp[name] = self._clock


@dataclass(slots=True)
class _Entry:
    """What the aged-LFU policy knows of one adapter.

    key: log of its aged access count times its reload cost (see AgedLFUPolicy).
    version: bumped on every key change; heap items with an older version are stale.
    """

    key: float
    version: int = 0
    resident: bool = False
    cost: float = 1.0
    last: int = 0  # access number of its last access
    epoch: int = 0  # shifts detected at its last access (or insert)
    deadline: float = math.inf  # set at a shift: overdue after this access number
    prefetched: bool = False  # prefetched and not requested since: its key is not a rate


class AgedLFUPolicy:
    """Least frequently used, with exponentially aged counts and shift detection ("lfu-aged").

    Score of an adapter = cost * sum over its past accesses of exp(-(age in requests) / tau).
    With tau large this is LFU over the last ~tau requests (near optimal on stationary skewed
    traffic, where LRU keeps letting one-off adapters push hot ones out); counts of adapters
    not resident are kept (bounded by `history_limit`), so an adapter that returns keeps its
    frequency, and a first-time adapter ranks lowest and is the next victim, which is what
    keeps the hot set in place.

    tau = tau_per_slot * (peak number of resident adapters), at least `min_tau`: the adapter
    at the edge of the hot set must collect enough accesses within tau to be told apart from
    its neighbours. Under Zipf(1.0) over 100,000 adapters with 20,000 slots, tau = 200 * slots
    gives 84.8% hits against 81.1% for LRU, where a fixed tau of 20,000 requests gave 81.3%
    (bench/cache_sim.py).

    Aging without touching every count: a virtual clock `v` advances by 1/tau per request and
    an access adds exp(v) to the count, so the order of adapters never changes by aging alone.
    Keys are kept as logs (`key = log(count) + log(cost)`), so nothing overflows.

    A popularity shift (a campaign: new adapters turn hot at once) makes a long-memory LFU slow
    to let go of the old hot set. The policy watches its own miss rate: it detects a shift when
    the miss rate of the last ~`detect_span` requests exceeds the long-run rate p by more than
    max(`detect_margin`, `detect_z` standard deviations of that short-run mean under p), i.e.
    max(0.05, 6 * sqrt(p (1 - p) / 400)): 0.08 at p = 8%, 0.14 at p = 30% (a fixed margin is
    either blind to a shift at high hit rates, where a prefetched campaign only doubles a small
    miss rate, or jumpy at low ones). On a shift it
    (1) ages all history at once by a factor exp(`shift_jump`) (the clock jumps, so accesses
        after the shift weigh more: e^4 = 55 old accesses count as one new one);
    (2) gives every resident adapter a deadline, its last access plus `overdue_z` times its
        mean gap between accesses (tau / its aged count), and for the next `overdue_window`
        requests evicts first the residents whose deadline passed with no request since the
        shift, the highest count first (the old campaign's adapters: hot until the shift, then
        silent); such an adapter also forgets its history, so a later request for it does not
        bring the old campaign's counts back.
    Why both: a jump large enough on its own to drop the old campaign's adapters (hundreds of
    accesses each) also wipes what the policy knows of the part of the traffic that did not
    change, which it then relearns slowly against one-off requests; the deadlines find the
    adapters that went quiet one by one. Residents prefetched and not requested yet move with
    the jump (`carry_prefetched`), so a campaign warmed up ahead of its start survives the
    shift its own prefetch set off. Then it takes the short-run rate as the new baseline
    and waits `detect_span` requests before it may fire again. Under stationary traffic the
    detector does not fire (none in any stationary run of bench/cache_sim.py).

    Recovery after a shift, against LRU, Belady and an oracle: bench/results/cache_sim_notes.md.
    """

    name = "lfu-aged"

    def __init__(
        self,
        tau_per_slot: float = 200.0,
        *,
        min_tau: float = 2_000.0,
        detect_span: int = 200,
        detect_margin: float = 0.05,
        detect_z: float = 6.0,
        shift_jump: float = 4.0,
        history_limit: int = 1_000_000,
        overdue_z: float = 0.5,
        overdue_window: int = 2_000,
        carry_prefetched: bool = True,
    ) -> None:
        if min(tau_per_slot, min_tau, detect_span, history_limit, overdue_window) <= 0:
            raise ValueError("tau_per_slot, min_tau, detect_span, history_limit and overdue_window "
                             "must be positive")
        if overdue_z < 0 or shift_jump < 0:
            raise ValueError("overdue_z and shift_jump must not be negative")
        self.tau_per_slot = tau_per_slot
        self.min_tau = min_tau
        self.tau = min_tau  # grows with the peak number of resident adapters
        self.detect_span = detect_span
        self.detect_margin = detect_margin
        self.detect_z = detect_z
        self.shift_jump = shift_jump
        self.history_limit = history_limit
        self.overdue_z = overdue_z
        self.overdue_window = overdue_window
        self.carry_prefetched = carry_prefetched
        self._shift_at = -overdue_window  # access number of the last detected shift
        # Residents at the last shift: (deadline, name) until the deadline passes, then
        # (-key, name) in _overdue, so the hottest of the silent adapters goes first.
        self._pending: list[tuple[float, str]] = []
        self._overdue: list[tuple[float, str]] = []
        self._v = 0.0  # virtual clock, in units of tau
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []  # (key, version, name), residents only
        self._resident = 0
        self._max_key = -math.inf
        # Miss-rate watch: exponentially weighted means, short and long (span tau).
        self._miss_short = 0.0
        self._miss_long = 0.0
        self._accesses = 0
        self._quiet_until = 0  # no jump before this many accesses
        self.shifts_detected = 0

    def __len__(self) -> int:
        return self._resident

    # -- protocol ---------------------------------------------------------------------------

    def record_access(self, name: str) -> None:
        self._accesses += 1
        self._v += 1.0 / self.tau
        entry = self._entries.get(name)
        self._watch_misses(miss=entry is None or not entry.resident)
        if entry is None:
            entry = self._entries[name] = _Entry(key=self._v, last=self._accesses, epoch=self.shifts_detected)
            if len(self._entries) > self.history_limit:
                self._prune_history()
        else:
            entry.last = self._accesses
            entry.epoch = self.shifts_detected
            entry.prefetched = False
            entry.key = _logaddexp(entry.key, self._v + math.log(entry.cost))
            entry.version += 1
            if entry.resident:
                self._push(name, entry)
        if entry.key > self._max_key:
            self._max_key = entry.key

    def record_insert(self, name: str, *, cost: float = 1.0, prefetch: bool = False) -> None:
        if cost <= 0:
            raise ValueError(f"cost must be positive, got {cost}")
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry(key=self._v - 1.0, last=self._accesses,
                                                 epoch=self.shifts_detected)
        if entry.cost != cost:
            entry.key += math.log(cost / entry.cost)
            entry.cost = cost
        if prefetch:
            # As hot as the hottest adapter seen: it survives until its real traffic (or the
            # lack of it) decides, after about tau * log(hottest / its rate) requests. Its key
            # is no rate, so it is never overdue before its first request.
            entry.key = max(entry.key, self._max_key)
            entry.prefetched = True
        entry.version += 1
        if not entry.resident:
            entry.resident = True
            self._resident += 1
            self.tau = max(self.tau, self.tau_per_slot * self._resident)
        self._push(name, entry)

    def record_evict(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is not None and entry.resident and self._is_overdue(entry):
            # Silent since the shift past its deadline: its counts describe the old traffic.
            self._resident -= 1
            del self._entries[name]
            return
        if entry is not None and entry.resident:
            entry.resident = False
            entry.version += 1  # its heap items are stale now
            self._resident -= 1

    def select_victim(self, candidates: Collection[str]) -> str | None:
        if not candidates:
            return None
        if len(candidates) <= _SCAN_CANDIDATES:
            return min(candidates, key=self._rank_of)
        if (self._pending or self._overdue) and self._accesses - self._shift_at >= self.overdue_window:
            self._pending, self._overdue = [], []
        if self._pending or self._overdue:
            victim = self._overdue_victim(candidates)
            if victim is not None:
                return victim
        heap = self._heap
        skipped: list[tuple[float, int, str]] = []
        victim = None
        while heap:
            item = heap[0]
            entry = self._entries.get(item[2])
            if entry is None or entry.version != item[1] or not entry.resident:
                heapq.heappop(heap)  # stale
                continue
            if item[2] in candidates:
                victim = item[2]
                break
            skipped.append(heapq.heappop(heap))  # pinned or in use: keep, look further
        for item in skipped:
            heapq.heappush(heap, item)
        if victim is None:
            # Candidates the policy never saw inserted: evict one of them (no history).
            victim = min(candidates, key=self._key_of)
        return victim

    # -- internals --------------------------------------------------------------------------

    def _is_overdue(self, entry: _Entry) -> bool:
        """Resident, silent since the last shift, past its deadline, within the window."""
        return (entry.resident and not entry.prefetched and entry.epoch < self.shifts_detected
                and entry.deadline < self._accesses and self._accesses - self._shift_at < self.overdue_window)

    def _rank_of(self, name: str) -> tuple[int, float]:
        """Eviction order for the scan path: overdue first (highest key first), then by key;
        the same order as _overdue_victim followed by the heap walk."""
        entry = self._entries.get(name)
        if entry is None:
            return (0, -math.inf)
        if self._is_overdue(entry):
            return (0, -entry.key)
        return (1, entry.key)

    def _overdue_victim(self, candidates: Collection[str]) -> str | None:
        """The overdue candidate with the highest key (the most surprising silence), or None."""
        pending, ready, entries = self._pending, self._overdue, self._entries
        while pending and pending[0][0] < self._accesses:
            _, name = heapq.heappop(pending)
            entry = entries.get(name)
            if entry is not None and self._is_overdue(entry):
                heapq.heappush(ready, (-entry.key, name))
        skipped = []
        victim = None
        while ready:
            neg_key, name = ready[0]
            entry = entries.get(name)
            if entry is None or entry.key != -neg_key or not self._is_overdue(entry):
                heapq.heappop(ready)  # requested since the shift, or gone: not overdue
                continue
            if name in candidates:
                victim = name
                break
            skipped.append(heapq.heappop(ready))
        for item in skipped:
            heapq.heappush(ready, item)
        return victim

    def _key_of(self, name: str) -> float:
        entry = self._entries.get(name)
        return -math.inf if entry is None else entry.key

    def _push(self, name: str, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.key, entry.version, name))
        if len(self._heap) > 2 * self._resident + 64:
            # Drop stale items: O(heap) once per ~resident pushes, so amortised O(1).
            entries = self._entries
            self._heap = [
                item for item in self._heap
                if (e := entries.get(item[2])) is not None and e.resident and e.version == item[1]
            ]
            heapq.heapify(self._heap)

    def _watch_misses(self, miss: bool) -> None:
        x = 1.0 if miss else 0.0
        # Means weighted by 1/span over the first `span` accesses, then exponentially
        # (so neither starts biased towards 0).
        n = self._accesses
        self._miss_short += (x - self._miss_short) / min(n, self.detect_span)
        self._miss_long += (x - self._miss_long) / min(n, self.tau)
        if (
            n >= self._quiet_until
            and n > 2 * self.detect_span  # the short-run rate means something by now
            and self._miss_short > self._miss_long + self._margin()
        ):
            if self.overdue_z > 0:
                self._mark_deadlines()
                self._shift_at = n
            self._v += self.shift_jump
            self._max_key = self._v  # the hottest adapter is not known yet: one fresh access
            if self.carry_prefetched:
                self._carry_prefetched(self.shift_jump)
            self._quiet_until = n + self.detect_span
            # The new normal: fire again only if misses rise further, not while it relearns.
            self._miss_long = self._miss_short
            self.shifts_detected += 1

    def _margin(self) -> float:
        if self.detect_z <= 0:
            return self.detect_margin
        p = self._miss_long
        return max(self.detect_margin, self.detect_z * math.sqrt(p * (1 - p) / (2 * self.detect_span)))

    def _mark_deadlines(self) -> None:
        """Deadline of each resident: last access + overdue_z / (aged count / tau). O(r) over
        the residents' heap items (not the whole history), once per detected shift. Example:
        tau = 50,000 and an aged count of 250 (one access in 200 requests) with overdue_z =
        0.5: overdue 100 requests after its last access."""
        heap = []
        for _, version, name in self._heap:
            e = self._entries.get(name)
            if e is None or e.version != version or not e.resident or e.prefetched:
                continue  # stale item, or a prefetch whose key is no rate
            rate = math.exp(e.key - self._v) / (e.cost * self.tau)
            e.deadline = e.last + self.overdue_z / max(rate, 1e-12)
            heap.append((e.deadline, name))
        heapq.heapify(heap)
        self._pending, self._overdue = heap, []

    def _carry_prefetched(self, jump: float) -> None:
        """Residents prefetched and not yet requested move with the clock's jump: they stay as
        hot as the hottest until their own traffic decides. Without this, a campaign warmed up
        ahead of its start was undone by the shift its own prefetch caused (the prefetch takes
        slots, misses rise, the detector fires, and the jump left the warmed adapters the
        coldest): in bench/cache_sim.py, prefetched 2,000 requests before the campaign, the
        first 500 requests after it hit 51.5% without this and 84.9% with it (LRU 62.0%;
        cache_sim_notes.md, "Warm-up ahead of the campaign"). O(r)."""
        for _, version, name in list(self._heap):
            e = self._entries.get(name)
            if e is None or e.version != version or not e.resident or not e.prefetched:
                continue
            e.key += jump
            e.version += 1
            self._push(name, e)
            self._max_key = max(self._max_key, e.key)

    def _prune_history(self) -> None:
        """Forget the coldest non-resident adapters down to half the limit: O(n log n) once
        per history_limit / 2 new adapters, so amortised O(log n)."""
        cold = [(e.key, n) for n, e in self._entries.items() if not e.resident]
        drop = len(self._entries) - self.history_limit // 2
        for _, name in heapq.nsmallest(max(drop, 0), cold):
            del self._entries[name]


def _logaddexp(a: float, b: float) -> float:
    if a < b:
        a, b = b, a
    return a + math.log1p(math.exp(b - a))


POLICY_NAMES = ("lru", "lfu-aged", "wtinylfu")


def make_policy(name: str, **options: float) -> EvictionPolicy:
    """The policy behind `--eviction-policy NAME`: "lru", "lfu-aged" or "wtinylfu" (options go to it)."""
    if name == "lru":
        if options:
            raise ValueError(f"lru takes no options, got {sorted(options)}")
        return LRUPolicy()
    if name == "lfu-aged":
        return AgedLFUPolicy(**options)
    if name == "wtinylfu":
        from .wtinylfu_policy import WTinyLFUPolicy  # it imports this module's helpers

        return WTinyLFUPolicy(**options)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
