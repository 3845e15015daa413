"""A failed load's reason (loraplex_adapter_load_failures_total's label) names what is wrong
with the files: a config that is JSON but no object is `corrupt`, as a garbled
adapter_model.safetensors is, not `mismatch` (weights that do not fit the base)."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.server.adapter_format import AdapterError, BaseSpec, read_adapter
from loraplex.server.adapter_sources import load_error


BASE = BaseSpec(num_layers=1, module_shapes={"q_proj": (8, 8)}, max_rank=4)


def reason_of(path) -> str:
    with pytest.raises(AdapterError) as e:
        read_adapter(path, BASE)
    return load_error("a", e.value).reason


def test_broken_files_are_corrupt_whatever_file_it_is(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "good"
    good.mkdir()
    (good / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)},
              str(good / "adapter_model.safetensors"))
    read_adapter(good, BASE)  # the files the others break
    list_config = tmp_path / "list-config"
    list_config.mkdir()
    (list_config / "adapter_config.json").write_text("[1, 2]")
    (list_config / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    assert reason_of(list_config) == "corrupt"
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (garbled / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    assert reason_of(garbled) == "corrupt"
