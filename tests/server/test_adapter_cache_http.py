"""The paging cache inside the engine and over real HTTP (uvicorn on loopback): requests wait in
the queue while their adapter loads, failed loads fail only their requests, session starts
make the first request a hit, pins from the API and the plan file, and the /metrics that the
Gateway API Inference Extension's endpoint picker reads."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.api.app import create_app
from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

from .conftest import LiveServer
from .test_adapter_cache import check_invariants, corrupt, write_adapter


def settings(cache_dir: Path, **kw) -> ServerSettings:
    base = dict(dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128,
                max_loras=2, max_lora_rank=8, adapter_cache_dir=str(cache_dir), cuda_graphs=False,
                served_model_name="tiny", seed=1)
    return ServerSettings(**(base | kw))


@pytest.fixture
def disk(tmp_path) -> Path:
    for i, name in enumerate(["a", "b", "c", "slow", "bad"]):
        write_adapter(tmp_path / name, seed=i)
    corrupt(tmp_path / "bad")
    return tmp_path


def gate_loads(engine: LLMEngine, name: str) -> threading.Event:
    """Hold loads of `name` until the returned event is set (a slow disk, deterministically)."""
    gate = threading.Event()
    loader, entries = engine.adapters.loader, engine.adapters.table.entries
    real = loader.copy_to_slot

    def copy(host, slot, *rest):
        if entries.get(name) is not None and entries[name].state == "loading" and entries[name].slot == slot:
            assert gate.wait(20)
        real(host, slot, *rest)

    loader.copy_to_slot = copy
    return gate


def run_to_end(engine: LLMEngine, reqs, timeout: float = 20) -> None:
    """Step until `reqs` finish; a stalled engine sleeps, as AsyncEngine's loop does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.finished for r in reqs):
            return
        engine.step()
        if engine.stalled:
            time.sleep(0.001)
    raise AssertionError("requests did not finish")


PROMPT = [5, 17, 33, 4, 9, 100]


def test_request_waits_in_the_queue_not_the_batch_while_its_adapter_loads(disk):
    engine = LLMEngine.from_settings(settings(disk))
    gate = gate_loads(engine, "a")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = engine.make_request(PROMPT, greedy)
    lora = engine.make_request(PROMPT, greedy, adapter="a")
    assert lora.slot == -1  # a cold miss: loading
    engine.add_request(base)
    engine.add_request(lora)
    for _ in range(4):
        engine.step()
    assert len(base.output_ids) == 4  # the other rows keep decoding
    assert lora in engine.scheduler.waiting and lora.row == -1 and not lora.output_ids
    assert engine.lora_state() == ([], ["a"])
    gate.set()
    run_to_end(engine, [base, lora])
    # The paged-in slot computes what an adapter loaded before any request computes.
    ref = LLMEngine.from_settings(settings(disk, lora_modules=[f"a={disk / 'a'}"]))
    want = ref.make_request(PROMPT, greedy, adapter="a")
    assert want.slot >= 0
    ref.add_request(want)
    run_to_end(ref, [want])
    assert lora.output_ids == want.output_ids and lora.output_ids != base.output_ids
    assert engine.metrics.queue_seconds._sum.get() > 0


def test_engine_fails_only_the_requests_of_a_failed_load(disk):
    engine = LLMEngine.from_settings(settings(disk))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    good, bad = engine.make_request(PROMPT, params, adapter="a"), engine.make_request(PROMPT, params, adapter="bad")
    engine.add_request(good)
    engine.add_request(bad)
    outs = []
    deadline = time.monotonic() + 20
    while not (good.finished and bad.finished) and time.monotonic() < deadline:
        outs += engine.step()
        time.sleep(0.001)
    assert good.finish_reason == "length" and len(good.output_ids) == 4
    assert bad.finish_reason == "error" and "'bad' failed to load" in bad.error and "adapter_model" in bad.error
    assert [o.error for o in outs if o.request_id == bad.request_id][-1] == bad.error
    assert engine.adapters.num_free == 1  # bad's slot went back


