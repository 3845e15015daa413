"""The node agent's check of adapter_config.json agrees with the server's reading of it.

The agent refuses a staged adapter whose config the server would refuse (InvalidAdapter,
given up on until the plan changes), so it must never refuse one the server serves: an
`adapter_config.json` without `r` is peft's default rank 8 to both, a lowercase `peft_type`
is LORA to both. Each config below is put beside weights that fit it (rank 8 on q_proj and
v_proj of a 2-layer, 32-wide base) and given to both; their verdicts must match.
"""

from __future__ import annotations

import json

import pytest

from loraplex.node_agent.adapter_files import CONFIG_FILE, InvalidAdapter, check_adapter_dir
from loraplex.server.adapter_format import AdapterError, BaseSpec, read_adapter

from .helpers import make_adapter

BASE = BaseSpec(num_layers=2, module_shapes={"q_proj": (32, 32), "v_proj": (32, 32)}, max_rank=64,
                allowed_modules=("q_proj", "v_proj"))
TARGETS = {"target_modules": ["q_proj", "v_proj"]}

# (config, whether the server serves it)
CONFIGS = [
    ({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **TARGETS}, True),
    ({"peft_type": "LORA", "lora_alpha": 16, **TARGETS}, True),  # r: peft's default, 8
    ({"r": 8, **TARGETS}, True),  # peft_type LORA, lora_alpha 8: the defaults
    ({"peft_type": "lora", "r": 8, **TARGETS}, True),
    ({"peft_type": "LORA", "r": 8, "lora_alpha": 0.5, **TARGETS}, True),
    ({"peft_type": "LOHA", "r": 8, **TARGETS}, False),
    ({"peft_type": None, "r": 8, **TARGETS}, False),
    ({"peft_type": "LORA", "r": 0, **TARGETS}, False),
    ({"peft_type": "LORA", "r": -8, **TARGETS}, False),
    ({"peft_type": "LORA", "r": "8", **TARGETS}, False),
    ({"peft_type": "LORA", "r": 8.0, **TARGETS}, False),
    ({"peft_type": "LORA", "r": True, **TARGETS}, False),
    ({"peft_type": "LORA", "r": None, **TARGETS}, False),
    ({"peft_type": "LORA", "r": 8, "lora_alpha": "16", **TARGETS}, False),
    ({"peft_type": "LORA", "r": 8, "lora_alpha": True, **TARGETS}, False),
    ({"peft_type": "LORA", "r": 8, "lora_alpha": None, **TARGETS}, False),
]


def _verdict(check, directory) -> bool:
    try:
        check(directory)
    except (InvalidAdapter, AdapterError):
        return False
    return True


@pytest.mark.parametrize("config, served", CONFIGS, ids=[json.dumps(c) for c, _ in CONFIGS])
def test_agent_and_server_agree_on_the_config(tmp_path, config, served):
    make_adapter(tmp_path, rank=8)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    assert _verdict(lambda d: read_adapter(d, BASE), tmp_path) is served  # the table is the server's
    assert _verdict(check_adapter_dir, tmp_path) is served


def test_lora_alpha_nan_is_refused_by_both(tmp_path):
    make_adapter(tmp_path, rank=8)
    (tmp_path / CONFIG_FILE).write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": NaN}')
    assert not _verdict(lambda d: read_adapter(d, BASE), tmp_path)
    assert not _verdict(check_adapter_dir, tmp_path)


async def test_a_config_without_r_is_staged(tmp_path):
    """As peft saves it with the default rank, and as the server serves it: staged, not
    refused as InvalidAdapter (which the warmer gives up on until the plan changes)."""
    from loraplex.node_agent.store import AdapterRef, AdapterStore

    sha = make_adapter(tmp_path / "src" / "a", rank=8)
    (tmp_path / "src" / "a" / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", **TARGETS}))
    store = AdapterStore(tmp_path / "cache", 10**9)
    staged = await store.stage(AdapterRef("a", str(tmp_path / "src" / "a"), sha))
    assert read_adapter(staged.path, BASE).rank == 8


@pytest.mark.parametrize("nbytes, served", [(2 << 20, True), ((16 << 20) + 1, False)])
def test_agent_and_server_agree_on_the_config_size(tmp_path, nbytes, served):
    """A long rank_pattern (here: a long string beside it) up to the server's limit."""
    make_adapter(tmp_path, rank=8)
    config = json.dumps({"peft_type": "LORA", "r": 8, **TARGETS, "notes": ""})
    (tmp_path / CONFIG_FILE).write_text(config[:-2] + "x" * (nbytes - len(config)) + '"}')
    assert (tmp_path / CONFIG_FILE).stat().st_size == nbytes
    assert _verdict(lambda d: read_adapter(d, BASE), tmp_path) is served
    assert _verdict(check_adapter_dir, tmp_path) is served


def test_a_config_nested_too_deep_is_refused_as_the_server_refuses_it(tmp_path):
    """json's RecursionError is a bad config (InvalidAdapter, as the server's AdapterError), not
    a disk error the warmer would retry for ever."""
    make_adapter(tmp_path, rank=8)
    (tmp_path / CONFIG_FILE).write_text("[" * 100_000 + "]" * 100_000)
    assert not _verdict(lambda d: read_adapter(d, BASE), tmp_path)
    with pytest.raises(InvalidAdapter, match="not JSON"):
        check_adapter_dir(tmp_path)
