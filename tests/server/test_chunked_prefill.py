"""--enable-chunked-prefill: a prompt longer than the step's --max-prefill-tokens budget is
prefilled in chunks over several steps while the running rows keep decoding.

The model: chunks (PrefillSeq.pos > 0) give the whole prefill's last-token logits and K/V.
The scheduler: the budget, the order of chunks, echo prompts never chunked. The engine:
greedy outputs of a mixed batch equal HF transformers + peft, a running request advances one
token on every step of another's chunked prefill, an abort mid-prefill frees the row."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.server.config import named_shape
from loraplex.server.engine import LLMEngine
from loraplex.server.kv_cache import KVCache
from loraplex.server.model import PrefillSeq
from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams
from loraplex.server.scheduler import Scheduler
from loraplex.server.settings import ServerSettings

from .conftest import ADAPTERS
from .test_ops import tiny_model
from .test_parity import hf_greedy

BUDGET = 8
GREEDY = dict(temperature=0, ignore_eos=True)


# -- the model -----------------------------------------------------------------------------------


def test_prefill_in_chunks_equals_one_whole_prefill():
    """Two prompts (adapter slots 0 and 1, a base one beside them) prefilled whole into rows
    0, 2, 4 and in chunks (8 and 5 tokens, packed together in each call) into rows 1, 3: the
    same last-token logits and the same K/V at every prompt position."""
    model = tiny_model(torch.float32, fused=False)
    gen = torch.Generator().manual_seed(3)
    lengths, slots_of, chunk_of = (37, 23), (0, 1), (8, 5)
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=gen) for n in lengths]
    base = torch.randint(3, model.cfg.vocab_size, (11,), generator=gen)

    tokens = torch.cat([*prompts, base])
    slots = torch.tensor([0] * 37 + [1] * 23 + [-1] * 11, dtype=torch.int32)
    seqs = [PrefillSeq(0, 0, 37), PrefillSeq(2, 37, 23), PrefillSeq(4, 60, 11)]
    whole = model.prefill(tokens, slots, seqs)

    last: dict[int, torch.Tensor] = {}
    done = [0, 0]
    while any(d < n for d, n in zip(done, lengths)):
        ids, token_slots, seqs, which = [], [], [], []
        for i, (row, n) in enumerate(zip((1, 3), lengths)):
            if done[i] == n:
                continue
            m = min(chunk_of[i], n - done[i])
            seqs.append(PrefillSeq(row, sum(len(t) for t in ids), m, pos=done[i]))
            ids.append(prompts[i][done[i]: done[i] + m])
            token_slots += [slots_of[i]] * m
            which.append(i)
            done[i] += m
        logits = model.prefill(torch.cat(ids), torch.tensor(token_slots, dtype=torch.int32), seqs)
        for j, i in enumerate(which):
            if done[i] == lengths[i]:
                last[i] = logits[j]
    for i, (whole_row, chunk_row) in enumerate(((0, 1), (2, 3))):
        torch.testing.assert_close(last[i], whole[i], atol=1e-5, rtol=1e-5)
        n = lengths[i]
        for cache in model.kv.k + model.kv.v:
            torch.testing.assert_close(cache[chunk_row, :, :n], cache[whole_row, :, :n], atol=1e-5, rtol=1e-5)
    # The adapters matter, or equal logits would prove little about the chunks' slots.
    assert not torch.allclose(whole[0], model.prefill(prompts[0], torch.full((37,), -1, dtype=torch.int32),
                                                      [PrefillSeq(1, 0, 37)])[0], atol=1e-3)


def test_a_later_chunk_sees_its_rows_cached_keys():
    """A chunk at pos > 0 attends to the row's keys before pos: change them and its logits change."""
    model = tiny_model(torch.float32, fused=False)
    ids = torch.randint(3, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(5))
    slots = torch.full((20,), -1, dtype=torch.int32)
    model.prefill(ids[:12], slots[:12], [PrefillSeq(0, 0, 12)])
    first = model.prefill(ids[12:], slots[12:], [PrefillSeq(0, 0, 8, pos=12)])
    model.kv.v[0][0, :, 3] += 1.0  # one cached value of layer 0
    second = model.prefill(ids[12:], slots[12:], [PrefillSeq(0, 0, 8, pos=12)])
    assert not torch.allclose(first, second, atol=1e-4)


