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
def all_linear(base_dir, tmp_path_factory) -> Path:
    return make_adapter(base_dir, tmp_path_factory.mktemp("all") / "a", r=4, lora_alpha=8,
                        target_modules="all-linear")


# ---- served, as peft computes them -------------------------------------------------------

@pytest.mark.parametrize("case, kwargs", [
    ("list", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    ("rslora", dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])),
    # peft 0.21 saves "all-linear" as the list of every module it matched, by full name
    ("all-linear", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    ("all-linear, patterns", dict(
        r=4, lora_alpha=8, target_modules="all-linear",
        rank_pattern={r"^model.layers.0.*q_proj": 8, "self_attn.k_proj": 2, "layers.1.mlp.up_proj": 6},
        alpha_pattern={"layers.1.mlp.down_proj": 3, "v_proj": 5, r"model\.layers\.0\.mlp\..*": 12})),
    ("list, patterns", dict(r=8, lora_alpha=16, target_modules=ALL,
                            rank_pattern={"o_proj": 4, "gate_proj": 12}, alpha_pattern={"down_proj": 32})),
    ("rslora, patterns", dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj"],
                              rank_pattern={"o_proj": 2}, alpha_pattern={"q_proj": 3})),
    ("regex string", dict(r=4, lora_alpha=8, target_modules=r".*layers\.1\.self_attn\.(q|k)_proj|.*\.mlp\.up_proj")),
    ("module-name suffixes", dict(r=4, lora_alpha=8, target_modules=["self_attn.q_proj", "mlp.up_proj"])),
    ("full module names", dict(r=4, lora_alpha=8, target_modules=["model.layers.1.self_attn.v_proj"])),
    ("layers_to_transform", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])),
    ("layers_to_transform, layers_pattern", dict(r=4, lora_alpha=8, target_modules=["o_proj"],
                                                 layers_to_transform=0, layers_pattern="layers")),
    ("exclude_modules", dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["k_proj", "gate_proj"])),
    ("exclude_modules regex", dict(r=4, lora_alpha=8, target_modules=ALL, exclude_modules=r".*layers\.0\..*")),
    ("bias all (Llama has no biases)", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="all")),
    ("bias lora_only", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="lora_only")),
    ("feature extraction task", dict(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="FEATURE_EXTRACTION")),
    ("no task type", dict(r=4, lora_alpha=8, target_modules=["q_proj"], task_type=None)),
])
def test_peft_adapters_give_peft_deltas(base_dir, tmp_path, case, kwargs):
    assert_conforms(base_dir, make_adapter(base_dir, tmp_path / "a", **kwargs))


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
    # peft turns fan_in_fan_out off for nn.Linear (every Llama projection), with a warning
    ("fan_in_fan_out on nn.Linear", lambda c: c.update(fan_in_fan_out=True)),
    ("another base's name", lambda c: c.update(base_model_name_or_path="meta-llama/Llama-3.1-8B")),
])
def test_configs_as_other_tools_write_them_give_peft_deltas(base_dir, qv, tmp_path, case, config):
    cfg = json.loads((qv / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16  # so that each default above matters
    assert_conforms(base_dir, edited(qv, tmp_path / "a", config=config))


def test_all_linear_as_a_string(base_dir, all_linear, tmp_path):
    """A config that says "all-linear" (as peft's LoraConfig takes it, and as a user may write
    one) targets all seven projections of every layer, lm_head not."""
    assert_conforms(base_dir, edited(all_linear, tmp_path / "a", config=lambda c: c.update(target_modules="all-linear")))
    assert_conforms(base_dir, edited(all_linear, tmp_path / "b", config=lambda c: c.update(target_modules="ALL-LINEAR")))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adapter_name", [False, True])
def test_tensor_dtypes_and_peft_adapter_name(base_dir, qv, tmp_path, dtype, adapter_name):
    """`.lora_A.default.weight` (peft's own state_dict keys) loads in peft as `.lora_A.weight` does."""
    def tensors(t):
        name = (lambda k: k.replace(".weight", ".default.weight")) if adapter_name else (lambda k: k)
        return {name(k): v.to(dtype) for k, v in t.items()}

    assert_conforms(base_dir, edited(qv, tmp_path / "a", tensors=tensors))


# ---- refused, with the reason ------------------------------------------------------------

def _rename(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


@pytest.mark.parametrize("case, tensors, words", [
    # peft loads none of these (it reports the module's weights missing): its output is the base's
    ("no base_model.model. prefix", _rename("base_model.model.", ""), "base_model.model."),
    ("a base model's keys (no model.)", _rename("base_model.model.model.", "base_model.model."), "base_model.model."),
    ("bare module keys", _rename("base_model.model.model.", ""), "base_model.model."),
    ("another adapter name", _rename(".weight", ".tenant1.weight"), "adapter name 'tenant1'"),
    ("a vision tower's layers", _rename("model.model.layers", "model.vision_tower.layers"), "vision_tower"),
    ("a projection under the wrong block", _rename("self_attn.q_proj", "mlp.q_proj"), "mlp.q_proj"),
    ("a layer index peft never writes", _rename("layers.1.", "layers.01."), "layers.01"),
    # both spellings of one weight: which one peft keeps depends on the file's order
    ("one weight twice", lambda t: t | {k.replace(".weight", ".default.weight"): v * 2 for k, v in t.items()},
     "twice"),
])
def test_tensor_names_peft_would_not_load_are_refused(qv, tmp_path, case, tensors, words):
    with pytest.raises(AdapterError, match=words):
        read_adapter(edited(qv, tmp_path / "a", tensors=tensors), BASE)


@pytest.mark.parametrize("extra, words", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embeddings"),
    ("base_model.model.lm_head.lora_A.weight", "lm_head"),
    ("base_model.model.lm_head.weight", "whole module"),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", "bias"),
])
def test_other_tensors_are_refused_by_what_they_are(qv, tmp_path, extra, words):
    """A tool that saves them without the config saying so (use_dora, modules_to_save, bias)."""
    with pytest.raises(AdapterError, match=words):
        read_adapter(edited(qv, tmp_path / "a", tensors=lambda t: t | {extra: torch.zeros(8)}), BASE)


def test_weights_of_modules_the_config_does_not_target_are_refused(base_dir, qv, all_linear, tmp_path):
    """peft creates LoRA layers only where the config targets and drops every other tensor
    silently: served, these k_proj weights changed outputs that peft's do not."""
    extra = {k: v for k, v in load_file(str(all_linear / WEIGHTS)).items() if "k_proj" in k}
    path = edited(qv, tmp_path / "a", config=lambda c: c.update(r=4, lora_alpha=8),
                  tensors=lambda t: {k: (v[:4] if "lora_A" in k else v[:, :4]).contiguous() for k, v in t.items()} | extra)
    assert not any("k_proj" in k for k in peft_deltas(base_dir, path))
    with pytest.raises(AdapterError, match="k_proj.*not targeted"):
        read_adapter(path, BASE)
    # the same with layers_to_transform and exclude_modules
    for name, config in (("layers", lambda c: c.update(layers_to_transform=[0])),
                         ("exclude", lambda c: c.update(exclude_modules=["v_proj"]))):
        with pytest.raises(AdapterError, match="not targeted"):
            read_adapter(edited(qv, tmp_path / name, config=config), BASE)


@pytest.mark.parametrize("case, kwargs, words", [
    ("DoRA", dict(use_dora=True), "DoRA"),
    ("modules_to_save", dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ("LoRA on lm_head", dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    ("LoRA on embed_tokens", dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    ("regex on lm_head", dict(target_modules=r".*(q_proj|lm_head)"), "lm_head"),
    ("a target this base lacks", dict(target_modules=["q_proj", "qkv_proj"]), "qkv_proj"),
    ("rank above the server's", dict(r=128), "exceeds"),
])
def test_peft_features_we_do_not_serve_are_refused_by_name(base_dir, tmp_path, case, kwargs, words):
    if case == "a target this base lacks":  # peft itself accepts entries that match nothing
        path = edited(make_adapter(base_dir, tmp_path / "src", r=4, target_modules=["q_proj"]), tmp_path / "a",
                      config=lambda c: c.update(target_modules=kwargs["target_modules"]))
    else:
        path = make_adapter(base_dir, tmp_path / "a", **({"r": 4, "target_modules": ["q_proj", "v_proj"]} | kwargs))
    with pytest.raises(AdapterError, match=words):
        read_adapter(path, BASE)


def test_bd_lora_is_refused_by_name(base_dir, tmp_path):
    """BD-LoRA saves block-diagonal A or B compactly ([r, in / nblocks]): it was refused as an
    adapter 'trained for another base', which it is not."""
    from peft.tuners.lora.config import BdLoraConfig

    path = make_adapter(base_dir, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"],
                        use_bdlora=BdLoraConfig(target_modules_bd_a=["q_proj"], target_modules_bd_b=["v_proj"],
                                                nblocks=2))
    with pytest.raises(AdapterError, match="BD-LoRA"):
        read_adapter(path, BASE)


def test_trained_biases_are_refused(tmp_path):
    """bias="lora_only" on a base with biases (Qwen2's q/k/v) saves `...q_proj.base_layer.bias`:
    a changed base bias we cannot serve per adapter."""
    qwen = make_hf_base(tmp_path / "qwen", "qwen2")
    path = make_adapter(qwen, tmp_path / "a", r=4, target_modules=["q_proj", "o_proj"], bias="lora_only")
    with pytest.raises(AdapterError, match="bias"):
        read_adapter(path, BASE)


def test_rank_that_disagrees_with_the_config_and_pickle_weights_are_refused(qv, tmp_path):
    path = edited(qv, tmp_path / "rank", config=lambda c: c.update(rank_pattern={"q_proj": 4}))
    with pytest.raises(AdapterError, match="config says 4"):
        read_adapter(path, BASE)
    pickled = edited(qv, tmp_path / "bin")
    torch.save(load_file(str(pickled / WEIGHTS)), pickled / "adapter_model.bin")
    (pickled / WEIGHTS).unlink()
    with pytest.raises(AdapterError, match="adapter_model.bin is not read"):
        read_adapter(pickled, BASE)


@pytest.mark.parametrize("cfg, words", [
    ({"target_modules": [["q_proj"]]}, "target_modules"),
    ({"target_modules": "(q_proj"}, "not a regular expression"),
    ({"exclude_modules": {"k_proj": 1}}, "exclude_modules"),
    ({"exclude_modules": "[k"}, "not a regular expression"),
    ({"layers_to_transform": "0"}, "layers_to_transform"),
    ({"layers_to_transform": [0, -1]}, "layers_to_transform"),
    ({"layers_to_transform": [0], "layers_pattern": 3}, "layers_pattern"),
    ({"target_modules": r".*"}, "only the decoder layers' projections"),
    ({"target_modules": ["mlp"]}, "only the decoder layers' projections"),
    ({"target_modules": ["q_proj"], "layers_to_transform": [5]}, "not targeted"),
])
def test_target_configs_peft_would_not_take_are_refused_with_a_reason(qv, tmp_path, cfg, words):
    with pytest.raises(AdapterError, match=words):
        read_adapter(edited(qv, tmp_path / "a", config=lambda c: c.update(cfg)), BASE)


def test_an_all_linear_adapter_with_patterns_is_served_as_peft_runs_it(base_dir, tmp_path):
    """End to end: the server's greedy tokens for peft's "all-linear" adapter (saved as full
    module names, refused before) with per-module ranks and alphas are HF + peft's."""
    from .test_parity import MAX_NEW, engine_for, hf_greedy, prompts_for, run_mixed_batch

    path = make_adapter(base_dir, tmp_path / "a", seed=3, r=8, lora_alpha=16, target_modules="all-linear",
                        rank_pattern={r"^model.layers.0.*q_proj": 16, "down_proj": 4},
                        alpha_pattern={"layers.1.self_attn.o_proj": 40}, exclude_modules=["k_proj"])
    engine = engine_for(base_dir, {"al": path}, "torch")
    prompts = prompts_for(["al", "base"])
    got = run_mixed_batch(engine, prompts)
    assert got["al"] == hf_greedy(base_dir, path, prompts["al"], MAX_NEW)
    assert got["al"] != hf_greedy(base_dir, None, prompts["al"], MAX_NEW)


@pytest.mark.parametrize("variant", ["velora", "monteclora"])
def test_variants_whose_inference_is_plain_lora_are_served(base_dir, tmp_path, variant):
    """VeLoRA (a compressed backward) and MonteCLoRA (sampling while training) run B A x at
    inference, as peft runs them in eval; their training state saved beside A and B made the
    whole adapter refused as 'not a LoRA A/B weight'. Their tensors without their config stay refused."""
    from peft.tuners.lora.config import MontecloraConfig, VeloraConfig

    kw = ({"velora_config": VeloraConfig(init_type="random")} if variant == "velora"
          else {"monteclora_config": MontecloraConfig()})
    path = make_adapter(base_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], **kw)
    assert any(f"lora_{variant}" in k for k in load_file(str(path / WEIGHTS)))
    assert_conforms(base_dir, path)
    # peft's eval forward is the merged weights' (no sampling, no compression)
    from peft import PeftModel

    model = PeftModel.from_pretrained(_base_model(base_dir), path).eval()
    merged = PeftModel.from_pretrained(_base_model(base_dir), path).merge_and_unload().eval()
    ids = torch.tensor([[1, 5, 9, 77, 200]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(AdapterError, match="training state"):
        read_adapter(edited(path, tmp_path / "b", config=lambda c: c.pop(f"{variant}_config")), BASE)
