"""The slot table alone: no threads, no files, a fake clock; loads are recorded, not run.

Each test drives the table as the cache does (want -> pump -> start_load -> finish_load)
and checks which adapter ends up in which slot.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from loraplex.server.adapter_sources import AdapterLoadError
from loraplex.server.cache_metrics import CacheMetrics
from loraplex.server.cache_policy import make_policy
from loraplex.server.host_tier import HostTier
from loraplex.server.slot_table import CachedAdapter, SlotTable


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_table(slots: int = 2, loads: int = 4) -> tuple[SlotTable, list[tuple[str, int]], Clock]:
    started: list[tuple[str, int]] = []
    clock = Clock()
    table = SlotTable(slots, make_policy("lru"), HostTier(0), CacheMetrics(), max_concurrent_loads=loads,
                      start_load=lambda e, slot: started.append((e.name, slot)), clock=clock)
    return table, started, clock


def add(table: SlotTable, name: str, refs: int = 0, **kw) -> CachedAdapter:
    """A known, cold adapter with a source (so an eviction keeps its row)."""
    e = table.entries[name] = CachedAdapter(name, source=f"file:///{name}", refs=refs, **kw)
    return e


def resident(table: SlotTable, name: str, refs: int = 0, **kw) -> CachedAdapter:
    """`name` wanted and loaded: ready in the slot pump gave it."""
    e = add(table, name, refs, **kw)
    table.policy.record_access(name)
    table.want(e)
    assert e.state == "loading"
    table.finish_load(e, e.slot, "disk", None, 0.0)
    assert e.ready
    return e


def check(table: SlotTable) -> None:
    held = [e.slot for e in table.entries.values() if e.state in ("loading", "ready")]
    assert sorted(held + table.free) == list(range(table.num_slots))
    assert table.ready == {n: e.slot for n, e in table.entries.items() if e.ready}


@pytest.mark.parametrize("loads, wanted, started_n, pending_n", [
    (4, 2, 2, 0),  # two free slots, two loads
    (1, 2, 1, 1),  # one load worker: the second waits for it
    (4, 3, 2, 1),  # two slots, nothing evictable (still loading): the third waits
])
def test_pump_starts_loads_while_a_worker_and_a_slot_are_free(loads, wanted, started_n, pending_n):
    table, started, _ = make_table(slots=2, loads=loads)
    for i in range(wanted):
        table.want(add(table, f"a{i}", refs=1))
    assert len(started) == started_n and len(table.pending) == pending_n
    assert table.in_flight == started_n == table.max_in_flight_seen
    check(table)


def test_a_finished_load_frees_a_worker_for_the_next_pending_one():
    table, started, _ = make_table(slots=2, loads=1)
    a, b = add(table, "a", refs=1), add(table, "b", refs=1)
    table.want(a)
    table.want(b)
    assert started == [("a", 0)]
    assert table.finish_load(a, 0, "disk", None, 0.0) == []
    assert started == [("a", 0), ("b", 1)] and table.ready == {"a": 0}
    check(table)


def test_a_full_table_evicts_the_policys_idle_unpinned_pick():
    table, started, _ = make_table(slots=3)
    resident(table, "pinned", pinned_api=True)
    resident(table, "busy", refs=1)
    resident(table, "idle")
    c = add(table, "c", refs=1)
    table.want(c)
    assert started[-1] == ("c", 2) and "idle" not in table.ready and table.entries["idle"].state == "cold"
    assert table.metrics.evictions.labels("gpu")._value.get() == 1
    check(table)


def test_pins_take_all_slots_but_one():
    table, started, _ = make_table(slots=2)
    resident(table, "p1", pinned_plan=True)
    p2 = add(table, "p2", pinned_plan=True)
    table.want(p2)
    assert p2.state == "pending" and len(started) == 1  # the last slot stays for requests
    table.want(add(table, "r", refs=1))
    assert started[-1] == ("r", 1)
    check(table)


def test_a_failed_load_frees_its_slot_and_reports_the_waiting_requests():
    table, _, _ = make_table(slots=1)
    e = add(table, "bad", refs=1)
    table.want(e)
    table.finish_load(e, 0, "disk", AdapterLoadError("bad", "corrupt", "garbled"), 0.0)
    assert e.state == "cold" and e.slot == -1 and table.free == [0] and table.in_flight == 0
    assert "garbled" in table.take_failures()["bad"] and table.take_failures() == {}
    assert table.metrics.load_failures.labels("corrupt")._value.get() == 1
    check(table)


def test_drop_frees_the_slot_and_fails_a_waiting_prefetch():
    table, _, _ = make_table(slots=2)
    a = resident(table, "a")
    b = add(table, "b")
    table.want(b)
    fut = concurrent.futures.Future()
    b.waiters.append(fut)
    table.drop(a)
    assert "a" not in table.entries and table.free == [0]
    table.drop(b)
    with pytest.raises(AdapterLoadError, match="unloaded"):
        fut.result(0)


def test_a_starved_load_drains_one_busy_adapter_after_drain_after_seconds():
    table, started, clock = make_table(slots=2)
    resident(table, "a", refs=1)
    resident(table, "b", refs=1)
    c = add(table, "c", refs=1)
    table.want(c)
    assert c.state == "pending"
    clock.now = 1.0
    assert table.ready_slots({"a", "b"}) == {"a": 0, "b": 1}  # not waited drain_after (2 s) yet
    clock.now = 2.5
    admitting = table.ready_slots({"a", "b"})
    drained = table.draining
    assert drained in ("a", "b") and drained not in admitting  # it admits no new requests
    running = {"a", "b"} - {drained}
    table.ready_slots(running)  # its running requests finished: it gives up its slot to c
    assert started[-1][0] == "c" and table.entries[drained].state == "pending"  # it still has requests
    assert table.draining is None
    check(table)