def test_prompt_logprobs_need_the_whole_prompt():
    model = tiny_model(torch.float32, fused=False)
    ids = torch.arange(3, 11)
    with pytest.raises(ValueError, match="whole prompt"):
        model.prefill(ids, torch.full((8,), -1, dtype=torch.int32), [PrefillSeq(0, 0, 8, pos=4)],
                      prompt_logprobs={0: 1})


# -- the scheduler -------------------------------------------------------------------------------


def req(name: str, n: int, echo_logprobs: bool = False) -> Request:
    params = SamplingParams(echo=True, logprobs=1) if echo_logprobs else SamplingParams()
    return Request(name, [1] * n, params, None, 0)


def plan(sched: Scheduler) -> list[tuple[str, int, int]]:
    """One step's chunks as (request, pos, length), marking them computed as the engine does."""
    chunks = sched.schedule()
    for c in chunks:
        c.req.num_computed = c.pos + c.length
    return [(c.req.request_id, c.pos, c.length) for c in chunks]


def make_scheduler(chunked: bool = True, rows: int = 4) -> Scheduler:
    kv = KVCache(named_shape("tiny"), rows=rows, max_len=64, device=torch.device("cpu"), dtype=torch.float32)
    return Scheduler(kv, max_prefill_tokens=BUDGET, chunked_prefill=chunked)


def test_schedule_cuts_the_budget_chunk_by_chunk():
    sched = make_scheduler()
    for r in (req("a", 20), req("b", 30), req("c", 3)):
        sched.add(r)
    assert plan(sched) == [("a", 0, 8)]
    assert [r.request_id for r in sched.running.values()] == ["a"]  # b, c still queued
    assert plan(sched) == [("a", 8, 8)]
    assert plan(sched) == [("a", 16, 4), ("b", 0, 4)]  # a's last chunk, then b starts
    assert plan(sched) == [("b", 4, 8)]
    assert plan(sched) == [("b", 12, 8)]
    assert plan(sched) == [("b", 20, 8)]
    assert plan(sched) == [("b", 28, 2), ("c", 0, 3)]
    assert plan(sched) == [] and not sched.waiting


def test_prompt_logprobs_requests_are_never_chunked():
    """An echo prompt goes whole: with other chunks in the step it waits (and FCFS holds the
    queue behind it), alone it goes however long."""
    sched = make_scheduler()
    for r in (req("a", 10), req("echo", 12, echo_logprobs=True), req("c", 2)):
        sched.add(r)
    assert plan(sched) == [("a", 0, 8)]
    assert plan(sched) == [("a", 8, 2)]  # echo (12 > 6 left) does not fit; c does not overtake
    assert plan(sched) == [("echo", 0, 12)]
    assert plan(sched) == [("c", 0, 2)]


def test_rows_bound_admission_and_off_means_whole_prompts():
    sched = make_scheduler(rows=1)
    for r in (req("a", 3), req("b", 3)):
        sched.add(r)
    assert plan(sched) == [("a", 0, 3)]  # b fits the budget but has no row
    sched = make_scheduler(chunked=False)
    for r in (req("a", 20), req("b", 30)):
        sched.add(r)
    assert plan(sched) == [("a", 0, 20)]  # the head alone, however long; b over the budget waits


# -- the engine ----------------------------------------------------------------------------------


