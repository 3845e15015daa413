"""A request's stop_token_ids are checked against every token it samples, on the engine
thread, between decode steps that every tenant's rows share. The check must not grow with
the list: as a list, a request with a million ids (an 8 MB body) cost 26 ms per row per step
on a 2-core machine, the whole batch's steps with it (a GPU decode step is ~7 ms)."""

from __future__ import annotations

import time

from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams

from .test_api_stop_tokens import CharTokenizer


def test_a_long_stop_token_id_list_costs_the_step_nothing():
    ids = list(range(1000, 2_001_000))  # none of them is sampled below
    req = Request.new("r", [1, 2], SamplingParams(max_tokens=1000, stop_token_ids=ids), None, 0, CharTokenizer())
    plain = Request.new("p", [1, 2], SamplingParams(max_tokens=1000), None, 0, CharTokenizer())

    def cost(r: Request) -> float:
        t0 = time.perf_counter()
        for t in range(200):
            r.append(97 + t % 26, (), 10_000)
        return time.perf_counter() - t0

    base, long = cost(plain), cost(req)
    assert not req.finished and len(req.output_ids) == 200
    assert long < base + 0.2, (long, base)  # as a list: 5-13 s here
    assert Request.new("s", [1], SamplingParams(stop_token_ids=ids), None, 0, CharTokenizer()).params.stop_token_ids == ids
    req.append(1500, (), 10_000)  # one of them ends it
    assert req.finished and req.finish_reason == "stop"
