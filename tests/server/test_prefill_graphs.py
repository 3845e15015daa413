"""Prefill steps padded to a bucket (server/prefill_graphs.py) against `LlamaModel.prefill`:
the same logits and the same K/V, nothing written but the step's positions and the scratch
one. On the CPU the padded step runs eagerly through Triton's interpreter; on a GPU
(`TRITON_INTERPRET=0`) the same tests capture and replay its CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.model import PrefillSeq
from loraplex.server.ops.prefill_attention import PrefillPlan
from loraplex.server.prefill_graphs import PREFILL_GRAPH_MAX_TOKENS, PrefillGraphs, token_buckets

from .test_ops import DEVICE, DTYPES, close, rel_error, tiny_model

pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET is off and there is no CUDA device")
GRAPHS = DEVICE == "cuda"


def test_buckets_double_up_to_the_step_and_stop_at_the_cap():
    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 32, 64, 128]
    assert token_buckets(10**6)[-1] == PREFILL_GRAPH_MAX_TOKENS


def test_a_padded_plan_keeps_the_step_and_parks_the_rest():
    flat = PrefillPlan.layout([(0, 3, 0, 2), (3, 2, 10, 0)], block_m=16, tokens=8, num_seqs=3, programs=4,
                              scratch=(0, 47))
    seqs, programs, rows, positions = flat[:16], flat[16:24], flat[24:32], flat[32:]
    assert seqs == [0, 3, 0, 2, 3, 2, 10, 0] + [0] * 8  # two spare prompts of length 0
    assert programs == [0, 0, 1, 0, 3, 0, 3, 0]  # spare programs on a spare prompt
    assert rows == [2, 2, 2, 0, 0, 0, 0, 0] and positions == [0, 1, 2, 10, 11, 47, 47, 47]
    with pytest.raises(ValueError, match="does not fit"):
        PrefillPlan.layout([(0, 40, 0, 1)], block_m=16, tokens=32, num_seqs=1, programs=3)


STEPS = {
    # (row, length, pos, slot) per prompt: whole prompts, one after a cached prefix, a one-token chunk
    "mixed": [(0, 9, 0, 0), (2, 6, 20, 1), (4, 1, 30, -1)],
    "base": [(1, 17, 0, -1), (3, 5, 11, -1)],  # 22 tokens: the 32 bucket
    "one-adapter": [(2, 16, 4, 1)],  # exactly a bucket
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
def test_a_padded_step_gives_the_prefills_logits_and_cache(dtype, step):
    eager, padded = (tiny_model(dtype, fused=True, device=DEVICE) for _ in range(2))
    runner = PrefillGraphs(padded, max_rows=5, max_tokens=64, graphs=GRAPHS)
    gen = torch.Generator().manual_seed(3)
    tokens, slots, seqs = [], [], []
    for row, n, pos, slot in STEPS[step]:
        seqs.append(PrefillSeq(row=row, start=len(tokens), length=n, pos=pos))
        tokens += torch.randint(3, eager.cfg.vocab_size, (n,), generator=gen).tolist()
        slots += [slot] * n
    used = {s for s in slots if s >= 0}
    max_adapters, groups = len(used), eager.lora.groups_of(used) if used else 0
    want = eager.prefill(torch.tensor(tokens, device=DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                         seqs, max_adapters, lora_groups=groups)
    assert runner.takes(len(tokens), len(seqs))
    got = runner.run(tokens, slots, seqs, max_adapters, groups)
    if GRAPHS:
        assert runner.num_graphs == 1
        got = runner.run(tokens, slots, seqs, max_adapters, groups).clone()  # a replay of the captured graph
    assert got.shape == want.shape and not got.isnan().any()
    assert rel_error(got, want) < {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    row, last = runner.scratch
    for kp, ke in zip(padded.kv.k + padded.kv.v, eager.kv.k + eager.kv.v):
        kp, ke = kp.clone(), ke.clone()
        kp[row, :, last] = ke[row, :, last]  # the spare tokens' K/V went there, and only there
        close(kp, ke, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_at_and_across_bucket_edges(seed):
    """Steps of 1 to 5 prompts whose tokens land on a bucket's edge or just past it (16, 17,
    32, 33, 64), each prompt whole or after a cached prefix, over the adapters and the base:
    the padded step's logits and K/V are the prefill's."""
    import random

    rng = random.Random(seed)
    eager, padded = (tiny_model(torch.float32, fused=True, device=DEVICE, max_len=96) for _ in range(2))
    runner = PrefillGraphs(padded, max_rows=5, max_tokens=64, graphs=GRAPHS)
    for total in (16, 17, 32, 33, 64):
        prompts = rng.randint(1, 5)
        cuts = sorted(rng.sample(range(1, total), prompts - 1))
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        tokens, slots, seqs = [], [], []
        for row, n in zip(rng.sample(range(5), prompts), lengths):
            pos = rng.choice([0, 0, rng.randrange(1, eager.kv.max_len - 1 - n)])  # positions < max_len - 1
            seqs.append(PrefillSeq(row=row, start=len(tokens), length=n, pos=pos))
            tokens += [rng.randrange(3, eager.cfg.vocab_size) for _ in range(n)]
            slots += [rng.choice([-1, 0, 1])] * n
        used = {x for x in slots if x >= 0}
        args = (len(used), eager.lora.groups_of(used) if used else 0)
        want = eager.prefill(torch.tensor(tokens, device=DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                             seqs, args[0], lora_groups=args[1])
        got = runner.run(tokens, slots, seqs, *args)
        assert rel_error(got, want) < 1e-5, (total, lengths)
        row, last = runner.scratch
        for kp, ke in zip(padded.kv.k + padded.kv.v, eager.kv.k + eager.kv.v):
            kp = kp.clone()
            kp[row, :, last] = ke[row, :, last]
            close(kp, ke, torch.float32)


def test_steps_it_does_not_take():
    model = tiny_model(torch.float32, fused=True, device=DEVICE)
    runner = PrefillGraphs(model, max_rows=5, max_tokens=40, graphs=GRAPHS)
    assert runner.buckets == [16, 32, 64]
    assert runner.takes(64, 5) and not runner.takes(65, 1)
    assert not runner.takes(6, 6)  # more prompts than rows
    model.prefill_kernel = False  # SDPA per prompt: not this path
    assert not runner.takes(8, 1)


@pytest.mark.skipif(not GRAPHS, reason="captures CUDA graphs")
def test_the_warm_up_captures_every_bucket_without_touching_a_prompts_cache():
    model = tiny_model(torch.float32, fused=True, device=DEVICE)
    runner = PrefillGraphs(model, max_rows=5, max_tokens=40, graphs=True)
    before = [t.clone() for t in model.kv.k + model.kv.v]
    # 3 buckets x (base, adapter buckets 1 and 2 on the one mask)
    assert runner.warm_up([model.lora.held_mask]) == 9
    row, last = runner.scratch
    for t, b in zip(model.kv.k + model.kv.v, before):
        t[row, :, last] = b[row, :, last]
        assert torch.equal(t, b)


def test_the_flag_says_the_largest_step_replayed():
    from loraplex.server.settings import field_docs

    assert f"{PREFILL_GRAPH_MAX_TOKENS:,} tokens" in " ".join(field_docs()["cuda_graphs"].split())


@pytest.mark.skipif(GRAPHS, reason="the CPU's padded eager path; on CUDA the engine's CUDA tests replay the graphs")
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix-cache"])
def test_an_engine_that_pads_its_prefills_matches_hf_peft(hf_llama, llama_adapters, prefix_caching):
    """The engine with its prefill steps padded to buckets (as a graph runs them, here eagerly
    in Triton's interpreter, with the fused ops): a mixed batch over every adapter and the
    base, prompts in chunks, two sharing a system prompt, gives HF transformers + peft's
    greedy tokens, request by request."""
    import random

    from loraplex.server.engine import LLMEngine
    from loraplex.server.sampling import SamplingParams
    from loraplex.server.settings import ServerSettings

    from .conftest import ADAPTERS
    from .test_parity import hf_greedy

    settings = ServerSettings(model=str(hf_llama), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128,
                              max_loras=8, max_lora_rank=16, max_prefill_tokens=24, enable_chunked_prefill=True,
                              enable_prefix_caching=prefix_caching,
                              lora_modules=[f"{n}={p}" for n, p in llama_adapters.items()])
    engine = LLMEngine.from_settings(settings)
    engine.model.fused_ops = True
    engine.prefill_graphs = PrefillGraphs(engine.model, settings.max_num_seqs, settings.max_prefill_tokens,
                                          graphs=False)
    engine.prefill_graphs.enabled = True
    padded = []
    run = engine.prefill_graphs.run
    engine.prefill_graphs.run = lambda *a: padded.append(len(a[0])) or run(*a)
    rng = random.Random(5)
    system = [1] + [rng.randrange(3, 320) for _ in range(20)]
    prompts = {name: [1] + [rng.randrange(3, 320) for _ in range(9 + 7 * i)]
               for i, name in enumerate(["base", *ADAPTERS])}
    prompts["again"] = system + [rng.randrange(3, 320) for _ in range(5)]
    prompts["base"] = system + [rng.randrange(3, 320) for _ in range(3)]
    adapter = {name: None if name in ("base", "again") else name for name in prompts}
    reqs = {}
    for name, prompt in prompts.items():
        reqs[name] = engine.make_request(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                         adapter[name])
        engine.add_request(reqs[name])
    while engine.has_work():
        engine.step()
    assert padded and max(padded) <= 24  # every prefill went the padded way
    for name, r in reqs.items():
        assert r.output_ids == hf_greedy(hf_llama, llama_adapters.get(adapter[name]), prompts[name], 5), name
    if prefix_caching:
        assert reqs["again"].cached_tokens + reqs["base"].cached_tokens >= 16  # one found the other's system prompt