def chunked_engine(base_dir, adapters: dict, chunked: bool = True) -> LLMEngine:
    settings = ServerSettings(model=str(base_dir), device="cpu", dtype="float32", max_num_seqs=8,
                              max_model_len=128, max_loras=8, max_lora_rank=16,
                              max_prefill_tokens=BUDGET, enable_chunked_prefill=chunked,
                              lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    return LLMEngine.from_settings(settings)


def test_flag_parses_and_is_off_by_default():
    assert ServerSettings(dummy_weights="tiny").enable_chunked_prefill is False
    on = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--enable-chunked-prefill"])
    assert on.enable_chunked_prefill is True


def test_mixed_batch_in_chunks_matches_hf_peft(hf_llama, llama_adapters):
    names = ["base", *ADAPTERS]
    rng = random.Random(11)
    prompts = {name: [1] + [rng.randrange(3, 320) for _ in range(19 + 5 * i)] for i, name in enumerate(names)}
    engine = chunked_engine(hf_llama, llama_adapters)
    max_new = 6
    reqs = {}
    for name, prompt in prompts.items():
        reqs[name] = engine.make_request(prompt, SamplingParams(max_tokens=max_new, **GREEDY),
                                         None if name == "base" else name)
        engine.add_request(reqs[name])
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert sum(not r.output_ids for r in engine.scheduler.running.values()) <= 2  # budget-bound
    # Every prompt went in chunks: far more steps than prompts' first tokens plus decodes.
    assert steps >= sum(map(len, prompts.values())) // BUDGET
    for name, r in reqs.items():
        assert r.output_ids == hf_greedy(hf_llama, llama_adapters.get(name), prompts[name], max_new), name


def test_running_request_decodes_between_chunks(hf_llama, llama_adapters):
    """A 40-token prompt (adapter all-r16) prefills in 5 steps of 8 tokens; on each of them the
    already running request gains exactly one token, and the long one holds its row from its
    first chunk on but has no token until its last."""
    engine = chunked_engine(hf_llama, llama_adapters)
    rng = random.Random(12)
    short_prompt = [1] + [rng.randrange(3, 320) for _ in range(5)]
    long_prompt = [1] + [rng.randrange(3, 320) for _ in range(39)]
    short = engine.make_request(short_prompt, SamplingParams(max_tokens=12, **GREEDY), "qv-r8")
    engine.add_request(short)
    engine.step()
    assert len(short.output_ids) == 1
    long = engine.make_request(long_prompt, SamplingParams(max_tokens=4, **GREEDY), "all-r16")
    engine.add_request(long)
    for step in range(1, 6):
        before = len(short.output_ids)
        outputs = {o.request_id: o for o in engine.step()}
        assert len(short.output_ids) == before + 1, step
        assert engine.scheduler.running.get(long.row) is long and long.num_computed == min(8 * step, 40)
        assert len(long.output_ids) == (1 if step == 5 else 0), step
        assert (long.request_id in outputs) == (step == 5)  # no empty outputs mid-prefill
    assert "all-r16" in engine.lora_state()[0]
    while engine.has_work():
        engine.step()
    assert short.output_ids == hf_greedy(hf_llama, llama_adapters["qv-r8"], short_prompt, 12)
    assert long.output_ids == hf_greedy(hf_llama, llama_adapters["all-r16"], long_prompt, 4)


def test_without_the_flag_a_long_prompt_prefills_in_one_step(hf_llama, llama_adapters):
    engine = chunked_engine(hf_llama, llama_adapters, chunked=False)
    long = engine.make_request([1] + list(range(3, 42)), SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request(long)
    engine.step()
    assert long.output_ids and long.num_computed == 40


def test_abort_mid_prefill_frees_row_and_adapter(hf_llama, llama_adapters):
    engine = chunked_engine(hf_llama, llama_adapters)
    long = engine.make_request([1] + list(range(3, 33)), SamplingParams(max_tokens=2, **GREEDY), "patterns")
    engine.add_request(long)
    engine.step()
    assert long.num_computed == BUDGET and engine.kv.num_free == engine.kv.rows - 1
    engine.abort(long.request_id)
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["abort"] and not engine.has_work()
    assert engine.kv.num_free == engine.kv.rows and engine.lora_state() == ([], [])
    assert not engine.scheduler.running and not engine.scheduler.waiting
