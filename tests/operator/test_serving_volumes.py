"""serving.volumes / serving.volumeMounts against the operator's own volumes and mounts: a
name or a mount path the Deployment already has would make a Deployment the API server
refuses (a duplicate volume name or mount path), so the CRD refuses it when applied and the
operator's parsing refuses it (InvalidSpec) if one gets past."""

from __future__ import annotations

import pytest

from loraplex.operator.reconciler import BaseRecord
from loraplex.operator.specs import OPERATOR_MOUNT_PATHS, OPERATOR_VOLUMES, BaseModelSpec, SpecError
from loraplex.operator.workloads import deployment

from .test_manifests import validator

MODELS = {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
MODELS_MOUNT = {"name": "models", "mountPath": "/models", "readOnly": True}


def body(volumes=None, mounts=None, api_keys=None):
    serving = {"volumes": [MODELS, *(volumes or [])], "volumeMounts": [MODELS_MOUNT, *(mounts or [])]}
    if api_keys:
        serving["apiKeys"] = api_keys
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "BaseModel",
            "metadata": {"name": "llama-3-8b", "namespace": "ml"},
            "spec": {"source": "/models/llama-3-8b", "maxLoraRank": 16, "serving": serving}}


def test_the_reserved_names_and_paths_are_the_ones_the_deployment_uses():
    """OPERATOR_VOLUMES / OPERATOR_MOUNT_PATHS are the Deployment's own parts (with every
    optional one, serving.apiKeys' keys file): the checks below guard exactly those."""
    base = BaseModelSpec.from_body(body(api_keys={"tenantKeysSecret": {"name": "keys"}}))
    pod = deployment(base, 8)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {v["name"] for v in pod["volumes"]} - {"models"} == set(OPERATOR_VOLUMES)
    assert {m["name"] for m in container["volumeMounts"]} - {"models"} == set(OPERATOR_VOLUMES)
    assert {m["mountPath"] for m in container["volumeMounts"]} - {"/models"} == set(OPERATOR_MOUNT_PATHS)


@pytest.mark.parametrize("name", OPERATOR_VOLUMES)
def test_a_volume_named_like_the_operators_is_refused_naming_the_field_and_the_name(name):
    with pytest.raises(SpecError, match=f"serving.volumes may not name a volume {name}"):
        BaseModelSpec.from_body(body(volumes=[{"name": name, "emptyDir": {}}]))


@pytest.mark.parametrize("name", OPERATOR_VOLUMES)
def test_a_mount_of_an_operators_volume_is_refused(name):
    with pytest.raises(SpecError, match=f"serving.volumeMounts may not mount {name}"):
        BaseModelSpec.from_body(body(mounts=[{"name": name, "mountPath": "/mnt/x"}]))


@pytest.mark.parametrize("path", [
    *OPERATOR_MOUNT_PATHS,
    "/etc/loraplex/plan/", "//etc/loraplex/plan", "/etc/./loraplex/plan", "/etc/loraplex/plan/extra",
    "/var/lib/loraplex/adapters/ml", "/var/lib/loraplex/kernel-cache/", "/etc/loraplex/api-keys/keys.json",
])
def test_a_mount_at_or_under_an_operators_mount_path_is_refused(path):
    with pytest.raises(SpecError, match=f"serving.volumeMounts may not mount at {path}"):
        BaseModelSpec.from_body(body(volumes=[{"name": "scratch", "emptyDir": {}}],
                                     mounts=[{"name": "scratch", "mountPath": path}]))


@pytest.mark.parametrize(("volumes", "mounts", "says"), [
    ([{"name": "models", "emptyDir": {}}], [], "serving.volumes names models more than once"),
    ([{"name": "scratch", "emptyDir": {}}], [{"name": "scratch", "mountPath": "/models/"}],
     "serving.volumeMounts mounts more than one volume at /models"),
    ([{"emptyDir": {}}], [], "serving.volumes must be a list of Volumes, each with a name"),
    ([], [{"name": "models"}], "serving.volumeMounts must be a list of VolumeMounts, each with a name and a mountPath"),
])
def test_volumes_the_api_server_would_refuse_among_themselves_are_refused(volumes, mounts, says):
    with pytest.raises(SpecError, match=says):
        BaseModelSpec.from_body(body(volumes=volumes, mounts=mounts))


@pytest.mark.parametrize("path", ["/etc/loraplex", "/var/lib/loraplex", "/etc/loraplex/planner", "/mnt/plan",
                                  "/var/lib/loraplex/adapters-old"])
def test_mounts_beside_or_above_the_operators_are_kept(path):
    base = BaseModelSpec.from_body(body(volumes=[{"name": "scratch", "emptyDir": {}}],
                                        mounts=[{"name": "scratch", "mountPath": path}]))
    (container,) = deployment(base, 8)["spec"]["template"]["spec"]["containers"]
    assert {"name": "scratch", "mountPath": path} in container["volumeMounts"]


def test_a_clashing_volume_makes_the_base_invalid_spec_not_a_refused_deployment():
    """The reconciler's record carries the error, as for any other spec error: the BaseModel's
    status says Accepted False / InvalidSpec with the message, and no Deployment is written."""
    record = BaseRecord.from_body(body(volumes=[{"name": "adapters", "persistentVolumeClaim": {"claimName": "a"}}]))
    assert record.spec is None and record.error is not None
    assert "serving.volumes" in record.error and "adapters" in record.error


@pytest.mark.parametrize("name", [*OPERATOR_VOLUMES, "models", "plans", "kernel"])
def test_the_schema_refuses_a_volume_named_like_the_operators(name):
    doc = body(volumes=[{"name": name, "emptyDir": {}}])
    doc["spec"]["serving"]["volumes"] = [doc["spec"]["serving"]["volumes"][1]]  # no models twice
    assert validator("BaseModel").is_valid(doc) == (name not in OPERATOR_VOLUMES)
    doc = body(mounts=[{"name": name, "mountPath": "/mnt/x"}])
    assert validator("BaseModel").is_valid(doc) == (name not in OPERATOR_VOLUMES)


@pytest.mark.parametrize(("path", "valid"), [
    *((p, False) for p in OPERATOR_MOUNT_PATHS),
    ("/etc/loraplex/plan/", False), ("//etc/loraplex/plan", False), ("/var/lib/loraplex/adapters/ml", False),
    ("/etc/loraplex/api-keys/keys.json", False),
    ("/etc/loraplex", True), ("/var/lib/loraplex/adapters-old", True), ("/mnt/plan", True),
])
def test_the_schema_refuses_a_mount_at_or_under_the_operators_paths(path, valid):
    doc = body(mounts=[{"name": "models", "mountPath": path}])
    assert validator("BaseModel").is_valid(doc) == valid
    try:
        BaseModelSpec.from_body(doc)
        parsed = True
    except SpecError:
        parsed = False
    assert parsed == valid


def test_the_schema_requires_a_volumes_name_and_a_mounts_path():
    doc = body(volumes=[{"emptyDir": {}}])
    assert not validator("BaseModel").is_valid(doc)
    doc = body(mounts=[{"name": "models"}])
    assert not validator("BaseModel").is_valid(doc)
