"""The engine loop dies (a bug raises inside a step): what the clients and /metrics see after.

Every client waiting on the engine gets an error (tested in test_chaos_http.py); here, the
gauges the endpoint picker and dashboards read must say what is true of a stopped engine (no
request running or waiting, no KV row in use), not keep the last values they had."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.api.app import create_app
from loraplex.server.engine import LLMEngine

from .conftest import LiveServer
from .test_adapter_cache import write_adapter
from .test_adapter_cache_http import PROMPT, settings


@pytest.fixture
def disk(tmp_path) -> Path:
    write_adapter(tmp_path / "a", seed=1)
    return tmp_path


def gauges(text: str) -> dict[str, list[tuple[dict, float]]]:
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def crash_on(engine: LLMEngine, crash: threading.Event) -> None:
    """Steps raise once `crash` is set; until then they run, slowly enough to watch."""
    real = engine.step

    def step():
        if crash.is_set():
            raise RuntimeError("boom")
        time.sleep(0.01)
        return real()

    engine.step = step


async def test_a_crash_leaves_no_stale_gauges(disk):
    engine = LLMEngine.from_settings(settings(disk, max_num_seqs=2))
    crash = threading.Event()
    crash_on(engine, crash)
    with LiveServer(create_app(engine)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            body = {"model": "a", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}
            answers = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(5)]
            deadline = time.monotonic() + 20
            while not (len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            before = gauges((await client.get("/metrics")).text)
            assert before["vllm:num_requests_running"] == [({}, 2.0)]
            assert before["vllm:num_requests_waiting"] == [({}, 3.0)]
            crash.set()
            assert [r.status_code for r in await asyncio.gather(*answers)] == [500] * 5
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/readyz")).status_code == 503
            after = gauges((await client.get("/metrics")).text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "loraplex_requests_running", "loraplex_requests_waiting"):
        assert after[name] == [({}, 0.0)], (name, after[name])
    (labels, _), = after["vllm:lora_requests_info"]
    assert labels["running_lora_adapters"] == "" and labels["waiting_lora_adapters"] == ""
    # What the dead engine held is let go: its rows and its adapter references.
    assert engine.kv.num_free == engine.kv.rows
    assert engine.adapters.table.entries["a"].refs == 0
