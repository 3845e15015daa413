"""Decode look-ahead (settings.decode_look_ahead): each decode step is launched before the
tokens of the step before it reach the host, on those tokens still on the device.

On CUDA that lets the host's work between steps run while the GPU decodes; on the CPU a
launch runs at once, so the engine leaves it off there, and these tests turn it on to check
its bookkeeping: a churning workload (arrivals between steps, more requests than KV rows,
chunked prefill, stop strings, EOS, max_tokens and the context length, seeded sampling,
penalties, logprobs, an abort) gives, step by step, the same outputs with the look-ahead as
without, and every step that decodes takes the logits the step before launched."""

from __future__ import annotations

import random

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

from .conftest import ADAPTERS


def engine_for(base_dir, adapters: dict, look_ahead: bool) -> LLMEngine:
    settings = ServerSettings(model=str(base_dir), device="cpu", dtype="float32", max_num_seqs=4,
                              max_model_len=48, max_loras=8, max_lora_rank=16, max_prefill_tokens=12,
                              enable_chunked_prefill=True, seed=5,
                              lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    engine = LLMEngine.from_settings(settings)
    engine.look_ahead = look_ahead
    return engine


def workload(seed: int) -> list[tuple[int, list[int], SamplingParams, str | None]]:
    """(step to arrive at, prompt, params, adapter): 14 requests over the base and every
    adapter, of every finishing kind."""
    rng = random.Random(seed)
    names = [None, *ADAPTERS]
    kinds = [
        dict(max_tokens=9, temperature=0, ignore_eos=True),
        dict(max_tokens=None, temperature=0),  # the whole context (48 tokens), or EOS
        dict(max_tokens=7, temperature=0.9, top_p=0.8, seed=3),
        dict(max_tokens=8, temperature=1.2, top_k=5, seed=4, presence_penalty=1.5, frequency_penalty=0.5),
        dict(max_tokens=6, temperature=0, logprobs=3),
        dict(max_tokens=12, temperature=0, stop=["e", "a "]),
        dict(max_tokens=1, temperature=0),  # done with the token its prefill samples
    ]
    out = []
    for i in range(14):
        prompt = [1] + [rng.randrange(3, 320) for _ in range(rng.randrange(3, 20))]
        kind = dict(kinds[i % len(kinds)])
        kind["max_tokens"] = kind["max_tokens"] or 48 - len(prompt)
        out.append((rng.randrange(0, 12), prompt, SamplingParams(**kind), names[i % len(names)]))
    return sorted(out, key=lambda w: w[0])


def rounded(logprobs, digits: int = 4) -> tuple:
    """Logprobs to `digits` decimals: a look-ahead may decode its rows in another batch size
    than the step would have (a row joining in between), and a matmul of another shape may
    round the last bits differently; the tokens are compared exactly."""
    return tuple((round(t.logprob, digits), tuple((i, round(v, digits)) for i, v in t.top)) for t in logprobs or ())


def run(engine: LLMEngine, work, abort_at: int = 6) -> list[list[tuple]]:
    """Each step's outputs, in order, as plain tuples; at step `abort_at` the first decoding
    request (by id) is aborted."""
    pending = list(work)
    steps: list[list[tuple]] = []
    step = 0
    ids = {}
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, prompt, params, adapter = pending.pop(0)
            req = engine.make_request(prompt, params, adapter, request_id=f"r{len(ids)}")
            ids[req.request_id] = req
            engine.add_request(req)
        if step == abort_at:
            decoding = sorted(r.request_id for r in engine.scheduler.running.values() if r.output_ids)
            assert decoding, "nothing to abort"
            engine.abort(decoding[0])
        outs = engine.step()
        steps.append(sorted((o.request_id, tuple(o.token_ids), o.text, o.finish_reason,
                             rounded(o.logprobs), o.completion_tokens) for o in outs))
        step += 1
        assert step < 400, "the workload does not finish"
    return steps


def test_look_ahead_gives_the_same_outputs_step_by_step(hf_llama, llama_adapters):
    work = workload(21)
    plain = run(engine_for(hf_llama, llama_adapters, look_ahead=False), work)
    engine = engine_for(hf_llama, llama_adapters, look_ahead=True)
    used = []
    original = engine.decoder.run

    def counting_run(running, span, sampled=None):
        used.append(sampled is not None)
        return original(running, span, sampled)

    engine.decoder.run = counting_run
    ahead = run(engine, work)
    assert ahead == plain
    reasons = {o[3] for step in plain for o in step}
    assert {"stop", "length", "abort"} <= reasons  # the workload ends requests every way
    # Every decode launched after the first is a look-ahead, and none went unused because a
    # step decoded a row it did not cover.
    assert engine.look_ahead_misses == 0
    assert used.count(False) <= 2 and used.count(True) > 20 and engine.look_ahead_hits > 20


def test_look_ahead_is_on_by_default_and_only_on_cuda():
    assert ServerSettings(dummy_weights="tiny").decode_look_ahead is True
    off = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--no-decode-look-ahead"])
    assert off.decode_look_ahead is False
    engine = LLMEngine.from_settings(ServerSettings(dummy_weights="tiny", device="cpu", dtype="float32",
                                                    max_num_seqs=2, max_model_len=32, warmup=False))
    assert engine.look_ahead is False  # a CPU launch runs at once: nothing to overlap


def test_look_ahead_behind_http_serves_what_waiting_does(hf_llama, llama_adapters):
    """Concurrent completions over real HTTP (streaming and not, the base and every adapter,
    one client leaving mid-stream) return the same texts with the look-ahead as without."""
    import concurrent.futures
    import json

    import httpx

    from .conftest import serve_tiny_llama

    rng = random.Random(4)
    jobs = [dict(model=name, prompt=[1] + [rng.randrange(3, 320) for _ in range(5 + 3 * i)], max_tokens=6 + 2 * i,
                 temperature=0, ignore_eos=True, stream=i % 2 == 1)
            for i, name in enumerate(["tiny-llama", *ADAPTERS, "tiny-llama", *ADAPTERS])]

    def ask(url: str, job: dict) -> str:
        with httpx.Client(base_url=url, timeout=60) as client:
            if not job["stream"]:
                return client.post("/v1/completions", json=job).json()["choices"][0]["text"]
            text = ""
            with client.stream("POST", "/v1/completions", json=job) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

    def leave_mid_stream(url: str) -> None:
        job = dict(jobs[1], max_tokens=40)
        with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions", json=job) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    return

    texts = {}
    for look_ahead in (False, True):
        with serve_tiny_llama(hf_llama, llama_adapters) as server:
            server.engine.look_ahead = look_ahead
            with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
                leaver = pool.submit(leave_mid_stream, server.url)
                futures = [pool.submit(ask, server.url, job) for job in jobs]
                texts[look_ahead] = [f.result() for f in futures]
                leaver.result()
            assert server.engine.look_ahead_misses == 0
            assert (server.engine.look_ahead_hits > 10) == look_ahead
    assert texts[True] == texts[False] and all(texts[False])
