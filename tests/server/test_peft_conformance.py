"""PEFT conformance: adapters made by `peft` itself (or edited the ways other tools write them)
on a tiny random Llama, read by `read_adapter`, give exactly the weight deltas that peft's own
load and merge give (scaling * B @ A on the same modules, and on no other), or are refused with
an AdapterError that names the reason. Served any other way, an adapter's outputs are silently
not the ones it was trained for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.server.adapter_format import AdapterError, BaseSpec, read_adapter
from loraplex.server.config import named_shape

from .conftest import make_hf_base

CFG = named_shape("tiny")  # the shapes of conftest's make_hf_base
BASE = BaseSpec(num_layers=CFG.num_layers, module_shapes=CFG.module_shapes(), max_rank=64)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_hf_base(tmp_path_factory.mktemp("conformance-base"))


def _base_model(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def make_adapter(base_dir, path: Path, seed: int = 0, **lora_kwargs) -> Path:
    """An adapter as peft saves it, A and B both random (so every module matters)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    kwargs = dict(task_type="CAUSAL_LM", init_lora_weights=False) | lora_kwargs
    get_peft_model(_base_model(base_dir), LoraConfig(**kwargs)).save_pretrained(path)
    return path


def peft_deltas(base_dir, adapter) -> dict[str, torch.Tensor]:
    """{parameter: merged - base} for every parameter peft's load + merge changes."""
    from peft import PeftModel

    model = _base_model(base_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    assert set(merged) == set(before)
    return {k: v - before[k] for k, v in merged.items() if not torch.equal(v, before[k])}


def our_deltas(adapter) -> dict[str, torch.Tensor]:
    """{parameter: scaling * B @ A} for every module read_adapter serves, from the file's tensors."""
    spec = read_adapter(adapter, BASE)
    tensors = load_file(str(Path(adapter) / WEIGHTS))
    out = {}
    for m in spec.modules:
        block = "mlp" if m.proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        out[f"model.layers.{m.layer}.{block}.{m.proj}.weight"] = (
            m.scaling * (tensors[m.key_b].double() @ tensors[m.key_a].double())).float()
    return out


def assert_conforms(base_dir, adapter) -> None:
    want, got = peft_deltas(base_dir, adapter), our_deltas(adapter)
    assert want, "the adapter changes nothing: the comparison would prove nothing"
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def edited(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of the adapter at `src`, its config changed by `config(cfg)` and its tensors
    replaced by `tensors(dict)` (as other tools write them)."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(str(dst / WEIGHTS))), str(dst / WEIGHTS))
    return dst


@pytest.fixture(scope="module")
def qv(base_dir, tmp_path_factory) -> Path:
    return make_adapter(base_dir, tmp_path_factory.mktemp("qv") / "a", r=8, lora_alpha=16,
                        target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def qv4(base_dir, tmp_path_factory) -> Path:
    return make_adapter(base_dir, tmp_path_factory.mktemp("qv4") / "a", r=4, lora_alpha=16,
                        target_modules=["q_proj", "v_proj"])


def test_no_lora_alpha_is_peft_s_default_8_not_r(base_dir, qv4, tmp_path):
    """read_adapter took a missing lora_alpha as r (scaling 1); peft's LoraConfig default is 8
    (scaling 8 / r): every output of such an adapter was off by that factor."""
    assert_conforms(base_dir, edited(qv4, tmp_path / "a", config=lambda c: c.pop("lora_alpha")))


@pytest.mark.parametrize("case, config", [
    # peft's LoraConfig defaults: r 8, lora_alpha 8, target_modules q_proj and v_proj for Llama
    ("no lora_alpha", lambda c: c.pop("lora_alpha")),
    ("no r", lambda c: c.pop("r")),
    ("target_modules null", lambda c: c.update(target_modules=None)),
    ("another base's name", lambda c: c.update(base_model_name_or_path="meta-llama/Llama-3.1-8B")),
])
def test_configs_as_other_tools_write_them_give_peft_deltas(base_dir, qv, tmp_path, case, config):
    cfg = json.loads((qv / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16  # so that each default above matters
    assert_conforms(base_dir, edited(qv, tmp_path / "a", config=config))
