"""Fixtures for the server tests: tiny HF checkpoints made by transformers, PEFT adapters
made by peft itself (random non-zero A and B), and a live server on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from loraplex.server.demo import build_tokenizer

# name -> LoraConfig kwargs: different ranks, alphas, targets; one rsLoRA, one with patterns.
ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"]),
    "mlp-rslora-r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
                     rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 32}),
}

BASES = {
    # Llama 3 shape: GQA, llama3 rope scaling, untied embeddings.
    "llama": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=False),
    # Qwen2 shape: q/k/v biases, tied embeddings.
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=True),
    # Mistral shape: a sliding window longer than any test sequence (served as full attention).
    "mistral": dict(model_type="mistral", rope_theta=1000000.0, sliding_window=256, tie_word_embeddings=False),
}


def merged_calls(deltas: list[dict]) -> list[dict]:
    """Stream deltas' `tool_calls` entries put together as OpenAI's clients do: by `index`,
    the first entry of a call with its id, type and name, the arguments of all concatenated."""
    calls: dict[int, dict] = {}
    for t in deltas:
        if t["index"] not in calls:
            assert t["id"] and t["type"] == "function" and t["function"]["name"], t
            calls[t["index"]] = {**t, "function": dict(t["function"])}
        else:
            assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}, t
            calls[t["index"]]["function"]["arguments"] += t["function"]["arguments"]
    return [calls[k] for k in sorted(calls)]


def make_hf_base(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(BASES[kind])
    model_type = extra.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.08, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if kind == "qwen2":  # HF zero-inits biases: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path, vocab_size=320)
    return path


def make_peft_adapter(base_dir: Path, path: Path, seed: int, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    # init_lora_weights=False: A and B both random (nn.Linear init), so every adapter matters.
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    return make_hf_base(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def llama_adapters(hf_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama-adapters")
    return {name: make_peft_adapter(hf_llama, root / name, seed=10 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}


class LiveServer:
    """A uvicorn server for an app, on a free loopback port, in a thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def live_server():
    return LiveServer


@contextlib.contextmanager
def serve_tiny_llama(hf_llama, llama_adapters, **overrides):
    """The tiny Llama and its PEFT adapters behind a live server (model name "tiny-llama"),
    its engine at hand as `.engine`; `overrides` change the ServerSettings."""
    from loraplex.server.api.app import create_app
    from loraplex.server.engine import LLMEngine
    from loraplex.server.settings import ServerSettings

    fields = dict(model=str(hf_llama), served_model_name="tiny-llama", device="cpu", dtype="float32",
                  max_num_seqs=8, max_model_len=256, max_loras=4, max_lora_rank=16,
                  lora_modules=[f"{n}={p}" for n, p in llama_adapters.items()])
    engine = LLMEngine.from_settings(ServerSettings(**(fields | overrides)))
    with LiveServer(create_app(engine)) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def served(hf_llama, llama_adapters):
    with serve_tiny_llama(hf_llama, llama_adapters) as server:
        yield server
