"""Prefix caching (--enable-prefix-caching, on by default): a prompt whose first tokens a KV
row holds (of the same adapter slot and load, or the base) has them copied from that row,
not prefilled.

The index: matches by whole blocks, then token by token; keys kept apart; a hash collision
is a miss; `keep` extends, `forget` drops. The engine: greedy outputs with the cache equal
those without it (the tiny HF Llama and its PEFT adapters, whose outputs test_parity holds
equal to HF + peft) for a system prompt shared by requests of one adapter, the next turn of
a chat (its answer is cached too), chunked prefill; no match across adapters, the base, or a
slot loaded with another adapter since; a free row keeps its keys while other rows decode
over it; echo prompts with logprobs are prefilled whole; the counters."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.server.config import named_shape
from loraplex.server.engine import LLMEngine
from loraplex.server.kv_cache import KVCache
from loraplex.server.prefix_cache import BLOCK, PrefixCache, key_hash
from loraplex.server.sampling import SamplingParams
from loraplex.server.scheduler import PrefillChunk
from loraplex.server.settings import ServerSettings

GREEDY = dict(temperature=0, ignore_eos=True)


# -- the index -----------------------------------------------------------------------------------


def small_cache(rows: int = 4, max_len: int = 128) -> PrefixCache:
    return PrefixCache(KVCache(named_shape("tiny"), rows, max_len, torch.device("cpu"), torch.float32))


def test_match_takes_whole_blocks_then_tokens_and_keeps_keys_apart():
    cache = small_cache()
    held = list(range(100, 140))  # 40 tokens: 2 whole blocks and 8 more
    cache.keep(2, ("a",), held)
    prompt = held[:37] + [7, 7, 7]
    assert cache.match(("a",), prompt, len(prompt) - 1) == (2, 37)
    assert cache.match(("b",), prompt, len(prompt) - 1) == (-1, 0)  # another adapter
    assert cache.match(("a",), held[:BLOCK - 1] + [1], BLOCK) == (-1, 0)  # under one block
    assert cache.match(("a",), held, 20) == (2, 20)  # the limit holds
    assert cache.match(("a",), [1] + held[1:], 39) == (-1, 0)  # the first block differs
    assert cache.kv.kept[2] == 40 and cache.kv.kept[1] == 0
    # Of the rows of the longest whole-block prefix, the one holding the most past it wins
    # (row 3 was used last, row 2 holds 7 more); among equals the one used last.
    cache.keep(0, ("a",), held[:BLOCK])
    cache.keep(3, ("a",), held[:32] + [5] * 8)
    assert cache.match(("a",), held, 39) == (2, 39)
    assert cache.match(("a",), held[:32] + [5] * 8, 39) == (3, 39)
    assert cache.match(("a",), held[:32] + [9], 32) == (3, 32)  # row 3 was used last
    assert cache.match(("a",), held[:32] + [9], 32, touch=False) == (3, 32)
    cache.match(("a",), held[:37], 36)  # row 2 is used now
    assert cache.match(("a",), held[:32] + [9], 32, touch=False)[0] == 2
    used = cache.rows[2].used
    assert cache.match(("a",), held, 39, touch=False) == (2, 39) and cache.rows[2].used == used


def test_a_new_request_gets_an_empty_free_row_then_the_least_recently_used():
    cache = small_cache()
    kv = cache.kv
    rows = [kv.alloc() for _ in range(4)]
    for row in rows:
        cache.keep(row, ("a",), [row] * 20)
    kv.free(1), kv.free(3)
    cache.forget(3)
    assert cache.victim() == 3  # holds nothing
    kv.free(0)
    cache.match(("a",), [1] * 20, 19)  # row 1 used after row 0
    kv.alloc(3)
    assert cache.victim() == 0 and cache.victim(donor=0) == 1


def test_a_hash_collision_is_a_miss_and_forget_drops_the_row():
    cache = small_cache()
    cache.keep(1, ("a",), list(range(32)))
    other = [9] * 32
    # Make the other prompt's first block hash to the held row's, as a collision would.
    h = hash((key_hash(("a",)), tuple(other[:BLOCK])))
    cache._index[h] = {1}
    cache.rows[1].hashes.append(h)
    assert cache.match(("a",), other, 31) == (-1, 0)
    cache.forget(1)
    assert cache.rows == {} and cache._index == {} and cache.kv.kept[1] == 0


def test_keep_extends_a_row_and_caps_it_below_the_last_position():
    cache = small_cache(max_len=40)
    cache.keep(0, ("a",), list(range(20)))
    first = list(cache.rows[0].hashes)
    cache.keep(0, ("a",), list(range(60)))  # a finished request: prompt and outputs
    assert cache.rows[0].hashes[:1] == first and len(cache.rows[0].tokens) == 39 == cache.kv.kept[0]
    assert cache.match(("a",), list(range(60)), 59) == (0, 39)
    cache.keep(0, ("b",), list(range(20)))  # rewritten under another key: the old blocks go
    assert cache.match(("a",), list(range(60)), 59) == (-1, 0)


def test_admit_copies_the_prefix_into_the_lowest_free_row():
    cache = small_cache()
    kv = cache.kv
    for row in range(4):
        assert kv.alloc() == row
    for t in kv.k + kv.v:
        t.normal_()
    cache.keep(2, ("a",), list(range(40)))
    for row in (0, 2):
        kv.free(row)
    before = [t[2, :, :30].clone() for t in kv.k + kv.v]
    row, n = cache.admit(("a",), list(range(30)) + [1, 2])
    assert (row, n) == (0, 30) and cache.hits == 30 and cache.queries == 32
    for want, t in zip(before, kv.k + kv.v):
        assert torch.equal(t[0, :, :30], want)
    # The new row holds the copied prefix now; a prompt of every token's logprob matches nothing.
    assert cache.match(("a",), list(range(30)), 29)[1] == 29
    assert cache.admit(("a",), list(range(40)), match=False) == (2, 0) and 2 not in cache.rows


# -- the engine ----------------------------------------------------------------------------------


def engine_for(base_dir, adapters, **overrides) -> LLMEngine:
    fields = dict(model=str(base_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=192,
                  max_loras=4, max_lora_rank=16, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    return LLMEngine.from_settings(ServerSettings(**(fields | overrides)))


def run(engine: LLMEngine, batch: list[tuple[list[int], str | None, int]]) -> list:
    """Run (prompt, adapter, max_tokens) requests added together to completion; their Requests."""
    reqs = [engine.make_request(p, SamplingParams(max_tokens=m, **GREEDY), a) for p, a, m in batch]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    return reqs


@pytest.fixture(scope="module")
def engines(hf_llama, llama_adapters):
    return (engine_for(hf_llama, llama_adapters),
            engine_for(hf_llama, llama_adapters, enable_prefix_caching=False))


def both(engines, batch):
    """The batch on the caching engine and on the one without; outputs equal; the cached requests."""
    cached, plain = (run(e, batch) for e in engines)
    assert [r.output_ids for r in cached] == [r.output_ids for r in plain]
    assert all(r.cached_tokens == 0 for r in plain)
    return cached


def test_shared_prompts_and_chat_turns_hit_and_answer_the_same(engines):
    rng = random.Random(5)
    system = [1] + [rng.randrange(3, 320) for _ in range(40)]
    q1, q2, q3 = ([rng.randrange(3, 320) for _ in range(n)] for n in (6, 9, 5))
    (first,) = both(engines, [(system + q1, "all-r16", 8)])
    assert first.cached_tokens == 0
    # The same system prompt: found for that adapter, not for another one or the base.
    same, other, base = both(engines, [(system + q2, "all-r16", 6), (system + q2, "qv-r8", 6),
                                       (system + q2, None, 6)])
    assert same.cached_tokens >= len(system) and other.cached_tokens == 0 and base.cached_tokens == 0
    # The chat's next turn: its prompt is the last one, its answer and a new question; all but
    # the answer's last token (never decoded) is found.
    turn = system + q1 + first.output_ids + q3
    (second,) = both(engines, [(turn, "all-r16", 6)])
    assert second.cached_tokens == len(system + q1) + len(first.output_ids) - 1
    # A prompt held whole: all but its last token is found, which computes the first logits.
    (again,) = both(engines, [(turn, "all-r16", 4)])
    assert again.cached_tokens == len(turn) - 1


@pytest.mark.parametrize("chunked", [False, True])
def test_requests_admitted_together_share_one_prefill(hf_llama, llama_adapters, chunked):
    """A burst of one system prompt (and n choices of one prompt) added at once: the first of
    them is prefilled, the others wait a step and copy what it computed; a prompt that shares
    less than half of itself with it, or another adapter's, goes at once."""
    rng = random.Random(11)
    system = [1] + [rng.randrange(3, 320) for _ in range(47)]
    own = [[rng.randrange(3, 320) for _ in range(5)] for _ in range(2)]
    short = system[:20] + [rng.randrange(3, 320) for _ in range(30)]  # 20 of 50 in common
    overrides = dict(enable_chunked_prefill=True, max_prefill_tokens=64) if chunked else {}
    engines = [engine_for(hf_llama, llama_adapters, max_num_seqs=6, enable_prefix_caching=on, **overrides)
               for on in (True, False)]
    first, b, n1, n2, half, other = both(engines, [
        (system + own[0], "all-r16", 4), (system + own[1], "all-r16", 4), (system + own[0], "all-r16", 3),
        (system + own[0], "all-r16", 5), (short, "all-r16", 4), (system + own[0], "qv-r8", 4)])
    assert first.cached_tokens == 0 and other.cached_tokens == 0 and half.cached_tokens == 0
    assert b.cached_tokens >= len(system) and n1.cached_tokens == n2.cached_tokens == len(system + own[0]) - 1
    assert engines[0].metrics.prompt_tokens._value.get() < engines[1].metrics.prompt_tokens._value.get() - 2 * len(system)


