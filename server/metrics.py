"""Prometheus metrics of one engine, in their own registry (so several engines can live in
one process, as in the tests). /metrics renders `EngineMetrics.render()`.

Besides loraplex's own names, the gauges that the Kubernetes Gateway API Inference
Extension's endpoint picker scrapes from a vLLM-compatible server are exported under
vLLM's names (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`), so its LoRA-affinity routing can
send a request to a pod that already holds the adapter.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


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
        self.vllm_lora = Gauge("vllm:lora_requests_info", "Running and waiting adapters; value: update time",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self._lora_labels: tuple[str, str, str] | None = None  # vllm_lora's one series

    def refresh(self, engine) -> None:
        """Gauges read from the engine at scrape time."""
        sched = engine.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        self.running.set(running)
        self.waiting.set(waiting)
        self.vllm_running.set(running)
        self.vllm_waiting.set(waiting)
        self.vllm_kv_usage.set(1 - engine.kv.num_free / engine.kv.rows)
        self.adapters_loaded.set(len(engine.adapters.list()))
        self.adapter_slots.set(engine.lora.num_slots)
        engine.adapters.refresh_metrics()
        run_names, wait_names = engine.lora_state()
        # The new series first, then the old one gone: a scrape rendering meanwhile (on another
        # thread) finds one or both, and the picker reads the newest; never none.
        labels = (",".join(run_names), ",".join(wait_names), str(engine.lora.num_slots))
        self.vllm_lora.labels(*labels).set(time.time())
        if self._lora_labels not in (None, labels):
            self.vllm_lora.remove(*self._lora_labels)
        self._lora_labels = labels

    def render(self) -> bytes:
        return generate_latest(self.registry)
