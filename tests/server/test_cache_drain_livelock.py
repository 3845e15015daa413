"""Anti-starvation drains must not livelock: with loads slower than drain_after, an adapter
that has just loaded must serve before it can be drained, or the slots swap adapters for
ever and no request finishes."""

from __future__ import annotations

import time

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams

from .test_adapter_cache import write_adapter
from .test_adapter_cache_http import PROMPT, settings


def test_loads_slower_than_drain_after_still_serve_every_request(tmp_path):
    for i, name in enumerate("ab"):
        write_adapter(tmp_path / name, seed=i)
    engine = LLMEngine.from_settings(settings(tmp_path, max_loras=1))
    try:
        engine.adapters.drain_after = 0.05
        copy = engine.adapters.loader.copy_to_slot

        def slow(*args, **kwargs):
            time.sleep(0.1)  # a load slower than drain_after (a remote fetch, a slow disk)
            return copy(*args, **kwargs)

        engine.adapters.loader.copy_to_slot = slow
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        requests = []
        for name in "ab":
            for _ in range(3):
                req = engine.make_request(PROMPT, params, name)
                engine.add_request(req)
                requests.append(req)
        deadline = time.monotonic() + 30
        while engine.has_work() and time.monotonic() < deadline:
            engine.step()
            if engine.stalled:
                time.sleep(0.005)
        assert all(r.finished and r.finish_reason == "length" for r in requests), \
            [(r.adapter, r.finish_reason) for r in requests]
    finally:
        engine.adapters.close()
