"""Which adapters stay on the GPU, and which get warmed before a campaign.

Pinned set: a bounded share of the slots, filled in one fixed order so the same adapters
always give the same set (plans do not flap on re-runs or restarts):

    1. pinPolicy Always, by priority (high first), then by name
    2. pinPolicy Auto,   by priority (high first), then by name
    (pinPolicy Never is never pinned)

    250 slots, pinnedPercent 50 -> at most 125 pinned; the other slots are an LRU cache.

At least one slot always stays a cache slot, or unpinned adapters could never be loaded.
An `Always` adapter that does not fit is reported (overflow), not silently dropped.

Prefetch: an adapter with a warm-up window enters the plan's prefetch list `lead` before
its start and leaves it at its end; `next_change` says when the list changes next, so a
timer can recompute the plan in time.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Sequence

from loraplex.operator.specs import AdapterSpec, Warmup, format_time


@dataclasses.dataclass(frozen=True)
class Pinning:
    capacity: int  # how many adapters may be pinned
    pinned: tuple[str, ...]  # names, sorted
    overflow: tuple[str, ...]  # Always adapters that did not fit, sorted


def pin_capacity(slots: int, pinned_percent: int) -> int:
    """Pinned slots: the share of `slots`, keeping at least one cache slot."""
    share = slots * max(0, min(100, pinned_percent)) // 100
    return max(0, min(share, slots - 1))


def pin_order(adapter: AdapterSpec) -> tuple[int, int, str]:
    """Sort key: Always before Auto, higher priority first, then by name (stable ties)."""
    return (0 if adapter.pin_policy == "Always" else 1, -adapter.priority, adapter.name)


def choose_pinned(adapters: Iterable[AdapterSpec], slots: int, pinned_percent: int) -> Pinning:
    """The pinned set among `adapters` (already validated for this base)."""
    capacity = pin_capacity(slots, pinned_percent)
    candidates = sorted((a for a in adapters if a.pin_policy != "Never"), key=pin_order)
    pinned = candidates[:capacity]
    overflow = [a.name for a in candidates[capacity:] if a.pin_policy == "Always"]
    return Pinning(capacity, tuple(sorted(a.name for a in pinned)), tuple(sorted(overflow)))


@dataclasses.dataclass(frozen=True)
class PrefetchEntry:
    name: str
    start: datetime.datetime
    end: datetime.datetime

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "start": format_time(self.start), "end": format_time(self.end)}


def opens(warmup: Warmup, lead: datetime.timedelta) -> datetime.datetime:
    """When a window enters the prefetch list: `lead` before its start, or at the start of
    the calendar for a start that early."""
    try:
        return warmup.start - lead
    except OverflowError:
        return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


def prefetch(adapters: Iterable[AdapterSpec], now: datetime.datetime,
             lead: datetime.timedelta) -> list[PrefetchEntry]:
    """Adapters whose window is open or opens within `lead` of `now`, by start then name."""
    entries = [
        PrefetchEntry(a.name, a.warmup.start, a.warmup.end)
        for a in adapters
        if a.warmup is not None and opens(a.warmup, lead) <= now < a.warmup.end
    ]
    return sorted(entries, key=lambda e: (e.start, e.name))


def next_change(adapters: Sequence[AdapterSpec], now: datetime.datetime,
                lead: datetime.timedelta) -> datetime.datetime | None:
    """The first moment after `now` at which `prefetch(...)` gives a different list."""
    moments = [
        moment
        for a in adapters if a.warmup is not None
        for moment in (opens(a.warmup, lead), a.warmup.end)
        if moment > now
    ]
    return min(moments, default=None)
