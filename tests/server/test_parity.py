"""Greedy outputs of one mixed batch (every adapter and the base, in the same steps) equal
HF transformers + peft running one adapter at a time, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.server.engine import LLMEngine
from loraplex.server.sampling import SamplingParams
from loraplex.server.settings import ServerSettings

from .conftest import ADAPTERS, make_hf_base, make_peft_adapter

MAX_NEW = 8


def hf_greedy(base_dir, adapter_dir, prompt: list[int], n: int) -> list[int]:
    """transformers (+ peft for an adapter): n greedy tokens, full forward each step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def prompts_for(names: list[str], seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    # Different lengths so rows sit at different positions in every decode step.
    return {name: [1] + [rng.randrange(3, 320) for _ in range(5 + 3 * i)] for i, name in enumerate(names)}


def run_mixed_batch(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    reqs = {}
    for name, prompt in prompts.items():
        adapter = None if name == "base" else name
        reqs[name] = engine.make_request(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                                         adapter)
        engine.add_request(reqs[name])
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 1:  # everyone was admitted together: one batch mixes all adapters
            assert len(engine.scheduler.running) == len(prompts)
    return {name: r.output_ids for name, r in reqs.items()}


def engine_for(base_dir, adapters: dict, backend: str = "auto", **overrides) -> LLMEngine:
    settings = ServerSettings(model=str(base_dir), device="cpu", dtype="float32", max_num_seqs=8,
                              max_model_len=128, max_loras=8, max_lora_rank=16, kernel_backend=backend,
                              lora_modules=[f"{n}={p}" for n, p in adapters.items()], **overrides)
    return LLMEngine.from_settings(settings)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-gemm"])
def test_mixed_batch_matches_hf_peft(hf_llama, llama_adapters, backend):
    engine = engine_for(hf_llama, llama_adapters, backend.removesuffix("-gemm"))
    # triton-gemm: the projections as kernels.linear (gemm / lora_linear), as on a GPU.
    engine.model.triton_gemm = backend == "triton-gemm"
    names = ["base", *ADAPTERS]
    prompts = prompts_for(names)
    got = run_mixed_batch(engine, prompts)
    want = {name: hf_greedy(hf_llama, llama_adapters.get(name), prompts[name], MAX_NEW) for name in names}
    assert got == want
    # The adapters must matter, or this test would prove nothing about them.
    for name in ADAPTERS:
        assert hf_greedy(hf_llama, None, prompts[name], MAX_NEW) != want[name], name


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_bases_match_hf_peft(tmp_path, kind):
    base = make_hf_base(tmp_path / kind, kind, seed=3)
    adapters = {"all-r16": make_peft_adapter(base, tmp_path / "a", seed=5, **ADAPTERS["all-r16"]),
                "mlp-rslora-r4": make_peft_adapter(base, tmp_path / "b", seed=6, **ADAPTERS["mlp-rslora-r4"])}
    engine = engine_for(base, adapters)
    if kind == "qwen2":
        assert engine.cfg.qkv_bias and engine.cfg.tie_word_embeddings
    else:
        assert engine.cfg.model_type == "mistral" and engine.max_model_len == 128
    prompts = prompts_for(["base", *adapters], seed=1)
    got = run_mixed_batch(engine, prompts)
    want = {name: hf_greedy(base, adapters.get(name), prompts[name], MAX_NEW) for name in prompts}
    assert got == want


def test_requests_join_and_leave_the_running_batch(hf_llama, llama_adapters):
    """Continuous batching: a request that arrives while others decode joins at the next
    step, one that finishes leaves; outputs stay exact for all of them."""
    engine = engine_for(hf_llama, llama_adapters)
    names = ["base", *ADAPTERS]
    prompts = prompts_for(names, seed=2)
    reqs = {}
    for i, name in enumerate(names):
        n = MAX_NEW if i % 2 == 0 else 3  # short ones leave early
        reqs[name] = engine.make_request(prompts[name], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                         None if name == "base" else name)
    order = list(names)
    engine.add_request(reqs[order.pop(0)])
    sizes = []
    while engine.has_work() or order:
        if order:  # one newcomer per step
            engine.add_request(reqs[order.pop(0)])
        engine.step()
        sizes.append(len(engine.scheduler.running))
    assert max(sizes) >= 3 and sizes[-1] == 0
    for name, req in reqs.items():
        want = hf_greedy(hf_llama, llama_adapters.get(name), prompts[name], req.params.max_tokens)
        assert req.output_ids == want, name
