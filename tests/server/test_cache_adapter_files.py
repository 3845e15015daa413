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

