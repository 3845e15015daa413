"""The agent's failure counter has every reason's series from the start, at 0, so that
increase() sees its first failed staging."""

from prometheus_client import generate_latest

from loraplex.node_agent.metrics import Metrics
from loraplex.node_agent.store import REASON_STATUS, AdapterStore


def test_failure_series_start_at_zero_for_every_reason(tmp_path):
    metrics = Metrics()
    AdapterStore(tmp_path / "cache", 10**6, metrics=metrics)
    text = generate_latest(metrics.registry).decode()
    for reason in REASON_STATUS:
        assert f'loraplex_node_agent_download_failures_total{{reason="{reason}"}} 0.0' in text
