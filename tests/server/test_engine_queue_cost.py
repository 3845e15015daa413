"""The engine thread's work per step does not grow with the queue: a burst of queued requests
(a benchmark sending 10,000 at once) cost every step three walks of the whole queue (finished
ones to reap, adapters ready, the admitted taken out): 5 ms a step at 10,000 queued on a
2-core machine, on top of the decode. Each abort walked the queue again to find its request
(10,000 aborts: 1.4 s of the engine thread). Now a step reads the queue only as far as it
admits, and the aborts between two steps cost one walk together."""

from __future__ import annotations

from collections import deque

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

QUEUED = 3000


class CountingDeque(deque):
    """A deque that counts the elements read by iterating it."""

    reads = 0

    def __iter__(self):
        for item in super().__iter__():
            CountingDeque.reads += 1
            yield item


def count_reads(engine: LLMEngine) -> None:
    engine.scheduler.waiting = CountingDeque(engine.scheduler.waiting)
    CountingDeque.reads = 0


def test_steps_and_aborts_read_no_more_of_the_queue_than_they_admit():
    engine = LLMEngine.from_settings(ServerSettings(
        dummy_weights="tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, max_loras=1,
        max_lora_rank=8, cuda_graphs=False, seed=1))
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    running = [engine.make_request([1, 5, 6], long) for _ in range(4)]
    for r in running:
        engine.add_request(r)
    engine.step()  # every row taken
    queued = [engine.make_request([1, 7, 8], SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(QUEUED)]
    for r in queued:
        engine.add_request(r)
    count_reads(engine)
    for _ in range(3):
        engine.step()
    assert CountingDeque.reads <= 3, CountingDeque.reads  # one look at the head each step, no row for it

    # Aborts between two steps: the queue is walked once for all of them, not once each.
    aborted = queued[::2]
    for r in aborted:
        assert engine.abort(r.request_id) is r
    assert CountingDeque.reads <= 3
    outputs = engine.step()
    assert sum(o.finish_reason == "abort" for o in outputs) == len(aborted)
    assert CountingDeque.reads <= QUEUED + 3
    assert list(engine.scheduler.waiting) == queued[1::2]

    # A freed row admits the next queued request, reading the queue only up to it.
    engine.abort(running[0].request_id)
    count_reads(engine)
    engine.step()
    assert queued[1].output_ids and queued[1].finished and CountingDeque.reads <= 3
    assert list(engine.scheduler.waiting) == queued[3::2]
    for r in queued[3::2] + running[1:]:
        engine.abort(r.request_id)
    engine.step()
    assert not engine.has_work() and engine.kv.num_free == engine.kv.rows
    assert engine.scheduler.find(queued[3].request_id) is None
