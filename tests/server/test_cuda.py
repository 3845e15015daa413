"""On a CUDA device only: CUDA-graph decode computes what eager decode computes, step after
step, in a batch that mixes adapters and the base, as rows leave and sequences grow (and
what a LoRA grid sized for every slot computes); graphs captured at start by the warm-up
serve a run without a capture and give its tokens; chunked prefill, logprobs, penalties
and echo under graphs and the fused ops give what whole prefills give; prompt logprobs in
chunks in bf16; prefix caching under graphs and the look-ahead, and its host tier.

tests/conftest.py sends Triton through its interpreter (for the CPU); on a GPU run these as
`TRITON_INTERPRET=0 pytest tests/server/test_cuda.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.server import model as model_module
from loraplex.server.adapters import AdapterId, random_adapter
from loraplex.server.engine import LLMEngine
from loraplex.server.model import PrefillSeq
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

from .test_look_ahead import rounded
from .test_ops import CUDA_CFG, tiny_model

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interpreter on: set TRITON_INTERPRET=0"),
]


def build(dtype: str) -> LLMEngine:
    settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=160,
                              max_loras=4, max_lora_rank=16, kv_block=16, seed=3)
    engine = LLMEngine.from_settings(settings)
    engine.look_ahead = False  # the test below launches decode steps of its own between steps
    for i in range(4):
        spec, tensors = random_adapter(engine.cfg, rank=8 + 2 * i, seed=i, device="cuda", dtype=engine.dtype)
        engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
    gen = torch.Generator().manual_seed(0)
    for i in range(7):
        prompt = torch.randint(3, engine.cfg.vocab_size, (5 + 7 * i,), generator=gen).tolist()
        adapter = None if i % 5 == 4 else f"a{i % 4}"
        params = SamplingParams(max_tokens=40 - 3 * i, temperature=0, ignore_eos=True)
        engine.add_request(engine.make_request(prompt, params, adapter))
    engine.step()  # prefill
    return engine


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_cuda_graph_decode_matches_eager(dtype, tol):
    engine = build(dtype)
    steps = 0
    while engine.has_work():
        running = {row: r for row, r in engine.scheduler.running.items()}
        span = engine.kv.span()
        graphed = engine.decoder.run(running, span).clone()
        eager = engine.decoder.rerun_eager()[:span]
        # The graph's LoRA grid is sized for the step's adapters; one sized for every slot
        # computes the same.
        every_slot = engine.model.decode(*engine.decoder.last_args[:4], None)[:span]
        rows = list(running)
        assert torch.allclose(graphed[rows], eager[rows], atol=tol, rtol=tol), steps
        assert torch.allclose(every_slot[rows], eager[rows], atol=tol, rtol=tol), steps
        engine.step()
        steps += 1
    assert engine.decoder.num_graphs >= 3 and steps >= 30


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_look_ahead_gives_the_same_outputs_step_by_step(dtype):
    """Under CUDA graphs, with each decode step launched on the device's tokens before the
    host has them (the default), a churning workload's outputs equal those of waiting for the
    tokens, step by step: arrivals between steps, more requests than rows, greedy and seeded
    sampling, penalties, logprobs, stop tokens, an abort."""

    def run(look_ahead: bool) -> tuple[list, LLMEngine]:
        settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype=dtype, max_num_seqs=4,
                                  max_model_len=64, max_loras=4, max_lora_rank=16, kv_block=16, seed=3)
        engine = LLMEngine.from_settings(settings)
        assert engine.look_ahead  # on by default on CUDA
        engine.look_ahead = look_ahead
        for i in range(3):
            spec, tensors = random_adapter(engine.cfg, rank=8 + 4 * i, seed=i, device="cuda", dtype=engine.dtype)
            engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
        gen = torch.Generator().manual_seed(1)
        kinds = [dict(temperature=0, ignore_eos=True), dict(temperature=0.8, top_p=0.9, seed=7),
                 dict(temperature=1.0, top_k=4, seed=8, presence_penalty=1.0), dict(temperature=0, logprobs=2),
                 dict(temperature=0, stop_token_ids=list(range(3, 200)))]
        pending = [(i % 9, torch.randint(3, engine.cfg.vocab_size, (3 + 5 * i,), generator=gen).tolist(),
                    SamplingParams(max_tokens=6 + 3 * (i % 4), **kinds[i % len(kinds)]),
                    None if i % 4 == 3 else f"a{i % 3}") for i in range(10)]
        pending.sort(key=lambda w: w[0])
        steps, step = [], 0
        while pending or engine.has_work():
            while pending and pending[0][0] <= step:
                _, prompt, params, adapter = pending.pop(0)
                engine.add_request(engine.make_request(prompt, params, adapter, request_id=f"r{step}-{len(pending)}"))
            if step == 5:
                engine.abort(min(r.request_id for r in engine.scheduler.running.values() if r.output_ids))
            steps.append(sorted((o.request_id, tuple(o.token_ids), o.finish_reason, rounded(o.logprobs, 3))
                                for o in engine.step()))
            step += 1
        return steps, engine

    plain, _ = run(False)
    ahead, engine = run(True)
    assert ahead == plain
    assert engine.look_ahead_misses == 0
    assert {o[2] for s in plain for o in s} >= {"stop", "length", "abort"}


def run_to_end(engine: LLMEngine, requests) -> None:
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_chunked_prefill_logprobs_and_echo_match_whole_prefill(dtype):
    """The request features, on CUDA graphs and the fused ops: a long prompt prefilled in chunks
    while other rows decode (with logprobs and penalties, mixed adapters), and an echo request
    that scores its prompt, give what one engine without chunked prefill gives."""
    outputs = {}
    for chunked in (False, True):
        settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype=dtype, max_num_seqs=8,
                                  max_model_len=256, max_loras=4, max_lora_rank=16, kv_block=16, seed=3,
                                  max_prefill_tokens=48, enable_chunked_prefill=chunked)
        engine = LLMEngine.from_settings(settings)
        assert engine.model.fused_ops
        for i in range(3):
            spec, tensors = random_adapter(engine.cfg, rank=8 + 4 * i, seed=i, device="cuda", dtype=engine.dtype)
            engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
        gen = torch.Generator().manual_seed(1)
        prompt = lambda n: torch.randint(3, engine.cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
        greedy = dict(temperature=0, ignore_eos=True)
        early = [engine.make_request(prompt(9 + i), SamplingParams(max_tokens=30, logprobs=2, **greedy),
                                     [None, "a0", "a1"][i]) for i in range(3)]
        run = early + [
            engine.make_request(prompt(150), SamplingParams(max_tokens=12, frequency_penalty=0.5, **greedy), "a2"),
            engine.make_request(prompt(20), SamplingParams(max_tokens=0, echo=True, logprobs=1, **greedy), "a1"),
        ]
        for r in early:
            engine.add_request(r)
        engine.step()
        engine.step()  # the early rows are decoding when the long prompt arrives
        run_to_end(engine, run[3:])
        assert all(r.finished and r.error is None for r in run)
        outputs[chunked] = run
    tol = 1e-3 if dtype == "float32" else 0.25
    whole, chunked = outputs[False], outputs[True]
    for a, b in zip(whole, chunked):
        if dtype == "float32":
            assert a.output_ids == b.output_ids
        for x, y in zip(a.output_logprobs, b.output_logprobs):
            if x.top[0][0] == y.top[0][0]:
                assert abs(x.top[0][1] - y.top[0][1]) < tol
    echo_a, echo_b = whole[4].prompt_logprobs, chunked[4].prompt_logprobs
    assert echo_a[0] is None and len(echo_a) == 20
    assert all(abs(x.logprob - y.logprob) < tol for x, y in zip(echo_a[1:], echo_b[1:]))
    assert len(whole[0].output_logprobs) == 30 and len(whole[0].output_logprobs[0].top) == 2


def test_cuda_bf16_prompt_logprobs_by_chunks(monkeypatch):
    """bf16 with the fused ops: a 300-token prompt's logprobs by chunks of 64 equal those in one
    chunk, and entry p + 1 is the log_softmax of the last-token logits of the prefix 0..p."""
    model = tiny_model(torch.bfloat16, fused=True, cfg=CUDA_CFG, device="cuda", max_len=320, rows=8)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, CUDA_CFG.vocab_size, (300,), generator=gen).cuda()
    slots = torch.full((300,), 0, dtype=torch.int32, device="cuda")
    whole = model.prefill(ids, slots, [PrefillSeq(0, 0, 300)], prompt_logprobs={0: 5})[1][0]
    monkeypatch.setattr(model_module, "PROMPT_LOGPROBS_CHUNK", 64)
    chunked = model.prefill(ids, slots, [PrefillSeq(0, 0, 300)], prompt_logprobs={0: 5})[1][0]
    assert whole[0] is None and chunked[0] is None and len(whole) == len(chunked) == 300
    assert [lp.logprob for lp in chunked[1:]] == pytest.approx([lp.logprob for lp in whole[1:]], abs=1e-2)
    for p in (0, 63, 64, 200, 298):
        prefix = model.prefill(ids[:p + 1], slots[:p + 1], [PrefillSeq(1, 0, p + 1)])[0]
        want = torch.log_softmax(prefix, -1)
        assert chunked[p + 1].logprob == pytest.approx(want[ids[p + 1]].item(), abs=0.1), p
    # The ranks (prompt_logprobs'): in the vocabulary, and the chunks' as the whole's, within
    # what bf16's different GEMMs of the two move a logprob by (1e-2, above) in a flat distribution.
    for a, b in zip(chunked[1:], whole[1:]):
        assert 1 <= a.rank <= CUDA_CFG.vocab_size and abs(a.rank - b.rank) <= max(8, b.rank // 10), (a.rank, b.rank)


def test_slots_of_q_and_v_only_give_what_full_slots_give():
    """--lora-target-modules q_proj v_proj: slots hold the q/k/v group alone, and under CUDA
    graphs the greedy tokens of a batch of q/v adapters and the base are a full-slot engine's."""
    def run(modules):
        settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype="float32", max_num_seqs=8,
                                  max_model_len=96, max_loras=4, max_lora_rank=16, kv_block=16, seed=3,
                                  lora_target_modules=modules)
        engine = LLMEngine.from_settings(settings)
        for i in range(3):
            spec, tensors = random_adapter(engine.cfg, rank=8, targets=("q_proj", "v_proj"), seed=i, device="cuda",
                                           dtype=engine.dtype)
            engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
        gen = torch.Generator().manual_seed(1)
        reqs = []
        for i in range(5):
            prompt = torch.randint(3, engine.cfg.vocab_size, (6 + 5 * i,), generator=gen).tolist()
            reqs.append(engine.make_request(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                            None if i == 4 else f"a{i % 3}"))
            engine.add_request(reqs[-1])
        while engine.has_work():
            engine.step()
        assert engine.decoder.num_graphs > 0
        return engine, [r.output_ids for r in reqs]

    qv, got = run(["q_proj", "v_proj"])
    full, want = run(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert qv.lora.groups == ("qkv",) and qv.lora.nbytes() < full.lora.nbytes() / 2
    assert got == want


def test_warm_up_captures_the_graphs_a_serving_run_needs():
    """After the warm-up, a run of base rows and adapters on every group captures no graph:
    each step's (batch bucket, adapter bucket, groups) was captured at start, all of them
    writing one logits buffer; and the greedy tokens are an engine's that captures as it goes."""
    def run(warm):
        settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype="float32", max_num_seqs=8,
                                  max_model_len=96, max_loras=4, max_lora_rank=16, kv_block=16, seed=3, warmup=warm)
        engine = LLMEngine.from_settings(settings)
        at_start = engine.decoder.num_graphs
        for i in range(4):
            spec, tensors = random_adapter(engine.cfg, rank=8, seed=i, device="cuda", dtype=engine.dtype)
            engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
        gen = torch.Generator().manual_seed(2)
        reqs = []
        for i in range(7):
            prompt = torch.randint(3, engine.cfg.vocab_size, (4 + 6 * i,), generator=gen).tolist()
            reqs.append(engine.make_request(prompt, SamplingParams(max_tokens=30 - 2 * i, temperature=0,
                                                                   ignore_eos=True), None if i == 3 else f"a{i % 4}"))
            engine.add_request(reqs[-1])
        while engine.has_work():
            engine.step()
        return engine, at_start, [r.output_ids for r in reqs]

    warm, at_start, got = run(True)
    cold, none, want = run(False)
    assert at_start > 0 and warm.decoder.num_graphs == at_start
    assert none == 0 and cold.decoder.num_graphs > 0
    assert got == want


