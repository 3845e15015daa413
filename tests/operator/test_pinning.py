"""Pinned set and warm-up prefetch: fixed order, stable ties, bounded share."""

import datetime
import random

import pytest

from loraplex.operator.pinning import choose_pinned, next_change, pin_capacity, prefetch
from loraplex.operator.specs import AdapterSpec, Warmup

UTC = datetime.timezone.utc
T0 = datetime.datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
LEAD = datetime.timedelta(minutes=10)


def adapter(name: str, priority: int = 0, policy: str = "Auto", warmup: Warmup | None = None) -> AdapterSpec:
    return AdapterSpec(name=name, namespace="ml", base_model="b", source="s3://x", priority=priority,
                       pin_policy=policy, rank=8, target_modules=("q_proj",), warmup=warmup)


@pytest.mark.parametrize(("slots", "percent", "capacity"), [
    (250, 50, 125), (250, 0, 0), (3, 50, 1), (1, 100, 0), (10, 100, 9), (0, 50, 0), (7, 33, 2),
])
def test_pin_capacity_keeps_a_cache_slot(slots, percent, capacity):
    assert pin_capacity(slots, percent) == capacity


# (adapters, slots, percent, pinned, overflow)
CASES = {
    "by-priority": ([adapter("low", 1), adapter("high", 9), adapter("mid", 5)], 5, 40, ("high", "mid"), ()),
    "always-first": ([adapter("vip", 100), adapter("contract", 0, "Always")], 3, 34, ("contract",), ()),
    "never-never": ([adapter("secret", 1000, "Never"), adapter("x", 1)], 10, 50, ("x",), ()),
    "ties-by-name": ([adapter("b", 5), adapter("c", 5), adapter("a", 5)], 5, 40, ("a", "b"), ()),
    "always-overflow": ([adapter("z", 0, "Always"), adapter("y", 0, "Always"), adapter("x", 0, "Always")],
                        3, 100, ("x", "y"), ("z",)),
    "nothing-fits": ([adapter("a", 1)], 1, 100, (), ()),
}


@pytest.mark.parametrize("case", CASES)
def test_pinning_table(case):
    adapters, slots, percent, pinned, overflow = CASES[case]
    result = choose_pinned(adapters, slots, percent)
    assert (result.pinned, result.overflow) == (pinned, overflow)


def test_pinned_set_does_not_depend_on_input_order():
    rng = random.Random(7)
    adapters = [adapter(f"a{i:03d}", rng.choice([0, 10, 10, 50]), rng.choice(["Auto", "Auto", "Always", "Never"]))
                for i in range(300)]
    first = choose_pinned(adapters, 100, 50)
    for _ in range(5):
        rng.shuffle(adapters)
        assert choose_pinned(adapters, 100, 50) == first
    assert len(first.pinned) == 50


def test_raising_a_priority_moves_the_pinned_set():
    adapters = [adapter("a", 10), adapter("b", 5), adapter("c", 1)]
    assert choose_pinned(adapters, 3, 67).pinned == ("a", "b")
    adapters[2] = adapter("c", 50)
    assert choose_pinned(adapters, 3, 67).pinned == ("a", "c")


WINDOW = Warmup(start=T0, end=T0 + datetime.timedelta(hours=2))


@pytest.mark.parametrize(("now", "listed"), [
    (T0 - datetime.timedelta(minutes=11), False),  # before the lead
    (T0 - datetime.timedelta(minutes=10), True),   # the lead starts: prefetch in time
    (T0 + datetime.timedelta(hours=1), True),      # in the window
    (T0 + datetime.timedelta(hours=2), False),     # ended
])
def test_warmup_window_becomes_a_prefetch_entry_in_time(now, listed):
    entries = prefetch([adapter("campaign", warmup=WINDOW), adapter("plain")], now, LEAD)
    assert [e.name for e in entries] == (["campaign"] if listed else [])


def test_prefetch_entries_are_ordered_and_rfc3339():
    later = Warmup(start=T0 + datetime.timedelta(minutes=5), end=T0 + datetime.timedelta(hours=1))
    entries = prefetch([adapter("b", warmup=later), adapter("a", warmup=later), adapter("c", warmup=WINDOW)], T0, LEAD)
    assert [e.name for e in entries] == ["c", "a", "b"]
    assert entries[0].as_json() == {"name": "c", "start": "2026-12-01T08:00:00Z", "end": "2026-12-01T10:00:00Z"}


def test_next_change_is_the_next_edge():
    adapters = [adapter("c", warmup=WINDOW)]
    assert next_change(adapters, T0 - datetime.timedelta(hours=1), LEAD) == T0 - LEAD
    assert next_change(adapters, T0, LEAD) == WINDOW.end
    assert next_change(adapters, WINDOW.end, LEAD) is None
