"""Adapter against base: accepted, or rejected with a reason (never half-served)."""

import json

import pytest

from loraplex.operator.specs import ALL_TARGET_MODULES, AdapterSpec, BaseModelSpec, SpecError
from loraplex.operator.validation import local_path, parse_adapter_config, read_adapter_config, validate

BASE = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama", max_lora_rank=64,
                     target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
ALL_TARGET_MODULES_SORTED = tuple(sorted(ALL_TARGET_MODULES))


def adapter(**overrides) -> AdapterSpec:
    fields = dict(name="a", namespace="ml", base_model="llama-3-8b", source="s3://a/a", rank=16,
                  target_modules=("q_proj", "v_proj"))
    fields.update(overrides)
    return AdapterSpec(**fields)


# (adapter, base, phase, reason)
CASES = {
    "fits": (adapter(), BASE, "Accepted", "Accepted"),
    "rank-at-the-limit": (adapter(rank=64), BASE, "Accepted", "Accepted"),
    "rank-above-max": (adapter(rank=128), BASE, "Rejected", "RankTooLarge"),
    "module-not-served": (adapter(target_modules=("gate_proj", "q_proj")), BASE, "Rejected", "TargetModulesNotAllowed"),
    "another-base": (adapter(base_model="mistral-7b"), BASE, "Rejected", "WrongBaseModel"),
    "same-name-other-namespace": (adapter(namespace="other"), BASE, "Rejected", "WrongBaseModel"),
    "no-such-base": (adapter(), None, "Pending", "BaseModelNotFound"),
    "rank-unknown": (adapter(rank=None), BASE, "Pending", "MetadataUnknown"),
    "modules-unknown": (adapter(target_modules=None), BASE, "Pending", "MetadataUnknown"),
}


@pytest.mark.parametrize("case", CASES)
def test_validation_table(case):
    spec, base, phase, reason = CASES[case]
    verdict = validate(spec, base)
    assert (verdict.phase, verdict.reason) == (phase, reason)
    assert verdict.accepted == (phase == "Accepted")
    assert verdict.message


def test_messages_name_the_numbers():
    assert "rank 128 > maxLoraRank 64" in validate(adapter(rank=128), BASE).message
    assert "['gate_proj']" in validate(adapter(target_modules=("gate_proj",)), BASE).message


def test_adapter_from_body_applies_schema_defaults():
    spec = AdapterSpec.from_body({"metadata": {"name": "a", "namespace": "ml", "generation": 3},
                                  "spec": {"baseModel": "llama-3-8b", "source": "s3://a",
                                           "targetModules": ["v_proj", "q_proj"]}})
    assert (spec.tenant, spec.priority, spec.pin_policy, spec.generation) == ("default", 0, "Auto", 3)
    assert spec.target_modules == ("q_proj", "v_proj")  # sorted: order in YAML does not matter


def test_spec_target_modules_name_modules_as_adapter_config_json_does():
    """The CRD asks for adapter_config.json's target_modules, and PEFT writes module path
    suffixes there ("self_attn.q_proj"): read from the file they were taken as q_proj, but
    copied into spec.targetModules the same adapter was rejected, TargetModulesNotAllowed."""
    body = {"metadata": {"name": "a", "namespace": "ml"},
            "spec": {"baseModel": "llama-3-8b", "source": "s3://a", "rank": 16,
                     "targetModules": ["self_attn.v_proj", "model.layers.0.self_attn.q_proj", "q_proj"]}}
    spec = AdapterSpec.from_body(body)
    assert spec.target_modules == ("q_proj", "v_proj")
    assert spec.target_modules == parse_adapter_config(json.dumps(
        {"r": 16, "target_modules": body["spec"]["targetModules"]}))[1]
    assert validate(spec, BASE).accepted


@pytest.mark.parametrize("spec", [
    {"source": "s3://a"},  # no baseModel
    {"baseModel": "b", "source": "s3://a", "pinPolicy": "Sometimes"},
    {"baseModel": "b", "source": "s3://a", "warmup": {"start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"}},
    {"baseModel": "b", "source": "s3://a", "warmup": {"start": "tomorrow", "end": "2026-01-01T00:00:00Z"}},
])
def test_bad_adapter_bodies_raise_spec_error(spec):
    with pytest.raises(SpecError):
        AdapterSpec.from_body({"metadata": {"name": "a"}, "spec": spec})


@pytest.mark.parametrize("spec", [
    {"maxLoraRank": 8},  # no source
    {"source": "/m", "maxLoraRank": 8, "dtype": "int4"},
    {"source": "/m", "maxLoraRank": 8, "targetModules": ["lm_head"]},
    {"source": "/m", "maxLoraRank": 8, "memory": {"gpuMemory": "lots"}},
])
def test_bad_base_bodies_raise_spec_error(spec):
    with pytest.raises(SpecError):
        BaseModelSpec.from_body({"metadata": {"name": "b"}, "spec": spec})


