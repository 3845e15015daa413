"""The engine loop sleeps when a step ran nothing (only requests whose adapter is loading are
queued) until the adapter cache wakes it (a load finished). Anything else that needs a step
to move on must not be left waiting for a wake-up that no load will send."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from loraplex.server.engine import AsyncEngine, LLMEngine
from loraplex.server.sampling import SamplingParams

from .test_adapter_cache import check_invariants, write_adapter
from .test_adapter_cache_http import PROMPT, settings

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
DRAIN_AFTER = 0.2  # longer than a tiny adapter's load, so a drain does not take back b's new slot


@pytest.fixture
def disk(tmp_path) -> Path:
    for i, name in enumerate("ab"):
        write_adapter(tmp_path / name, seed=i)
    return tmp_path


def resident(engine: LLMEngine, name: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while name not in engine.adapters.ready_slots():
        assert time.monotonic() < deadline, f"{name} did not load"
        time.sleep(0.005)


def one_slot(disk) -> LLMEngine:
    engine = LLMEngine.from_settings(settings(disk, max_loras=1))
    engine.adapters.drain_after = DRAIN_AFTER
    return engine


def test_a_step_that_starts_a_drain_is_not_a_stall(disk):
    """A step whose ready_slots picks a to drain for b admits nothing (a drains) and decodes
    nothing. The drain gives a's slot up only at the next step's ready_slots, and no load is in
    flight to wake the loop, so that step must not count as stalled. One slot, holding a (its
    request queued: a reference, so a cannot be evicted); b's request has waited for the slot
    longer than drain_after."""
    engine = one_slot(disk)
    # a serves a request first: an adapter is drained only once it has run one since its load.
    first = engine.make_request(PROMPT, PARAMS, "a")
    engine.add_request(first)
    while not first.finished:
        engine.step()
        if engine.stalled:
            time.sleep(0.005)
    ra = engine.make_request(PROMPT, PARAMS, "a")
    resident(engine, "a")
    rb = engine.make_request(PROMPT, PARAMS, "b")
    time.sleep(DRAIN_AFTER * 1.5)
    engine.add_request(ra)
    engine.add_request(rb)
    engine.step()
    assert engine.adapters.table.draining == "a" and not engine.scheduler.running
    assert not engine.stalled  # else AsyncEngine's loop waits for a wake-up nobody sends
    engine.step()  # a gives up its slot: b loads
    resident(engine, "b")
    deadline = time.monotonic() + 20
    while engine.has_work():
        assert time.monotonic() < deadline
        engine.step()
        if engine.stalled:
            time.sleep(0.005)
    assert ra.finish_reason == rb.finish_reason == "length"
    check_invariants(engine.adapters)


async def test_requests_behind_a_drain_are_answered(disk):
    """The same through AsyncEngine's loop: both requests end (they waited for ever)."""
    engine = one_slot(disk)
    runner = AsyncEngine(engine)
    runner.start()
    try:
        engine.adapters.acquire("a")  # a loads and stays resident while this reference lasts
        await asyncio.to_thread(resident, engine, "a")
        engine.adapters.acquire("b")  # b waits for the slot from now on
        await asyncio.sleep(DRAIN_AFTER * 1.5)
        streams = [runner.add_request(PROMPT, PARAMS, name) for name in ("a", "b")]
        for name in ("a", "b"):
            engine.adapters.release(name)

        async def drain(stream):
            return [out async for out in stream][-1].finish_reason

        assert await asyncio.wait_for(asyncio.gather(*map(drain, streams)), 20) == ["length", "length"]
    finally:
        runner.stop()
