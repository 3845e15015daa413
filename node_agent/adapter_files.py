"""Checks that a staged PEFT adapter directory is whole, before it is renamed into place.

The node agent does not load tensors; it only makes sure a server will not trip over a
file that is cut short or is not an adapter at all. The format itself (and the checks of
a safetensors header against its file) lives in `loraplex.server.adapter_format`, which
imports only the standard library, so the agent's image needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.server.adapter_format import (CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, AdapterError,
                                            rank_and_alpha, read_safetensors_header)

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "MAX_CONFIG_BYTES", "InvalidAdapter", "check_adapter_dir"]

# The agent's name for the format's error: the directory is not a whole PEFT LoRA adapter.
InvalidAdapter = AdapterError


def check_config(path: Path) -> dict:
    raw = path.read_bytes()
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidAdapter(f"{CONFIG_FILE}: {len(raw)} bytes, more than {MAX_CONFIG_BYTES}")
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise InvalidAdapter(f"{CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{CONFIG_FILE}: not a JSON object")
    # The fields as the server reads them (adapter_format.read_adapter): a key left out takes
    # peft's LoraConfig default (r 8, lora_alpha 8), peft_type in any case. Refusing more than
    # the server does would fail for good an adapter it serves.
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise InvalidAdapter(f"{CONFIG_FILE}: peft_type {peft_type!r}, not 'LORA'")
    try:
        rank_and_alpha(config)
    except AdapterError as e:
        raise InvalidAdapter(f"{CONFIG_FILE}: {e}") from None
    return config


def check_adapter_dir(directory: Path) -> None:
    """Raise InvalidAdapter unless `directory` holds a whole adapter."""
    check_config(directory / CONFIG_FILE)
    if not read_safetensors_header(directory / WEIGHTS_FILE):
        raise InvalidAdapter(f"{WEIGHTS_FILE}: no tensors")