def test_a_request_waits_for_a_shared_prefill_once():
    """The scheduler's rule alone: of requests picked together under one key, a later one with
    at least half of its prompt (and a block) in common with an earlier one waits a step;
    once a row holds that part (the first one admitted), it is admitted."""
    from loraplex.server.request import Request
    from loraplex.server.scheduler import Scheduler

    cache = small_cache(rows=4)
    sched = Scheduler(cache.kv, 4096, prefixes=cache, prefix_key=lambda r: r.adapter)
    prompt = list(range(3, 43))

    def req(i, tokens, adapter="a"):
        return Request(f"r{i}", tokens, SamplingParams(max_tokens=2), adapter, seed=0)

    reqs = [req(0, prompt), req(1, prompt[:39] + [1]), req(2, prompt, "b"), req(3, prompt[:17] + [1] * 23)]
    for r in reqs:
        sched.add(r)
    assert [r.request_id for r in sched.admit()] == ["r0", "r2", "r3"]
    sched.prefilled([c for c in (PrefillChunk(r, 0, len(r.prompt_ids)) for r in (reqs[0], reqs[2], reqs[3]))])
    assert [r.request_id for r in sched.admit()] == ["r1"] and reqs[1].cached_tokens == 39


def test_a_free_row_keeps_its_keys_while_other_rows_decode(hf_llama, llama_adapters):
    """Request A finishes in row 0 after 2 tokens while B (row 1) decodes 30 more: each of those
    steps runs row 0 as a free row. C, A's prompt and more, then finds A's row whole (before
    free rows were written at position 0, and the copy read a wrong key there)."""
    rng = random.Random(8)
    prompt_a = [1] + [rng.randrange(3, 320) for _ in range(35)]
    prompt_b = [1] + [rng.randrange(3, 320) for _ in range(12)]
    engines = [engine_for(hf_llama, llama_adapters, enable_prefix_caching=on) for on in (True, False)]
    a, b = both(engines, [(prompt_a, "patterns", 2), (prompt_b, "qv-r8", 32)])
    assert (a.row, b.row) == (-1, -1) and engines[0].prefixes.rows.keys() == {0, 1}
    (c,) = both(engines, [(prompt_a + a.output_ids[:1] + [5, 6, 7], "patterns", 8)])
    # A's prompt and first token, copied out of row 0 (which keeps them) into an empty row.
    held = engines[0].prefixes.rows
    assert c.cached_tokens == len(prompt_a) + 1
    assert held[2].tokens[: len(c.prompt_ids)] == c.prompt_ids and held[0].tokens == prompt_a + a.output_ids[:1]


