"""Malformed adapter files: every one is refused with an AdapterError that says why (a 400 from
load_lora_adapter, a refused --lora-modules entry, one failed adapter), never another exception
(a 500, a server that does not start) and never served."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from loraplex.server.adapter_format import (
    AdapterError, BaseSpec, peft_key, read_adapter, read_safetensors_header, write_adapter_config)
from loraplex.server.config import named_shape

CFG = named_shape("tiny")
BASE = BaseSpec(num_layers=CFG.num_layers, module_shapes=CFG.module_shapes(), max_rank=16)
Q_A, Q_B = torch.zeros(4, 64), torch.zeros(64, 4)  # tiny: hidden 64, q 64, rank 4
QA, QB = peft_key(0, "q_proj", "A"), peft_key(0, "q_proj", "B")


def _adapter(path, *, cfg: dict | None = None, raw_cfg: bytes | None = None, raw_weights: bytes | None = None):
    write_adapter_config(path, r=4, lora_alpha=8, target_modules=["q_proj"])
    if cfg:
        c = json.loads((path / "adapter_config.json").read_text()) | cfg
        (path / "adapter_config.json").write_text(json.dumps(c))
    if raw_cfg is not None:
        (path / "adapter_config.json").write_bytes(raw_cfg)
    save_file({QA: Q_A, QB: Q_B}, str(path / "adapter_model.safetensors"))
    if raw_weights is not None:
        (path / "adapter_model.safetensors").write_bytes(raw_weights)
    return path


def _safetensors(header: dict, data_len: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data_len


DEEP = b"[" * 100_000 + b"]" * 100_000  # valid JSON, nested past the parser's recursion limit


@pytest.mark.parametrize("case, kw, words", [
    ("config a list", {"raw_cfg": b"[1, 2]"}, "not a JSON object"),
    ("config null", {"raw_cfg": b"null"}, "not a JSON object"),
    ("config not UTF-8", {"raw_cfg": b"\xff\xfe{\x00}"}, "invalid JSON"),
    ("config nested too deep", {"raw_cfg": DEEP}, "invalid JSON"),
    ("rank_pattern key not a regex", {"cfg": {"rank_pattern": {"[": 4}}}, "rank_pattern"),
    ("alpha_pattern key not a regex", {"cfg": {"alpha_pattern": {"(q_proj": 4}}}, "alpha_pattern"),
    ("rank_pattern a list", {"cfg": {"rank_pattern": ["q_proj", 4]}}, "rank_pattern"),
    ("target_modules of lists", {"cfg": {"target_modules": [["q_proj"]]}}, "target_modules"),
    ("r a bool", {"cfg": {"r": True}}, "r=True"),
    ("header nested too deep", {"raw_weights": struct.pack("<Q", len(DEEP)) + DEEP}, "not a safetensors file"),
    ("shape of strings", {"raw_weights": _safetensors(
        {QA: {"dtype": "F32", "shape": "46", "data_offsets": [0, 96]}}, 96)}, "malformed entry"),
    ("shape of floats", {"cfg": {"rank_pattern": {"q_proj": 4.5}}, "raw_weights": _safetensors(
        {QA: {"dtype": "F32", "shape": [4.5, 64], "data_offsets": [0, 1024]},
         QB: {"dtype": "F32", "shape": [64, 4.5], "data_offsets": [1024, 2048]}}, 2048)}, "malformed entry"),
    ("negative dimensions", {"raw_weights": _safetensors(
        {QA: {"dtype": "F32", "shape": [-4, -64], "data_offsets": [0, 1024]},
         QB: {"dtype": "F32", "shape": [64, 4], "data_offsets": [1024, 2048]}}, 2048)}, "malformed entry"),
    ("dtype unknown", {"raw_weights": _safetensors(
        {QA: {"dtype": "F128", "shape": [4, 64], "data_offsets": [0, 1024]}}, 1024)}, "F128"),
])
def test_malformed_files_are_refused_with_a_reason(tmp_path, case, kw, words):
    path = _adapter(tmp_path, **kw)
    with pytest.raises(AdapterError, match=words):
        read_adapter(path, BASE)


def test_a_module_of_rank_zero_is_refused(tmp_path):
    """rank_pattern 0 and empty tensors agree with each other, and scaling = alpha / 0 raised
    ZeroDivisionError (a 500 from load_lora_adapter). PEFT itself refuses r <= 0."""
    path = _adapter(tmp_path, cfg={"rank_pattern": {"q_proj": 0}})
    save_file({QA: torch.zeros(0, 64), QB: torch.zeros(64, 0)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="rank 0"):
        read_adapter(path, BASE)


def test_a_header_nested_too_deep_is_refused_by_the_header_reader_too(tmp_path):
    """The node agent checks staged files with read_safetensors_header."""
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(DEEP)) + DEEP)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        read_safetensors_header(tmp_path / "x.safetensors")


@pytest.mark.parametrize("raw_cfg, words", [
    (b'{"r": 4, "lora_alpha": NaN, "target_modules": ["q_proj"]}', "lora_alpha"),
    (b'{"r": 4, "lora_alpha": Infinity, "target_modules": ["q_proj"]}', "lora_alpha"),
    (b'{"r": 4, "lora_alpha": 1' + b"0" * 400 + b', "target_modules": ["q_proj"]}', "lora_alpha"),
    (b'{"r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj": -Infinity}, "target_modules": ["q_proj"]}',
     "lora_alpha"),
])
def test_an_alpha_that_is_not_a_finite_number_is_refused(tmp_path, raw_cfg, words):
    """Python's json reads NaN and Infinity: served, every output of the adapter was NaN."""
    path = _adapter(tmp_path, raw_cfg=raw_cfg)
    with pytest.raises(AdapterError, match=words):
        read_adapter(path, BASE)


