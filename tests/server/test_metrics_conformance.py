"""/metrics against what reads it: the Prometheus text format (0.0.4) and its naming rules,
the Gateway API Inference Extension's endpoint picker (vLLM's names), and the values of the
cache, queue and token series after real requests, loads, evictions and pins over HTTP."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.api.app import create_app
from loraplex.server.engine import LLMEngine

from .conftest import LiveServer
from .test_adapter_cache import write_adapter
from .test_adapter_cache_http import completion, epp_lora_info, flapping_lora_state, gate_loads, settings

NAMES = ["a.b", "c-d", "e@f", "g+h", "slow"]  # the punctuation adapter names may hold


@pytest.fixture
def server(tmp_path):
    for i, name in enumerate(NAMES):
        write_adapter(tmp_path / name, seed=i)
    engine = LLMEngine.from_settings(settings(tmp_path))
    with LiveServer(create_app(engine)) as s:
        s.engine = engine
        yield s


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, sample: str, **labels) -> float:
    """The value of the sample named `sample` with exactly `labels`."""
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    raise KeyError(f"{sample}{labels}")


def test_metrics_is_prometheus_text_0_0_4(server):
    """Prometheus asks for text/plain;version=0.0.4 (or 1.0.0 with an escaping scheme), and
    prometheus-client serves 0.0.4 unless asked for more; a body of 0.0.4 text must not be
    labelled 1.0.0, which Prometheus 2 scrapers and the endpoint picker never asked for."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/v1/completions", json=completion("a.b")).status_code == 200
        r = client.get("/metrics")
        assert r.status_code == 200
        kind, *params = [p.strip() for p in r.headers["content-type"].split(";")]
        assert kind == "text/plain" and "version=0.0.4" in params, r.headers["content-type"]
        # As Prometheus 2 and the endpoint picker scrape (Accept of a Prometheus 2 server).
        r = client.get("/metrics", headers={"Accept": "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
        assert "version=0.0.4" in r.headers["content-type"]
    text = r.text
    fams = families(text)  # the parser fails on malformed text
    help_lines = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    type_lines = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert help_lines == set(type_lines)
    for name, kind in type_lines.items():
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds") or name.endswith("_bytes"), name
    for f in fams.values():
        if f.type != "histogram":
            continue
        by_series: dict[tuple, list] = {}
        for s in f.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            by_series.setdefault(key, []).append(s)
        for samples in by_series.values():
            names = {s.name for s in samples}
            assert {f.name + "_bucket", f.name + "_sum", f.name + "_count"} <= names, f.name
            buckets = [s for s in samples if s.name.endswith("_bucket")]
            assert buckets[-1].labels["le"] == "+Inf"
            count = next(s.value for s in samples if s.name.endswith("_count"))
            assert buckets[-1].value == count
            assert [b.value for b in buckets] == sorted(b.value for b in buckets)  # cumulative
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:cache_config_info"):
        assert fams[name].type == "gauge", name
    # The cache's configuration, as the endpoint picker's vllm engine reads it: one series of
    # value 1, block_size and num_gpu_blocks in its labels; their product the cache's tokens.
    (config,) = fams["vllm:cache_config_info"].samples
    engine = server.engine
    tokens = int(config.labels["block_size"]) * int(config.labels["num_gpu_blocks"])
    assert config.value == 1 and int(config.labels["block_size"]) == engine.settings.kv_block
    assert engine.kv.rows * engine.kv.max_len <= tokens < engine.kv.rows * (engine.kv.max_len + engine.settings.kv_block)
    assert config.labels["enable_prefix_caching"] == "True" and config.labels["cache_dtype"] == "float32"


def test_cache_token_and_queue_values_after_requests_loads_evictions_and_pins(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        def run(name: str) -> None:
            r = client.post("/v1/completions", json=completion(name))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4

        run("a.b")  # from disk: a miss of gpu and host, a hit of disk
        run("a.b")  # resident: a gpu hit
        text = client.get("/metrics").text
        assert value(text, "loraplex_adapter_cache_hits_total", tier="gpu") == 1
        assert value(text, "loraplex_adapter_cache_misses_total", tier="gpu") == 1
        assert value(text, "loraplex_adapter_cache_misses_total", tier="host") == 1
        assert value(text, "loraplex_adapter_cache_hits_total", tier="disk") == 1
        assert value(text, "loraplex_adapter_load_seconds_count", source="disk") == 1
        assert value(text, "loraplex_adapters_resident") == 1
        assert value(text, "loraplex_adapter_slots") == 2
        assert value(text, "loraplex_queue_wait_seconds_count") == 2
        assert value(text, "loraplex_prompt_tokens_total") == 2 * 6
        assert value(text, "loraplex_generation_tokens_total") == 2 * 4
        assert value(text, "loraplex_adapter_evictions_total", tier="gpu") == 0

        run("c-d")
        run("e@f")  # two slots: a.b (least recently used) is evicted
        text = client.get("/metrics").text
        assert value(text, "loraplex_adapter_evictions_total", tier="gpu") == 1
        assert value(text, "loraplex_adapters_resident") == 2
        assert value(text, "loraplex_adapter_load_seconds_count", source="disk") == 3

        r = client.post("/v1/adapters/g+h/pin")
        assert r.status_code == 200 and r.json()["pinned"]
        text = client.get("/metrics").text
        assert value(text, "loraplex_adapters_pinned") == 1
        assert value(text, "loraplex_adapter_evictions_total", tier="gpu") == 2
        # A pin is not traffic: no hit, no miss.
        assert value(text, "loraplex_adapter_cache_misses_total", tier="gpu") == 3
        assert value(text, "loraplex_adapter_cache_hits_total", tier="gpu") == 1
        assert client.post("/v1/adapters/g+h/unpin").status_code == 200
        assert value(client.get("/metrics").text, "loraplex_adapters_pinned") == 0


async def test_gauges_while_a_load_runs_and_the_picker_reads_punctuated_names(server):
    gate = gate_loads(server.engine, "slow")
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        long = asyncio.create_task(client.post("/v1/completions", json=completion("e@f", max_tokens=100)))
        slow = asyncio.create_task(client.post("/v1/completions", json=completion("slow")))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            if epp_lora_info(text)[:2] == (["e@f"], ["slow"]):
                break
            await asyncio.sleep(0.01)
        assert epp_lora_info(text) == (["e@f"], ["slow"], 2)
        assert value(text, "vllm:num_requests_running") == value(text, "loraplex_requests_running") == 1
        assert value(text, "vllm:num_requests_waiting") == value(text, "loraplex_requests_waiting") == 1
        assert value(text, "loraplex_adapter_loads_in_flight") == 1
        assert value(text, "loraplex_adapter_loads_pending") == 0
        assert 0 < value(text, "vllm:kv_cache_usage_perc") <= 1
        gate.set()
        assert (await slow).status_code == 200 and (await long).status_code == 200
        text = (await client.get("/metrics")).text
        assert value(text, "loraplex_adapter_loads_in_flight") == 0
        assert value(text, "vllm:kv_cache_usage_perc") == 0
        assert value(text, "vllm:num_requests_running") == 0

async def test_scrapes_while_only_a_load_is_awaited_add_no_engine_steps(server):
    """A step that ran nothing (the queue waits for an adapter load, and a scrape or another
    command woke the loop) is not an engine step: counted, it drags the step-time histogram
    toward zero and its count away from the steps the batch took."""
    gate = gate_loads(server.engine, "slow")
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        slow = asyncio.create_task(client.post("/v1/completions", json=completion("slow")))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            if epp_lora_info(text)[1] == ["slow"] and server.engine.stalled:
                break
            await asyncio.sleep(0.01)
        before = value((await client.get("/metrics")).text, "loraplex_step_seconds_count")
        for _ in range(20):
            await client.get("/metrics")
        after = value((await client.get("/metrics")).text, "loraplex_step_seconds_count")
        assert after == before
        gate.set()
        assert (await slow).status_code == 200


def test_cold_load_series_start_at_zero_for_every_source(server):
    """A histogram series born at its first observation loses that load to rate() and
    increase() (the series had no earlier sample), so a pod's first cold load from a tier, most
    of its cold loads after a start, never reaches a p95 panel. Every source's series is there,
    at 0, before any load, as the failure counters are."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        text = client.get("/metrics").text
        for source in ("host", "disk", "source"):
            assert value(text, "loraplex_adapter_load_seconds_count", source=source) == 0
            assert value(text, "loraplex_adapter_load_seconds_bucket", source=source, le="+Inf") == 0
        assert client.post("/v1/completions", json=completion("a.b")).status_code == 200
        text = client.get("/metrics").text
        assert value(text, "loraplex_adapter_load_seconds_count", source="disk") == 1
        assert value(text, "loraplex_adapter_load_seconds_count", source="host") == 0


def test_lora_requests_info_is_one_series_in_every_scrape_while_it_changes():
    """The endpoint picker's newer scraper takes the first vllm:lora_requests_info series of
    the family (it compares scrape timestamps, which the text has none of), its older one the
    highest value. A refresh that set the new series and then removed the old one let a scrape
    rendering in between (two scrapers at once: Prometheus and the picker) see both, the old
    one first, so the newer picker read the adapters of the moment before. Every scrape must
    hold exactly one series, the one last set."""
    with flapping_lora_state() as (metrics, states):
        for _ in range(2000):
            family = families(metrics.render().decode())["vllm:lora_requests_info"]
            assert len(family.samples) == 1, family.samples
            labels = family.samples[0].labels
            assert set(labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
            running = [x for x in labels["running_lora_adapters"].split(",") if x]
            waiting = [x for x in labels["waiting_lora_adapters"].split(",") if x]
            assert (running, waiting) in states and labels["max_lora"] == "4"
            assert family.samples[0].value > 1e9  # a Unix time, the update's
