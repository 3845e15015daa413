"""Prometheus metrics of the adapter cache, registered in the engine's registry (so /metrics
serves them beside the engine's).

    loraplex_adapter_cache_hits_total{tier}      a request found its adapter in tier (gpu, host, disk, source)
    loraplex_adapter_cache_misses_total{tier}    ... did not find it in that tier (and looked further down)
    loraplex_adapter_load_seconds{source}        cold load, from the load's start to resident in a slot
                                                 (from "source": its fetch, before it waited for a slot, too)
    loraplex_adapter_loads_in_flight             loads running now (at most --max-concurrent-loads)
    loraplex_adapter_loads_pending               loads waiting for a load worker or a free slot
                                                 (an adapter being fetched first is in neither)
    loraplex_adapter_evictions_total{tier}       adapters evicted from gpu slots / the host tier
    loraplex_adapter_load_failures_total{reason} failed loads (missing, corrupt, mismatch, oom, fetch, other);
                                                 a load refused at once, as its last failed on the same
                                                 files (AdapterCache._refused), counts as one too
    loraplex_adapters_pinned / _host             pinned adapters (resident or not) / host copies

Hits and misses count requests only (prefetches and pins are not traffic). Resident
adapters and slots are the engine's `loraplex_adapters_resident` / `loraplex_adapter_slots`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .adapter_sources import LOAD_FAILURE_REASONS

TIERS = ("gpu", "host", "disk", "source")
LOAD_SOURCES = TIERS[1:]  # where a cold load's bytes come from (never a slot)

# Cold loads: a rank-16 8B adapter is ~84 MB: ~2 ms from pinned host memory on an H200,
# tens of ms from NVMe, seconds from an object store.
LOAD_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0, 8.0,
                16.0, 32.0, 64.0)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry or CollectorRegistry()
        self.registry = r
        self.hits = Counter("loraplex_adapter_cache_hits", "Requests whose adapter was found in this tier",
                            ["tier"], registry=r)
        self.misses = Counter("loraplex_adapter_cache_misses", "Requests whose adapter was not in this tier",
                              ["tier"], registry=r)
        self.load_seconds = Histogram("loraplex_adapter_load_seconds",
                                      "Cold-load time into a GPU slot, by the tier the bytes came from",
                                      ["source"], buckets=LOAD_BUCKETS, registry=r)
        self.loads_in_flight = Gauge("loraplex_adapter_loads_in_flight", "Adapter loads running now", registry=r)
        self.loads_pending = Gauge("loraplex_adapter_loads_pending",
                                   "Adapter loads waiting for a load worker or a free slot", registry=r)
        self.evictions = Counter("loraplex_adapter_evictions", "Adapters evicted, by tier", ["tier"], registry=r)
        self.load_failures = Counter("loraplex_adapter_load_failures", "Adapter loads that failed, by reason",
                                     ["reason"], registry=r)
        self.pinned = Gauge("loraplex_adapters_pinned", "Pinned adapters (resident or waiting for a slot)",
                            registry=r)
        self.host = Gauge("loraplex_adapters_host", "Adapters with a copy in host memory", registry=r)
        self.host_bytes = Gauge("loraplex_adapter_host_bytes", "Bytes of host-memory adapter copies", registry=r)
        for tier in TIERS:  # every series present from the start, at 0
            self.hits.labels(tier)
            self.misses.labels(tier)
        for tier in ("gpu", "host"):
            self.evictions.labels(tier)
        # So with each source's cold-load histogram: born at its first load, that load would be
        # lost to rate() and increase(), and with it most of a fresh pod's cold loads.
        for source in LOAD_SOURCES:
            self.load_seconds.labels(source)
        # A counter's first failure must show as an increase: a series born at 1 is missed by
        # increase() and rate(), so alerts on the first failed load would never fire.
        for reason in LOAD_FAILURE_REASONS:
            self.load_failures.labels(reason)

    def record_lookup(self, tier: str) -> None:
        """One request found its adapter in `tier`: a miss in every tier above it."""
        for t in TIERS:
            if t == tier:
                self.hits.labels(t).inc()
                return
            self.misses.labels(t).inc()
