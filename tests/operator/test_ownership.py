"""Which existing objects the operator may write under the names it needs (table-driven)."""

from __future__ import annotations

import kopf
import pytest

from loraplex.operator.workloads import foreign_owner, service

from .test_workloads import BASE

OWNER = {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
         "metadata": {"name": "llama-3-8b", "namespace": "ml", "uid": "u-2"}}


def _desired() -> dict:
    desired = service(BASE)
    kopf.adopt(desired, owner=OWNER)
    return desired


def _ref(kind: str, name: str, uid: str, api: str = "loraplex.io/v1alpha1", controller: bool = True) -> dict:
    return {"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": controller}


OURS = {"app.kubernetes.io/managed-by": "loraplex-operator", "loraplex.io/base-model": "llama-3-8b"}


@pytest.mark.parametrize(("meta", "ours"), [
    ({"ownerReferences": [_ref("BaseModel", "llama-3-8b", "u-2")]}, True),
    ({"ownerReferences": [_ref("BaseModel", "llama-3-8b", "u-1")]}, True),  # the BaseModel made again
    ({"labels": OURS}, True),  # ours, its owner reference lost
    ({}, False),  # someone else's, unmarked
    ({"labels": {**OURS, "loraplex.io/base-model": "other"}}, False),
    ({"ownerReferences": [_ref("BaseModel", "other", "u-3")]}, False),
    ({"ownerReferences": [_ref("HelmRelease", "llama-3-8b", "u-4", api="helm.toolkit.fluxcd.io/v2")]}, False),
    ({"ownerReferences": [_ref("Deployment", "llama-3-8b", "u-5", api="apps/v1")], "labels": OURS}, False),
    ({"ownerReferences": [_ref("Thing", "x", "u-6", controller=False)], "labels": OURS}, True),
])
def test_foreign_owner(meta, ours):
    existing = {"metadata": {"name": "llama-3-8b", "namespace": "ml", **meta}}
    assert (foreign_owner(existing, _desired()) is None) == ours
