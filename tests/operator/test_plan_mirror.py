"""Plan mirrors: each BaseModel's plan copied into one namespace (the node agents'), where the
agents find every plan by label instead of being told each one's name.

The name and the object are pure functions; the operator's writing, deleting and sweeping of
mirrors runs kopf against the emulated API (as test_operator_e2e.py does).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from loraplex.operator.cli import parse_args
from loraplex.operator.kube import BASE_MODELS, CONFIG_MAPS, KubeClient
from loraplex.operator.specs import BaseModelSpec
from loraplex.operator.workloads import (MANAGED_BY, foreign_owner, plan_config_map, plan_mirror, plan_mirror_name,
                                         read_plan)

from .test_operator_e2e import NS, adapter_body, base_body
from .test_workloads import BASE

MIRRORS = "loraplex-system"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.mark.parametrize("namespace, base, expected", [
    ("ml", "llama-3-8b", "ml.llama-3-8b-plan"),
    ("team-b", "ml", "team-b.ml-plan"),
    # namespaces have no dots: "a.b" + "c" and "a" + "b.c" cannot both be namespaces, so no clash
    ("a", "b.c", "a.b.c-plan"),
])
def test_the_mirror_name_is_namespace_dot_plan(namespace, base, expected):
    assert plan_mirror_name(namespace, base) == expected


def test_a_mirror_name_past_253_characters_is_cut_and_hashed():
    ns = "n" * 63
    long_a, long_b = "a" * 240 + "-x", "a" * 240 + "-y"  # same 253-character head
    names = {plan_mirror_name(ns, base) for base in (long_a, long_b)}
    assert len(names) == 2
    for name in names:
        assert len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name), name
        assert name.startswith(f"{ns}.aaaa")
    assert plan_mirror_name(ns, long_a) == plan_mirror_name(ns, long_a)  # stable
    # A cut that ends at a dot or a dash still gives a valid name.
    dotted = plan_mirror_name("a" * 63, "b" * 177 + "." + "c" * 80)
    assert len(dotted) <= 253 and DNS_SUBDOMAIN.fullmatch(dotted), dotted


def test_the_mirror_copies_the_plan_and_names_its_source():
    spec = BASE
    source = plan_config_map(spec, '{"baseModel": "llama-3-8b"}')
    mirror = plan_mirror(source, spec.name, MIRRORS)
    meta = mirror["metadata"]
    assert (meta["namespace"], meta["name"]) == (MIRRORS, "ml.llama-3-8b-plan")
    assert meta["labels"] == {"app.kubernetes.io/managed-by": MANAGED_BY, "loraplex.io/plan-mirror": "true"}
    assert meta["annotations"] == {"loraplex.io/plan-encoding": "json", "loraplex.io/plan-of": "ml/llama-3-8b-plan",
                                   "loraplex.io/plan-namespace": "ml", "loraplex.io/base-model": "llama-3-8b"}
    assert "ownerReferences" not in meta  # none can cross namespaces
    assert mirror["data"] == source["data"] and "binaryData" not in mirror
    assert read_plan(mirror) == read_plan(source)


def test_a_gzipped_plan_is_mirrored_gzipped():
    spec = BASE
    big = json.dumps({"baseModel": "x", "adapters": [{"name": f"a{i}", "source": "s" * 100} for i in range(10_000)]})
    source = plan_config_map(spec, big)
    mirror = plan_mirror(source, spec.name, MIRRORS)
    assert mirror["binaryData"] == source["binaryData"] and "data" not in mirror
    assert mirror["metadata"]["annotations"]["loraplex.io/plan-encoding"] == "gzip"
    assert read_plan(mirror) == json.loads(big)


def test_a_mirror_is_ours_only_when_it_mirrors_the_same_plan():
    spec = BASE
    mirror = plan_mirror(plan_config_map(spec, "{}"), spec.name, MIRRORS)
    assert foreign_owner(mirror, mirror) is None
    other = plan_mirror(plan_config_map(dataclasses.replace(spec, namespace="x"), "{}"), spec.name, MIRRORS)
    assert foreign_owner(other, mirror) == "the mirror of x/llama-3-8b-plan"
    someones = {"metadata": {"name": mirror["metadata"]["name"], "labels": {"app": "theirs"}}}
    assert foreign_owner(someones, mirror) == "not a plan mirror of the loraplex operator"


def test_the_mirror_namespace_comes_from_the_flag_else_the_environment():
    assert parse_args([], env={}).plan_mirror_namespace is None
    assert parse_args([], env={"LORAPLEX_PLAN_MIRROR_NAMESPACE": "lp"}).plan_mirror_namespace == "lp"
    assert parse_args(["--plan-mirror-namespace", "mine"],
                      env={"LORAPLEX_PLAN_MIRROR_NAMESPACE": "lp"}).plan_mirror_namespace == "mine"
    for argv, env in ((["--plan-mirror-namespace", "Not_A_Namespace"], {}),
                      ([], {"LORAPLEX_PLAN_MIRROR_NAMESPACE": "a/b"})):
        with pytest.raises(SystemExit):
            parse_args(argv, env=env)


# -- the operator, against the emulated API ----------------------------------------------------


async def _mirror(api: KubeClient, base: str = "llama-3-8b", namespace: str = NS) -> dict | None:
    return await api.get(CONFIG_MAPS.path(MIRRORS, plan_mirror_name(namespace, base)))


async def test_the_operator_mirrors_each_plan_and_deletes_the_mirror_with_its_base(
        api, emulator, kubeconfig, crds, operator_runner, eventually_, settled):
    async with operator_runner(mirror_namespace=MIRRORS):
        await api.create(BASE_MODELS.path(NS), base_body())
        await api.create(BASE_MODELS.path("team-b"), {**base_body("mistral"), "metadata": {"name": "mistral",
                                                                                           "namespace": "team-b"}})
        await api.create("/apis/loraplex.io/v1alpha1/namespaces/ml/loraadapters", adapter_body("a", 10))

        async def mirrored(names):
            cm = await _mirror(api)
            plan = read_plan(cm) if cm else None
            return cm if plan and [a["name"] for a in plan["adapters"]] == names else None
        cm = await eventually_(lambda: mirrored(["a"]), what="the mirror of ml's plan")
        assert cm["metadata"]["annotations"]["loraplex.io/plan-of"] == f"{NS}/llama-3-8b-plan"
        assert cm["data"] == (await api.get(CONFIG_MAPS.path(NS, "llama-3-8b-plan")))["data"]
        await eventually_(lambda: _mirror(api, "mistral", "team-b"), what="the mirror of team-b's plan")
        listed = await api.list_objects(CONFIG_MAPS, MIRRORS, "loraplex.io/plan-mirror=true")
        assert sorted(m["metadata"]["name"] for m in listed) == ["ml.llama-3-8b-plan", "team-b.mistral-plan"]

        # A new adapter: the plan and its mirror change together; an unchanged plan writes nothing.
        await api.create("/apis/loraplex.io/v1alpha1/namespaces/ml/loraadapters", adapter_body("b", 5))
        await eventually_(lambda: mirrored(["a", "b"]), what="the mirror of the new plan")
        await settled()
        key = next(k for k in emulator.objects if k[1] == MIRRORS and k[2] == "ml.llama-3-8b-plan")
        writes = len(emulator.objects[key].history)
        await api.merge_patch(BASE_MODELS.path(NS, "llama-3-8b"), {"metadata": {"labels": {"touched": "yes"}}})
        await settled()
        assert len(emulator.objects[key].history) == writes

        # Deleting the BaseModel deletes its mirror (its finalizer waits for that); the other stays.
        await api._request("DELETE", BASE_MODELS.path(NS, "llama-3-8b"))

        async def gone():
            return await _mirror(api) is None and await api.get(BASE_MODELS.path(NS, "llama-3-8b")) is None
        await eventually_(gone, what="the mirror deleted with its BaseModel")
        assert await _mirror(api, "mistral", "team-b") is not None


async def test_without_a_mirror_namespace_no_mirror_is_written(api, kubeconfig, crds, operator_runner, eventually_,
                                                             settled):
    async with operator_runner():
        await api.create(BASE_MODELS.path(NS), base_body())
        await eventually_(lambda: api.get(CONFIG_MAPS.path(NS, "llama-3-8b-plan")), what="the plan")
        await settled()
    assert await api.list_objects(CONFIG_MAPS, None, "loraplex.io/plan-mirror=true") == []


async def test_the_sweep_deletes_mirrors_whose_base_is_gone_and_keeps_the_rest(
        api, kubeconfig, crds, operator_runner, eventually_):
    """A BaseModel whose finalizer was removed by hand (the operator was down) leaves its mirror:
    the operator's sweep, at start and then periodically, deletes it. Live mirrors, and a
    ConfigMap of the namespace that is no mirror, stay."""
    await api.create(BASE_MODELS.path(NS), base_body())
    spec = BaseModelSpec.from_body(base_body())
    live = plan_mirror(plan_config_map(spec, "{}"), spec.name, MIRRORS)
    gone_spec = BaseModelSpec.from_body(base_body("deleted-by-hand"))
    orphan = plan_mirror(plan_config_map(gone_spec, "{}"), gone_spec.name, MIRRORS)
    stranger = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ml.other-plan", "namespace": MIRRORS,
                                                                       "labels": {"loraplex.io/plan-mirror": "true"}}}
    for cm in (live, orphan, stranger):
        await api.create(CONFIG_MAPS.path(MIRRORS), cm)
    async with operator_runner(mirror_namespace=MIRRORS, mirror_sweep_seconds=0.2):
        await eventually_(lambda: _gone(api, orphan), what="the orphaned mirror swept at start")
        assert await _mirror(api) is not None
        assert await api.get(CONFIG_MAPS.path(MIRRORS, "ml.other-plan")) is not None  # not the operator's

        # One orphaned while the operator runs (written by another operator, say) goes at the next sweep.
        await api.create(CONFIG_MAPS.path(MIRRORS), orphan)
        await eventually_(lambda: _gone(api, orphan), what="the orphan swept again")
        assert await _mirror(api) is not None


async def _gone(api: KubeClient, cm: dict) -> bool:
    return await api.get(CONFIG_MAPS.path(MIRRORS, cm["metadata"]["name"])) is None