def test_adapter_config_is_read_from_local_sources(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"], "peft_type": "LORA"}))
    assert read_adapter_config(f"file://{tmp_path}") == (8, ("q_proj", "v_proj"))
    assert read_adapter_config(str(tmp_path)) == (8, ("q_proj", "v_proj"))
    assert read_adapter_config(f"file://{tmp_path}/missing") == (None, None)
    assert read_adapter_config("s3://bucket/adapter") == (None, None)
    spec = adapter(rank=None, target_modules=None, source=f"file://{tmp_path}")
    assert validate(spec.with_metadata(*read_adapter_config(spec.source)), BASE).accepted


def test_peft_target_module_forms():
    # One string is a regex that peft fullmatches against whole module names: "q_proj" names none.
    assert parse_adapter_config('{"r": 4, "target_modules": "q_proj"}') == (4, ())
    assert parse_adapter_config('{"r": 4, "target_modules": ".*q_proj"}') == (4, ("q_proj",))
    assert parse_adapter_config('{"r": 4, "target_modules": ["model.layers.0.self_attn.k_proj"]}') == (4, ("k_proj",))
    # No target_modules: peft's default for Llama-family models, which the servers serve too.
    assert parse_adapter_config('{"target_modules": null}') == (None, ("q_proj", "v_proj"))
    with pytest.raises(ValueError):
        parse_adapter_config("[1, 2]")


@pytest.mark.parametrize(("config", "modules"), [
    # A regex (peft fullmatches it against module names): read as a module named
    # "(q_proj|v_proj)" it was rejected, TargetModulesNotAllowed, on a q/k/v/o base.
    ({"target_modules": r".*\.(q_proj|v_proj)"}, ("q_proj", "v_proj")),
    ({"target_modules": r".*layers\.(3|40)\.self_attn\.k_proj"}, ("k_proj",)),
    # exclude_modules was ignored: all-linear without the MLP read as all seven projections.
    ({"target_modules": "all-linear", "exclude_modules": ["gate_proj", "up_proj", "down_proj"]},
     ("k_proj", "o_proj", "q_proj", "v_proj")),
    ({"target_modules": ["q_proj", "k_proj"], "layers_to_transform": [100]}, ("k_proj", "q_proj")),
    ({"target_modules": ["q_proj", "down_proj"], "exclude_modules": r".*mlp.*"}, ("q_proj",)),
])
def test_adapter_config_target_modules_are_read_as_the_servers_read_them(config, modules):
    assert parse_adapter_config(json.dumps({"r": 8, **config})) == (8, modules)
    spec = adapter(rank=None, target_modules=None)
    assert validate(spec.with_metadata(*parse_adapter_config(json.dumps({"r": 8, **config}))), BASE).accepted


def test_an_adapter_config_the_servers_refuse_is_not_read(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match="lm_head"):
        parse_adapter_config((tmp_path / "adapter_config.json").read_text())
    assert read_adapter_config(str(tmp_path)) == (None, None)


def test_local_path_only_for_local_sources():
    assert str(local_path("file:///data/a%20b")) == "/data/a b"
    assert local_path("https://host.invalid/a") is None


def test_an_adapters_rank_is_its_largest_module_rank():
    """PEFT's rank_pattern gives modules ranks other than r, and the servers refuse a module
    rank over --max-lora-rank (and report the largest as the adapter's rank): read as r alone,
    an adapter of r 16 with down_proj at rank 64 was Accepted by a base of maxLoraRank 32, and
    planned as rank 16, which no server then loaded."""
    config = {"r": 16, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {"model.layers.3.self_attn.v_proj": 64}}
    assert parse_adapter_config(json.dumps(config)) == (64, ("q_proj", "v_proj"))
    assert parse_adapter_config(json.dumps({**config, "rank_pattern": {"v_proj": 8}})) == (16, ("q_proj", "v_proj"))
    assert parse_adapter_config(json.dumps({**config, "rank_pattern": {}})) == (16, ("q_proj", "v_proj"))
    spec = adapter(rank=None, target_modules=None).with_metadata(*parse_adapter_config(json.dumps(config)))
    small = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m", max_lora_rank=32,
                          target_modules=("q_proj", "v_proj"))
    assert validate(spec, small).reason == "RankTooLarge"


def test_all_linear_targets_every_projection():
    """PEFT's target_modules "all-linear" (the servers read it so) is every projection, not a
    module of that name, which no base allows (TargetModulesNotAllowed)."""
    assert parse_adapter_config('{"r": 4, "target_modules": "all-linear"}') == (4, ALL_TARGET_MODULES_SORTED)
    every = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m", max_lora_rank=8,
                          target_modules=ALL_TARGET_MODULES)
    spec = adapter(rank=None, target_modules=None).with_metadata(
        *parse_adapter_config('{"r": 4, "target_modules": "ALL-LINEAR"}'))
    assert validate(spec, every).accepted
