"""Prometheus metrics of one engine, in their own registry (so several engines can live in
one process, as in the tests). /metrics renders `EngineMetrics.render()`.

Besides loraplex's own names, the gauges that the Kubernetes Gateway API Inference
Extension's endpoint picker scrapes from a vLLM-compatible server are exported under
vLLM's names (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`, `vllm:cache_config_info`), so its LoRA-affinity routing can
send a request to a pod that already holds the adapter.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching")


class LoraRequestsInfo:
    """vllm:lora_requests_info as exactly one series: the labels and the time of the last
    update, swapped in as one tuple, so a scrape rendering on another thread while a refresh
    runs finds the old series or the new one, never both and never none. (A labelled Gauge
    whose new series is set and the old one removed shows both in between, the old one
    first: the endpoint picker's newer scraper takes a family's first series.)"""

    def __init__(self, registry: CollectorRegistry):
        self._current: tuple[tuple[str, str, str], float] | None = None
        registry.register(self)

    def set(self, running: str, waiting: str, max_lora: str, when: float) -> None:
        self._current = ((running, waiting, max_lora), when)

    def collect(self):
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting adapters; value: update time",
                                   labels=LORA_INFO_LABELS)
        current = self._current
        if current is not None:
            family.add_metric(list(current[0]), current[1])
        return [family]


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.aborted = Counter("loraplex_requests_aborted", "Requests aborted (client gone)", registry=r)
        self.running = Gauge("loraplex_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("loraplex_requests_waiting", "Requests waiting for admission", registry=r)
        self.step_seconds = Histogram("loraplex_step_seconds", "Engine step time (prefill + decode + sampling)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.queue_seconds = Histogram("loraplex_queue_wait_seconds",
                                       "Time from arrival to admission into the batch (adapter loads included)",
                                       buckets=STEP_BUCKETS + (5.0, 10.0, 30.0), registry=r)
        self.adapters_loaded = Gauge("loraplex_adapters_resident", "Adapters resident in device slots", registry=r)
        self.adapter_slots = Gauge("loraplex_adapter_slots", "Adapter slots in the device buffers", registry=r)
        # vLLM-compatible names read by the Gateway API Inference Extension.
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests in the running batch", registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for admission", registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of KV rows in use (0..1)", registry=r)
        self.vllm_lora = LoraRequestsInfo(r)
        # vLLM's cache_config_info (value 1, the configuration in labels), which the endpoint
        # picker's vllm engine reads beside the gauges above: without it, it counts the pod's
        # metrics as failed. `describe_kv_cache` sets it once.
        self.vllm_cache_config = Gauge("vllm:cache_config_info", "KV cache configuration (in the labels)",
                                       CACHE_CONFIG_LABELS, registry=r)
        # Prefix caching, in prompt tokens, under vLLM's names: asked for (the prompts admitted
        # with it on) and found in a KV row (not prefilled). hits / queries is the hit rate.
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        # The host tier (--kv-offloading-size; prefix_store.py): tokens copied back from it (of
        # the hits above), tokens copied to it, and how full it is.
        self.offload_hits = Counter("loraplex_kv_offload_hit_tokens",
                                    "Prompt tokens found in the prefix cache's host tier and copied back", registry=r)
        self.offload_saved = Counter("loraplex_kv_offload_saved_tokens",
                                     "Tokens copied to the prefix cache's host tier", registry=r)
        self.offload_usage = Gauge("loraplex_kv_offload_usage_perc",
                                   "Share of the prefix cache's host tier in use (0..1)", registry=r)

    def describe_kv_cache(self, block_size: int, rows: int, max_len: int, dtype: str,
                          prefix_caching: bool = False) -> None:
        """The KV cache as vLLM's labels describe one: `rows` x `max_len` tokens, preallocated,
        counted in blocks of `block_size` tokens (the granularity a decode step reads it in;
        there is no paging), and whether prefix caching is on."""
        blocks = rows * -(-max_len // block_size)
        self.vllm_cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(blocks), cache_dtype=dtype,
                                      enable_prefix_caching=str(bool(prefix_caching))).set(1)

    def refresh(self, engine) -> None:
        """Gauges read from the engine at scrape time."""
        sched = engine.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        self.running.set(running)
        self.waiting.set(waiting)
        self.vllm_running.set(running)
        self.vllm_waiting.set(waiting)
        self.vllm_kv_usage.set(1 - engine.kv.num_free / engine.kv.rows)
        store = engine.prefixes.store if engine.prefixes is not None else None
        self.offload_usage.set(store.blocks_used / store.num_blocks if store is not None else 0)
        self.adapters_loaded.set(len(engine.adapters.list()))
        self.adapter_slots.set(engine.lora.num_slots)
        engine.adapters.refresh_metrics()
        run_names, wait_names = engine.lora_state()
        self.vllm_lora.set(",".join(run_names), ",".join(wait_names), str(engine.lora.num_slots), time.time())

    def render(self) -> bytes:
        return generate_latest(self.registry)