def test_cuda_prefix_caching_gives_what_whole_prefills_give():
    """Under CUDA graphs and the decode look-ahead (both on by default), requests that share
    system prompts per adapter (and the base), arriving between steps while others decode over
    the free rows that keep those prompts: the greedy outputs with the prefix cache equal those
    without it (float32), and most of the prompt tokens were found."""

    def run(prefix_caching: bool) -> tuple[dict, LLMEngine]:
        settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype="float32", max_num_seqs=4,
                                  max_model_len=128, max_loras=4, max_lora_rank=16, kv_block=16, seed=3,
                                  enable_prefix_caching=prefix_caching)
        engine = LLMEngine.from_settings(settings)
        assert engine.look_ahead
        for i in range(2):
            spec, tensors = random_adapter(engine.cfg, rank=8 + 8 * i, seed=i, device="cuda", dtype=engine.dtype)
            engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
        gen = torch.Generator().manual_seed(2)
        systems = [torch.randint(3, engine.cfg.vocab_size, (40,), generator=gen).tolist() for _ in range(3)]
        pending = [(2 * i, systems[i % 3] + torch.randint(3, engine.cfg.vocab_size, (3 + i,), generator=gen).tolist(),
                    [None, "a0", "a1"][i % 3], 4 + 5 * (i % 3)) for i in range(12)]
        reqs, step = {}, 0
        while pending or engine.has_work():
            while pending and pending[0][0] <= step:
                _, prompt, adapter, n = pending.pop(0)
                r = engine.make_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), adapter)
                reqs[r.request_id] = r
                engine.add_request(r)
            engine.step()
            step += 1
        return reqs, engine

    plain, _ = run(False)
    cached, engine = run(True)
    assert [r.output_ids for r in cached.values()] == [r.output_ids for r in plain.values()]
    assert sum(r.cached_tokens for r in cached.values()) >= 8 * 32 and engine.decoder.num_graphs >= 2


