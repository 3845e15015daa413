"""The PEFT adapter format, read with the standard library and checked against a base."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from loraplex.server.adapter_format import (
    AdapterError, BaseSpec, peft_key, read_adapter, read_safetensors_header, write_adapter_config)
from loraplex.server.config import named_shape
from loraplex.server.demo import write_random_adapter

CFG = named_shape("tiny")
BASE = BaseSpec(num_layers=CFG.num_layers, module_shapes=CFG.module_shapes(), max_rank=16)


def test_importing_it_pulls_in_no_torch():
    code = ("import sys, loraplex.server.adapter_format, loraplex.server.config, loraplex.server.settings; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_header_matches_safetensors(tmp_path):
    t = {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(2)}
    save_file(t, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    h = read_safetensors_header(tmp_path / "x.safetensors")
    assert h["a"]["shape"] == [3, 4] and h["a"]["dtype"] == "BF16" and h["b"]["dtype"] == "F32"


def test_adapters_that_share_a_header_are_parsed_once_and_each_keeps_its_own_config(tmp_path, monkeypatch):
    """A fleet's adapters share their header byte for byte: the second is not parsed again,
    yet each spec follows its own config (alpha here) and path, a caller changing a returned
    header changes nothing for the next, and a header that differs in one byte is parsed."""
    from loraplex.server import adapter_format

    a, b = tmp_path / "a", tmp_path / "b"
    write_random_adapter(a, CFG, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    write_random_adapter(b, CFG, r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], seed=9)
    raw = lambda d: adapter_format._header_bytes(d / "adapter_model.safetensors")[0]  # noqa: E731
    assert raw(a) == raw(b)
    adapter_format.checked_header.cache_clear()
    adapter_format._header_modules.cache_clear()
    parses = []
    real = adapter_format.json.loads
    monkeypatch.setattr(adapter_format.json, "loads", lambda text, *k, **kw: parses.append(1) or real(text, *k, **kw))
    spec_a, spec_b = read_adapter(a, BASE), read_adapter(b, BASE)
    assert len(parses) == 3  # a's config, a's header, b's config: b's header came from the cache
    assert spec_a.path == str(a) and spec_b.path == str(b)
    assert spec_a.module(0, "q_proj").scaling == 2.0 and spec_b.module(0, "q_proj").scaling == 4.0
    header = read_safetensors_header(a / "adapter_model.safetensors")
    header.clear()
    assert read_safetensors_header(b / "adapter_model.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "c.safetensors"), metadata={"format": "pt", "n": "1"})
    parses.clear()
    assert list(read_safetensors_header(tmp_path / "c.safetensors")) == ["x"] and len(parses) == 1


def test_patterns_and_rslora_scaling(tmp_path):
    write_random_adapter(tmp_path, CFG, r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"],
                         rank_pattern={"o_proj": 4})
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {"layers.1.self_attn.q_proj": 4}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    spec = read_adapter(tmp_path, BASE)
    assert spec.target_modules == ("q_proj", "o_proj") and spec.max_rank == 8
    assert spec.module(0, "q_proj").scaling == 2.0  # 16 / 8
    assert spec.module(0, "o_proj").rank == 4 and spec.module(0, "o_proj").scaling == 4.0  # 16 / 4
    assert spec.module(1, "q_proj").scaling == 0.5  # alpha_pattern 4 / 8
    cfg["use_rslora"] = True
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    assert read_adapter(tmp_path, BASE).module(0, "o_proj").scaling == 16 / math.sqrt(4)


def _adapter(tmp_path, tensors: dict, **cfg):
    write_adapter_config(tmp_path, r=cfg.pop("r", 4), lora_alpha=8, target_modules=cfg.pop("targets", ["q_proj"]))
    c = json.loads((tmp_path / "adapter_config.json").read_text()) | cfg
    (tmp_path / "adapter_config.json").write_text(json.dumps(c))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


Q_A, Q_B = torch.zeros(4, 64), torch.zeros(64, 4)  # tiny: hidden 64, q 64


@pytest.mark.parametrize("case, tensors, cfg, words", [
    ("dora", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B}, {"use_dora": True}, "DoRA"),
    # bias="all" on a Llama (no biases) saves a plain LoRA, served; a trained bias is refused
    ("bias", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B,
              "base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, {"bias": "all"}, "bias"),
    ("bias value", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B}, {"bias": "some"}, "bias"),
    ("modules_to_save", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B},
     {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("missing B", {peft_key(0, "q_proj", "A"): Q_A}, {}, "lora_B is missing"),
    ("layer", {peft_key(5, "q_proj", "A"): Q_A, peft_key(5, "q_proj", "B"): Q_B}, {}, "only 2 layers"),
    ("shape", {peft_key(0, "q_proj", "A"): torch.zeros(4, 32), peft_key(0, "q_proj", "B"): Q_B}, {},
     "do not fit the base"),
    ("rank", {peft_key(0, "q_proj", "A"): torch.zeros(32, 64), peft_key(0, "q_proj", "B"): torch.zeros(64, 32)},
     {"r": 32}, "exceeds"),
    ("rank vs config", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B}, {"r": 8},
     "config says 8"),
    ("targets", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B},
     {"targets": ["q_proj", "lm_head"]}, "lm_head"),
    ("foreign key", {"base_model.model.lm_head.lora_A.weight": Q_A}, {}, "LoRA on the embeddings or lm_head"),
    ("dtype", {peft_key(0, "q_proj", "A"): Q_A.to(torch.int32), peft_key(0, "q_proj", "B"): Q_B}, {}, "dtype"),
    # Not a number: a TypeError or ValueError here was a 500 from load_lora_adapter, not a 400.
    ("alpha", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B}, {"lora_alpha": None},
     "lora_alpha"),
    ("alpha pattern", {peft_key(0, "q_proj", "A"): Q_A, peft_key(0, "q_proj", "B"): Q_B},
     {"alpha_pattern": {"q_proj": "high"}}, "lora_alpha"),
])
def test_refusals_say_why(tmp_path, case, tensors, cfg, words):
    path = _adapter(tmp_path, tensors, **cfg)
    with pytest.raises(AdapterError, match=words):
        read_adapter(path, BASE)


def test_server_may_restrict_target_modules(tmp_path):
    write_random_adapter(tmp_path, CFG, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    attn_only = BaseSpec(CFG.num_layers, CFG.module_shapes(), 16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(AdapterError, match="down_proj"):
        read_adapter(tmp_path, attn_only)
    assert read_adapter(tmp_path, BASE).target_modules == ("q_proj", "down_proj")


def test_not_an_adapter(tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path, BASE)
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="invalid JSON"):
        read_adapter(tmp_path, BASE)
