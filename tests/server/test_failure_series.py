"""Failure counters have every reason's series from the start, at 0: a series born at 1 is
missed by increase() and rate(), so an alert on the first failed load would never fire."""

from prometheus_client import CollectorRegistry, generate_latest

from loraplex.server.adapter_sources import LOAD_FAILURE_REASONS, AdapterLoadError
from loraplex.server.cache_metrics import CacheMetrics


def test_load_failure_series_start_at_zero_for_every_reason():
    registry = CollectorRegistry()
    CacheMetrics(registry)
    text = generate_latest(registry).decode()
    for reason in LOAD_FAILURE_REASONS:
        assert f'loraplex_adapter_load_failures_total{{reason="{reason}"}} 0.0' in text


def test_every_reason_the_server_raises_is_listed():
    import pathlib
    import re

    import loraplex.server as server

    raised = set()
    for path in pathlib.Path(server.__file__).parent.rglob("*.py"):
        raised |= set(re.findall(r'AdapterLoadError\([^,]+, "([a-z_]+)"', path.read_text()))
    assert raised and raised <= set(LOAD_FAILURE_REASONS), raised - set(LOAD_FAILURE_REASONS)
    assert AdapterLoadError("a", "oom", "x").reason == "oom"