def test_a_load_that_fails_before_its_request_is_queued_still_fails_it(disk):
    """The server's race, made deterministic: the HTTP handler's `make_request` starts the load,
    the load fails, a step takes that failure, and only then does the engine thread queue the
    request. It must fail, not wait for a load that nothing will start again."""
    engine = LLMEngine.from_settings(settings(disk))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    good, bad = engine.make_request(PROMPT, params, adapter="a"), engine.make_request(PROMPT, params, adapter="bad")
    deadline = time.monotonic() + 20
    while "bad" not in {r["name"] for r in engine.adapters.describe() if r["state"] == "failed"}:
        assert time.monotonic() < deadline, "the corrupt adapter's load did not fail"
        time.sleep(0.005)
    engine.add_request(good)
    engine.step()  # takes the failure while `bad` is not queued yet
    engine.add_request(bad)
    run_to_end(engine, [good, bad])
    assert good.finish_reason == "length"
    assert bad.finish_reason == "error" and "'bad' failed to load" in bad.error
    # A later request for it fails at once with the same error (its files are unchanged).
    again = engine.make_request(PROMPT, params, adapter="bad")
    engine.add_request(again)
    run_to_end(engine, [again])
    assert again.finish_reason == "error" and engine.adapters.num_free == 1


@pytest.mark.parametrize("drain_after, served", [(0.05, True), (float("inf"), False)])
def test_a_cold_request_does_not_starve_behind_busy_adapters(disk, drain_after, served):
    """Two slots, four rows; a and b always have more requests than rows (a new one joins as one
    leaves), so neither frees its slot by itself. c's request gets a slot once it has waited
    drain_after; without draining it waits for ever."""
    engine = LLMEngine.from_settings(settings(disk))
    engine.adapters.drain_after = drain_after
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    busy = []

    def keep_busy():
        for name in ("a", "b"):
            while sum(1 for r in busy if r.adapter == name and not r.finished) < 5:
                req = engine.make_request(PROMPT, params, adapter=name)
                engine.add_request(req)
                busy.append(req)

    keep_busy()
    for _ in range(20):  # a and b resident and running
        engine.step()
        keep_busy()
    cold = engine.make_request(PROMPT, params, adapter="c")
    engine.add_request(cold)
    deadline = time.monotonic() + (10 if served else 1.0)
    while not cold.finished and time.monotonic() < deadline:
        keep_busy()
        engine.step()
    assert cold.finished == served
    done = sum(1 for r in busy if r.finished)
    assert done >= 4  # a and b were served all along
    if served:
        assert cold.finish_reason == "length" and len(cold.output_ids) == 3
        check_invariants(engine.adapters)


@pytest.fixture
def serve(disk):
    servers = []

    def start(**kw) -> LiveServer:
        engine = LLMEngine.from_settings(settings(disk, **kw))
        server = LiveServer(create_app(engine)).__enter__()
        server.engine = engine
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.__exit__(None, None, None)


def completion(model: str, **kw) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True} | kw


def test_session_start_makes_the_first_request_a_hit(serve):
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/sessions", json={"model": "c"})
        assert r.status_code == 200, r.text
        assert r.json()["tier"] == "gpu" and r.json()["id"].startswith("sess-")
        assert client.post("/v1/completions", json=completion("c")).status_code == 200
        row = {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}["c"]
        assert (row["hits"], row["misses"], row["tier"]) == (1, 0, "gpu")
        metrics = client.get("/metrics").text
        assert 'loraplex_adapter_cache_hits_total{tier="gpu"} 1.0' in metrics
        assert 'loraplex_adapter_cache_misses_total{tier="gpu"} 0.0' in metrics
        # Without a session start the first request misses (and loads from disk).
        assert client.post("/v1/completions", json=completion("b")).status_code == 200
        row = {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}["b"]
        assert (row["hits"], row["misses"]) == (0, 1)
        assert client.post("/v1/sessions", json={"model": "nope"}).status_code == 404