@pytest.mark.parametrize("cfg, words", [
    ({"alora_invocation_tokens": [128, 9]}, "aLoRA"),
    ({"layer_replication": [[0, 2], [0, 2]]}, "layer_replication"),
    ({"lora_bias": True}, "lora_bias"),
    ({"use_qalora": True}, "use_qalora"),
    ({"trainable_token_indices": [5, 6]}, "trainable_token_indices"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
    ({"arrow_config": {"top_k": 3}}, "arrow_config"),
    ({"kasa_config": {}}, "kasa_config"),
    ({"init_lora_weights": "pissa"}, "changed the base"),
    ({"init_lora_weights": "pissa_niter_16"}, "changed the base"),
    ({"init_lora_weights": "olora"}, "changed the base"),
    ({"init_lora_weights": "corda"}, "changed the base"),
    ({"init_lora_weights": "loftq"}, "changed the base"),
    ({"init_lora_weights": "lora_ga"}, "changed the base"),
])
def test_peft_features_that_are_not_plain_lora_are_refused(tmp_path, cfg, words):
    """Their weights are plain lora_A/lora_B tensors of the right shapes, so they passed every
    check and were served as plain LoRA: wrong outputs (an aLoRA active on every token, a
    replicated layer's adapter on another layer, a PiSSA adapter without its residual base)."""
    path = _adapter(tmp_path, cfg=cfg)
    with pytest.raises(AdapterError, match=words):
        read_adapter(path, BASE)


@pytest.mark.parametrize("cfg", [
    {"init_lora_weights": True}, {"init_lora_weights": False}, {"init_lora_weights": "gaussian"},
    {"init_lora_weights": "eva"}, {"init_lora_weights": "orthogonal"}, {"init_lora_weights": "mica"},
    {"lora_dropout": 0.1}, {"target_modules": "(?:.*\\.)?(q_proj|v_proj)"}, {"layers_to_transform": [0]},
    {"layers_pattern": "layers"}, {"exclude_modules": ["k_proj"]}, {"use_rslora": True},
    {"lora_bias": False, "layer_replication": None, "alora_invocation_tokens": None, "use_qalora": False,
     "trainable_token_indices": None, "target_parameters": None, "arrow_config": None, "kasa_config": None},
])
def test_what_plain_lora_means_is_still_served(tmp_path, cfg):
    """Options that do not change what a LoRA computes at inference (or that PEFT writes at
    their defaults) are served."""
    path = _adapter(tmp_path, cfg=cfg)
    assert read_adapter(path, BASE).target_modules == ("q_proj",)


def test_a_pissa_adapter_as_peft_saves_it_is_refused_and_its_conversion_served(tmp_path):
    """PiSSA moves the adapter's principal part out of the base's weights: the adapter alone,
    on the base served here, is wrong. PEFT's conversion on save makes it a plain LoRA (of
    twice the rank) that is right on the original base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .conftest import make_hf_base

    base_dir = make_hf_base(tmp_path / "base")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa"))
    model.peft_config["default"].init_lora_weights = True  # PEFT's recipe: the initial adapter as plain LoRA
    model.save_pretrained(tmp_path / "initial")
    model.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():  # "training"
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "pissa")
    model.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))

    base = BaseSpec(num_layers=2, module_shapes=CFG.module_shapes(), max_rank=16)
    with pytest.raises(AdapterError, match="changed the base"):
        read_adapter(tmp_path / "pissa", base)
    assert read_adapter(tmp_path / "converted", base).max_rank == 8


def test_an_adapter_config_too_large_to_be_one_is_refused_unread(tmp_path, monkeypatch):
    """adapter_config.json was read whole: a huge one (a path mistaken for an adapter, a
    sparse file) took that much memory before anything was checked, enough to get the
    server killed. PEFT writes about a kilobyte."""
    from pathlib import Path

    path = _adapter(tmp_path)
    with (path / "adapter_config.json").open("r+b") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB that take no disk
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or real(self))
    with pytest.raises(AdapterError, match="too large"):
        read_adapter(path, BASE)
    assert not reads
