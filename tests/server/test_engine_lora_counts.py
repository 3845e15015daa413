"""vllm:lora_requests_info (the adapters running and waiting, read by the endpoint picker)
comes from per-adapter counts the scheduler keeps as requests enter and leave the queue and
the batch: a /metrics scrape walked the whole waiting queue on the engine thread (0.36 ms at
10,000 queued), now it reads the adapters only. The counts stay equal to a full recount of
the queue and the batch through a storm of adds, admissions, aborts and finishes."""

from __future__ import annotations

import random
from collections import Counter

import torch

from loraplex.server.config import named_shape
from loraplex.server.engine import LLMEngine
from loraplex.server.kv_cache import KVCache
from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams
from loraplex.server.scheduler import Scheduler
from loraplex.server.settings import ServerSettings

from .test_adapter_cache import write_adapter
from .test_engine_queue_cost import CountingDeque, count_reads

QUEUED = 3000


def recount(sched: Scheduler) -> tuple[Counter, Counter]:
    """Requests per adapter in the batch and in the queue, counted from scratch."""
    return (Counter(r.adapter for r in sched.running.values() if r.adapter),
            Counter(r.adapter for r in sched.waiting if r.adapter))


def check(sched: Scheduler) -> None:
    running, waiting = recount(sched)
    assert sched._running_adapters == running
    assert {name: len(reqs) for name, reqs in sched._waiting_adapters.items()} == waiting
    for name in waiting:  # each adapter's queue in queue order
        assert sched.waiting_for(name) == [r for r in sched.waiting if r.adapter == name]
    assert sched.lora_state() == (sorted(running), sorted(waiting))


def engine_with_adapters(tmp_path, names=("a", "b")) -> LLMEngine:
    for i, name in enumerate(names):
        write_adapter(tmp_path / name, seed=i)
    return LLMEngine.from_settings(ServerSettings(
        dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, max_loras=2,
        max_lora_rank=8, cuda_graphs=False, seed=1, lora_modules=[f"{n}={tmp_path / n}" for n in names]))


def test_a_scrape_reads_no_queued_request(tmp_path):
    engine = engine_with_adapters(tmp_path)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for adapter in ("a", None, "a", None):  # every row taken, one adapter among them
        engine.add_request(engine.make_request([1, 5, 6], long, adapter))
    engine.step()
    for i in range(QUEUED):
        engine.add_request(engine.make_request([1, 7, 8], SamplingParams(max_tokens=1), ("a", "b", None)[i % 3]))
    count_reads(engine)
    assert engine.lora_state() == (["a"], ["a", "b"])
    engine.metrics.refresh(engine)
    assert CountingDeque.reads == 0
    text = engine.metrics.render().decode()
    assert 'running_lora_adapters="a"' in text and 'waiting_lora_adapters="a,b"' in text


def test_counts_equal_a_recount_through_a_storm_of_adds_admissions_aborts_and_finishes():
    kv = KVCache(named_shape("tiny"), rows=6, max_len=64, device=torch.device("cpu"), dtype=torch.float32)
    rng = random.Random(7)
    for chunked in (False, True):
        sched = Scheduler(kv, max_prefill_tokens=12, chunked_prefill=chunked)
        ids = iter(range(10**9))
        live: list[Request] = []
        for _ in range(3000):
            op = rng.random()
            if op < 0.4:
                req = Request(f"r{next(ids)}", [1] * rng.randint(1, 9), SamplingParams(),
                              rng.choice(["a", "b", "c", None]), 0)
                sched.add(req)
                live.append(req)
            elif op < 0.6:
                # Some adapters still loading: their requests stay queued.
                ready = {a: i for i, a in enumerate("abc") if rng.random() < 0.7}
                sched.schedule(ready if rng.random() < 0.8 else None)
            elif live:
                # Aborts (queued or running) and finishes, alone or several at once, some twice.
                gone = rng.sample(live, min(len(live), rng.randint(1, 4)))
                for r in gone:
                    if rng.random() < 0.5:
                        r.abort()
                    live.remove(r)
                sched.remove_all(gone + gone[:1] if rng.random() < 0.2 else gone)
            check(sched)
        sched.remove_all(list(live))
        check(sched)
        assert sched.lora_state() == ([], []) and not sched.has_work() and kv.num_free == kv.rows


def test_engine_counts_follow_steps_aborts_and_failures(tmp_path):
    engine = engine_with_adapters(tmp_path)
    rng = random.Random(3)
    reqs = []
    for step in range(60):
        for _ in range(rng.randint(0, 3)):
            req = engine.make_request([1, 5, rng.randint(2, 90)], SamplingParams(
                max_tokens=rng.randint(1, 6), temperature=0, ignore_eos=True), rng.choice(["a", "b", None]))
            engine.add_request(req)
            reqs.append(req)
        for req in rng.sample(reqs, min(len(reqs), rng.randint(0, 2))):
            engine.abort(req.request_id)
        engine.step()
        check(engine.scheduler)
    engine.fail_all("stopped")
    check(engine.scheduler)
    assert engine.lora_state() == ([], [])
