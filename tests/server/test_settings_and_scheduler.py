"""Settings <-> flags, config parsing, the admission policy and the KV row allocator."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch

from loraplex.server.batch import adapter_bucket, batch_buckets, bucket, kv_bucket, warmup_plan
from loraplex.server.config import ModelConfig, ModelConfigError, named_shape
from loraplex.server.kv_cache import KVCache
from loraplex.server.request import Request
from loraplex.server.sampling import SamplingParams
from loraplex.server.scheduler import FcfsPolicy, Scheduler
from loraplex.server.settings import ServerSettings, build_parser, field_docs


def test_every_field_has_a_flag_and_a_docstring():
    parser = build_parser()
    flags = {a.dest for a in parser._actions if a.dest != "help" and a.option_strings}
    fields = {f.name for f in dataclasses.fields(ServerSettings)}
    assert flags == fields
    # One positional beside them: the model folder first, as `vllm serve MODEL` takes it.
    assert [a.dest for a in parser._actions if not a.option_strings] == ["model_dir"]
    docs = field_docs()
    assert set(docs) == fields and all("Default" in d for d in docs.values())


def test_flags_env_and_validation(monkeypatch):
    s = ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--max-loras", "3", "--no-cuda-graphs",
                                          "--no-fused-ops", "--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"])
    assert (s.max_loras, s.cuda_graphs, s.fused_ops, s.lora_modules) == (3, False, False, ["a=/x", "b=/y", "c=/z"])
    assert ServerSettings.from_env_and_args(["--demo"]).fused_ops
    monkeypatch.setenv("LORAPLEX_MAX_NUM_SEQS", "5")
    assert ServerSettings.from_env_and_args(["--demo"]).max_num_seqs == 5
    for bad in (["--dummy-weights", "tiny", "--dtype", "int8"], [], ["--demo", "--max-loras", "-1"],
                ["--demo", "--lora-target-modules", "lm_head"], ["--demo", "--lora-modules", "nopath"]):
        with pytest.raises(ValueError):
            ServerSettings.from_env_and_args(bad)


@pytest.mark.parametrize("var, raw, words", [
    ("LORAPLEX_PORT", "80a", "LORAPLEX_PORT='80a': not an integer"),
    # A typo of "true" turned the feature off without a word.
    ("LORAPLEX_CUDA_GRAPHS", "ture", "LORAPLEX_CUDA_GRAPHS='ture'"),
    # Set and empty (`value: ""` in a pod spec) turned it off too, where an empty number stops the server.
    ("LORAPLEX_CUDA_GRAPHS", "", "LORAPLEX_CUDA_GRAPHS=''"),
])
def test_a_bad_environment_value_names_its_variable(monkeypatch, var, raw, words):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError, match=words):
        ServerSettings.from_env_and_args(["--demo"])
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "off")
    monkeypatch.setenv("LORAPLEX_PORT", "8080")
    s = ServerSettings.from_env_and_args(["--demo"])
    assert (s.cuda_graphs, s.port) == (False, 8080)


def test_hf_config_variants():
    llama31 = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, "eos_token_id": [5, 6]})
    assert llama31.rope_scaling["factor"] == 8.0 and llama31.eos_token_ids == (5, 6) and llama31.head_dim == 16
    qwen = ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "tie_word_embeddings": True})
    assert qwen.qkv_bias and qwen.tie_word_embeddings and qwen.num_kv_heads == 4
    mistral = ModelConfig.from_hf({"model_type": "mistral", "vocab_size": 10, "hidden_size": 64,
                                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "max_position_embeddings": 32768, "sliding_window": 4096})
    assert mistral.max_position_embeddings == 4096
    with pytest.raises(ModelConfigError, match="gpt2"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelConfig.from_hf(dict(qwen.to_hf(), rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert ModelConfig.from_hf(named_shape("llama-3-8b").to_hf()) == named_shape("llama-3-8b")
    assert named_shape("llama-3-8b").num_params() == pytest.approx(8.03e9, rel=0.01)


def req(n_prompt: int, i: int = 0) -> Request:
    return Request(f"r{i}", [1] * n_prompt, SamplingParams(), None, 0)


@pytest.mark.parametrize("prompts, free, budget, admitted", [
    ([10, 10, 10], 8, 100, 3),
    ([10, 10, 10], 2, 100, 2),  # rows run out
    ([60, 60, 10], 8, 100, 1),  # budget: the second would exceed it, and FCFS does not skip ahead
    ([500], 8, 100, 1),  # the head is admitted alone however long
    ([], 8, 100, 0),
])
def test_fcfs_policy(prompts, free, budget, admitted):
    waiting = deque(req(n, i) for i, n in enumerate(prompts))
    assert len(FcfsPolicy().select(waiting, free, budget)) == admitted


def test_scheduler_rows_are_reused_lowest_first():
    kv = KVCache(named_shape("tiny"), rows=3, max_len=16, device=torch.device("cpu"), dtype=torch.float32)
    sched = Scheduler(kv, max_prefill_tokens=100)
    reqs = [req(2, i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert [r.row for r in sched.admit()] == [0, 1, 2] and len(sched.waiting) == 1
    assert kv.span() == 3
    reqs[0].abort()
    sched.remove(reqs[0])
    reqs[2].abort()
    sched.remove(reqs[2])
    assert kv.span() == 2
    assert [r.row for r in sched.admit()] == [0]
    assert sched.find("r3") is reqs[3] and sched.has_work()


def test_decode_graph_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket(9, batch_buckets(64)) == 16
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(65, batch_buckets(64))
    # Distinct adapters of a step -> the bound its LoRA grid is sized for.
    assert [adapter_bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 32, 33)] == [0, 1, 2, 4, 4, 8, 32, 32, 64]


def test_kv_bound_is_the_whole_cache_with_graphs_and_whole_blocks_without():
    # max_position p needs p + 1 keys.
    assert {kv_bucket(p, 256, 8192, graphs=True) for p in range(8192)} == {8192}  # one graph key
    eager = [kv_bucket(p, 256, 8192, graphs=False) for p in (0, 255, 256, 700, 1024, 8191)]
    assert eager == [256, 256, 512, 768, 1280, 8192]
    assert kv_bucket(700, 256, 1000, graphs=False) == 768 and kv_bucket(900, 256, 1000, graphs=False) == 1000


def test_warmup_plan_covers_every_lora_configuration():
    buckets = batch_buckets(16)
    plan = warmup_plan(buckets, 6)
    assert len(plan) == len(set(plan))
    # Every batch bucket with every adapter bucket a step of it can reach (at most 6 distinct
    # adapters in 6 slots): the LoRA kernels' configurations; the attention's follow the
    # batch bucket alone, at the one KV bound.
    for b in buckets:
        reachable = {adapter_bucket(n) for n in range(0, min(b, 6) + 1)}
        assert {a for bb, a in plan if bb == b} == reachable
    assert (1, 2) not in plan and (16, 8) in plan