async def test_failed_load_fails_only_its_requests_over_http(serve):
    server = serve()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        good, bad = await asyncio.gather(client.post("/v1/completions", json=completion("a")),
                                         client.post("/v1/completions", json=completion("bad")))
        assert good.status_code == 200 and len(good.json()["choices"][0]["text"]) >= 0
        assert bad.status_code == 500
        err = bad.json()["error"]
        assert err["code"] == "adapter_load_failed" and "'bad' failed to load" in err["message"]
        async with client.stream("POST", "/v1/completions", json=completion("bad", stream=True)) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert json.loads(events[0][6:])["error"]["code"] == "adapter_load_failed" and events[-1] == "data: [DONE]"
        listing = (await client.get("/v1/adapters")).json()
        row = {a["name"]: a for a in listing["data"]}["bad"]
        assert row["state"] == "failed" and row["slot"] is None and listing["free_slots"] >= 1
        assert (await client.post("/v1/completions", json=completion("b"))).status_code == 200


def epp_lora_info(metrics_text: str) -> tuple[list[str], list[str], int]:
    """What the endpoint picker takes from vllm:lora_requests_info: the series with the highest
    value (the newest), its running and waiting adapter lists split on commas, and max_lora."""
    family = next(f for f in text_string_to_metric_families(metrics_text) if f.name == "vllm:lora_requests_info")
    newest = max(family.samples, key=lambda s: s.value)
    split = lambda v: [x for x in v.split(",") if x]  # noqa: E731
    return (split(newest.labels["running_lora_adapters"]), split(newest.labels["waiting_lora_adapters"]),
            int(newest.labels["max_lora"]))


def test_lora_requests_info_never_scrapes_empty_while_it_changes():
    """A scrape renders on the event loop's thread while another scrape's refresh runs on the
    engine's: the series was cleared, then set, so a render between the two found no
    vllm:lora_requests_info at all (the endpoint picker then has no adapters for the pod)."""
    with flapping_lora_state() as (metrics, states):
        for _ in range(3000):
            running, waiting, max_lora = epp_lora_info(metrics.render().decode())
            assert (running, waiting) in states and max_lora == 4


@contextlib.contextmanager
def flapping_lora_state():
    """(metrics, states): EngineMetrics refreshed without pause on another thread from a stub
    engine whose (running, waiting) adapters alternate between the two `states`, 4 slots."""
    from types import SimpleNamespace as NS

    from loraplex.server.metrics import EngineMetrics

    states = [(["a"], []), (["b"], ["a"])]
    turn = itertools.count()
    engine = NS(scheduler=NS(running={}, waiting=[]), kv=NS(num_free=1, rows=2), lora=NS(num_slots=4), prefixes=None,
                adapters=NS(list=list, refresh_metrics=lambda: None), lora_state=lambda: states[next(turn) % 2])
    metrics = EngineMetrics()
    stop = threading.Event()

    def refresh() -> None:
        while not stop.is_set():
            metrics.refresh(engine)

    thread = threading.Thread(target=refresh)
    thread.start()
    try:
        yield metrics, states
    finally:
        stop.set()
        thread.join()


def gauge(metrics_text: str, name: str) -> float:
    family = next(f for f in text_string_to_metric_families(metrics_text) if f.name == name)
    return family.samples[0].value


async def test_metrics_as_the_inference_extension_reads_them(serve):
    server = serve()
    gate = gate_loads(server.engine, "slow")
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        long = asyncio.create_task(client.post("/v1/completions", json=completion("a", max_tokens=100)))
        slow = asyncio.create_task(client.post("/v1/completions", json=completion("slow")))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            if epp_lora_info(text)[:2] == (["a"], ["slow"]):
                break
            await asyncio.sleep(0.01)
        assert epp_lora_info(text) == (["a"], ["slow"], 2)
        assert gauge(text, "vllm:num_requests_waiting") == 1 and gauge(text, "vllm:num_requests_running") == 1
        assert 0 < gauge(text, "vllm:kv_cache_usage_perc") <= 1
        assert gauge(text, "loraplex_adapter_loads_in_flight") == 1
        gate.set()
        assert (await slow).status_code == 200 and (await long).status_code == 200
        text = (await client.get("/metrics")).text
        assert epp_lora_info(text) == ([], [], 2)
        family = next(f for f in text_string_to_metric_families(text) if f.name == "loraplex_adapter_load_seconds")
        counts = {s.labels["source"]: s.value for s in family.samples if s.name.endswith("_count")}
        assert counts["disk"] == 2


