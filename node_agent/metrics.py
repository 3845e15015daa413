"""The node agent's Prometheus metrics, on a registry of their own (one per agent)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "loraplex_node_agent"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.downloads_in_flight = Gauge(
            f"{PREFIX}_downloads_in_flight", "Adapter downloads running now", registry=r)
        self.downloads_waiting = Gauge(
            f"{PREFIX}_downloads_waiting", "Adapter downloads waiting for a download slot", registry=r)
        self.disk_bytes = Gauge(
            f"{PREFIX}_disk_bytes", "Bytes of staged adapters on local disk", registry=r)
        self.budget_bytes = Gauge(
            f"{PREFIX}_disk_budget_bytes", "Byte budget of the local adapter cache", registry=r)
        self.staged_adapters = Gauge(
            f"{PREFIX}_staged_adapters", "Adapters staged on local disk", registry=r)
        self.pinned_adapters = Gauge(
            f"{PREFIX}_pinned_adapters", "Staged adapters that the plan pins", registry=r)
        self.download_seconds = Histogram(
            f"{PREFIX}_download_seconds", "Time to fetch, verify and place one adapter",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.download_bytes = Counter(
            f"{PREFIX}_download_bytes", "Bytes downloaded into the local cache", registry=r)
        self.failures = Counter(
            f"{PREFIX}_download_failures", "Failed stagings by reason", ["reason"], registry=r)
        self.evictions = Counter(
            f"{PREFIX}_evictions", "Adapters removed from local disk to make room", registry=r)
        self.server_calls = Counter(
            f"{PREFIX}_server_calls", "Calls to the node's servers (prefetch, pin) by outcome",
            ["action", "outcome"], registry=r)
        self.task_crashes = Counter(
            f"{PREFIX}_task_crashes", "Background loops that ended with an exception", ["task"], registry=r)