def test_no_match_once_the_slot_is_loaded_with_another_adapter(hf_llama, llama_adapters):
    engine = engine_for(hf_llama, llama_adapters)
    prompt = [1] + list(range(10, 50))
    (first,) = run(engine, [(prompt, "qv-r8", 3)])
    slot = first.slot
    engine.adapters.unload("qv-r8")
    engine.adapters.load("other", llama_adapters["all-r16"])  # into the slot qv-r8 left
    (second,) = run(engine, [(prompt, "other", 3)])
    assert second.slot == slot and second.cached_tokens == 0


def test_chunked_prefill_starts_after_the_cached_prefix(hf_llama, llama_adapters):
    engines = [engine_for(hf_llama, llama_adapters, enable_chunked_prefill=True, max_prefill_tokens=8,
                          enable_prefix_caching=on) for on in (True, False)]
    prompt = [1] + list(range(60, 100))
    both(engines, [(prompt, "mlp-rslora-r4", 4)])
    (second,) = both(engines, [(prompt[:33] + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], "mlp-rslora-r4", 4)])
    assert second.cached_tokens == 33


def test_echo_prompt_logprobs_are_prefilled_whole_and_the_counters_count(engines):
    engine = engines[0]
    prompt = [1] + list(range(120, 160))
    run(engine, [(prompt, None, 2)])
    queries, hits = engine.metrics.prefix_queries._value.get(), engine.metrics.prefix_hits._value.get()
    req = engine.make_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs_top=0, **GREEDY), None)
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert req.cached_tokens == 0 and len(req.prompt_logprobs) == len(prompt)
    (hit,) = run(engine, [(prompt, None, 2)])
    assert hit.cached_tokens == len(prompt) - 1
    assert engine.metrics.prefix_queries._value.get() == queries + len(prompt)
    assert engine.metrics.prefix_hits._value.get() == hits + len(prompt) - 1


