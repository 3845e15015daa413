"""Which existing objects the operator may write under the names it needs (table-driven)."""

from __future__ import annotations

import kopf
import pytest

from loraplex.operator.workloads import foreign_owner, needs_update, owner_references, service

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


# Another owner's reference (not the controller: a GitOps tool's, a higher-level controller's).
# Kubernetes lets an object have several owners, at most one of them its controller.
THEIRS = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application", "name": "serving", "uid": "u-9"}


def _live(*refs: dict) -> dict:
    live = _desired()
    live["metadata"]["ownerReferences"] = [dict(r) for r in refs]
    live["metadata"]["resourceVersion"] = "7"
    return live


@pytest.mark.parametrize(("have", "merged", "update"), [
    ("ours", "ours", False),
    ("theirs ours", "theirs ours", False),  # only others' entries differ: nothing to write
    ("ours theirs", "ours theirs", False),
    ("theirs", "theirs ours", True),  # ours lost: put back beside theirs
    ("", "ours", True),
    ("theirs stale", "theirs ours", True),  # the BaseModel made again: its stale entry replaced, in place
    ("stale theirs", "ours theirs", True),
])
def test_others_owner_references_are_kept(have, merged, update):
    ours = _desired()["metadata"]["ownerReferences"][0]
    stale = {**ours, "uid": "u-1"}
    refs = {"ours": ours, "theirs": THEIRS, "stale": stale}
    live = _live(*(refs[word] for word in have.split()))
    assert owner_references(live, _desired()) == [refs[word] for word in merged.split()]
    assert needs_update(live, _desired()) is update


def test_no_owner_references_of_ours_leave_the_list_alone():
    """A plan mirror has no owner reference (none can cross namespaces): nothing to merge."""
    mirror = _desired()
    del mirror["metadata"]["ownerReferences"]
    assert owner_references(_live(THEIRS), mirror) is None
    assert not needs_update(_live(THEIRS), mirror)