def test_cuda_host_tier_gives_what_whole_prefills_give():
    """KV offloading on the GPU (page-locked host memory, the staging buffer, every copy on the
    compute stream), under graphs, the look-ahead and the prefill graphs: two KV rows, six
    system prompts over two adapters and the base, asked in turn while other requests decode,
    so the rows alone never hold a prompt when it comes back. The greedy outputs with the
    host tier equal those without prefix caching (float32), and the host tier gave most of
    the second round's prompts."""

    def run(offload: float | None) -> tuple[list, LLMEngine]:
        settings = ServerSettings(dummy_weights="tiny", device="cuda", dtype="float32", max_num_seqs=2,
                                  max_model_len=128, max_loras=4, max_lora_rank=16, kv_block=16, seed=3,
                                  enable_prefix_caching=offload is not None, kv_offloading_size=offload or 0.0)
        engine = LLMEngine.from_settings(settings)
        for i in range(2):
            spec, tensors = random_adapter(engine.cfg, rank=8 + 8 * i, seed=i, device="cuda", dtype=engine.dtype)
            engine.adapters.install(AdapterId(f"a{i}", str(i), "memory"), spec, tensors)
        gen = torch.Generator().manual_seed(4)
        systems = [torch.randint(3, engine.cfg.vocab_size, (48,), generator=gen).tolist() for _ in range(6)]
        reqs = []
        for turn in range(2):
            for i, system in enumerate(systems):
                prompt = system + torch.randint(3, engine.cfg.vocab_size, (5,), generator=gen).tolist()
                r = engine.make_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                        [None, "a0", "a1"][i % 3])
                reqs.append(r)
                engine.add_request(r)
                engine.step()  # the next arrives while this one decodes
        while engine.has_work():
            engine.step()
        return reqs, engine

    plain, _ = run(None)
    offloaded, engine = run(0.01)
    assert engine.prefixes.store.data.is_pinned()
    assert [r.output_ids for r in offloaded] == [r.output_ids for r in plain]
    assert sum(r.cached_tokens for r in offloaded[6:]) >= 4 * 48 and engine.prefixes.store.loaded_tokens >= 4 * 48


