"""Base checkpoints of every promised shape, made by transformers itself, give the logits
transformers gives (CPU, float32); checkpoints this engine cannot run are refused at load
with the reason, never served wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.server.config import ModelConfig
from loraplex.server.kv_cache import KVCache
from loraplex.server.model import LlamaModel, PrefillSeq
from loraplex.server.weights import load_weights

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.08, bos_token_id=1, eos_token_id=2)


def make_checkpoint(path: Path, model_type: str, arch: str = "AutoModelForCausalLM", **config) -> Path:
    """A random checkpoint of transformers' own making; every bias random (HF zero-inits them)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **(SHAPE | config))
    torch.manual_seed(0)
    cls = getattr(transformers, arch)
    model = cls.from_config(cfg, dtype=torch.float32) if arch.startswith("Auto") else cls(cfg)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def last_logits(path: Path, n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') float32 logits of a random prompt's last token."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_dir(path)
    weights = load_weights(path, cfg, torch.device("cpu"), torch.float32)
    model = LlamaModel(cfg, weights, KVCache(cfg, 1, 64, torch.device("cpu"), torch.float32), None, "torch")
    ids = torch.randint(3, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(1))
    ours = model.prefill(ids, torch.full((n,), -1, dtype=torch.int32), [PrefillSeq(0, 0, n)], max_adapters=0)[0]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0, -1]
    return ours, hf


def test_llama_with_attention_bias_matches_transformers(tmp_path):
    """Llama's attention_bias=true puts a bias on o_proj as well as on q/k/v."""
    path = make_checkpoint(tmp_path / "m", "llama", attention_bias=True)
    ours, hf = last_logits(path)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


def test_a_checkpoint_of_another_head_is_refused(tmp_path):
    """A sequence classifier has `score.weight` where the LM head would be: served, its
    embeddings stood in for lm_head and every completion was noise."""
    from loraplex.server.config import ModelConfigError

    path = make_checkpoint(tmp_path / "m", "llama", arch="LlamaForSequenceClassification")
    with pytest.raises(ModelConfigError, match="LlamaForSequenceClassification"):
        ModelConfig.from_dir(path)
