"""A stopped engine leaves nothing running behind it: a pin whose load failed was retried on
a timer (2 s, doubling up to 2 minutes) for as long as the process lived, the server long
stopped; in the test suite such a retry fetched through a node agent of an earlier test."""

from __future__ import annotations

import time

from loraplex.server import adapter_cache
from loraplex.server.engine import AsyncEngine, LLMEngine

from .test_adapter_cache_http import settings


def test_a_stopped_engine_retries_no_failed_pin(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_cache, "PIN_RETRY_FIRST_S", 0.02)
    monkeypatch.setattr(adapter_cache, "PIN_RETRY_MAX_S", 0.02)
    (tmp_path / "gone").mkdir()  # an adapter folder whose files never come: every load fails
    engine = LLMEngine.from_settings(settings(tmp_path))
    running = AsyncEngine(engine)
    running.start()
    engine.adapters.register("gone", path=tmp_path / "gone")
    engine.adapters.pin("gone")
    row = engine.adapters.table.entries["gone"]
    deadline = time.monotonic() + 10
    while row.failed_in_row < 3:  # it is retried on its own while the engine runs
        assert time.monotonic() < deadline, row
        time.sleep(0.01)
    running.stop()
    time.sleep(0.1)  # a timer set just before the stop may still fire once
    failed = row.failed_in_row
    time.sleep(0.3)
    assert row.failed_in_row == failed, "a failed pin is still retried after the engine stopped"
