"""Adapter names in the operator: a LoRAAdapter's name is the adapter's name in the plan,
the servers' API, the node agents' caches and the endpoint picker's metric, so the plan only
carries names that fit the one rule (server/adapter_names.py). Every Kubernetes object name
fits it; a name that does not (an emulated or future API server that lets one through) is
rejected with a reason instead of being planned and refused by every server and agent."""

from __future__ import annotations

import datetime

import pytest

from loraplex.operator.plan import build_plan
from loraplex.operator.specs import AdapterSpec, BaseModelSpec, Memory
from loraplex.operator.validation import validate

BASE = BaseModelSpec(name="llama-3-8b", namespace="ml", source="s3://m/llama", max_lora_rank=64,
                     memory=Memory(slots=8))
NOW = datetime.datetime(2026, 5, 1, tzinfo=datetime.timezone.utc)


def adapter(name: str) -> AdapterSpec:
    return AdapterSpec(name=name, namespace="ml", base_model="llama-3-8b", source="s3://a/a", rank=16,
                       target_modules=("q_proj",))


@pytest.mark.parametrize("name", ["a", "sql-v2", "my.adapter-1", "0a", "a" * 253,
                                  ".".join(["x" * 63] * 4)[:253].rstrip(".")])
def test_kubernetes_names_are_accepted(name):
    assert validate(adapter(name), BASE).accepted


@pytest.mark.parametrize("name", ["a,b", "a/b", "..", "a b", "x" * 254])
def test_other_names_are_rejected_with_the_reason(name):
    verdict = validate(adapter(name), BASE)
    assert (verdict.phase, verdict.reason) == ("Rejected", "InvalidName")
    assert "adapter name" in verdict.message
    plan = build_plan(BASE, [adapter(name), adapter("ok")], NOW)
    assert [a["name"] for a in plan.as_json()["adapters"]] == ["ok"]
    assert plan.verdicts[name].reason == "InvalidName"


def test_an_adapter_named_as_its_served_base_is_rejected():
    """Its servers answer a request for that name with the base model, so the adapter could
    only take a slot and be listed Ready while nobody can reach it."""
    verdict = validate(adapter("llama-3-8b"), BASE)  # served as /models/llama-3-8b -> "llama-3-8b"
    assert (verdict.phase, verdict.reason) == ("Rejected", "InvalidName")
    assert "base" in verdict.message
    assert validate(adapter("llama-3-8b-sql"), BASE).accepted