def test_the_flag_parses_and_is_on_by_default():
    assert ServerSettings(dummy_weights="tiny").enable_prefix_caching is True
    off = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--no-enable-prefix-caching"])
    assert off.enable_prefix_caching is False


def test_an_adapter_paged_out_and_back_in_finds_its_prefixes(hf_llama, llama_adapters):
    """One slot, two adapters taking turns: a's prompt was kept under the slot and its load
    count, so a's next request after b had the slot found nothing. Keyed by the files the
    weights were read from, a's prefix outlives the slot; b, loaded into the same slot, never
    matches a's row; and the answers are those of an engine with no prefix caching."""
    engines = [engine_for(hf_llama, {n: llama_adapters[n] for n in ("qv-r8", "all-r16")}, max_loras=1,
                          max_cpu_loras=max_cpu, enable_prefix_caching=on)
               for on, max_cpu in ((True, 0), (False, 0), (True, 2))]
    prompt = [1] + list(range(10, 50))
    # max_cpu_loras 0: host copies for as many adapters as slots (one: a's gives way to b's, so
    # a reloads from disk); 2: both stay in host memory (a reloads from there).
    for cached in (engines[0], engines[2]):
        plain = engines[1]
        evictions, host_hits = (cached.adapters.metrics.evictions.labels("gpu"),
                                cached.adapters.metrics.hits.labels("host"))
        before, host_before = evictions._value.get(), host_hits._value.get()
        turns = [(prompt, "qv-r8"), (prompt, "all-r16"), (prompt + [7, 8, 9], "qv-r8"), (prompt + [5], "all-r16")]
        got = []
        for p, name in turns:
            (c,) = run(cached, [(p, name, 3)])
            (r,) = run(plain, [(p, name, 3)])
            assert c.output_ids == r.output_ids, name
            got.append(c.cached_tokens)
        assert got[:2] == [0, 0]  # b in a's slot: not a's prefix
        assert got[2] == len(prompt) and got[3] == len(prompt)  # each found its own after a reload
        assert evictions._value.get() - before in (3, 4)  # each turn paged the other out (the first too, if b was in)
        assert (host_hits._value.get() > host_before) == (cached is engines[2])