def test_cuda_freed_host_tier_memory_leaves_cublas_working():
    """The host tier's page-locked memory, freed, is unregistered first: freed while still
    registered, the next cuBLAS handle the process made failed (CUBLAS_STATUS_INTERNAL_ERROR,
    bench/results/cuda_host_register_h200.log). In a process of its own, which has made no
    cuBLAS handle yet."""
    import subprocess
    import sys

    code = ("import gc, torch\n"
            "from loraplex.server.prefix_store import host_buffer\n"
            "t = host_buffer((256 << 20,), torch.uint8, True)\n"
            "assert t.is_pinned()\n"
            "del t; gc.collect()\n"
            "a = torch.randn(64, 64, device='cuda')\n"
            "print(float((a @ a).sum()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cuda_attention_after_a_cached_prefix_needs_no_score_matrix():
    """A prefill after a cached prefix (or a later chunk) attends to the row's keys with the
    causal triangle aligned bottom right. As an explicit mask with GQA, SDPA has no fused
    kernel: its math backend builds the [heads, n, keys] scores in float32 (2.3 GB for a
    1,024-token chunk after 16,384 cached tokens); as a lower-right CausalBias it runs the
    flash kernel of a whole prefill, with no such matrix, and gives the whole prefill's rows
    to within a bfloat16 step."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    torch.manual_seed(0)
    heads, kv_heads, d, pos, n = 32, 8, 128, 16384, 1024
    q = torch.randn(1, heads, pos + n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, pos + n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = dict(scale=d ** -0.5, enable_gqa=True)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, **opts)[:, :, pos:].float()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    after = F.scaled_dot_product_attention(q[:, :, pos:], k, v, attn_mask=causal_lower_right(n, pos + n), **opts)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 << 20, f"{extra / 2**20:.0f} MiB for a {n}-token chunk after {pos}"
    assert (after.float() - whole).abs().max().item() <= 4e-3
