"""Helpers shared by the node agent tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE


def make_adapter(directory: Path, *, rank: int = 4, hidden: int = 32, layers: int = 2, seed: int = 0) -> str:
    """A PEFT LoRA adapter on q_proj/v_proj; returns the sha256 of adapter_model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, hidden), dtype=np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((hidden, rank), dtype=np.float32)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": "tiny"}
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()