def test_pin_unpin_prefetch_and_listing(serve):
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        listing = client.get("/v1/adapters").json()
        rows = {a["name"]: a for a in listing["data"]}
        assert set(rows) == {"a", "b", "c", "slow", "bad"} and rows["a"]["tier"] == "disk"
        assert listing["slots"] == 2 and rows["a"]["bytes"] > 0
        r = client.post("/v1/adapters/a/prefetch", params={"wait": "false"})
        assert r.status_code == 202 and r.json()["state"] in ("staging", "pending", "loading", "ready")
        r = client.post("/v1/adapters/b/pin")
        assert r.status_code == 200 and r.json()["pinned"]
        r = client.post("/v1/adapters/c/prefetch")
        assert r.status_code == 200 and r.json()["tier"] == "gpu"
        for name in ("a", "c", "slow"):  # paging through one unpinned slot never moves b
            assert client.post("/v1/completions", json=completion(name)).status_code == 200
            assert {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}["b"]["tier"] == "gpu"
        assert not client.post("/v1/adapters/b/unpin").json()["pinned"]
        assert client.post("/v1/adapters/nope/pin").status_code == 404
        assert client.post("/v1/adapters/nope/prefetch").status_code == 404
        r = client.post("/v1/adapters/bad/prefetch")
        assert r.status_code == 500 and r.json()["error"]["code"] == "adapter_load_failed"
        ids = {m["id"] for m in client.get("/v1/models").json()["data"]}
        assert {"tiny", "a", "b", "c", "slow", "bad"} <= ids


def test_load_lora_adapter_evicts_instead_of_refusing(serve, tmp_path_factory):
    extra = write_adapter(tmp_path_factory.mktemp("extra") / "x", seed=77)
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in ("a", "b"):  # both slots resident
            assert client.post("/v1/completions", json=completion(name)).status_code == 200
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(extra)})
        assert r.status_code == 200, r.text
        assert client.post("/v1/completions", json=completion("x")).status_code == 200
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(extra)})
        assert r.status_code == 400


def test_plan_file_pins_without_a_restart(serve, tmp_path_factory):
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.write_text(json.dumps({"pinned": ["a"], "adapters": [], "prefetch": []}))
    server = serve(plan_file=str(plan))

    def pinned(client) -> set[str]:
        return {a["name"] for a in client.get("/v1/adapters").json()["data"] if a["pinned"]}

    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert pinned(client) == {"a"}
        plan.write_text(json.dumps({"pinned": ["c"], "adapters": [], "prefetch": []}) + "\n")
        deadline = time.monotonic() + 10
        while pinned(client) != {"c"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pinned(client) == {"c"}
        r = client.post("/v1/adapters/c/prefetch")
        assert r.json()["tier"] == "gpu" and r.json()["pinned"]


def test_pin_and_prefetch_answers_are_described_off_the_event_loop(serve, monkeypatch):
    """A pin's or a prefetch's answer is its row of GET /v1/adapters, and `describe` stats every
    folder of the node's cache: on the event loop, a large cache stalled every stream and
    health probe for as long. Here describe takes 1.5 s (a slow disk): /healthz still answers."""
    import time

    server = serve()
    cache = server.engine.adapters
    real = cache.describe

    def slow_describe():
        time.sleep(1.5)
        return real()

    monkeypatch.setattr(cache, "describe", slow_describe)
    answer = {}

    def pin() -> None:
        answer["pin"] = httpx.post(server.url + "/v1/adapters/a/pin", timeout=30)

    t = threading.Thread(target=pin)
    t.start()
    time.sleep(0.3)  # the pin is being described
    t0 = time.monotonic()
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
    health_seconds = time.monotonic() - t0
    t.join()
    assert answer["pin"].status_code == 200 and answer["pin"].json()["pinned"] is True
    assert health_seconds < 0.8, health_seconds
