"""A failed adapter load ends that adapter's queued requests, and the engine finds them without
reading the queue: it walked the whole waiting queue on every step that took a failure (3,000
queued for other adapters: 3,000 reads to find one request), and even when no queued request
was the failed adapter's (one made on the HTTP thread and not queued yet). The requests are
still taken out of the queue in one walk for all of them, as aborts are (Scheduler.remove_all)."""

from __future__ import annotations

import time

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

from .test_adapter_cache import corrupt, write_adapter
from .test_engine_queue_cost import CountingDeque, count_reads

QUEUED = 3000


def engine_with_a_bad_adapter(tmp_path) -> LLMEngine:
    write_adapter(tmp_path / "a", seed=0)
    write_adapter(tmp_path / "bad", seed=1)
    corrupt(tmp_path / "bad")
    return LLMEngine.from_settings(ServerSettings(
        dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, max_loras=2,
        max_lora_rank=8, adapter_cache_dir=str(tmp_path), cuda_graphs=False, seed=1))


def wait_failed(engine: LLMEngine, name: str) -> None:
    deadline = time.monotonic() + 20
    while name not in {r["name"] for r in engine.adapters.describe() if r["state"] == "failed"}:
        assert time.monotonic() < deadline, f"the load of {name} did not fail"
        time.sleep(0.005)


def fill(engine: LLMEngine) -> list:
    """Every row taken by a long base request, then QUEUED requests of the base and of `a`."""
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for _ in range(4):
        engine.add_request(engine.make_request([1, 5, 6], long))
    engine.step()
    queued = [engine.make_request([1, 7, 8], SamplingParams(max_tokens=1), ("a", None)[i % 2]) for i in range(QUEUED)]
    for r in queued:
        engine.add_request(r)
    return queued


def test_a_failed_load_reads_only_its_adapters_requests(tmp_path):
    engine = engine_with_a_bad_adapter(tmp_path)
    queued = fill(engine)
    params = SamplingParams(max_tokens=4)
    bad = [engine.make_request([1, 9, 9], params, "bad") for _ in range(2)]
    for r in bad:
        engine.add_request(r)  # at the queue's tail, behind 3,000 others
    wait_failed(engine, "bad")
    count_reads(engine)
    outputs = engine.step()
    assert all(r.finish_reason == "error" and "'bad' failed to load" in r.error for r in bad)
    assert {o.request_id for o in outputs if o.finish_reason == "error"} == {r.request_id for r in bad}
    # One walk, taking both out (remove_all), and a look at the head; finding them read none.
    assert CountingDeque.reads <= len(engine.scheduler.waiting) + len(bad) + 3, CountingDeque.reads
    assert list(engine.scheduler.waiting) == queued and not any(r.finished for r in queued)
    assert engine.scheduler.waiting_for("bad") == [] and engine.lora_state()[1] == ["a"]


def test_a_failure_with_no_queued_request_reads_no_queue(tmp_path):
    """The HTTP thread made a request (its load started) and has not queued it yet when the load
    fails: the step that takes the failure fails nothing, and read the whole queue to find so."""
    engine = engine_with_a_bad_adapter(tmp_path)
    queued = fill(engine)
    bad = engine.make_request([1, 9, 9], SamplingParams(max_tokens=4), "bad")
    wait_failed(engine, "bad")
    count_reads(engine)
    engine.step()
    assert CountingDeque.reads <= 3, CountingDeque.reads
    engine.add_request(bad)  # queued after the failure was taken: it fails at once, as before
    assert bad.finish_reason == "error"
    engine.step()
    assert list(engine.scheduler.waiting) == queued


def test_the_index_holds_the_live_requests_only(tmp_path):
    """The scheduler's per-adapter queue (`waiting_for`) gains each request of an adapter when
    it is queued and loses it when it leaves (admitted, aborted, failed): it never grows with
    requests served."""
    engine = engine_with_a_bad_adapter(tmp_path)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    reqs = [engine.make_request([1, 5, 6], params, ("a", "bad", None)[i % 3]) for i in range(12)]
    for r in reqs:
        engine.add_request(r)
    engine.abort(reqs[0].request_id)
    deadline = time.monotonic() + 20
    while engine.has_work():
        assert time.monotonic() < deadline
        engine.step()
        time.sleep(0.001)
    assert engine.scheduler._waiting_adapters == {} and not engine.scheduler._running_adapters
    assert {r.finish_reason for r in reqs[1::3]} == {"error"} and reqs[0].finish_reason == "abort"
    assert {r.finish_reason for r in reqs[3::3] + reqs[2::3]} == {"length"}
