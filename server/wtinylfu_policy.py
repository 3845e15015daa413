"""W-TinyLFU ("wtinylfu"), the third eviction policy for the GPU adapter slots.

The protocol it follows, and the other two policies (lru, lfu-aged), are in
cache_policy.py; `make_policy("wtinylfu")` builds this one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection

from .cache_policy import _SCAN_CANDIDATES

# W-TinyLFU regions, in the order select_victim looks at main: probation before protected.
_WINDOW, _PROBATION, _PROTECTED = 0, 1, 2


class WTinyLFUPolicy:
    """W-TinyLFU with an adaptive window, as in Caffeine ("wtinylfu").

    Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission Policy" (2017),
    and the hill-climbing window of Caffeine (Einziger, Eytan, Friedman, Manes, "Adaptive
    Software Cache Management", 2018). Three LRU regions over the resident adapters and a
    frequency estimate over all recent requests::

        new adapter -> window (LRU, ~1% of the slots at first) -> main: probation -> protected
                                            |                          (a hit promotes;
                admission: window's oldest vs probation's oldest,       protected holds at
                the one with the lower frequency is the victim          most 80% of main)

    Example, 4 slots, window 1: the window holds d; main holds a (protected, 9 requests), b and c
    (probation, 1 and 3). A request for e misses: d leaves the window and duels with b, the
    oldest in probation: freq(d) = 1 is not above freq(b) = 1, so d is the victim (a one-off
    request does not displace what main holds); had d been requested twice, b would go and d
    would move to probation when e takes the window.

    Frequency: an exact count per adapter, saturating at 15 (Caffeine's 4-bit counters), over
    the requests since the last reset; after `sample_factor` x capacity counted increments
    every count halves (an adapter that went quiet falls from 15 to 7, 3, 1, 0 in four resets),
    and the sample count halves too, as in Caffeine, so resets then come every half sample.
    Capacity is the largest number of residents seen (the policy is not told the slot count).

    Window size: every `climb_factor` x capacity requests (once the cache has been full) a
    hill climber compares the hit rate of the sample with the previous one; if it did not fall
    it keeps stepping the window the same way, else it turns. The step starts at 6.25% of the
    capacity, decays by 2% a sample, and restarts at 6.25% when the hit rate moves by 5 points
    or more. A large window makes the policy LRU for all but the frequent core; a window of
    one makes it LFU with a one-slot probation for new adapters. Caffeine samples every 10 x
    capacity requests; the default here is the same.

    Prefetch: the adapter goes straight to protected with its count raised to the cap (no
    admission duel), so it stays in main until resets age it out, unless its own requests
    keep it there.

    `cost` is accepted and ignored (W-TinyLFU has no cost term). Every operation is O(1)
    amortised, plus O(skipped) in `select_victim` for residents that are not candidates
    (pinned or in use); a reset is O(tracked adapters) once per half sample.
    """

    name = "wtinylfu"

    def __init__(
        self,
        *,
        window_share: float = 0.01,
        protected_share: float = 0.8,
        sample_factor: float = 10.0,
        climb_factor: float = 10.0,
        max_count: int = 15,
        climb_step: float = 0.0625,
        climb_decay: float = 0.98,
        climb_restart: float = 0.05,
        adaptive: bool = True,
    ) -> None:
        if not 0 <= window_share <= 1 or not 0 < protected_share < 1:
            raise ValueError("window_share must be in [0, 1] and protected_share in (0, 1)")
        if min(sample_factor, climb_factor, max_count, climb_step) <= 0 or not 0 < climb_decay <= 1:
            raise ValueError("sample_factor, climb_factor, max_count and climb_step must be positive, "
                             "climb_decay in (0, 1]")
        self.protected_share = protected_share
        self.sample_factor = sample_factor
        self.climb_factor = climb_factor
        self.max_count = int(max_count)
        self.climb_step = climb_step
        self.climb_decay = climb_decay
        self.climb_restart = climb_restart
        self.adaptive = adaptive
        self.window_share = window_share  # target window / capacity; the climber moves it
        self.capacity = 0
        # Each region: name -> stamp of its arrival at the young end; dict order is oldest
        # first, the same as stamp order (a touch pops and re-adds with a new stamp).
        self._regions: tuple[dict[str, int], dict[str, int], dict[str, int]] = ({}, {}, {})
        self._clock = 0
        self._where: dict[str, int] = {}  # resident -> its region
        self._count: dict[str, int] = {}
        self._samples = 0  # counted increments since the last reset
        self.resets = 0
        # Climber state (Caffeine's names): the first step shrinks the window, as there.
        self._full = False  # the cache has been full (a victim was asked for)
        self._hits = self._misses = 0
        self._prev_hit_rate = 0.0
        self._step = -climb_step
        # window_share after each of the last 1,000 climbs (for tests and the simulator).
        self.window_history: deque[float] = deque(maxlen=1_000)

    def __len__(self) -> int:
        return len(self._where)

    # -- protocol ---------------------------------------------------------------------------

    def record_access(self, name: str) -> None:
        self._increment(name)
        region = self._where.get(name)
        if region == _WINDOW:
            self._move(name, _WINDOW, _WINDOW)
        elif region is not None:  # a hit in main: to (the young end of) protected
            self._move(name, region, _PROTECTED)
            self._balance_protected()
        if self._full:
            if region is None:
                self._misses += 1
            else:
                self._hits += 1
            if self.adaptive and self._hits + self._misses >= self.climb_factor * self.capacity:
                self._climb()

    def record_insert(self, name: str, *, cost: float = 1.0, prefetch: bool = False) -> None:
        if prefetch:
            self._count[name] = self.max_count
        region = self._where.get(name)
        if prefetch:
            # Straight to protected: through the window it would duel with probation's oldest,
            # and a campaign larger than probation would duel with itself (ties lose).
            self._move(name, region, _PROTECTED)
        elif region is not None:  # already resident: just touch it
            self._move(name, region, region)
            return
        else:
            self._move(name, None, _WINDOW)
        if len(self._where) > self.capacity:
            self.capacity = len(self._where)
        self._balance_window()
        self._balance_protected()

    def record_evict(self, name: str) -> None:
        region = self._where.pop(name, None)
        if region is not None:
            del self._regions[region][name]

    def select_victim(self, candidates: Collection[str]) -> str | None:
        if not candidates:
            return None
        self._full = True
        if len(candidates) <= _SCAN_CANDIDATES:
            for name in candidates:
                if name not in self._where:
                    return name  # never inserted: no history, it goes first (as in LRU)
        window = self._oldest(_WINDOW, candidates)
        main = self._oldest(_PROBATION, candidates) or self._oldest(_PROTECTED, candidates)
        if window is None or main is None:
            # Neither: every candidate is unknown to the policy (never inserted); any goes.
            return window or main or next(iter(candidates))
        if len(self._regions[_WINDOW]) < self._window_max():
            return main  # the window has room to grow: main gives up the slot
        # The window is full, so its oldest must leave it: admitted to main only if it has
        # been requested more often than main's oldest (ties keep the incumbent).
        return main if self.frequency(window) > self.frequency(main) else window

    # -- internals --------------------------------------------------------------------------

    def frequency(self, name: str) -> int:
        """Requests for `name` counted since the last resets (halved at each), at most max_count."""
        return self._count.get(name, 0)

    def _increment(self, name: str) -> None:
        c = self._count.get(name, 0)
        if c < self.max_count:
            self._count[name] = c + 1
            self._samples += 1
            if self._samples >= self.sample_factor * max(self.capacity, 1):
                self._reset()

    def _reset(self) -> None:
        self._count = {n: c >> 1 for n, c in self._count.items() if c > 1}
        self._samples //= 2
        self.resets += 1

    def _oldest(self, region: int, candidates: Collection[str]) -> str | None:
        """The oldest adapter of `region` that is a candidate."""
        order = self._regions[region]
        if len(candidates) <= _SCAN_CANDIDATES:
            # Few candidates: rank them by stamp (a region's dict order is its stamp order).
            mine = [n for n in candidates if self._where.get(n) == region]
            return min(mine, key=order.__getitem__) if mine else None
        for name in order:
            if name in candidates:
                return name
        return None

    def _move(self, name: str, src: int | None, dst: int) -> None:
        """`name` leaves region `src` (None: it was not resident) for the young end of `dst`."""
        if src is not None:
            del self._regions[src][name]
        self._clock += 1
        self._regions[dst][name] = self._clock
        self._where[name] = dst

    def _window_max(self) -> int:
        cap = max(self.capacity, 1)
        return max(1, min(cap - 1, round(self.window_share * cap))) if cap > 1 else 1

    def _protected_max(self) -> int:
        return int(self.protected_share * (max(self.capacity, 1) - self._window_max()))

    def _balance_window(self) -> None:
        """Move the window's oldest to probation (young end) while the window is over its size."""
        window, limit = self._regions[_WINDOW], self._window_max()
        while len(window) > limit:
            self._move(next(iter(window)), _WINDOW, _PROBATION)

    def _balance_protected(self) -> None:
        """Demote protected's oldest to probation (young end) while protected is over its size."""
        protected, limit = self._regions[_PROTECTED], self._protected_max()
        while len(protected) > limit:
            self._move(next(iter(protected)), _PROTECTED, _PROBATION)

    def _climb(self) -> None:
        """One hill-climbing step (Caffeine's determineAdjustment + climb)."""
        total = self._hits + self._misses
        hit_rate = self._hits / total
        change = hit_rate - self._prev_hit_rate
        amount = self._step if change >= 0 else -self._step
        if abs(change) >= self.climb_restart:
            self._step = math.copysign(self.climb_step, amount)
        else:
            self._step = self.climb_decay * amount
        self._prev_hit_rate = hit_rate
        self._hits = self._misses = 0
        cap = max(self.capacity, 1)
        self.window_share = min(max(self.window_share + amount, 1 / cap), (cap - 1) / cap if cap > 1 else 1.0)
        self.window_history.append(self.window_share)
        # A smaller window hands its oldest to probation now; a larger one fills from new
        # adapters (select_victim takes from main while the window is under its size).
        self._balance_window()
        self._balance_protected()
